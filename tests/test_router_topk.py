"""The router's one-launch top-k + softmax (model/router_topk.py) against megatron's dense
softmax routing (``topk_routing_with_score_function``), run by Triton's CPU interpreter in a
subprocess (tests/interpreted.py; skipped when triton does not import), both kernels (the rank
count, D's, and the k rounds, P's, forced for every case of several rows): post- and pre-softmax,
a scaling factor, one row and many (more rows than one program holds), E not a power of two,
and tied logits (descending order, ties to the lower expert id: a stable sort's choice)."""

from __future__ import annotations

import pytest
import torch

from colo_rollout.model import router_topk as rt
from tests.interpreted import HAS_TRITON, interpreted_main

# (N tokens, E experts, top-k, pre-softmax, scaling factor, tied logits)
CASES = [
    (1, 128, 8, False, None, False),  # Qwen3-30B-A3B's router at B = 1
    (37, 64, 8, False, None, False),  # three programs of 16 rows
    (9, 128, 8, True, None, False),
    (3, 8, 2, False, 2.5, False),  # Mixtral-like, scaled
    (20, 160, 6, True, 16.0, False),  # E not a power of two
    (1, 256, 8, False, None, False),
    (24, 32, 4, False, None, True),  # logits on a coarse grid: ties decided by expert id
    (5, 16, 16, True, None, True),  # k = E
]


def _case(i):
    N, E, k, pre, scale, tied = CASES[i]
    gen = torch.Generator().manual_seed(i)
    logits = torch.randn(N, E, generator=gen)
    if tied:
        logits = (logits * 2).round() / 2
    return logits, k, pre, scale


def _reference(logits, k, pre, scale):
    """Descending, ties to the lower id (a stable sort), then megatron's softmax order."""
    scores = torch.softmax(logits, -1) if pre else logits
    top = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    vals = scores.gather(1, top)
    probs = vals if pre else torch.softmax(vals, -1)
    return probs * (scale or 1.0), top


def test_supports_names_what_the_kernel_computes():
    ok = dict(score_function="softmax", num_groups=None, group_topk=None, expert_bias=None,
              router_replay=None, topk=8, experts=128)
    assert rt.supports(**ok) == HAS_TRITON
    for change in (dict(score_function="sigmoid"), dict(num_groups=8, group_topk=4),
                   dict(expert_bias=torch.zeros(128)), dict(router_replay=object()),
                   dict(topk=129), dict(experts=4096, topk=8), dict(topk=0)):
        assert not rt.supports(**{**ok, **change}), change


def _interpreted() -> list[str]:
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    fails = []
    rank_from = rt.ROUNDS_FROM
    for i in [*range(len(CASES)), *(-1 - j for j in range(len(CASES)) if CASES[j][0] > 1)]:
        # i < 0: case -1 - i through the k-rounds kernel (P's), forced for every case of
        # more than one row
        rt.ROUNDS_FROM = 1 if i < 0 else rank_from
        i = i if i >= 0 else -1 - i
        logits, k, pre, scale = _case(i)
        probs, ids = rt.softmax_topk(logits, k, pre_softmax=pre, scaling_factor=scale)
        ref_p, ref_i = _reference(logits, k, pre, scale)
        if ids.dtype != torch.int64 or not torch.equal(ids, ref_i):
            fails.append(f"case {i} (rounds from {rt.ROUNDS_FROM}): ids {ids[0].tolist()} != "
                         f"{ref_i[0].tolist()}")
            continue
        if not torch.allclose(probs, ref_p, rtol=1e-6, atol=1e-7):
            fails.append(f"case {i} (rounds from {rt.ROUNDS_FROM}): probs off by "
                         f"{(probs - ref_p).abs().max().item():.2e}")
        if CASES[i][5]:
            continue  # megatron's torch.topk orders ties its own way
        # megatron's routing: the same experts (as sets) with the same probabilities
        mp, mi = topk_routing_with_score_function(
            logits, k, use_pre_softmax=pre, scaling_factor=scale, score_function="softmax",
            dense_output=True)
        mi, order = mi.sort(dim=1)
        mine, mo = ids.sort(dim=1)
        if not torch.equal(mi, mine):
            fails.append(f"case {i}: experts differ from megatron's")
        elif not torch.allclose(probs.gather(1, mo), mp.gather(1, order), rtol=1e-6, atol=1e-7):
            fails.append(f"case {i}: probabilities differ from megatron's")
    empty_p, empty_i = rt.softmax_topk(torch.zeros(0, 8), 2)
    if empty_p.shape != (0, 2) or empty_i.shape != (0, 2):
        fails.append("no rows: wrong shapes")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_softmax_topk_matches_megatron_interpreted(interpreted):
    interpreted.check(__file__)


def test_bad_logits_are_refused():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    with pytest.raises(ValueError, match="fp32"):
        rt.softmax_topk(torch.zeros(2, 8, dtype=torch.bfloat16), 2)
    with pytest.raises(ValueError, match="range"):
        rt.softmax_topk(torch.zeros(2, 8), 9)


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)
