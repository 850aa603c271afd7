"""Batch-invariant D iterations (``engine.batch_invariant``): a row's logits do not depend on
which other rows share its D iteration, nor on how many there are.

Why: with the default kernels a D row's bits depend on the batch -- cuBLAS picks its GEMM
algorithm (tile, split-K) by the row count, the decode attention's split count follows rows x
groups (paged_attention.num_splits), the fused MoE's tile follows the pairs per expert
(fused_moe.regime). In bf16 that moves near-tied argmaxes: MTP's verify forward (2B rows)
parted from the plain D stream (B rows) in 0-18% of greedy streams on an H200 (docs/
benchmarks.md session 12), and a rollout's tokens depended on its batch neighbours.

What this module owns, each a function of the weights' shapes alone, never of the rows:
  * ``invariant_linear(x, w)``: x [M, K] @ w[N, K]^T with one Triton tile per (N, K) -- the
    same instruction sequence for every row whatever M is (M only sets the grid and the row
    masks; it is not specialised on). Where the tile splits K, the splits are fixed K ranges
    (by K alone) whose fp32 partials a second kernel adds in split order. Off CUDA (the CPU
    tier) each row is its own 1 x K product (a batched GEMV): invariant by construction.
  * ``SPLIT_TOKENS``: the decode attention's key-axis split width (splits at fixed absolute
    positions; an empty split adds exactly zero in the reduce, and a row whose table fits one
    split takes the single pass, the same bits as one split through the reduce).
  * the fused MoE's experts on the small or decode regime's tiles, never the prefill
    regime's (``fused_moe.INVARIANT_REGIMES``; on CPU one product per pair row):
    ``moe_experts(..., invariant=True)``.

Scope: D iterations (P is unchanged: its first token comes from P with the default
kernels). D's sums across ranks (attention TP's and the gather backend's reduce-scatters,
whose order NCCL picks by the message size) go as an all-to-all added in rank order
(model/comm.py, ``ordered_sums``). Refused at the door (config/schema.py:
``batch_invariance_problem``): DeepEP's combine, FP8 and Transformer Engine's GEMMs
(cuBLAS's), megatron's expert path.

Imports only torch (and triton when present).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from colo_rollout.model.kernel_backend import rne_bf16, tl, triton

# decode attention: keys split at multiples of this many tokens (a multiple of every
# BLOCK_N the kernel uses); 512 keeps B = 1 at 4k contexts at 8 splits per group
SPLIT_TOKENS = 512
BLOCK_M = 64  # rows per tile (one warpgroup MMA's M on sm90)


@dataclass(frozen=True)
class LinearTile:
    """The invariant linear's launch: columns per program, K per step, K splits (each split
    a fixed K range, its fp32 partial added in split order by a second kernel), pipeline
    stages, warps. Chosen from (N, K) alone (``linear_tile``), never from the rows."""

    block_n: int
    block_k: int = 64
    split_k: int = 1
    stages: int = 4
    warps: int = 4


def linear_tile(n: int, k: int) -> LinearTile:
    """The shipped tile for an output width ``n`` and depth ``k``, from an H200 sweep of 36
    tiles over the bench shapes' projections at 1, 64 and 256 rows (scripts/
    gpu_invariant_gemm.py --sweep, 2026-12-04; docs/benchmarks.md session 24): 128-deep K
    steps in 3 stages; 64 columns for wide outputs (the vocabulary: 64-deep steps), 32 for
    the 2-4k-wide projections, whose weights then spread over the chip; a narrow output (the
    router's gate) or a deep one over few columns (Qwen3's 4096-deep output projection) split
    K in 2 -- more programs streaming the weight, a second kernel adding their partials."""
    if n >= 16384:
        return LinearTile(64, 64, 1, 3)
    if n <= 256:
        return LinearTile(16, 64, 2, 4)
    if k >= 2 * n:
        return LinearTile(32, 128, 2, 3)
    return LinearTile(64 if n >= 4096 else 32, 128, 1, 3)


if triton is not None:

    @triton.jit
    def _round_out(acc, Bias, offs_n, n_ok, Y, ptrs, mask, HAS_BIAS: tl.constexpr,
                   OUT_F32: tl.constexpr, RNE: tl.constexpr):
        if OUT_F32:
            y = acc
            if HAS_BIAS:
                y = y + tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(ptrs, y, mask=mask)
        else:
            # torch's matmul-then-add: the product rounded to the output dtype, the bias
            # added to that and rounded again (RNE: bf16 output, rounded to nearest even
            # under the interpreter too)
            y = (rne_bf16(acc) if RNE else acc).to(Y.dtype.element_ty)
            if HAS_BIAS:
                v = y.to(tl.float32) + tl.load(Bias + offs_n, mask=n_ok,
                                               other=0.0).to(tl.float32)[None, :]
                y = (rne_bf16(v) if RNE else v).to(Y.dtype.element_ty)
            tl.store(ptrs, y, mask=mask)

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(X, W, Bias, Y, Part, M, N, K, k_split, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, OUT_F32: tl.constexpr, RNE: tl.constexpr,
                       UPCAST: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # axis 0 over row blocks: the programs sharing a weight tile run side by side (L2)
        pid_m = tl.program_id(0)
        # int64: a weight row's offset n * K passes 2^31 for a vocabulary x hidden past it
        # (262,400 x 8192)
        pid_n = tl.program_id(1).to(tl.int64)
        pid_s = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        k_lo = pid_s * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k0 + offs_k) < k_hi
            a = tl.load(X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(W + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                        mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if UPCAST:  # the interpreter's dot reads bf16 as integers: fp32 there
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT > 1:  # this split's fp32 partial; _split_sum_kernel adds them in order
            tl.store(Part + (pid_s * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
        else:
            _round_out(acc, Bias, offs_n, n_ok, Y, Y + offs_m[:, None] * stride_ym
                       + offs_n[None, :], mask, HAS_BIAS, OUT_F32, RNE)

    @triton.jit(do_not_specialize=["M"])
    def _split_sum_kernel(Part, Bias, Y, M, N, stride_ym, HAS_BIAS: tl.constexpr,
                          OUT_F32: tl.constexpr, RNE: tl.constexpr, SPLIT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        mask = (offs_m < M)[:, None] & n_ok[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLIT):  # split order: a row's sum whatever the rows
            acc += tl.load(Part + (s * M + offs_m[:, None]) * N + offs_n[None, :], mask=mask,
                           other=0.0)
        _round_out(acc, Bias, offs_n, n_ok, Y, Y + offs_m[:, None] * stride_ym
                   + offs_n[None, :], mask, HAS_BIAS, OUT_F32, RNE)


def invariant_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None,
                     tile: LinearTile | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (+ bias [N]) -> [..., N] in ``out_dtype`` (default x's), each
    row's bits independent of the other rows (module docstring). The Triton kernel on CUDA
    (and on CPU tensors under TRITON_INTERPRET=1, which the tests use); else per-row products.
    ``out_dtype`` float32 keeps the fp32 accumulator (the router's gate). ``tile``: a launch
    override for tests and the sweep (default ``linear_tile(N, K)``)."""
    out_dtype = out_dtype or x.dtype
    lead, K = x.shape[:-1], x.shape[-1]
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"invariant_linear: x has {K} columns, w {tuple(w.shape)}")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    # the kernel for 16-bit operands on CUDA (any dtype under the interpreter); else per-row
    # products (a [M, 1, K] x [K, N] batched GEMV) -- fp32 and fp64 (a router in fp64) on CUDA
    # too: fp32 is the checks' reference precision, where the kernel's dot would round
    # through tf32
    kernel = triton is not None and (
        _interpreting() or x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
        and w.dtype == x.dtype)
    if not kernel:
        y = torch.matmul(x2.unsqueeze(1), w.t().to(x2.dtype)).squeeze(1)
        if bias is not None:
            y = y + bias
        return y.to(out_dtype).reshape(*lead, N)
    if w.stride(-1) != 1:
        w = w.contiguous()
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M:
        t = tile or linear_tile(N, K)
        # each split a whole number of K steps: its range, and so a row's sum, fixed by K
        k_split = -(-(-(-K // t.split_k)) // t.block_k) * t.block_k
        split = -(-K // k_split)
        part = (torch.empty((split, M, N), dtype=torch.float32, device=x.device)
                if split > 1 else y)
        flags = dict(HAS_BIAS=bias is not None, OUT_F32=out_dtype == torch.float32,
                     RNE=out_dtype == torch.bfloat16)
        b = bias if bias is not None else w
        _linear_kernel[(-(-M // BLOCK_M), -(-N // t.block_n), split)](
            x2, w, b, y, part, M, N, K, k_split, x2.stride(0), w.stride(0), y.stride(0),
            UPCAST=not x.is_cuda, SPLIT=split, BLOCK_M=BLOCK_M, BLOCK_N=t.block_n,
            BLOCK_K=t.block_k, num_warps=t.warps, num_stages=t.stages, **flags)
        if split > 1:
            _split_sum_kernel[(-(-M // 32), -(-N // 128))](
                part, b, y, M, N, y.stride(0), SPLIT=split, BLOCK_M=32, BLOCK_N=128,
                num_warps=4, **flags)
    return y.reshape(*lead, N)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
