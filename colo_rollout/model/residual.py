"""The residual add of a layer's fp32 partial: ``res + partial.to(res.dtype)`` in one launch.

Owns ``add_rounded``: the MoE (and dense MLP) output is combined in fp32 (model/moe.py:
COMBINE_DTYPE) and rounded to the model dtype once before it joins the residual stream -- two
kernels on the torch path (the cast, the add). The Triton kernel does both per element with
the same two roundings to nearest even (the partial to the model dtype, then the sum), so
the result is bitwise the torch path's. Where it does not apply (CPU tensors, equal dtypes,
non-contiguous inputs) it is the torch expression.

Imports only torch (and triton when present): no megatron.
"""

from __future__ import annotations

import torch

from colo_rollout.model.kernel_backend import rne_bf16, tl, triton

_BLOCK = 1024


def add_rounded(res: torch.Tensor, partial: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """res [..., H] (model dtype) + partial [..., H] rounded to res's dtype -> a new tensor.
    ``backend`` "triton": one kernel where it applies (see the module docstring)."""
    if (backend != "triton" or partial.dtype == res.dtype or res.shape != partial.shape
            or not (res.is_contiguous() and partial.is_contiguous())
            or res.dtype not in (torch.bfloat16, torch.float16)):
        return res + partial.to(res.dtype)
    out = torch.empty_like(res)
    n = res.numel()
    if n:
        _add_rounded_kernel[(triton.cdiv(n, _BLOCK),)](
            res, partial, out, n, BLOCK=_BLOCK, RNE_BF16=not res.is_cuda
            and res.dtype == torch.bfloat16, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _rounded(v, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
        if RNE_BF16:  # the interpreter truncates: round to nearest even by hand
            v = rne_bf16(v)
        return v.to(dtype).to(tl.float32)

    @triton.jit(do_not_specialize=["n"])
    def _add_rounded_kernel(Res, Partial, Out, n, BLOCK: tl.constexpr,
                            RNE_BF16: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dtype = Out.dtype.element_ty
        p = _rounded(tl.load(Partial + offs, mask=mask, other=0.0).to(tl.float32), dtype,
                     RNE_BF16)
        r = tl.load(Res + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + offs, _rounded(r + p, dtype, RNE_BF16).to(dtype), mask=mask)
