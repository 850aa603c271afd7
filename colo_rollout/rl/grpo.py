"""Policy-gradient math: GRPO group-relative advantages, PPO token advantages from a value
baseline, the clipped policy-ratio loss and the value loss. Pure torch.

Owns the objective only (no models, no processes), so it is unit-tested on hand-made numbers.
"""

from __future__ import annotations

import torch


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


def clipped_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                 mask: torch.Tensor, clip: float = 0.2, kl_coef: float = 0.0,
                 ref_logp: torch.Tensor | None = None) -> torch.Tensor:
    """-mean over masked tokens of min(ratio * A, clip(ratio, 1-e, 1+e) * A) [+ kl_coef * KL].

    new/old/ref_logp, mask: [B, T]; adv: [B] (one advantage per trajectory). KL uses the k3
    estimator exp(ref - new) - (ref - new) - 1 (non-negative, unbiased)."""
    ratio = torch.exp(new_logp - old_logp)
    a = adv[:, None] if adv.dim() == 1 else adv  # per trajectory (GRPO) or per token (PPO)
    obj = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a)
    per_tok = -obj
    if kl_coef and ref_logp is not None:
        d = ref_logp - new_logp
        per_tok = per_tok + kl_coef * (torch.exp(d) - d - 1)
    m = mask.to(per_tok.dtype)
    return (per_tok * m).sum() / m.sum().clamp(min=1)


def ppo_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Terminal reward, gamma = lambda = 1: the return of every generated token is its
    trajectory's reward; advantage = return - V(token), whitened over the masked tokens.
    rewards [B], values/mask [B, T] -> (advantages [B, T], returns [B, T])."""
    returns = rewards[:, None].expand_as(values) * mask
    adv = (returns - values) * mask
    n = mask.sum().clamp(min=1)
    mean = adv.sum() / n
    std = (((adv - mean) * mask) ** 2).sum().div(n).sqrt()
    return ((adv - mean) / (std + eps)) * mask, returns


def value_loss(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(values.dtype)
    return (((values - returns) ** 2) * m).sum() / m.sum().clamp(min=1)
