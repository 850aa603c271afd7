"""GRPO objective on hand-made numbers."""

from __future__ import annotations

import math

import torch

from colo_rollout.rl.grpo import clipped_loss, group_advantages, ppo_advantages, value_loss


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
