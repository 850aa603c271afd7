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
    masks; it is not specialised on). No split-K: each output element is one program's K loop
    in a fixed order. Off CUDA (the CPU tier) each row is its own 1 x K product (a batched
    GEMV): invariant by construction.
  * ``SPLIT_TOKENS``: the decode attention's key-axis split width (splits at fixed absolute
    positions; an empty split adds exactly zero in the reduce).
  * the fused MoE's experts on ``fused_moe.INVARIANT_TILES`` (one tile pair for every D
    launch; on CPU one product per pair row): ``moe_experts(..., invariant=True)``.

Scope: D iterations of one rank's computation (P is unchanged: its first token comes from P
with the default kernels). Sums across ranks break it (NCCL's reduction order follows the
message size), so the door refuses attention TP > 1 and the gather backend at EP > 1; FP8
and Transformer Engine's GEMMs are cuBLAS's and refused too (config/checks.py).

Imports only torch (and triton when present).
"""

from __future__ import annotations

import os

import torch

from colo_rollout.model.kernel_backend import rne_bf16, tl, triton

# decode attention: keys split at multiples of this many tokens (a multiple of every
# BLOCK_N the kernel uses); 512 keeps B = 1 at 4k contexts at 8 splits per group
SPLIT_TOKENS = 512
BLOCK_M = 64  # rows per tile (one warpgroup MMA's M on sm90)
BLOCK_K = 64
SMS = 132  # H200 multiprocessors: BLOCK_N is the widest that gives a program per SM


def block_n(n: int) -> int:
    """The tile's columns for an output width ``n``: 64, or 32 / 16 where 64 would leave
    multiprocessors idle at one row block (a D GEMM streams its weight: the programs must
    cover the chip)."""
    for bn in (64, 32):
        if -(-n // bn) >= SMS:
            return bn
    return 16


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, OUT_F32: tl.constexpr, RNE: tl.constexpr,
                       UPCAST: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # axis 0 over row blocks: the programs sharing a weight tile run side by side (L2)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            a = tl.load(X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(W + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                        mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if UPCAST:  # the interpreter's dot reads bf16 as integers: fp32 there
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
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


def invariant_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (+ bias [N]) -> [..., N] in ``out_dtype`` (default x's), each
    row's bits independent of the other rows (module docstring). The Triton kernel on CUDA
    (and on CPU tensors under TRITON_INTERPRET=1, which the tests use); else per-row products.
    ``out_dtype`` float32 keeps the fp32 accumulator (the router's gate)."""
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
    # products (a [M, 1, K] x [K, N] batched GEMV) -- fp32 on CUDA too, the checks' reference
    # precision, where the kernel's dot would round through tf32
    kernel = triton is not None and (_interpreting() or x.is_cuda and x.dtype != torch.float32)
    if not kernel:
        y = torch.matmul(x2.unsqueeze(1), w.t().to(x2.dtype)).squeeze(1)
        if bias is not None:
            y = y + bias
        return y.to(out_dtype).reshape(*lead, N)
    if w.stride(-1) != 1:
        w = w.contiguous()
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M:
        bn = block_n(N)
        grid = (-(-M // BLOCK_M), -(-N // bn))
        _linear_kernel[grid](x2, w, bias if bias is not None else w, y, M, N, K,
                             x2.stride(0), w.stride(0), y.stride(0),
                             HAS_BIAS=bias is not None, OUT_F32=out_dtype == torch.float32,
                             RNE=out_dtype == torch.bfloat16, UPCAST=not x.is_cuda,
                             BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=BLOCK_K,
                             num_warps=4, num_stages=4)
    return y.reshape(*lead, N)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
