"""GRPO objective and the mismatch correction on hand-made numbers."""

from __future__ import annotations

import math

import torch

import pytest

from colo_rollout.config import ConfigError
from colo_rollout.config.schema import RLConfig
from colo_rollout.rl.grpo import (
    flat_group_share,
    MismatchCorrection,
    clipped_loss,
    group_advantages,
    mismatch_metrics,
    ppo_advantages,
    value_loss,
)


def test_group_advantages_normalise_within_groups():
    adv = group_advantages([1.0, 3.0, 5.0, 7.0], [0, 0, 1, 1])
    assert [round(a, 5) for a in adv] == [-1.0, 1.0, -1.0, 1.0]
    assert group_advantages([2.0, 2.0], [0, 0]) == [0.0, 0.0]  # no signal, no push
    assert group_advantages([4.0], [3]) == [0.0]


def test_clipped_loss_matches_the_formula():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.25]]))  # ratios 1.5 and 0.5
    adv = torch.tensor([2.0])
    mask = torch.tensor([[1, 1]])
    # token 1: min(1.5*2, 1.2*2) = 2.4 ; token 2: min(0.5*2, 0.8*2) = 1.0 -> loss -1.7
    assert math.isclose(float(clipped_loss(new, old, adv, mask)), -1.7, rel_tol=1e-6)
    # negative advantage: min(1.5*-2, 1.2*-2) = -3.0 ; min(0.5*-2, 0.8*-2) = -1.6 -> loss 2.3
    assert math.isclose(float(clipped_loss(new, old, -adv, mask)), 2.3, rel_tol=1e-6)
    # masked-out tokens do not count
    assert math.isclose(float(clipped_loss(new, old, adv, torch.tensor([[1, 0]]))), -2.4,
                        rel_tol=1e-6)


def test_dual_clip_bounds_negative_advantages_only():
    old = torch.log(torch.tensor([[0.1, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.8, 0.6, 0.25]]))  # ratios 8, 1.2 and 0.5
    mask = torch.ones(1, 3)
    # A = -2: min(r*A, clip(r)*A) = -16, -2.4, -1.6; bounded below by 3 * A = -6 -> -6, -2.4,
    # -1.6: loss (6 + 2.4 + 1.6) / 3
    got = clipped_loss(new, old, torch.tensor([-2.0]), mask, dual_clip=3.0)
    assert math.isclose(float(got), 10.0 / 3, rel_tol=1e-6)
    assert math.isclose(float(clipped_loss(new, old, torch.tensor([-2.0]), mask)), 20.0 / 3,
                        rel_tol=1e-6)  # without it the huge ratio dominates
    # positive advantages: unchanged (min(16, 2.4), 2.4, 1.0)
    pos = torch.tensor([2.0])
    assert float(clipped_loss(new, old, pos, mask, dual_clip=3.0)) == \
        float(clipped_loss(new, old, pos, mask))
    # per-token advantages: only the negative token's term is bounded
    tok = torch.tensor([[-2.0, 2.0, 2.0]])
    assert math.isclose(float(clipped_loss(new, old, tok, mask, dual_clip=3.0)),
                        -(-6.0 + 2.4 + 1.0) / 3, rel_tol=1e-6)
    # the bounded token passes no gradient (the bound is a constant)
    n = new.clone().requires_grad_(True)
    clipped_loss(n, old, torch.tensor([-2.0]), mask, dual_clip=3.0).backward()
    assert n.grad[0, 0] == 0 and n.grad[0, 1] != 0  # (the third is PPO-clipped: 0 too)


def test_kl_term_is_zero_at_the_reference_and_positive_away():
    logp = torch.log(torch.tensor([[0.3, 0.6]]))
    z = clipped_loss(logp, logp, torch.tensor([0.0]), torch.tensor([[1, 1]]), kl_coef=1.0,
                     ref_logp=logp)
    assert float(z) == 0.0
    moved = clipped_loss(logp + 0.2, logp + 0.2, torch.tensor([0.0]), torch.tensor([[1, 1]]),
                         kl_coef=1.0, ref_logp=logp)
    assert float(moved) > 0


def test_gradient_pushes_up_positive_advantage_tokens():
    logits = torch.zeros(1, 2, 4, requires_grad=True)
    logp_all = torch.log_softmax(logits, -1)
    tok = torch.tensor([[1, 2]])
    new = logp_all.gather(-1, tok[..., None])[..., 0]
    loss = clipped_loss(new, new.detach(), torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    assert logits.grad[0, 0, 1] < 0 and logits.grad[0, 1, 2] < 0  # descent raises them


def test_ppo_advantages_and_value_loss():
    rewards = torch.tensor([1.0, 0.0])
    values = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv, ret = ppo_advantages(rewards, values, mask)
    assert ret.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    # raw advantages +0.5 (x2) and -0.5 (x3): whitened, masked-out token stays 0
    assert adv[0, 2] == 0 and adv[0, 0] > 0 and adv[1, 0] < 0
    assert abs(float((adv * mask).sum())) < 1e-6  # zero mean over the masked tokens
    assert float(value_loss(values, ret, mask)) == (0.25 * 2 + 0.25 * 3) / 5


def test_per_token_advantages_in_clipped_loss():
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0]])
    assert float(clipped_loss(logp, logp, adv, torch.ones(1, 2))) == 0.0  # ratio 1: -mean(A)


# trainer and rollout logprobs of 2 trajectories x 3 tokens; the last token of row 1 is masked
TRAIN = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.6, 0.1]]))
ROLL = torch.log(torch.tensor([[0.5, 0.05, 0.6], [0.6, 0.6, 0.7]]))
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_truncated_weights_are_the_ratio_capped():
    w, kept = MismatchCorrection("token", "truncate", cap=2.0).weights(TRAIN, ROLL, MASK)
    # ratios 1, 4, 1.5 ; 0.5, 1, (masked: log-ratio zeroed -> 1)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 1.5], [0.5, 1.0, 1.0]]))
    assert torch.equal(kept, MASK.bool())


def test_token_masked_weights_drop_tokens_outside_the_band():
    w, kept = MismatchCorrection("token", "mask", cap=2.0, floor=0.6).weights(TRAIN, ROLL, MASK)
    assert torch.equal(w, torch.ones_like(TRAIN))
    assert kept.tolist() == [[True, False, True], [False, True, False]]


def test_sequence_level_is_the_geometric_mean_over_generated_tokens():
    w, _ = MismatchCorrection("sequence", "truncate", cap=10.0).weights(TRAIN, ROLL, MASK)
    g0 = (1.0 * 4.0 * 1.5) ** (1 / 3)
    g1 = (0.5 * 1.0) ** (1 / 2)  # the masked token does not count
    assert torch.allclose(w, torch.tensor([[g0] * 3, [g1] * 3]), rtol=1e-5)
    _, kept = MismatchCorrection("sequence", "mask", cap=1.5).weights(TRAIN, ROLL, MASK)
    assert kept.tolist() == [[False] * 3, [True, True, False]]  # row 0 (1.82) out whole


def test_weighted_loss_scales_each_tokens_gradient_by_its_weight():
    new = TRAIN.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    w, kept = MismatchCorrection("token").weights(new, ROLL, MASK)
    loss = clipped_loss(new, new.detach(), adv, MASK * kept, weights=w)
    loss.backward()
    # ratio exp(new - new.detach()) is 1 with gradient 1: d loss / d new = -w * A / n_tokens
    want = -(w * adv[:, None] * MASK) / MASK.sum()
    assert torch.allclose(new.grad, want)
    assert not w.requires_grad


def test_mismatch_metrics():
    got = mismatch_metrics(TRAIN, ROLL, MASK, clip=0.2)
    d = torch.log(torch.tensor([1.0, 4.0, 1.5, 0.5, 1.0]))
    assert math.isclose(got["logprob_gap_max"], math.log(4.0), rel_tol=1e-6)
    assert math.isclose(got["mismatch_kl_k1"], float(-d.mean()), rel_tol=1e-6)
    assert math.isclose(got["mismatch_kl_k3"], float((d.exp() - d - 1).mean()), rel_tol=1e-5)
    assert math.isclose(got["mismatch_clip_frac"], 3 / 5)  # 4, 1.5 and 0.5 outside [0.8, 1.2]
    w, kept = MismatchCorrection("token", cap=2.0).weights(TRAIN, ROLL, MASK)
    got = mismatch_metrics(TRAIN, ROLL, MASK, 0.2, w, kept, cap=2.0)
    assert math.isclose(got["is_weight_max"], 2.0) and math.isclose(got["is_corrected_frac"], 0.2)
    # a cap fp32 cannot hold exactly: the clamped weights still count as at the cap (found by
    # probing: 1.01 in fp32 is below 1.01 in float64, and none counted)
    for cap in (1.01, 1.05, 1.3):
        w, kept = MismatchCorrection("token", cap=cap).weights(TRAIN, ROLL, MASK)
        got = mismatch_metrics(TRAIN, ROLL, MASK, 0.2, w, kept, cap=cap)
        assert math.isclose(got["is_corrected_frac"], 2 / 5), (cap, got)  # 4 and 1.5
    identical = mismatch_metrics(TRAIN, TRAIN, MASK, 0.2)
    assert identical["mismatch_kl_k3"] == 0.0 and identical["mismatch_clip_frac"] == 0.0


@pytest.mark.parametrize("key,value", [("is_level", "tokens"), ("is_mode", "clip"),
                                       ("is_cap", 1.0), ("is_floor", 1.0)])
def test_correction_keys_are_checked(key, value):
    with pytest.raises(ConfigError, match=f"rl.{key}"):
        RLConfig(**{key: value})


def test_reverse_task_rewards_positions():
    import random

    from colo_rollout.rl.tasks import Reverse, TargetToken

    task = Reverse(length=3, alphabet=4)
    p = task.prompt(random.Random(0))
    assert len(p) == 4 and p[-1] == 5 and all(1 <= t <= 4 for t in p[:3])
    assert task.reward([1, 2, 3, 5], [3, 2, 1]) == 1.0
    assert task.reward([1, 2, 3, 5], [3, 9, 9]) == 1 / 3
    assert task.reward([1, 2, 3, 5], [1, 2, 3]) == 1 / 3  # copying is not reversing
    assert task.reward([1, 2, 3, 5], [3]) == 1 / 3  # a short completion loses the rest
    assert TargetToken(64, 7, 8).reward([1], [7, 7, 1, 2]) == 0.5


def test_reverse_task_keys_are_checked():
    from colo_rollout.config import Config

    with pytest.raises(ConfigError, match="rl.max_new_tokens"):
        RLConfig(task="reverse", reverse_len=4, max_new_tokens=3)
    with pytest.raises(ConfigError, match="rl.reverse_alphabet"):
        Config(rl=RLConfig(task="reverse", reverse_alphabet=255, max_new_tokens=3))


def test_flat_groups_are_the_ones_without_signal():
    rewards = [1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5]
    groups = [0, 0, 1, 1, 2, 2, 2]
    assert flat_group_share(rewards, groups) == 2 / 3  # groups 0 and 2: every reward equal
    # their advantages are exactly the zeros the share stands for
    adv = group_advantages(rewards, groups)
    assert adv[0] == adv[1] == adv[4] == adv[5] == adv[6] == 0.0 and adv[2] != 0.0
    assert flat_group_share([], []) == 0.0


def test_every_task_prompt_is_within_the_configs_longest_prompt():
    """The door holds RLConfig.longest_prompt to the engine: no task draws a longer one."""
    import random

    from colo_rollout.config.schema import RLConfig
    from colo_rollout.rl.tasks import task_for

    for rl in (RLConfig(task="reverse", reverse_len=7, max_new_tokens=7),
               RLConfig(prompt_len_max=5)):
        longest, _ = rl.longest_prompt
        task, rng = task_for(rl, 64), random.Random(0)
        lens = [len(task.prompt(rng)) for _ in range(200)]
        assert max(lens) == longest


def test_padding_values_outside_the_mask_never_reach_the_loss():
    """-inf / nan where the mask is 0 (an API user's padding) leave the loss and the
    importance weights finite: selected away, not multiplied by 0 (found by probing)."""
    new = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.2, float("-inf")]])
    mask = torch.tensor([[1, 0]])
    loss = clipped_loss(new, old, torch.tensor([1.0]), mask, kl_coef=0.1,
                        ref_logp=torch.tensor([[-1.1, float("inf")]]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    for level, mode in (("token", "truncate"), ("sequence", "truncate"), ("token", "mask")):
        w, kept = MismatchCorrection(level, mode).weights(new, old, mask)
        assert torch.isfinite(w[mask.bool()]).all() and bool(kept[0, 0]), (level, mode)


@pytest.mark.parametrize("args", [("tokens",), ("token", "truncated"), ("token", "truncate", -1.0),
                                  ("token", "mask", 2.0, 5.0), ("sequence", "mask", 1.0)])
def test_a_mismatch_correction_it_cannot_mean_is_refused(args):
    with pytest.raises(ValueError, match="MismatchCorrection"):
        MismatchCorrection(*args)
