"""Policy-gradient math: GRPO group-relative advantages, PPO token advantages from a value
baseline, the clipped policy-ratio loss, the value loss, and the train/inference mismatch
correction (truncated or masked importance sampling) with its metrics. Pure torch.

Owns the objective only (no models, no processes), so it is unit-tested on hand-made numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Totals:
    """How one rank's partial sums and maxima become the whole batch's, when the batch is
    split over data-parallel ranks: ``sum`` / ``max`` map a tensor to its total over the ranks
    (the trainer passes all-reduces over its DP group; on one rank both are the identity).
    Every mean below is over the whole batch's tokens, so the loss and the metrics do not
    depend on how the batch was split (found by probing: per-rank token means weighed the
    ranks' tokens unequally once masked IS dropped different numbers on each)."""

    sum: Callable[[torch.Tensor], torch.Tensor] = _same
    max: Callable[[torch.Tensor], torch.Tensor] = _same


LOCAL = Totals()


def group_advantages(rewards: list[float], groups: list[int], eps: float = 1e-6) -> list[float]:
    """A_i = (r_i - mean of its group) / (std of its group + eps); a group of one gets 0."""
    out = []
    by: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups):
        by.setdefault(g, []).append(r)
    for r, g in zip(rewards, groups):
        xs = torch.tensor(by[g], dtype=torch.float64)
        if len(xs) < 2:
            out.append(0.0)
            continue
        out.append(float((r - xs.mean()) / (xs.std(unbiased=False) + eps)))
    return out


def flat_group_share(rewards: list[float], groups: list[int]) -> float:
    """The share of groups whose rewards are all equal (0 without groups): their GRPO
    advantages are all zero, so they train nothing -- the step's signal is the rest. High when
    the temperature is near greedy (a group's samples alike) or the task is too easy or too
    hard for the policy; a per-step metric (``flat_groups``)."""
    by: dict[int, set[float]] = {}
    for r, g in zip(rewards, groups):
        by.setdefault(g, set()).add(r)
    return sum(len(v) == 1 for v in by.values()) / len(by) if by else 0.0


def clipped_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                 mask: torch.Tensor, clip: float = 0.2, kl_coef: float = 0.0,
                 ref_logp: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None, totals: Totals = LOCAL,
                 dual_clip: float = 0.0) -> torch.Tensor:
    """-mean over masked tokens of w * min(ratio * A, clip(ratio, 1-e, 1+e) * A)
    [+ kl_coef * KL].

    ``dual_clip`` c > 1 (0: off): dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c) -- where
    A < 0 the objective is bounded below by c * A, so a token whose ratio is huge (a
    rollout/trainer mismatch, a stale sample) cannot pull the loss without bound.

    new/old/ref_logp, mask: [B, T]; adv: [B] (one advantage per trajectory) or [B, T];
    ``weights`` [B, T] (no gradient): the mismatch correction's importance weights w (None:
    1). KL uses the k3 estimator exp(ref - new) - (ref - new) - 1 (non-negative; an unbiased
    estimate of the KL's value). ``totals``: the mean's count is the whole batch's; the sum
    is this rank's rows (its share of the batch's loss: the ranks' shares add up to it)."""
    keep = mask.bool()
    # positions outside the mask are selected away, never multiplied by 0: a padding value
    # there (-inf, nan) would make the loss NaN (found by probing)
    ratio = torch.exp(torch.where(keep, new_logp - old_logp, 0.0))
    a = adv[:, None] if adv.dim() == 1 else adv  # per trajectory (GRPO) or per token (PPO)
    obj = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a)
    if dual_clip:
        obj = torch.where(a < 0, torch.maximum(obj, dual_clip * a), obj)
    per_tok = -obj if weights is None else -weights * obj
    if kl_coef and ref_logp is not None:
        d = torch.where(keep, ref_logp - new_logp, 0.0)
        per_tok = per_tok + kl_coef * (torch.exp(d) - d - 1)
    m = mask.to(per_tok.dtype)
    return torch.where(keep, per_tok, 0.0).sum() / totals.sum(m.sum().detach()).clamp(min=1)


def ppo_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   eps: float = 1e-6, totals: Totals = LOCAL
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Terminal reward, gamma = lambda = 1: the return of every generated token is its
    trajectory's reward; advantage = return - V(token), whitened over the masked tokens of
    the whole batch (``totals``). rewards [B], values/mask [B, T] -> (advantages [B, T],
    returns [B, T])."""
    returns = rewards[:, None].expand_as(values) * mask
    adv = (returns - values) * mask
    n = totals.sum(mask.sum()).clamp(min=1)
    mean = totals.sum(adv.sum()) / n
    std = totals.sum((((adv - mean) * mask) ** 2).sum()).div(n).sqrt()
    return ((adv - mean) / (std + eps)) * mask, returns


def value_loss(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               totals: Totals = LOCAL) -> torch.Tensor:
    """Squared error over the masked tokens: this rank's sum over the whole batch's count."""
    m = mask.to(values.dtype)
    return (((values - returns) ** 2) * m).sum() / totals.sum(m.sum().detach()).clamp(min=1)


@dataclass(frozen=True)
class MismatchCorrection:
    """Importance sampling between the policy that sampled the tokens (the rollout engine's
    numbers) and the trainer's numbers for the same weights (``rl.is_level``, ``is_mode``,
    ``is_cap``, ``is_floor``): w = pi_trainer / pi_rollout of each sampled token --
    ``token`` level -- or, per trajectory, the geometric mean over its generated tokens --
    ``sequence`` level. ``truncate`` caps w at ``cap`` (truncated IS); ``mask`` leaves out of
    the loss the tokens (or trajectories) whose w is outside [floor, cap] and weighs the rest
    by 1 (masked IS). With a correction, PPO's old policy is the trainer's own logprobs, so the
    ratio clip sees the update and the weight sees the mismatch."""

    level: str  # "token" | "sequence"
    mode: str = "truncate"  # "truncate" | "mask"
    cap: float = 2.0
    floor: float = 0.0

    def __post_init__(self) -> None:
        # (found by probing: 'tokens' ran as token level, 'truncated' as mask, a negative
        # cap flipped the gradient's sign)
        if self.level not in ("token", "sequence"):
            raise ValueError(f"MismatchCorrection: level must be token or sequence, got "
                             f"{self.level!r}")
        if self.mode not in ("truncate", "mask"):
            raise ValueError(f"MismatchCorrection: mode must be truncate or mask, got "
                             f"{self.mode!r}")
        if not (self.cap > 1 and 0 <= self.floor < 1):
            raise ValueError(f"MismatchCorrection: cap must be > 1 and floor in [0, 1), got "
                             f"cap {self.cap}, floor {self.floor}")

    def weights(self, trainer_logp: torch.Tensor, rollout_logp: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """trainer/rollout logp, mask [B, T] -> (weights [B, T], kept [B, T] bool): the
        weight of each token in the loss and whether it stays in; no gradient."""
        m = mask.to(torch.float64)
        log_w = torch.where(mask.bool(), (trainer_logp.detach() - rollout_logp).to(
            torch.float64), 0.0)
        if self.level == "sequence":  # geometric mean over the trajectory's tokens
            n = m.sum(dim=1, keepdim=True).clamp(min=1)
            log_w = (log_w.sum(dim=1, keepdim=True) / n).expand_as(log_w)
        w = torch.exp(log_w)
        if self.mode == "truncate":
            return torch.clamp(w, max=self.cap).to(trainer_logp.dtype), mask.bool()
        kept = mask.bool() & (w <= self.cap) & (w >= self.floor)
        return torch.ones_like(trainer_logp), kept


def mismatch_metrics(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor,
                     mask: torch.Tensor, clip: float, weights: torch.Tensor | None = None,
                     kept: torch.Tensor | None = None, cap: float | None = None,
                     totals: Totals = LOCAL) -> dict:
    """Per-step numbers of the train/inference mismatch over the masked (generated) tokens:
    the logprob gap's max and mean, KL(rollout || trainer) by the k1 and k3 estimators on the
    rollout's samples, the share of tokens whose ratio trainer/rollout falls outside PPO's clip
    band on either side (the uncorrected loss clips the side its advantage's sign selects),
    and with a correction the weights' mean and max and the share truncated (weight at the
    cap) or masked out. Over the whole batch (``totals``: every rank's tokens)."""
    m = mask.bool()
    d = (trainer_logp.detach() - rollout_logp).double()[m]  # log(pi_train / pi_rollout)
    ratio = torch.exp(d)
    zero = d.new_zeros(())
    # the sums and counts of every rank in one reduction, the maxima in another
    sums = [d.numel(), d.abs().sum(), -d.sum(), (ratio - d - 1).sum(),
            ((ratio < 1 - clip) | (ratio > 1 + clip)).sum()]
    maxes = [d.abs().max() if d.numel() else zero]
    if weights is not None:
        w = weights.double()[m]
        # the cap as the weights hold it (they were clamped, then cast to the logprobs'
        # dtype: 1.01 in fp32 is below 1.01 in float64 -- found by probing: never counted)
        cap_held = float(torch.tensor(cap, dtype=weights.dtype)) if cap is not None else None
        sums += [w.sum(), (~kept[m]).sum() if kept is not None else 0,
                 (w >= cap_held).sum() if cap is not None else 0]
        maxes.append(w.max() if w.numel() else zero)
    s = totals.sum(torch.stack([torch.as_tensor(x, dtype=torch.float64, device=d.device)
                                for x in sums])).tolist()
    mx = totals.max(torch.stack(maxes)).tolist()
    n = max(s[0], 1.0)
    out = {"logprob_gap_max": mx[0], "logprob_gap_mean": s[1] / n,
           "mismatch_kl_k1": s[2] / n, "mismatch_kl_k3": s[3] / n,
           "mismatch_clip_frac": s[4] / n}
    if weights is not None:
        out["is_weight_mean"] = s[5] / n
        out["is_weight_max"] = mx[1]
        out["is_corrected_frac"] = (s[7] + s[6]) / n
    return out
