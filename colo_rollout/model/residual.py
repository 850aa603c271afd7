"""The residual add of a layer's partial: ``res + partial.to(res.dtype)`` in one launch, and,
where the combine collective is the identity, the k-slot sum of the MoE pairs fused into it.

Owns
  * ``add_rounded``: the MoE (and dense MLP) output is combined in fp32 (model/moe.py:
    COMBINE_DTYPE) and rounded to the model dtype once before it joins the residual stream --
    two kernels on the torch path (the cast, the add). The Triton kernel does both per element
    with the same two roundings to nearest even (the partial to the model dtype, then the
    sum), so the result is bitwise the torch path's.
  * ``add_rounded_slots``: ``res + round(sum_k pairs[:, j])`` for the gather MoE's unsummed
    (token, slot) outputs [n, k, H] (``GatherMoE(pairs=True)``), when nothing has to happen
    to the fp32 sum between the experts and the residual (one rank, no shared experts: the
    caller decides). The fp32 sum runs over the slots in a fixed order -- slot 0, then 1, ...
    one after the other -- on both paths, so the kernel is bitwise the torch path on every
    device. (``torch.sum`` over the slot dim does not promise that order: on CPU it is
    sequential only for k <= 4, or k <= 16 with H a multiple of the vector width -- measured
    -- and CUDA's reduction keeps several accumulators; the torch path therefore spells the
    order out.) One launch instead of the slot sum's reduction and the add.
  * ``SortedSlots``: the slots where fc2 left them in prefill -- in the pairs' expert-sorted
    order, each token's slot j at the row its ``where`` names (model/fused_moe.py:
    ``stores_sorted``; its scattered store into the pairs' order cost fc2 3-7%) -- which the
    functions here read by index: the same rows, the same adds in the same order, so the
    same bits as the slots in place.

Where a kernel does not apply (backend torch, CPU tensors outside the interpreter's tests,
fp32 models, non-contiguous inputs) it is the torch expression. The same adds fused with the
RMSNorm that reads their result: model/norm_add.py.

Must not go in here: the decision which combine is the identity (model.py), collectives.
Imports only torch (and triton when present): no megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colo_rollout.model.kernel_backend import rne_bf16, tl, triton

_BLOCK = 1024
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def add_rounded(res: torch.Tensor, partial: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """res [..., H] (model dtype) + partial [..., H] rounded to res's dtype -> a new tensor.
    ``backend`` "triton": one kernel where it applies (see the module docstring)."""
    if (backend != "triton" or partial.dtype == res.dtype or res.shape != partial.shape
            or not (res.is_contiguous() and partial.is_contiguous())
            or res.dtype not in _KERNEL_DTYPES):
        return res + partial.to(res.dtype)
    out = torch.empty_like(res)
    n = res.numel()
    if n:
        _add_rounded_kernel[(triton.cdiv(n, _BLOCK),)](
            res, partial, out, n, BLOCK=_BLOCK, RNE_BF16=not res.is_cuda
            and res.dtype == torch.bfloat16, num_warps=4)
    return out


@dataclass(frozen=True)
class SortedSlots:
    """A MoE layer's (token, slot) outputs where fc2 stored them -- in the pairs' order by
    expert, each row once (no scattered store): ``rows`` [R, H]; token t's slot j is row
    ``where[t, j]`` (``where`` [n, k], integer). Beside it the slots in place, a [n, k, H]
    tensor, which the functions here take too."""

    rows: torch.Tensor
    where: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """[n, k, H], as the slots in place."""
        return (*self.where.shape, self.rows.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    def in_place(self) -> torch.Tensor:
        """The slots gathered into [n, k, H] (the torch path's and the tests' view)."""
        n, k = self.where.shape
        return self.rows[self.where.reshape(-1)].view(n, k, -1)


Slots = torch.Tensor | SortedSlots


def slot_shape_error(what: str, pairs: Slots, res: torch.Tensor) -> str | None:
    """Why ``pairs`` cannot be summed into res [n, H] (None: it can)."""
    if isinstance(pairs, SortedSlots):
        ok = (pairs.rows.dim() == 2 and pairs.where.dim() == 2
              and pairs.where.shape[0] == res.shape[0] and pairs.where.shape[1] >= 1
              and pairs.rows.shape[1] == res.shape[1] and not pairs.where.is_floating_point())
    else:
        ok = (pairs.dim() == 3 and pairs.shape[0] == res.shape[0]
              and pairs.shape[2] == res.shape[1] and pairs.shape[1] >= 1)
    return None if ok else (f"{what}: pairs {tuple(pairs.shape)} do not match res "
                            f"{tuple(res.shape)} as [n, k, H]")


def slot_sum(pairs: Slots) -> torch.Tensor:
    """pairs [n, k, H] (or ``SortedSlots``) -> their fp32 sum over k [n, H], slot 0 first and
    one slot after the other (the order the kernel sums in; see the module docstring)."""
    if isinstance(pairs, SortedSlots):
        rows, where = pairs.rows, pairs.where
        acc = rows[where[:, 0]].to(torch.float32)  # (an index gather: a copy)
        for j in range(1, where.shape[1]):
            acc += rows[where[:, j]]
        return acc
    acc = pairs[:, 0].to(torch.float32, copy=True)  # a copy (fp32 pairs too): pairs unchanged
    for j in range(1, pairs.shape[1]):
        acc += pairs[:, j]  # fp32 += model dtype: the slot widened exactly, one fp32 add
    return acc


def slot_operands(pairs: Slots) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernels' operands of ``pairs``: (the rows, the index or None)."""
    if isinstance(pairs, SortedSlots):
        return pairs.rows, pairs.where
    return pairs, None


def add_rounded_slots(res: torch.Tensor, pairs: Slots, backend: str = "torch",
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """res [n, H] (model dtype) + the fp32 sum of pairs [n, k, H] (or ``SortedSlots``) over k
    rounded to res's dtype -> a new tensor (or ``out``, [n, H] contiguous in res's dtype: a P
    graph's shared output rows): ``add_rounded(res, slot_sum(pairs))``. ``backend``
    "triton": one kernel where it applies (bf16/fp16, contiguous, pairs in res's dtype)."""
    n, H = res.shape
    problem = slot_shape_error("add_rounded_slots", pairs, res)
    if problem:
        raise ValueError(problem)
    if out is not None and (out.shape != res.shape or out.dtype != res.dtype
                            or not out.is_contiguous()):
        raise ValueError(f"add_rounded_slots: out {tuple(out.shape)} {out.dtype} is not "
                         f"res's {tuple(res.shape)} {res.dtype}, contiguous")
    rows, where = slot_operands(pairs)
    if (backend != "triton" or rows.dtype != res.dtype or res.dtype not in _KERNEL_DTYPES
            or not (res.is_contiguous() and rows.is_contiguous())
            or not (where is None or where.is_contiguous())):
        if out is None:
            return res + slot_sum(pairs).to(res.dtype)
        return torch.add(res, slot_sum(pairs).to(res.dtype), out=out)
    if out is None:
        out = torch.empty_like(res)
    if n and H:
        # a 2-D grid (row, column block): no division per element, and at decode (n = 1) a
        # handful of programs; k is a constant of the model, so the slot loop unrolls
        _add_rounded_slots_kernel[(n, triton.cdiv(H, _BLOCK))](
            res, rows, rows if where is None else where, out, H, K=pairs.shape[1],
            SORTED=where is not None, BLOCK=_BLOCK,
            RNE_BF16=not res.is_cuda and res.dtype == torch.bfloat16, num_warps=4)
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

    @triton.jit
    def slot_residual(Res, Pairs, Where, row, cols, mask, H, K: tl.constexpr,
                      SORTED: tl.constexpr, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
        """Row ``row``'s new residual at ``cols`` (fp32, exact in ``dtype``): its K slots in
        slot_sum's order -- slot 0 widened, then each further slot added in fp32 (no
        products, so no contraction into FMAs can change a rounding) -- rounded to the model
        dtype, added to the residual, rounded again (K = 1: add_rounded's partial). The
        slots are Pairs' rows row * K + j, or with ``SORTED`` its rows Where[row * K + j]."""
        if SORTED:
            r = tl.load(Where + row * K).to(tl.int64)
            acc = tl.load(Pairs + r * H + cols, mask=mask, other=0.0).to(tl.float32)
            for j in tl.static_range(1, K):
                r = tl.load(Where + row * K + j).to(tl.int64)
                acc += tl.load(Pairs + r * H + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            base = Pairs + row * K * H + cols
            acc = tl.load(base, mask=mask, other=0.0).to(tl.float32)
            for j in tl.static_range(1, K):
                acc += tl.load(base + j * H, mask=mask, other=0.0).to(tl.float32)
        p = _rounded(acc, dtype, RNE_BF16)
        r = tl.load(Res + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        return _rounded(r + p, dtype, RNE_BF16)

    @triton.jit
    def _add_rounded_slots_kernel(Res, Pairs, Where, Out, H, K: tl.constexpr,
                                  SORTED: tl.constexpr, BLOCK: tl.constexpr,
                                  RNE_BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        dtype = Out.dtype.element_ty
        x = slot_residual(Res, Pairs, Where, row, cols, mask, H, K, SORTED, dtype, RNE_BF16)
        tl.store(Out + row * H + cols, x.to(dtype), mask=mask)
