"""Routed experts of the grouped (host-sync-free) MoE path: two grouped GEMMs over sorted pairs.

Owns ``moe_experts`` -- what ``GatherMoE._grouped`` calls between its routing and its combine
-- with its two backends: the torch path (``x[token]`` gathered, ``torch._grouped_mm`` for fc1,
the activation, the router probability, ``torch._grouped_mm`` for fc2: the CPU path and the
reference) and a Triton fused-MoE kernel; plus the backend's resolution at model build
(``resolve_backend``: ``engine.moe_kernel``).

The input is the (token, top-k slot) pairs sorted by local expert: ``token`` [R] (the pair's
row of x), ``offs`` [E] int32 (group ends: pairs < offs[e] belong to experts <= e; pairs past
offs[-1] belong to other ranks' experts or padding rows), ``prob`` [R] (the router
probability of each sorted pair). The output y [R, H] is in the same sorted order; rows past
offs[-1] are zero (Triton) or unwritten (torch; the caller masks them).

The Triton kernel (one launch for fc1, one for fc2, as vLLM/SGLang's fused_moe):
  * per-expert tiles of ``BLOCK_M`` rows: every program reads ``offs`` (E values) and works
    out, on the device, which expert its row block belongs to -- each expert's count padded up
    to a multiple of BLOCK_M, as a "moe_align_block_size" would, but without materialising
    the padded index. The grid has a fixed bound, cdiv(R, BLOCK_M) + min(E, R) row blocks
    times the output's column tiles, so it depends on shapes alone: a CUDA graph replays it
    with new routing. Row blocks past the last expert's write zeros over the rows past
    offs[-1] (fc2) or nothing (fc1).
  * fc1 reads its A rows through ``token`` (the gather is fused: no [R, H] copy of x), keeps
    gate and up accumulators (fp32) side by side and applies the activation (SwiGLU: silu(gate)
    * up; or plain silu/gelu/relu when ``gated_linear_unit`` is off) and the router probability
    in the epilogue, writing h [R, F] in x's dtype; fc2 is a plain grouped GEMM writing y.
  * the tile shape (``BLOCK_M`` x ``BLOCK_N`` x ``BLOCK_K``, warps, stages) comes from the
    average rows per expert, R / E -- a host-known shape (``tile_config``): small row blocks
    and column splits in decode, where the GEMMs are bound by reading the experts' weights;
    larger tiles with grouped program order (weight tiles reused from L2) in prefill.

Numerics: fp32 accumulation; the activation and the probability in fp32, rounded to x's dtype
once (the torch path rounds h before the activation and again after the probability).
Activations other than silu/gelu/relu have no Triton epilogue (``triton_supports``): the torch
path serves them.

Imports torch (and triton when present) and model/fp8.py: no megatron, so a GPU check can load
it alone.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from colo_rollout.model.kernel_backend import BACKENDS, tl, triton, triton_available  # noqa: F401
from colo_rollout.model.kernel_backend import resolve_backend as _resolve
from colo_rollout.model.kernel_backend import pow2, rne_bf16, smem_per_block
from colo_rollout.model.fp8 import Fp8Weight, dequantize_rows, quantize_grouped, quantize_rows

try:  # TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the host
    TensorDescriptor = None

KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # what "auto" gives the kernel
# the epilogue's activations (constexpr codes in the kernel); anything else: torch path
ACTIVATIONS = {F.silu: 1, F.gelu: 2, F.relu: 3}
ACT_NONE = 0
# the expert-map vector's least width: one compiled kernel for every E_local up to 128 (the
# map's work per program is a few vector ops on it either way)
E_PAD_MIN = 128


@dataclass(frozen=True)
class Tile:
    """One launch's tile shape and pipelining."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 1  # row blocks per program group (L2 reuse of a weight tile)
    # the weight tiles (and fc2's contiguous A tiles) through TMA tensor descriptors instead
    # of pointer loads (sm90+, bf16/fp16 operands; ``tma_usable``)
    tma: bool = False
    # one program per SM walking the tiles, the tile loop flattened into the K loop so the
    # next tile's loads run under this tile's epilogue (``_moe_gemm_persistent_kernel``);
    # only where both operands come through TMA and the epilogue is a plain store (fc2 in
    # 16 bits): elsewhere the launch falls back to the one-tile-per-program kernel
    persistent: bool = False
    # an expert's last row block with at most this many rows (a power of two < block_m, or 0:
    # off) runs a tile of this many rows in its place -- the MMA work of the padded rows cut;
    # only where A comes by pointer (a TMA descriptor's block is block_m rows)
    tail_m: int = 0
    # a gated GEMM's gate and up weight tiles in one TMA load of a [2, block_n, block_k] box
    # (the weight stack seen as [2E, n, K]) and one MMA of 2 x block_n columns, split in the
    # epilogue: A's tile is read once per K step instead of once per half (W through TMA
    # only; elsewhere the two-MMA body runs)
    paired: bool = False

    def __post_init__(self) -> None:
        t = self.tail_m
        if t and (t & (t - 1) or not 16 <= t < self.block_m):
            raise ValueError(f"Tile.tail_m {t}: a power of two in [16, block_m "
                             f"{self.block_m}), or 0")


# Tile shapes by regime (average pairs per local expert, R / E), one for each GEMM (fc1: the
# gated 2F x H weight, fc2: H x F). Hard-coded from the H200 sweep of scripts/gpu_fused_moe.py
# (H 2048, F 1408 / 768, E 64 / 128, top-8, bf16; 30-48 tiles per shape, the pick the least
# mean slowdown against each shape's best: <= 1.8% in every regime). Decode streams the
# weights at 3.9-4.3 TB/s with 16-32-row blocks and 32-128 columns. Prefill's tiles are fed
# by TMA descriptors (scripts/gpu_moe_prefill_tiles.py, 2026-12-02: 1.09-1.22x the pointer-fed
# kernel's best, 46-61% of the bf16 peak at 4096-8192 tokens); fc2's 256 columns pay off
# once its A tiles come through TMA. fc2 in prefill is persistent with the epilogue under the
# next tile's loads (scripts/gpu_moe_gemm_ceiling.py, 2026-12-03: 1.05-1.26x the
# one-tile-per-program kernel at 4096-8192 tokens; fc1's two accumulators lose 15-30% that
# way, so fc1 stays as it is). fc1's last row block of an expert, when it holds <= 64 rows,
# runs as a 64-row tile in its place (``tail_m``; bench-speed same-run A/B, 2026-12-03: P steps
# 0.2-1.1% faster, the 4k rows within the runs' spread).
SMALL_ROWS = 1  # R / E at or under this: "small" (decode batches of a few rows)
DECODE_ROWS = 32  # at or under this: "decode"; above it: "prefill"
TILES = {
    ("small", "fc1"): Tile(16, 32, 128, 4, 3),
    ("small", "fc2"): Tile(16, 128, 128, 4, 4),
    ("decode", "fc1"): Tile(16, 64, 128, 4, 3),
    ("decode", "fc2"): Tile(32, 128, 64, 4, 3),
    ("prefill", "fc1"): Tile(128, 128, 64, 8, 4, 1, True, tail_m=64, paired=True),
    ("prefill", "fc2"): Tile(128, 256, 64, 8, 3, 8, True, True),
}
# fc2's prefill tile one pipeline stage deeper where a launch holds at most this many pairs
# (4096 tokens of top-8): scripts/gpu_moe_gemm_ceiling.py --fc2-sweep 5 (2026-12-06, H100):
# 1.078x / 1.079x at 4096 tokens on the Qwen3 / first shape (2048 tiles over 132 SMs), 0.987x /
# 0.989x at 8192 (4096 tiles) -- so only the shorter launches take it
PREFILL_FC2_DEEP = Tile(128, 256, 64, 8, 4, 8, True, True)
PREFILL_FC2_DEEP_PAIRS = 32768
# engine.batch_invariant's D (model/batch_invariant.py): the small and decode regimes' tiles
# only -- pointer-fed, 16-32 rows, 4 warps, the K loop adding 16-deep MMA steps in K order,
# so a pair row's bits are the same in either (checked on an H200: tests/
# test_batch_invariant.py) -- never the prefill regime's 128-row tiles (another MMA shape)
INVARIANT_REGIMES = ("small", "decode")
# Blockwise FP8 (``SCALE_K``: each K step's partial product rescaled before it is added) keeps
# a second fp32 tile live beside the accumulator, so the prefill tiles above spill: on an H200
# (scripts/gpu_fp8_block_tiles.py, 2026-12-03, 4096 tokens) fc1 on 128 x 128 x 64 ran at
# 8-10% of the bf16 peak. Tiles of 64 rows at 4 warps with one rescale per 128-wide scale
# block: fc1 5.2-5.5x, fc2 2.2-2.5x, a QKV-sized projection 2.4x faster than those.
BLOCKWISE_TILES = {
    ("prefill", "fc1"): Tile(64, 64, 128, 4, 3),
    ("prefill", "fc2"): Tile(64, 128, 128, 4, 3, 8),
}


def tile_for(reg: str, which: str, blockwise: bool = False, pairs: int | None = None) -> Tile:
    """The tile of a launch in regime ``reg`` ("small" / "decode" / "prefill") for ``which``
    ("fc1" / "fc2"; a dense projection takes fc2's); ``blockwise``: blockwise-FP8 operands;
    ``pairs``: the launch's rows where known (a short prefill's fc2 pipelines deeper)."""
    if blockwise and (reg, which) in BLOCKWISE_TILES:
        return BLOCKWISE_TILES[(reg, which)]
    short = pairs is not None and pairs <= PREFILL_FC2_DEEP_PAIRS
    if (reg, which) == ("prefill", "fc2") and short:
        return PREFILL_FC2_DEEP
    return TILES[(reg, which)]


def triton_supports(activation) -> bool:
    """Whether the kernel's epilogue computes ``activation`` (silu, gelu, relu)."""
    return activation in ACTIVATIONS


def resolve_backend(requested: str, device: torch.device | str,
                    dtype: torch.dtype | None = None) -> str:
    """``engine.moe_kernel`` -> the backend a model on ``device`` in ``dtype`` uses ("auto": triton on
    CUDA for bf16/fp16 models; model/kernel_backend.py)."""
    return _resolve("engine.moe_kernel", requested, device, dtype is None or dtype in KERNEL_DTYPES)

def _activated(h: torch.Tensor, prob: torch.Tensor, activation, gated: bool,
               dtype: torch.dtype) -> torch.Tensor:
    """fc1's output [R, 2F or F] -> the activation (gated: act(gate) * up), times each pair's
    router probability (megatron: probs after the activation), in ``dtype``."""
    if gated:
        gate, up = torch.chunk(h, 2, dim=-1)
        h = activation(gate) * up
    else:
        h = activation(h)
    return (h * prob.unsqueeze(-1)).to(dtype)


def torch_experts(x: torch.Tensor, token: torch.Tensor, offs: torch.Tensor,
                  prob: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
                  activation, gated: bool) -> torch.Tensor:
    """The reference (and CPU) path: ``torch._grouped_mm`` on the gathered rows. x [N, H];
    token [R]; offs [E] int32 group ends; prob [R]; fc1 [E, 2F or F, H]; fc2 [E, H, F] ->
    y [R, H] in x's dtype (rows past offs[-1] unwritten)."""
    h = torch._grouped_mm(x[token], fc1.transpose(1, 2), offs=offs)  # [R, 2F or F]
    h = _activated(h, prob, activation, gated, x.dtype)
    return torch._grouped_mm(h, fc2.transpose(1, 2), offs=offs)  # [R, H]


def torch_experts_rowwise(x: torch.Tensor, token: torch.Tensor, offs: torch.Tensor,
                          prob: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
                          activation, gated: bool) -> torch.Tensor:
    """``torch_experts``'s math with every pair row its own product (batched 1-row GEMMs over
    the row's expert's weights): a row's bits independent of how many rows its expert has --
    the CPU path of engine.batch_invariant. Rows past offs[-1] come out zero."""
    R, E = token.shape[0], fc1.shape[0]
    rows = torch.arange(R, device=x.device)
    e = torch.searchsorted(offs.to(torch.int64), rows, right=True)  # each row's expert
    valid = e < E
    e = e.clamp(max=E - 1)
    h = torch.bmm(x[token].unsqueeze(1), fc1[e].transpose(1, 2)).squeeze(1)
    h = _activated(h, prob, activation, gated, x.dtype)
    y = torch.bmm(h.unsqueeze(1), fc2[e].transpose(1, 2)).squeeze(1)
    return torch.where(valid.unsqueeze(-1), y, 0).to(x.dtype)


def torch_experts_fp8(x: torch.Tensor, token: torch.Tensor, offs: torch.Tensor,
                      prob: torch.Tensor, fc1: Fp8Weight, fc2: Fp8Weight,
                      activation, gated: bool) -> torch.Tensor:
    """The FP8 reference: ``torch_experts``'s math on the dequantised operands in fp32 -- x
    quantised per token row, h (after the activation and the probability, rounded to x's
    dtype as the kernel stores it) per pair row, the weights per channel (model/fp8.py) --
    or, blockwise weights (``block``), x and h per 1 x block columns, the weights per block;
    TE's tensorwise weights (``tensorwise``): x's and h's rows per expert
    (``quantize_grouped``)."""
    R = token.shape[0]
    if fc1.tensorwise:
        xd = dequantize_rows(*quantize_grouped(x, offs, R, token=token, backend="torch"))
    else:
        xd = dequantize_rows(*quantize_rows(x, pad=False, group=fc1.block, pow2=fc1.te))[token]
    h = torch._grouped_mm(xd, fc1.dequantized().transpose(1, 2), offs=offs)
    h = _activated(h, prob, activation, gated, x.dtype)
    if fc2.tensorwise:
        hd = dequantize_rows(*quantize_grouped(h, offs, R, backend="torch"))
    else:
        hd = dequantize_rows(*quantize_rows(h, pad=False, group=fc2.block, pow2=fc2.te))
    return torch._grouped_mm(hd, fc2.dequantized().transpose(1, 2), offs=offs).to(x.dtype)


if triton is not None:

    @triton.jit
    def _expert_block(Offs, pid_m, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
        """Row block ``pid_m`` of the padded layout -> (expert, its first row, the expert's
        end row, the number of row blocks in use). Each expert's pairs, padded up to a
        multiple of BLOCK_M, take consecutive row blocks in expert order."""
        eids = tl.arange(0, E_PAD)
        inside = eids < E
        ends = tl.load(Offs + eids, mask=inside, other=0).to(tl.int32)
        starts = tl.load(Offs + eids - 1, mask=inside & (eids > 0), other=0).to(tl.int32)
        nblk = (tl.where(inside, ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
        cum = tl.cumsum(nblk, 0)  # inclusive: row blocks of experts <= e
        total = tl.sum(nblk, 0)
        e = tl.sum((cum <= pid_m).to(tl.int32), 0)  # the expert whose blocks hold pid_m
        sel = eids == e
        first_blk = tl.sum(tl.where(sel, cum - nblk, 0), 0)
        row_lo = tl.sum(tl.where(sel, starts, 0), 0) + (pid_m - first_blk) * BLOCK_M
        row_hi = tl.sum(tl.where(sel, ends, 0), 0)
        return e, row_lo, row_hi, total

    @triton.jit
    def _zero_rows(Out, Scatter, r, rows, offs_n, n_out, stride_om, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, SCATTER: tl.constexpr):
        """Zeros into rows r (< rows) of Out, columns offs_n (< n_out) -- or, with
        ``SCATTER``, into the rows Scatter[r] (the pairs' own order)."""
        if SCATTER:
            r_out = tl.load(Scatter + r, mask=r < rows, other=0).to(tl.int64)
        else:
            r_out = r.to(tl.int64)
        tl.store(Out + r_out[:, None] * stride_om + offs_n[None, :],
                 tl.zeros([BLOCK_M, BLOCK_N], dtype=Out.dtype.element_ty),
                 mask=(r < rows)[:, None] & (offs_n < n_out)[None, :])

    @triton.jit
    def _activate(v, ACT: tl.constexpr):
        if ACT == 1:  # silu
            v = v / (1.0 + tl.exp(-v))
        elif ACT == 2:  # gelu (erf)
            v = 0.5 * v * (1.0 + tl.erf(v * 0.7071067811865476))
        elif ACT == 3:  # relu
            v = tl.maximum(v, 0.0)
        return v

    @triton.jit
    def _tile(A, Tok, W, Prob, Out, Scatter, AScale, WScale,
              e, row_lo, row_hi, pid_n, offs_n, nmask, n_out, k_dim,
              stride_am, stride_tok, stride_we, stride_wn, stride_wk, stride_om, stride_p,
              up_off, stride_wse, stride_as, stride_wsn,
              BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GATHER: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
              PROB: tl.constexpr, SCATTER: tl.constexpr, EVEN_K: tl.constexpr,
              DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, RNE_BF16: tl.constexpr,
              FP8: tl.constexpr, W_TMA: tl.constexpr, A_TMA: tl.constexpr,
              SCALE_K: tl.constexpr, PAIRED: tl.constexpr):
        """One output tile of ``_moe_gemm_kernel``: rows [row_lo, min(row_lo + BM, row_hi))
        of expert e, columns offs_n; the K loop and the epilogue."""
        offs_m = tl.arange(0, BM)
        rows_m = row_lo + offs_m
        mmask = rows_m < row_hi
        if GATHER:  # A's rows through the pairs' token index
            a_rows = tl.load(Tok + rows_m * stride_tok, mask=mmask, other=0).to(tl.int64)
        else:
            a_rows = rows_m.to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        # weight columns wrapped into range (the stores mask them): no mask on the loads
        offs_wn = offs_n % n_out
        if not A_TMA:
            a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
        if not W_TMA:
            w_ptrs = (W + e.to(tl.int64) * stride_we + offs_wn[None, :] * stride_wn
                      + offs_k[:, None] * stride_wk)
        # TMA: W is a descriptor over the [E * wn, K] rows. A tile's columns past n_out read
        # the up half's (gate) or the next expert's rows, and fc2's A rows past row_hi the
        # next expert's pairs -- finite values whose products the stores mask; past the
        # tensors' ends the descriptor reads zeros
        w_row = e * (stride_we // stride_wn) + pid_n * BLOCK_N
        acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
        if PAIRED:  # [gate | up] columns of one MMA (W: a [2E, n_out, K] descriptor)
            acc_pair = tl.zeros([BM, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            if A_TMA:  # (A_TMA implies W_TMA: a pointer-fed W always has kmask below)
                a = A.load([row_lo, k0])
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
            else:
                kmask = offs_k < k_dim - k0
                a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            if UPCAST:  # the interpreter's dot reads bf16 as integers: fp32 there
                a = a.to(tl.float32)
            if PAIRED:
                wp = W.load([2 * e, pid_n * BLOCK_N, k0]).reshape(2 * BLOCK_N, BLOCK_K).T
                if UPCAST:
                    wp = wp.to(tl.float32)
                acc_pair = tl.dot(a, wp, acc_pair, input_precision=DOT_PREC)
            else:
                if W_TMA:
                    w = W.load([w_row, k0]).T
                elif EVEN_K:
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
                if UPCAST:
                    w = w.to(tl.float32)
                if SCALE_K:  # blockwise FP8: this K step's partial product, rescaled by its
                    # K block's scales (A's row x 1 x SCALE_K, W's SCALE_K x SCALE_K; BLOCK_K
                    # divides SCALE_K, and the tile's columns lie in one weight block or wrap
                    # per column)
                    kb = k0 // SCALE_K
                    a_sk = tl.load(AScale + a_rows * stride_as + kb, mask=mmask, other=0.0)
                    w_sk = tl.load(WScale + e.to(tl.int64) * stride_wse
                                   + (offs_wn // SCALE_K) * stride_wsn + kb)
                    acc += (tl.dot(a, w, input_precision=DOT_PREC) * a_sk[:, None]
                            * w_sk[None, :])
                else:
                    acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
                if GATED:  # the up projection's rows sit up_off past the gate's
                    if W_TMA:
                        wu = W.load([w_row + n_out, k0]).T
                    elif EVEN_K:
                        wu = tl.load(w_ptrs + up_off)
                    else:
                        wu = tl.load(w_ptrs + up_off, mask=kmask[:, None], other=0.0)
                    if UPCAST:
                        wu = wu.to(tl.float32)
                    if SCALE_K:
                        wu_sk = tl.load(WScale + e.to(tl.int64) * stride_wse
                                        + ((offs_wn + n_out) // SCALE_K) * stride_wsn + kb)
                        acc_up += (tl.dot(a, wu, input_precision=DOT_PREC) * a_sk[:, None]
                                   * wu_sk[None, :])
                    else:
                        acc_up = tl.dot(a, wu, acc_up, input_precision=DOT_PREC)
            if not A_TMA:
                a_ptrs += BLOCK_K
            if not W_TMA:
                w_ptrs += BLOCK_K * stride_wk
        if PAIRED:  # the gate's columns, then the up projection's
            acc, acc_up = acc_pair.reshape(BM, 2, BLOCK_N).permute(0, 2, 1).split()
        if FP8 and not SCALE_K:  # row-wise x channel-wise scales (model/fp8.py), in fp32
            a_s = tl.load(AScale + a_rows, mask=mmask, other=0.0)
            ws_ptrs = WScale + e.to(tl.int64) * stride_wse + offs_wn
            acc = acc * a_s[:, None] * tl.load(ws_ptrs)[None, :]
            if GATED:
                acc_up = acc_up * a_s[:, None] * tl.load(ws_ptrs + n_out)[None, :]
        if GATED:
            acc = _activate(acc, ACT) * acc_up
        else:
            acc = _activate(acc, ACT)
        if PROB:
            p = tl.load(Prob + rows_m * stride_p, mask=mmask, other=0.0).to(tl.float32)
            acc = acc * p[:, None]
        if RNE_BF16:
            acc = rne_bf16(acc)
        if SCATTER:  # row r of the sorted pairs goes to its pair's place, Scatter[r]
            out_rows = tl.load(Scatter + rows_m, mask=mmask, other=0).to(tl.int64)
        else:
            out_rows = rows_m.to(tl.int64)
        tl.store(Out + out_rows[:, None] * stride_om + offs_n[None, :],
                 acc.to(Out.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])

    # the row counts (a graph bucket's), the group size and E change nothing in the code:
    # never specialised on, so one compiled kernel serves every bucket
    @triton.jit(do_not_specialize=["rows", "m_blocks", "group_m", "E"])
    def _moe_gemm_kernel(
        A, Tok, W, Offs, Prob, Out, Scatter, AScale, WScale,
        rows, m_blocks, group_m, n_out, k_dim, E,
        stride_am, stride_tok, stride_we, stride_wn, stride_wk, stride_om, stride_p, up_off,
        stride_wse, stride_as, stride_wsn,
        E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GATHER: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
        PROB: tl.constexpr, ZERO_TAIL: tl.constexpr, SCATTER: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, RNE_BF16: tl.constexpr,
        FP8: tl.constexpr, W_TMA: tl.constexpr, A_TMA: tl.constexpr, SCALE_K: tl.constexpr,
        TAIL_M: tl.constexpr, PAIRED: tl.constexpr,
    ):
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(n_out, BLOCK_N)
        # grouped order: group_m row blocks sweep each column tile together (the weight tile
        # stays in L2 while they read it); group_m 1 = column tiles of one row block in a row
        per_group = group_m * n_tiles
        first_m = (pid // per_group) * group_m
        size_m = tl.minimum(m_blocks - first_m, group_m)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m

        e, row_lo, row_hi, total = _expert_block(Offs, pid_m, E, E_PAD, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < n_out
        offs_m = tl.arange(0, BLOCK_M)
        if pid_m >= total:  # a spare row block (the grid is a bound, fixed by shapes)
            if ZERO_TAIL:  # the spare blocks zero the rows past the last expert's:
                # (m_blocks - total) * BLOCK_M >= rows - offs[-1] (see row_blocks), so one
                # block each covers them
                r = tl.load(Offs + E - 1).to(tl.int32) + (pid_m - total) * BLOCK_M + offs_m
                _zero_rows(Out, Scatter, r, rows, offs_n, n_out, stride_om, BLOCK_M, BLOCK_N,
                           SCATTER)
            return

        # an expert's last row block with at most TAIL_M rows runs a TAIL_M-row tile in its
        # place (the same program order, so its weight tiles are the ones its expert's other
        # blocks just read through L2): the padded rows' MMA work is cut, not moved. The two
        # calls differ in BM only: a tile's rows are a compile-time constant, so each size
        # is its own compiled body
        if TAIL_M and row_hi - row_lo <= TAIL_M:
            _tile(A, Tok, W, Prob, Out, Scatter, AScale, WScale, e, row_lo, row_hi, pid_n,
                  offs_n, nmask, n_out, k_dim, stride_am, stride_tok, stride_we, stride_wn,
                  stride_wk, stride_om, stride_p, up_off, stride_wse, stride_as, stride_wsn,
                  BM=TAIL_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GATHER=GATHER, GATED=GATED,
                  ACT=ACT, PROB=PROB, SCATTER=SCATTER, EVEN_K=EVEN_K, DOT_PREC=DOT_PREC,
                  UPCAST=UPCAST, RNE_BF16=RNE_BF16, FP8=FP8, W_TMA=W_TMA, A_TMA=A_TMA,
                  SCALE_K=SCALE_K, PAIRED=PAIRED)
        else:
            _tile(A, Tok, W, Prob, Out, Scatter, AScale, WScale, e, row_lo, row_hi, pid_n,
                  offs_n, nmask, n_out, k_dim, stride_am, stride_tok, stride_we, stride_wn,
                  stride_wk, stride_om, stride_p, up_off, stride_wse, stride_as, stride_wsn,
                  BM=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GATHER=GATHER, GATED=GATED,
                  ACT=ACT, PROB=PROB, SCATTER=SCATTER, EVEN_K=EVEN_K, DOT_PREC=DOT_PREC,
                  UPCAST=UPCAST, RNE_BF16=RNE_BF16, FP8=FP8, W_TMA=W_TMA, A_TMA=A_TMA,
                  SCALE_K=SCALE_K, PAIRED=PAIRED)

    @triton.jit(do_not_specialize=["rows", "m_blocks", "group_m", "E"])
    def _moe_gemm_persistent_kernel(
        A, W, Offs, Out, Scatter,
        rows, m_blocks, group_m, n_out, k_dim, E, w_rows_per_expert, stride_om,
        E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, ZERO_TAIL: tl.constexpr, SCATTER: tl.constexpr,
        NPROG: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
        RNE_BF16: tl.constexpr,
    ):
        """``_moe_gemm_kernel``'s plain GEMM (no gather, gate or probability; A and W
        through TMA descriptors) with NPROG programs walking the tiles in use: tile t of
        program p is p + t * NPROG, in the same grouped order. The tile loop is flattened
        into the K loop (the software pipeline loads the next tile's operands while this
        tile's epilogue stores). The row blocks past the last expert's then zero the rows
        past offs[-1] (``ZERO_TAIL``), one block each, as in the other kernel."""
        pid = tl.program_id(0)
        eids = tl.arange(0, E_PAD)
        inside = eids < E
        ends = tl.load(Offs + eids, mask=inside, other=0).to(tl.int32)
        starts = tl.load(Offs + eids - 1, mask=inside & (eids > 0), other=0).to(tl.int32)
        nblk = (tl.where(inside, ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
        cum = tl.cumsum(nblk, 0)
        total = tl.sum(nblk, 0)  # row blocks in use
        n_tiles = tl.cdiv(n_out, BLOCK_N)
        per_group = group_m * n_tiles
        offs_m = tl.arange(0, BLOCK_M)
        for t in tl.range(pid, total * n_tiles, NPROG, flatten=True):
            first_m = (t // per_group) * group_m
            size_m = tl.minimum(total - first_m, group_m)
            pid_m = first_m + (t % per_group) % size_m
            pid_n = (t % per_group) // size_m
            e = tl.sum((cum <= pid_m).to(tl.int32), 0)
            sel = eids == e
            first_blk = tl.sum(tl.where(sel, cum - nblk, 0), 0)
            row_lo = tl.sum(tl.where(sel, starts, 0), 0) + (pid_m - first_blk) * BLOCK_M
            row_hi = tl.sum(tl.where(sel, ends, 0), 0)
            w_row = e * w_rows_per_expert + pid_n * BLOCK_N
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, k_dim, BLOCK_K):
                a = A.load([row_lo, k0])
                w = W.load([w_row, k0]).T
                if UPCAST:
                    a = a.to(tl.float32)
                    w = w.to(tl.float32)
                acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
            if RNE_BF16:
                acc = rne_bf16(acc)
            rows_m = row_lo + offs_m
            mmask = rows_m < row_hi
            # (loaded here, after the K loop: loaded before it and held through it, the
            # scatter rows spilled the 128 x 256 accumulator -- 2.9-3.7x slower on an H100,
            # 2026-12-06)
            if SCATTER:
                out_rows = tl.load(Scatter + rows_m, mask=mmask, other=0).to(tl.int64)
            else:
                out_rows = rows_m.to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(Out + out_rows[:, None] * stride_om + offs_n[None, :],
                     acc.to(Out.dtype.element_ty),
                     mask=mmask[:, None] & (offs_n < n_out)[None, :])
        if ZERO_TAIL:  # spare row blocks (see row_blocks): the rows past offs[-1]
            tail = tl.load(Offs + E - 1).to(tl.int32)
            for t in range(total * n_tiles + pid, m_blocks * n_tiles, NPROG):
                pid_m = t // n_tiles
                offs_n = (t % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
                r = tail + (pid_m - total) * BLOCK_M + offs_m
                _zero_rows(Out, Scatter, r, rows, offs_n, n_out, stride_om, BLOCK_M, BLOCK_N,
                           SCATTER)


def row_blocks(rows: int, experts: int, block_m: int) -> int:
    """The grid's row blocks: enough for every expert's count padded up to ``block_m``
    (cdiv(rows, block_m) + one partial block per non-empty expert), and spare blocks enough
    to zero the rest in one block each. With R = offs[-1] pairs over m <= min(E, R)
    non-empty experts, the blocks in use are at most (R + m (block_m - 1)) / block_m, so the
    spare ones hold at least rows - R + m rows: every row past R, and one block at least."""
    return -(-rows // block_m) + min(experts, rows)


def regime(rows: int, experts: int) -> str:
    """"small", "decode" or "prefill" from the average pairs per expert (host shapes only)."""
    per = rows / max(1, experts)
    if per <= SMALL_ROWS:
        return "small"
    return "decode" if per <= DECODE_ROWS else "prefill"


_FIT: dict[tuple, Tile] = {}


def fit_tile(tile: Tile, device: torch.device, esize: int, gated: bool) -> Tile:
    """``tile`` with fewer stages, then a shorter K step, until every stage's A and weight
    tiles fit the device's shared memory per block (smaller parts than the H200)."""
    key = (tile, device.type, device.index, esize, gated)
    got = _FIT.get(key)
    if got is None:
        limit = smem_per_block(device) or 1 << 30  # the interpreter: no limit
        bm, bn, bk, stages = tile.block_m, tile.block_n, tile.block_k, tile.num_stages
        ways = 2 if gated else 1
        while bk > 16 and stages * (bm * bk + ways * bk * bn) * esize + 8192 > limit:
            if stages > 2:
                stages -= 1
            else:
                bk //= 2
        got = _FIT[key] = dataclasses.replace(tile, block_k=bk, num_stages=stages)
    return got


def moe_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, rows: int, *,
             token: torch.Tensor | None = None, prob: torch.Tensor | None = None,
             gated: bool = False, act: int = ACT_NONE, zero_tail: bool = False,
             scatter: torch.Tensor | None = None, out: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None, tile: Tile,
             a_scale: torch.Tensor | None = None,
             w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One grouped GEMM over ``rows`` sorted pairs: out[r] = epilogue(A[r] @ w[e(r)].T) for the
    pairs r < offs[-1] (e(r): the expert whose group holds r). A[r] = a[token[r]] (fc1) or
    a[r] (fc2, token None); w [E, n (2n if gated), K]; gated: columns [0, n) are the gate,
    [n, 2n) the up projection, epilogue act(gate) * up; prob [rows]: a per-row factor after
    the activation. ``zero_tail``: rows >= offs[-1] are written as zeros, else left as they
    were. ``scatter`` [rows]: row r is stored at out[scatter[r]] (a permutation of the rows:
    the pairs' own order) instead of out[r]. FP8 (``a`` and ``w`` e4m3, model/fp8.py):
    ``a_scale`` [len(a)] per A row and ``w_scale`` [E, wn] per weight row multiply the fp32
    product before the epilogue -- or, blockwise, ``a_scale`` [len(a), K / b] per 1 x b and
    ``w_scale`` [E, wn / b, K / b] per b x b block rescale each K block's partial product (wn
    and K multiples of b; the K step is cut to divide b). Host values read: shapes and strides
    only (graph-capturable)."""
    if triton is None:
        raise RuntimeError("triton is not importable: use the torch moe kernel backend")
    E, wn, K = w.shape
    if a.shape[-1] != K or offs.shape != (E,):
        raise ValueError(f"a {tuple(a.shape)}, w {tuple(w.shape)}, offs {tuple(offs.shape)}")
    if gated and wn % 2:
        raise ValueError(f"a gated weight needs an even output width, got {wn}")
    n_out = wn // 2 if gated else wn
    if a.stride(-1) != 1:
        a = a.contiguous()
    if w.stride(-1) != 1:
        raise ValueError("the expert weights' input dim must be contiguous")
    fp8 = a_scale is not None
    scale_k = 0  # blockwise: the scale block
    if fp8 and w_scale is not None and w_scale.dim() == 3:
        scale_k = K // max(w_scale.shape[2], 1)
        if (not scale_k or w_scale.shape != (E, wn // scale_k, K // scale_k)
                or wn % scale_k or K % scale_k or (gated and n_out % scale_k)
                or a_scale.shape != (a.shape[0], K // scale_k)):
            raise ValueError(f"blockwise FP8 scales a {tuple(a_scale.shape)}, w "
                             f"{tuple(w_scale.shape)} do not fit a {tuple(a.shape)}, "
                             f"w {tuple(w.shape)}")
    elif fp8 != (w_scale is not None) or (fp8 and w_scale.shape != (E, wn)):
        raise ValueError("FP8 operands need both a_scale and w_scale [E, wn]")
    if fp8 and out_dtype is None and out is None:
        raise ValueError("an FP8 GEMM needs out_dtype")
    if out is None:
        out = torch.empty((rows, n_out), dtype=out_dtype or a.dtype, device=a.device)
    if rows == 0:
        return out
    tile = fit_tile(tile, a.device, a.element_size(), gated)
    if scale_k and scale_k % tile.block_k:  # a K step inside one scale block
        tile = dataclasses.replace(tile, block_k=math.gcd(tile.block_k, scale_k))
    m_blocks = row_blocks(rows, E, tile.block_m)
    grid = (m_blocks * triton.cdiv(n_out, tile.block_n),)
    upcast = not a.is_cuda  # CPU tensors run only under the interpreter: exact fp32 dots
    prec = "ieee" if a.dtype == torch.float32 or upcast else "tf32"
    tok = token if token is not None else offs  # unused when not gathering
    pr = prob if prob is not None else offs
    sc = scatter if scatter is not None else offs
    a_s = a_scale if fp8 else offs
    w_s = w_scale if fp8 else offs
    w_tma = tile.tma and tma_usable(a, w)
    a_tma = w_tma and token is None
    if runs_persistent(a, w, tile, token=token, gated=gated, prob=prob, act=act, fp8=fp8):
        _persistent_gemm(a, w, offs, rows, out, tile, m_blocks, zero_tail, scatter)
        return out
    a_arg, w_arg = a, w
    paired = w_tma and gated and tile.paired and not a_tma
    if paired:  # [gate; up] of expert e are rows 2e and 2e + 1 of a [2E, n_out, K] stack
        w_arg = TensorDescriptor(w, [2 * E, n_out, K], [n_out * w.stride(1), w.stride(1), 1],
                                 [2, tile.block_n, tile.block_k])
    elif w_tma:
        w_arg = TensorDescriptor(w, [E * wn, K], [w.stride(1), 1], [tile.block_n, tile.block_k])
        if a_tma:
            a_arg = TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1],
                                     [tile.block_m, tile.block_k])
    _moe_gemm_kernel[grid](
        a_arg, tok, w_arg, offs, pr, out, sc, a_s, w_s,
        rows, m_blocks, tile.group_m, n_out, K, E,
        a.stride(0), tok.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        pr.stride(0), n_out * w.stride(1), w_s.stride(0) if fp8 else 0,
        a_s.stride(0) if scale_k else 0, w_s.stride(1) if scale_k else 0,
        E_PAD=pow2(E, E_PAD_MIN), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, GATHER=token is not None, GATED=gated, ACT=act,
        PROB=prob is not None, ZERO_TAIL=zero_tail, SCATTER=scatter is not None,
        EVEN_K=K % tile.block_k == 0,
        DOT_PREC=prec, UPCAST=upcast, RNE_BF16=upcast and out.dtype == torch.bfloat16,
        FP8=fp8, W_TMA=w_tma, A_TMA=a_tma, SCALE_K=scale_k,
        TAIL_M=0 if a_tma else tile.tail_m, PAIRED=paired, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out


def stores_sorted(rows: int, experts: int, backend: str) -> bool:
    """Whether a caller that sums the k slots itself (model/residual.py: ``SortedSlots``) has
    fc2 leave a launch of ``rows`` pairs over ``experts`` in the pairs' sorted order: the
    prefill regime's Triton launches, whose scattered store costs fc2 3-7% (each row's place
    loaded in the epilogue, its latency exposed; scripts/gpu_moe_gemm_ceiling.py
    --fc2-sweep, 2026-12-06, H100: sorted 1.03x at 8192 tokens, 1.07x at 4096 over the
    scatter), while the slot sum reads the same rows through an index either way. Decode
    keeps the scatter: its launches are bound by reading the weights."""
    return backend == "triton" and regime(rows, experts) == "prefill"


def runs_persistent(a: torch.Tensor, w: torch.Tensor, tile: Tile, *,
                    token: torch.Tensor | None = None, gated: bool = False,
                    prob: torch.Tensor | None = None, act: int = ACT_NONE,
                    fp8: bool = False) -> bool:
    """Whether ``moe_gemm`` with these arguments launches the persistent kernel: the tile
    asks for it, both operands come through TMA (no row gather) and the epilogue is a plain
    store (no gate, activation, probability or FP8 scales)."""
    return (tile.persistent and tile.tma and token is None and tma_usable(a, w)
            and not (fp8 or gated or prob is not None or act))


def _programs(device: torch.device) -> int:
    """Programs of a persistent launch: the device's SMs (4 under the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _persistent_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, rows: int,
                     out: torch.Tensor, tile: Tile, m_blocks: int, zero_tail: bool,
                     scatter: torch.Tensor | None) -> None:
    """``moe_gemm``'s plain case (A and W through TMA, no epilogue but the store) on the
    persistent kernel: one program per SM, whatever the shapes (one compiled kernel for every
    bucket; programs past the tiles find their loops empty)."""
    E, wn, K = w.shape
    nprog = _programs(a.device)
    upcast = not a.is_cuda
    sc = scatter if scatter is not None else offs
    _moe_gemm_persistent_kernel[(nprog,)](
        TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [tile.block_m, tile.block_k]),
        TensorDescriptor(w, [E * wn, K], [w.stride(1), 1], [tile.block_n, tile.block_k]),
        offs, out, sc, rows, m_blocks, tile.group_m, wn, K, E, wn, out.stride(0),
        E_PAD=pow2(E, E_PAD_MIN), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, ZERO_TAIL=zero_tail, SCATTER=scatter is not None,
        NPROG=nprog,
        DOT_PREC="ieee" if a.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        RNE_BF16=upcast and out.dtype == torch.bfloat16, num_warps=tile.num_warps,
        num_stages=tile.num_stages)


def tma_usable(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether TMA descriptors can feed this GEMM: triton has them, the device is sm90+ (or
    the interpreter's CPU tensors), 16-bit operands, the weight stack one [E * wn, K] block
    of rows, and every row 16-byte aligned (TMA's rule for base and strides)."""
    if TensorDescriptor is None or a.dtype not in KERNEL_DTYPES or w.dtype != a.dtype:
        return False
    if a.is_cuda and torch.cuda.get_device_capability(a.device)[0] < 9:
        return False
    E, wn, K = w.shape
    rows_ok = w.stride(0) == wn * w.stride(1) and a.stride(-1) == 1
    aligned = all(v * a.element_size() % 16 == 0 for v in (w.stride(1), a.stride(0)))
    return (rows_ok and aligned and w.data_ptr() % 16 == 0 and a.data_ptr() % 16 == 0)


def triton_experts(x: torch.Tensor, token: torch.Tensor, offs: torch.Tensor,
                   prob: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, activation,
                   gated: bool, *, order: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None,
                   tiles: tuple[Tile, Tile] | None = None,
                   invariant: bool = False) -> torch.Tensor:
    """The Triton path; same arguments and result as ``torch_experts``, except that rows past
    offs[-1] are zeros. ``order``: fc2 stores sorted row r at order[r] (y in the pairs' own
    order; no separate permute back). ``out_dtype``: y's dtype (default x's; fp32 keeps the
    accumulator's precision for the combine). ``tiles``: (fc1, fc2) overrides for tests and
    the sweep. ``invariant``: the rows' regime capped at ``INVARIANT_REGIMES`` (see
    ``moe_experts``)."""
    act = ACTIVATIONS.get(activation)
    if act is None:
        raise ValueError(f"no Triton epilogue for the activation {activation!r}")
    rows = token.shape[0]
    E = (fc1.q if isinstance(fc1, Fp8Weight) else fc1).shape[0]
    if tiles is None:
        r = regime(rows, E)
        if invariant and r not in INVARIANT_REGIMES:
            r = "decode"
        block = isinstance(fc1, Fp8Weight) and bool(fc1.block)
        tiles = (tile_for(r, "fc1", block), tile_for(r, "fc2", block, rows))
    # the group max is offs[-1]; the kernel reads offs, so int32 and int64 both do
    if isinstance(fc1, Fp8Weight):  # FP8 operands: x and h quantised on the way in
        if fc1.tensorwise:
            # TE's Float8CurrentScaling: x's rows quantised per expert (one scale from the
            # amax over the expert's rows, as TE's GroupedLinear quantises its splits) into
            # the pairs' sorted order, so fc1 reads them without the token gather; h likewise
            xq, xs = quantize_grouped(x, offs, rows, token=token)
            gather = None
        else:  # per row (or 1 x block), before fc1's token gather
            xq, xs = quantize_rows(x, pad=False, group=fc1.block, pow2=fc1.te)
            gather = token
        h = moe_gemm(xq, fc1.q, offs, rows, token=gather, prob=prob, gated=gated, act=act,
                     tile=tiles[0], a_scale=xs, w_scale=fc1.scale, out_dtype=x.dtype)
        hq, hs = (quantize_grouped(h, offs, rows) if fc2.tensorwise
                  else quantize_rows(h, pad=False, group=fc2.block, pow2=fc2.te))
        return moe_gemm(hq, fc2.q, offs, rows, zero_tail=True, scatter=order,
                        out_dtype=out_dtype or x.dtype, tile=tiles[1], a_scale=hs,
                        w_scale=fc2.scale)
    h = moe_gemm(x, fc1, offs, rows, token=token, prob=prob, gated=gated, act=act,
                 tile=tiles[0])
    return moe_gemm(h, fc2, offs, rows, zero_tail=True, scatter=order,
                    out_dtype=out_dtype or x.dtype, tile=tiles[1])


def moe_experts(x: torch.Tensor, token: torch.Tensor, offs: torch.Tensor, prob: torch.Tensor,
                fc1: torch.Tensor, fc2: torch.Tensor, activation, gated: bool,
                backend: str = "auto", order: torch.Tensor | None = None,
                invariant: bool = False) -> torch.Tensor:
    """The routed experts on sorted pairs: x [N, H]; token [R] (each pair's row of x, pairs
    sorted by local expert); offs [E] int32 group ends; prob [R] router probabilities;
    fc1 [E, 2F (gated) or F, H]; fc2 [E, H, F] (or both ``Fp8Weight``: the FP8 GEMMs, x and h
    quantised per row) -> y [R, H] in x's dtype, sorted order -- or,
    given ``order`` [R] (the pair index at each sorted position, a permutation), in the
    pairs' own order with the rows of pairs past offs[-1] (other ranks' experts, padding)
    zero.

    backend: "torch" (reference), "triton" (the kernel; also on CPU tensors under
    TRITON_INTERPRET=1, which the tests use), "auto" (triton on CUDA bf16/fp16 tensors when
    it imports and computes the activation, else torch). ``invariant`` (engine.
    batch_invariant's D, model/batch_invariant.py): each row's bits independent of the other
    rows -- the Triton path on the small or decode regime's tiles (``INVARIANT_REGIMES``),
    never the prefill regime's, the torch path one product per row
    (``torch_experts_rowwise``)."""
    if backend == "auto":
        backend = ("triton" if x.is_cuda and triton is not None and x.dtype in KERNEL_DTYPES
                   and triton_supports(activation) else "torch")
    if backend == "triton":
        if torch.autograd.profiler._is_profiler_enabled:
            # a named range the profiler links the Triton launches to (bench-speed's "expert
            # GEMMs"); entered only under a profiler, never in a graph capture of serving
            with torch.profiler.record_function("colo.moe_gemm"):
                return triton_experts(x, token, offs, prob, fc1, fc2, activation, gated,
                                      order=order, invariant=invariant)
        return triton_experts(x, token, offs, prob, fc1, fc2, activation, gated, order=order,
                              invariant=invariant)
    if backend != "torch":
        raise ValueError(f"moe kernel backend must be one of {BACKENDS}, got {backend!r}")
    experts = (torch_experts_fp8 if isinstance(fc1, Fp8Weight)
               else torch_experts_rowwise if invariant else torch_experts)
    y = experts(x, token, offs, prob, fc1, fc2, activation, gated)
    if order is None:
        return y
    # rows past offs[-1] are unwritten: zero them (a Python scalar: no extra launch), then
    # each sorted row back to its pair's place
    valid = torch.arange(y.shape[0], device=y.device) < offs[-1]
    y = torch.where(valid.unsqueeze(-1), y, 0.0)
    return torch.empty_like(y).index_copy_(0, order.long(), y)
