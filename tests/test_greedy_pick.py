"""Greedy tokens and logprobs in a split reduction (model/greedy_pick.py) against torch's
argmax and log_softmax, run by Triton's CPU interpreter in a subprocess (tests/interpreted.py;
skipped when triton does not import): one row and several, a vocabulary not a multiple of the
chunk, one chunk only, the maximum tied across chunks and inside one (the first column wins,
as torch.argmax's), bf16 logits (read without a copy), large logits (the shift by the max),
masked (-inf) columns and whole chunks of them."""

from __future__ import annotations

import pytest
import torch

from colo_rollout.model import greedy_pick as gp
from tests.interpreted import HAS_TRITON, interpreted_main

# (rows, vocabulary, chunk columns, dtype, kind)
CASES = [
    (1, 1000, 128, torch.float32, "random"),  # 8 chunks, the last partial
    (5, 1000, 128, torch.float32, "random"),
    (3, 100, 128, torch.float32, "random"),  # one partial chunk
    (4, 1024, 256, torch.float32, "tied"),  # the max in several chunks and inside one
    (2, 777, 64, torch.bfloat16, "random"),
    (2, 500, 64, torch.float32, "large"),  # logits ~1e4: exp only of x - max
    (3, 600, 64, torch.float32, "masked"),  # -inf columns, whole chunks of them
]


def _case(i):
    n, V, block, dtype, kind = CASES[i]
    gen = torch.Generator().manual_seed(i)
    x = torch.randn(n, V, generator=gen) * 3
    if kind == "tied":
        x = x.round().clamp(max=4.0)  # several columns at 4.0 in every row
        x[:, -1] = 4.0
    if kind == "large":
        x = x + 1e4
    if kind == "masked":
        x[:, 64:256] = float("-inf")  # chunks 1-3 masked whole
        x[:, ::7] = float("-inf")
    return x.to(dtype), block


def _interpreted() -> list[str]:
    fails = []
    for i in range(len(CASES)):
        x, block = _case(i)
        tokens, logprobs = gp.greedy_pick(x, block=block)
        ref_t = x.float().argmax(dim=-1)
        ref_lp = torch.log_softmax(x.float(), dim=-1).gather(1, ref_t[:, None])[:, 0]
        if tokens.dtype != torch.int64 or not torch.equal(tokens, ref_t):
            fails.append(f"case {i}: tokens {tokens.tolist()} != {ref_t.tolist()}")
        elif logprobs.dtype != torch.float32 or not torch.allclose(logprobs, ref_lp,
                                                                   rtol=1e-5, atol=1e-6):
            fails.append(f"case {i}: logprobs off by {(logprobs - ref_lp).abs().max():.2e}")
    # a row slice of a larger tensor (the sampler's logits[:n]) reads its own rows only
    x, block = _case(1)
    tokens, _ = gp.greedy_pick(x[1:3], block=block)
    if tokens.tolist() != x[1:3].argmax(dim=-1).tolist():
        fails.append("row slice: wrong rows read")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_greedy_pick_matches_torch_interpreted(interpreted):
    interpreted.check(__file__)


def test_supports_and_bad_input():
    x = torch.zeros(2, 8)
    assert gp.supports(x) == HAS_TRITON
    assert not gp.supports(torch.zeros(0, 8)) and not gp.supports(torch.zeros(8))
    assert not gp.supports(x.t()) and not gp.supports(x.long())
    if HAS_TRITON:
        with pytest.raises(ValueError, match="greedy_pick"):
            gp.greedy_pick(x.t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_greedy_pick_on_the_gpu_at_qwen3s_vocabulary():
    """The shipped chunk size on an H200's rows: Qwen3's 151936 logits, 1 and 64 rows, fp32
    and bf16 -- torch's tokens, its logprobs within the sum's rounding."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in (1, 64):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(n, 151936, generator=gen, device="cuda") * 4).to(dtype)
            tokens, logprobs = gp.greedy_pick(x)
            ref_t = x.float().argmax(dim=-1)
            ref_lp = torch.log_softmax(x.float(), dim=-1).gather(1, ref_t[:, None])[:, 0]
            assert torch.equal(tokens, ref_t)
            torch.testing.assert_close(logprobs, ref_lp, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)
