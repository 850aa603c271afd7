"""A residual add fused with the RMSNorm that reads its result: the new residual stream and its
normalised rows in one launch, both returned.

Owns
  * ``FusedRMSNorm`` and ``fused_rms_norm``: which norm modules the kernel stands in for --
    exactly ``torch.nn.RMSNorm`` over the hidden dim with a weight and an eps (megatron's local
    spec: ``WrappedTorchNorm`` builds one), whose forward is ``F.rms_norm(x, (H,), weight,
    eps)``. Anything else -- LayerNorm, TE's norms, an ``IdentityOp``, a subclass, no weight,
    eps None -- is None: it stays a module.
  * ``add_rms_norm``: ``add_rounded(res, partial)`` (model/residual.py; with the partial in the
    model dtype that is torch's add, one rounding) and the RMSNorm of the sum;
  * ``add_slots_rms_norm``: ``add_rounded_slots(res, pairs)`` (the MoE's k slots summed in fp32
    slot 0 first, rounded, added) and the RMSNorm of the sum;
  * ``embed_rms_norm``: the embedding rows of token ids (``F.embedding``) and their RMSNorm --
    the first layer's input norm -- in one launch (the residual stream's start and what the
    first layer reads).

The residual output is bitwise the unfused expression's: the kernel does residual.py's ops in
its order with its roundings. The normalised output is torch's rms_norm on that residual as
model/rope_kv.py's note establishes it (torch 2.14: matched bitwise on CPU, model-dtype
weights): rstd = rsqrt(mean(x^2) + eps) in fp32 from the widened row, the mean an IEEE division
by H, then (x * rstd) * weight in fp32, rounded to the model dtype once. The one difference is
the order of the sum of squares (a tree in the kernel): rstd may move by an fp32 ulp, which the
rounding to bf16/fp16 mostly absorbs (tests/test_norm_add.py states what was measured). On a
GPU, torch's CUDA kernel (Welford-style sums, its rsqrtf) and Triton's rsqrt are their own: not
compared there yet.

Where the kernel does not apply (backend torch, fp32 models, a weight in another dtype than the
rows -- torch's rms_norm then rounds differently --, non-contiguous inputs, H > MAX_HIDDEN) it
is the torch expression: the residual.py function, then ``F.rms_norm``.

Must not go in here: the decision which adds may fuse (model.py: one rank, where the collectives
around them are the identity), collectives. Imports only torch (and triton when present).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from colo_rollout.model.bound_kernel import BoundKernel, all_aligned
from colo_rollout.model.kernel_backend import pow2, rne_bf16, tl, triton
from colo_rollout.model.residual import (Slots, slot_shape_error, add_rounded,
                                         add_rounded_slots, slot_operands)

if triton is not None:
    from colo_rollout.model.residual import slot_residual

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
# one program holds a whole row (its sum of squares needs all of it): up to 16K columns, 32
# fp32 values per thread at 16 warps
MAX_HIDDEN = 16384


class FusedRMSNorm(NamedTuple):
    """An RMSNorm the kernel computes: weight [H] and eps."""

    weight: torch.Tensor
    eps: float


def fused_rms_norm(norm: torch.nn.Module, hidden: int) -> FusedRMSNorm | None:
    """``norm`` as the kernel's RMSNorm when it is exactly torch's RMSNorm over (hidden,) with
    a weight and an eps (its forward then is ``F.rms_norm(x, (hidden,), weight, eps)``), else
    None (see the module docstring)."""
    if (type(norm) is not torch.nn.RMSNorm or norm.weight is None or norm.eps is None
            or tuple(norm.normalized_shape) != (hidden,)):
        return None
    return FusedRMSNorm(norm.weight, float(norm.eps))


Outputs = tuple[torch.Tensor, torch.Tensor]
NORM_RANGE = "colo.norm"  # the profiler range around the fused add + norm launches


def add_rms_norm(res: torch.Tensor, partial: torch.Tensor, norm: FusedRMSNorm,
                 backend: str = "torch", out: Outputs | None = None) -> Outputs:
    """res [n, H] (model dtype) + partial [n, H] (model dtype or fp32) rounded to res's dtype
    -> (that sum, its RMSNorm): ``add_rounded(res, partial)`` and ``F.rms_norm`` of it, in one
    kernel with ``backend`` "triton" where it applies. ``out``: two contiguous [n, H] tensors
    of res's dtype to write them into (returned)."""
    n, H = res.shape
    if partial.shape != res.shape:
        raise ValueError(f"add_rms_norm: partial {tuple(partial.shape)} does not match "
                         f"res {tuple(res.shape)}")
    _check_out(res, out)
    if not _kernel_applies(res, partial, norm, backend):
        new = add_rounded(res, partial)
        return _into(out, new, F.rms_norm(new, (H,), norm.weight, norm.eps))
    return _launch(res, partial.view(n, 1, H), norm, out)


def add_slots_rms_norm(res: torch.Tensor, pairs: Slots, norm: FusedRMSNorm,
                       backend: str = "torch", out: Outputs | None = None) -> Outputs:
    """res [n, H] (model dtype) + the fp32 sum of pairs [n, k, H] (or ``SortedSlots``) over k
    rounded to res's dtype -> (that sum, its RMSNorm): ``add_rounded_slots(res, pairs)`` and
    ``F.rms_norm`` of it, in one kernel with ``backend`` "triton" where it applies. ``out`` as
    for ``add_rms_norm``."""
    H = res.shape[1]
    problem = slot_shape_error("add_slots_rms_norm", pairs, res)
    if problem:
        raise ValueError(problem)
    _check_out(res, out)
    rows, where = slot_operands(pairs)
    if (not _kernel_applies(res, rows, norm, backend)
            or not (where is None or where.is_contiguous())):
        new = add_rounded_slots(res, pairs)
        return _into(out, new, F.rms_norm(new, (H,), norm.weight, norm.eps))
    return _launch(res, pairs, norm, out)


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, norm: FusedRMSNorm,
                   backend: str = "torch") -> Outputs:
    """ids [n] (int64) into table [V, H] -> (``F.embedding(ids, table)``, its RMSNorm): one
    kernel with ``backend`` "triton" where it applies, else the two torch ops. The rows are
    the table's bitwise (a copy); the norm as ``add_rms_norm``'s. Ids must lie in the table
    (the scheduler refuses others at submit; the kernel does not check them)."""
    if ids.dim() != 1 or table.dim() != 2:
        raise ValueError(f"embed_rms_norm: ids {tuple(ids.shape)} must be [n] and the table "
                         f"{tuple(table.shape)} [V, H]")
    n, H = ids.shape[0], table.shape[1]
    if not (_kernel_applies(table, table, norm, backend) and ids.dtype == torch.int64
            and ids.is_contiguous()):
        rows = F.embedding(ids, table)
        return rows, F.rms_norm(rows, (H,), norm.weight, norm.eps)
    rows, normed = (table.new_empty((n, H)) for _ in range(2))
    if n and H:
        block = pow2(H, 16)
        rne = not table.is_cuda and table.dtype == torch.bfloat16
        warps = min(16, max(1, block // 256))
        key = ((table.dtype, H, block, rne, warps)
               if all_aligned(ids, table, norm.weight, rows, normed) else None)
        _EMBED_RMS_NORM(key, (n,), (ids, table, norm.weight, rows, normed, H, norm.eps, block,
                                    rne), warps)
    return rows, normed


def _check_out(res: torch.Tensor, out: Outputs | None) -> None:
    if out is not None and not all(t.shape == res.shape and t.dtype == res.dtype
                                   and t.is_contiguous() for t in out):
        raise ValueError(f"out: two contiguous {tuple(res.shape)} {res.dtype} tensors")


def _into(out: Outputs | None, new: torch.Tensor, normed: torch.Tensor) -> Outputs:
    if out is None:
        return new, normed
    out[0].copy_(new)
    out[1].copy_(normed)
    return out


def _kernel_applies(res, partial, norm: FusedRMSNorm, backend: str) -> bool:
    w = norm.weight
    return (backend == "triton" and res.dtype in _KERNEL_DTYPES
            and partial.dtype in (res.dtype, torch.float32) and w.dtype == res.dtype
            and w.shape == (res.shape[-1],) and res.shape[-1] <= MAX_HIDDEN
            and res.is_contiguous() and partial.is_contiguous() and w.is_contiguous())


def _launch(res: torch.Tensor, pairs: Slots, norm: FusedRMSNorm,
            out: Outputs | None = None) -> Outputs:
    n, k, H = pairs.shape
    rows, where = slot_operands(pairs)
    new, normed = (torch.empty_like(res), torch.empty_like(res)) if out is None else out
    if n and H:
        block = pow2(H, 16)
        # one program per row: decode's one row is one program (launch-bound either way); k
        # and the block are constants of the model, so a model shape compiles one variant
        # (bound once per key: model/bound_kernel.py)
        rne = not res.is_cuda and res.dtype == torch.bfloat16
        warps = min(16, max(1, block // 256))
        sort = where is not None
        key = ((res.dtype, rows.dtype, H, k, sort, where.dtype if sort else None, block, rne,
                warps)
               if all_aligned(res, rows, norm.weight, new, normed, *([where] if sort else []))
               else None)
        args = (res, rows, where if sort else rows, norm.weight, new, normed, H, norm.eps, k,
                sort, block, rne)
        if torch.autograd.profiler._is_profiler_enabled:
            # a named range the profiler sees the launch under (bench-speed's "norms": the
            # layers call this kernel themselves, outside the norm modules); entered only
            # under a profiler, never in a graph capture of serving
            with torch.profiler.record_function(NORM_RANGE):
                _ADD_RMS_NORM(key, (n,), args, warps)
        else:
            _ADD_RMS_NORM(key, (n,), args, warps)
    return new, normed


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(Res, Pairs, Where, W, New, Normed, H, eps, K: tl.constexpr,
                             SORTED: tl.constexpr, BLOCK: tl.constexpr,
                             RNE_BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        dtype = New.dtype.element_ty
        # the new residual, bitwise add_rounded / add_rounded_slots (exact in fp32; masked: 0)
        x = slot_residual(Res, Pairs, Where, row, cols, mask, H, K, SORTED, dtype, RNE_BF16)
        tl.store(New + row * H + cols, x.to(dtype), mask=mask)
        # torch's rms_norm on it
        _store_rms_norm(x, W, Normed, row, cols, mask, H, eps, dtype, RNE_BF16)

    @triton.jit
    def _store_rms_norm(x, W, Normed, row, cols, mask, H, eps, dtype: tl.constexpr,
                        RNE_BF16: tl.constexpr):
        """torch's rms_norm of the row x (fp32, exact in dtype; masked lanes 0) stored at
        Normed's row: rstd = rsqrt(mean(x^2) + eps), the mean an IEEE division by H, then
        (x * rstd) * w rounded once -- no rounding before the weight, and no add next to a
        product that could contract into an FMA but the sum of squares (whose order differs
        from torch's anyway)."""
        ss = tl.sum(x * x, axis=0)
        rstd = tl.rsqrt(tl.math.div_rn(ss, tl.zeros_like(ss) + H) + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x * rstd) * w
        if RNE_BF16:
            y = rne_bf16(y)
        tl.store(Normed + row * H + cols, y.to(dtype), mask=mask)

    @triton.jit
    def _embed_rms_norm_kernel(Ids, Table, W, Rows, Normed, H, eps, BLOCK: tl.constexpr,
                               RNE_BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        dtype = Rows.dtype.element_ty
        tok = tl.load(Ids + row).to(tl.int64)
        x = tl.load(Table + tok * H + cols, mask=mask, other=0.0)
        tl.store(Rows + row * H + cols, x, mask=mask)
        _store_rms_norm(x.to(tl.float32), W, Normed, row, cols, mask, H, eps, dtype, RNE_BF16)


# the launches through their bound variants (model/bound_kernel.py): P's critical path
_ADD_RMS_NORM = BoundKernel(_add_rms_norm_kernel) if triton is not None else None
_EMBED_RMS_NORM = BoundKernel(_embed_rms_norm_kernel) if triton is not None else None
