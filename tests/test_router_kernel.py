"""The decode router kernel (model/router_kernel.py) against megatron's own routing
(``topk_routing_with_score_function`` in its dense form on the gating GEMM's logits), run by
Triton's CPU interpreter in a subprocess (tests/interpreted.py; skipped when triton does not
import): softmax after and before the top-k, sigmoid with an expert bias, a gate bias, a
scaling factor, k = 1, fp32 and bf16 router dtypes, expert counts and hidden sizes that are
not powers of two; and which routers it covers."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from colo_rollout.model import router_kernel as rk
from tests.interpreted import HAS_TRITON, run_interpreted

# (rows, hidden, experts, top-k, score, pre-softmax, gate bias, expert bias, scale,
#  router dtype, x dtype)
F32, BF16 = torch.float32, torch.bfloat16
CASES = [
    (1, 64, 8, 2, "softmax", False, False, False, None, F32, BF16),
    (13, 96, 64, 8, "softmax", False, False, False, None, F32, BF16),
    (20, 200, 60, 4, "softmax", True, True, False, 2.5, F32, F32),
    (17, 64, 256, 8, "sigmoid", False, False, True, 2.5, F32, BF16),  # DeepSeek-V3-like
    (5, 64, 32, 1, "sigmoid", False, False, False, None, F32, BF16),
    (33, 128, 64, 8, "softmax", False, False, False, None, BF16, BF16),  # bf16 logits
]


def _case(i):
    N, H, E, k, score, pre, has_bias, has_eb, scale, rdt, xdt = CASES[i]
    g = torch.Generator().manual_seed(i)
    x = torch.randn(N, H, generator=g).to(xdt)
    w = (torch.randn(E, H, generator=g) / H ** 0.5).to(xdt)  # the parameter: model dtype
    bias = torch.randn(E, generator=g).to(xdt) if has_bias else None
    eb = torch.randn(E, generator=g) * 0.1 if has_eb else None
    return x, w, bias, eb, k, score, pre, scale, rdt


def _reference(x, w, bias, eb, k, score, pre, scale, rdt):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits = x.to(rdt) @ w.to(rdt).t()  # megatron's gating without TE
    if bias is not None:
        logits = logits + bias.to(rdt)
    probs, ids = topk_routing_with_score_function(
        logits, k, use_pre_softmax=pre, scaling_factor=scale, score_function=score,
        expert_bias=eb, dense_output=True)
    return probs, ids, logits


def test_supports():
    assert rk.supports("softmax", 8, 128, None, None, None)
    assert rk.supports("sigmoid", 8, 256, None, None, None)
    assert not rk.supports("sigmoid", 8, 256, 8, 4, None)  # group-limited top-k
    assert not rk.supports("sqrtsoftplus", 8, 64, None, None, None)
    assert not rk.supports("softmax", 8, 64, None, None, object())  # routing replay
    assert not rk.supports("softmax", 8, rk.MAX_EXPERTS + 1, None, None, None)


def _interpreted() -> list[str]:
    fails = []
    for i in range(len(CASES)):
        x, w, bias, eb, k, score, pre, scale, rdt = _case(i)
        ref_p, ref_i, logits = _reference(x, w, bias, eb, k, score, pre, scale, rdt)
        got_p, got_i = rk.route_rows(x, w, bias, eb, k, score_function=score, pre_softmax=pre,
                                     scaling_factor=scale, router_dtype=rdt)
        if got_p.dtype != rdt or got_i.dtype != torch.int64 or got_p.shape != ref_p.shape:
            fails.append(f"case {i}: {got_p.dtype} {got_i.dtype} {tuple(got_p.shape)}")
            continue
        if rdt == torch.float32:
            # fp32 logits: the same experts (random logits, no ties), probabilities to fp32
            # rounding (slots sorted by id on both sides)
            gi, go = got_i.sort(dim=1)
            ri, ro = ref_i.sort(dim=1)
            if not torch.equal(gi, ri):
                fails.append(f"case {i}: experts differ in {int((gi != ri).any(1).sum())} rows")
                continue
            err = (got_p.gather(1, go) - ref_p.gather(1, ro)).abs().max().item()
            if err > 1e-5:
                fails.append(f"case {i}: probabilities differ by {err:.2e}")
        else:
            # bf16 logits tie often: the chosen logits (as a multiset) and the probabilities
            # in descending order agree; which of tied experts is chosen is unspecified
            lv = logits.float()
            a = lv.gather(1, got_i).sort(dim=1).values
            b = lv.gather(1, ref_i).sort(dim=1).values
            pa = got_p.float().sort(dim=1).values
            pb = ref_p.float().sort(dim=1).values
            if not torch.equal(a, b) or (pa - pb).abs().max().item() > 1e-2:
                fails.append(f"case {i}: bf16 choice or probabilities differ")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_router_kernel_matches_megatron_routing_interpreted():
    run_interpreted(__file__)


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    failures = _interpreted()
    print("\n".join(failures) if failures else "all cases pass")
    sys.exit(1 if failures else 0)
