"""The residual add of an fp32 partial (model/residual.py): the Triton kernel bitwise equal to
``res + partial.to(res.dtype)``, run by Triton's CPU interpreter in a subprocess
(tests/interpreted.py; skipped when triton does not import), and the torch expression where
the kernel does not apply."""

from __future__ import annotations


import pytest
import torch

from colo_rollout.model.residual import add_rounded
from tests.interpreted import HAS_TRITON, interpreted_main

CASES = [((1, 37), torch.bfloat16), ((3, 2048), torch.bfloat16), ((5, 1100), torch.float16)]


def _case(i):
    shape, dtype = CASES[i]
    g = torch.Generator().manual_seed(i)
    res = (torch.randn(shape, generator=g) * 4).to(dtype)
    # magnitudes from 1e-3 to 1e3: roundings at every exponent, ties included
    partial = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])
    partial[..., :4] = torch.tensor([0.5, -0.0, 1 + 2 ** -8, 1 + 3 * 2 ** -9])  # ties, zero
    return res, partial


def test_torch_expression_where_the_kernel_does_not_apply():
    res, partial = _case(1)
    want = res + partial.to(res.dtype)
    assert torch.equal(add_rounded(res, partial), want)  # backend torch
    assert torch.equal(add_rounded(res, partial.to(res.dtype), "triton"), want)  # equal dtypes
    assert torch.equal(add_rounded(res.float(), partial, "triton"), res.float() + partial)


def _interpreted() -> list[str]:
    fails = []
    for i in range(len(CASES)):
        res, partial = _case(i)
        got = add_rounded(res, partial, "triton")
        want = res + partial.to(res.dtype)
        if got.dtype != res.dtype or not torch.equal(got, want):
            fails.append(f"case {i}: {int((got != want).sum())} elements differ")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_is_bitwise_the_torch_expression_interpreted(interpreted):
    interpreted.check(__file__)


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)
