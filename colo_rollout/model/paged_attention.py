"""D (decode) attention over the paged KV cache: one query token per row against its block table.

Owns ``decode_attention`` -- the one entry point ``PagedSelfAttention._decode`` calls -- with
its two backends: the torch path (gather the table's K/V, two grouped-query matmuls, fp32
masked softmax: the CPU path and the reference) and a Triton split-KV (flash-decoding) kernel
that reads K/V straight out of the paged cache through the block table; plus the backend's
resolution at model build (``resolve_backend``: ``engine.decode_attention``).

The Triton kernel:
  * grid (rows, KV groups, splits): one program holds every q head of its KV group (padded to
    16 rows for the tensor-core dot), so each K/V tile is loaded once per group, and walks its
    split's share of the table in tiles of ``BLOCK_N`` tokens with an online softmax in fp32
    (bf16/fp16/fp32 inputs; fp32 accumulation).
  * context lengths are read on the device: the grid depends only on the rows, the groups and
    the table's width, which a D graph bucket fixes, so a captured graph replays with new
    lengths and tables. Keys at or past a row's length are masked; tiles past it are skipped.
    A row of length <= 0 (never fed: padding rows get 1 and the sink block) yields zeros.
  * several splits: each writes its normalised partial output and log-sum-exp (fp32), and a
    reduce kernel combines them; one split writes the output directly (single pass).
  * the number of splits comes from rows, groups and width alone (``num_splits``): as many as
    fit one wave of two programs per multiprocessor.

Imports only torch (and triton when present): no megatron, so a GPU check can load it alone.
"""

from __future__ import annotations

import torch

from colo_rollout.model.kernel_backend import BACKENDS, tl, triton, triton_available  # noqa: F401
from colo_rollout.model.kernel_backend import resolve_backend as _resolve
from colo_rollout.model.kernel_backend import as_dtype, pow2, smem_per_block

# Defaults from a sweep on one H200 (scripts/gpu_attention.py --sweep; 32 q heads, 4 KV groups,
# head dim 128, bf16, block size 16, B 1..128, contexts 128..8k): 128-key tiles, 4 warps, 3
# stages and splits up to one wave of 2 programs per multiprocessor were the best or within a
# few percent of it on every shape; more splits lost up to 15% on the mid-size batches.
SMS = 132  # H200 / H100 SXM multiprocessors: what the split heuristic fills
PROGRAMS_PER_SM = 2  # programs the split heuristic aims at per multiprocessor
BLOCK_N = 128  # keys per tile (halved, with fewer stages, where shared memory is short)
NUM_WARPS = 4
NUM_STAGES = 3
MIN_TILES_PER_SPLIT = 1  # a split covers at least this many tiles
MAX_SPLITS = 64


def resolve_backend(requested: str, device: torch.device | str) -> str:
    """``engine.decode_attention`` -> the backend a model on ``device`` uses (model/kernel_backend.py)."""
    return _resolve("engine.decode_attention", requested, device)

def torch_decode_attention(q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor,
                           tables: torch.Tensor, ctx_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """The reference (and CPU) path. q [B, heads, dim]; kv_k/kv_v [blocks, block_size, groups,
    dim] (one layer); tables [B, W] block ids; ctx_lens [B] -> [B, heads, dim].

    Grouped-query: the q heads of a KV group are one matrix against that group's keys, so K and
    V are gathered once and never repeated per head. Scores and softmax in fp32, as SDPA's
    kernels do."""
    B, heads, dim = q.shape
    g = kv_k.shape[2]
    n = heads // g
    S = tables.shape[1] * kv_k.shape[1]
    k = kv_k[tables].view(B, S, g, dim).transpose(1, 2)  # [B, g, S, dim]
    v = kv_v[tables].view(B, S, g, dim).transpose(1, 2)
    qg = q.view(B, g, n, dim)
    scores = torch.matmul(qg, as_dtype(k, q.dtype).transpose(-1, -2)).float()  # [B, g, n, S]
    keep = torch.arange(S, device=q.device)[None, :] < ctx_lens[:, None]  # [B, S]
    scores = (scores * scale).masked_fill(~keep[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    # slots past a row's context hold whatever their block held before (another request's
    # values, NaN/inf after a bad weight load): a zero probability times NaN is NaN, so they
    # are zeroed, as the Triton kernel never loads them
    v = torch.where(keep[:, None, :, None], as_dtype(v, q.dtype), 0.0)
    return torch.matmul(probs, v).reshape(B, heads, dim)


def num_splits(rows: int, groups: int, width_tokens: int, block_n: int = BLOCK_N,
               sms: int = SMS, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Splits of the key axis: the most that keep the programs (rows x groups x splits) within
    one wave of ``programs_per_sm`` per multiprocessor, each split at least
    ``MIN_TILES_PER_SPLIT`` tiles. One program more than a wave holds starts a second, mostly
    idle wave: on the H200 sweep, B=32 (128 programs a split) ran 3 splits in 86 us and 2 in
    74, B=64 2 splits in 77 us and 1 in 70-73. A function of the shapes alone (fixed per D
    graph bucket), never of the context lengths."""
    tiles = max(1, -(-width_tokens // block_n))
    want = (sms * programs_per_sm) // max(1, rows * groups)
    return max(1, min(want, tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


if triton is not None:

    @triton.jit
    def _decode_split_kernel(
        Q, K, V, Tab, Ctx, Out, Lse,
        scale_log2,
        stride_qb, stride_qh,
        stride_kb, stride_kt, stride_kg,
        stride_vb, stride_vt, stride_vg,
        stride_tb, stride_tw, stride_c,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh,
        width_tokens, split_tokens,
        N_Q: tl.constexpr, N_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
        DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    ):
        # the row in int64: b * stride passes 2^31 in the split partials [rows, heads,
        # splits, dim] of long batch-invariant rows (fixed 512-token splits: 1024 MTP rows x
        # 64 heads past 131k tokens)
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(Ctx + b * stride_c).to(tl.int32)
        ctx = tl.minimum(ctx, width_tokens)  # never read past the table
        lo = s * split_tokens
        hi = tl.minimum(lo + split_tokens, ctx)

        offs_h = tl.arange(0, N_PAD)
        offs_d = tl.arange(0, D_PAD)
        hmask = offs_h < N_Q
        dmask = offs_d < HEAD_DIM
        heads = g * N_Q + offs_h
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=hmask[:, None] & dmask[None, :], other=0.0)
        qd = q
        if UPCAST:  # the interpreter's dot reads bf16 as integers: exact fp32 products instead
            qd = q.to(tl.float32)

        m_i = tl.full([N_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([N_PAD], dtype=tl.float32)
        acc = tl.zeros([N_PAD, D_PAD], dtype=tl.float32)
        tab = Tab + b * stride_tb
        k_base = K + g * stride_kg
        v_base = V + g * stride_vg
        # every tile holds at least one key < ctx, so the running max is finite from the first
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            nmask = offs_n < hi
            blk = tl.load(tab + (offs_n // BLOCK_SIZE) * stride_tw, mask=nmask, other=0)
            blk = blk.to(tl.int64)
            tok = offs_n % BLOCK_SIZE
            kvmask = nmask[:, None] & dmask[None, :]
            k = tl.load(k_base + blk[:, None] * stride_kb + tok[:, None] * stride_kt
                        + offs_d[None, :], mask=kvmask, other=0.0)
            k = k.to(q.dtype)
            if UPCAST:
                k = k.to(tl.float32)
            qk = tl.dot(qd, tl.trans(k), input_precision=DOT_PREC) * scale_log2
            qk = tl.where(nmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + blk[:, None] * stride_vb + tok[:, None] * stride_vt
                        + offs_d[None, :], mask=kvmask, other=0.0)
            p = p.to(q.dtype)  # the probabilities in the input dtype, as flash attention
            v = v.to(q.dtype)
            if UPCAST:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
            m_i = m_new

        filled = l_i > 0.0
        out = acc / tl.where(filled, l_i, 1.0)[:, None]  # an empty split (or row): zeros
        omask = hmask[:, None] & dmask[None, :]
        if SINGLE:
            tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     out.to(Out.dtype.element_ty), mask=omask)
        else:
            tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + s * stride_os
                     + offs_d[None, :], out, mask=omask)
            lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
            tl.store(Lse + b * stride_lb + heads * stride_lh + s, lse, mask=hmask)

    @triton.jit
    def _decode_reduce_kernel(
        Part, Lse, Out,
        stride_pb, stride_ph, stride_ps,
        stride_lb, stride_lh,
        stride_ob, stride_oh,
        splits,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
        ORDERED: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)  # (int64: the split kernel's reason)
        h = tl.program_id(1)
        offs_s = tl.arange(0, S_PAD)
        offs_d = tl.arange(0, D_PAD)
        smask = offs_s < splits
        dmask = offs_d < HEAD_DIM
        lse = tl.load(Lse + b * stride_lb + h * stride_lh + offs_s, mask=smask,
                      other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key: weights 0, output 0
        if ORDERED:  # split by split in index order: a row's sum whatever splits follow
            acc = tl.zeros([D_PAD], dtype=tl.float32)
            total = 0.0
            for s in range(0, splits):
                ws = tl.exp2(tl.load(Lse + b * stride_lb + h * stride_lh + s) - m)
                acc += ws * tl.load(Part + b * stride_pb + h * stride_ph + s * stride_ps
                                    + offs_d, mask=dmask, other=0.0)
                total += ws
            out = acc / tl.where(total > 0.0, total, 1.0)
        else:
            w = tl.exp2(lse - m)
            total = tl.sum(w, 0)
            part = tl.load(Part + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
                           + offs_d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
            out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
        tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
                 mask=dmask)


_TILES: dict[tuple, tuple[int, int]] = {}


def tile_config(device: torch.device, dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(keys per tile, pipeline stages): the defaults, shrunk (stages first, then the tile)
    until the K and V tiles of every stage fit the device's shared memory per block."""
    key = (device.type, device.index, dim, dtype)
    got = _TILES.get(key)
    if got is None:
        smem = smem_per_block(device) or 99 * 1024  # the interpreter: a conservative bound
        esize = torch.finfo(dtype).bits // 8
        block_n, stages = BLOCK_N, NUM_STAGES
        while block_n > 16 and stages * 2 * block_n * pow2(dim, 16) * esize + 16384 > smem:
            if stages > 2:
                stages -= 1
            else:
                block_n //= 2
        got = _TILES[key] = (block_n, stages)
    return got


def triton_decode_attention(q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor,
                            tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float, *,
                            splits: int | None = None, block_n: int | None = None,
                            num_warps: int = NUM_WARPS, num_stages: int | None = None,
                            programs_per_sm: int = PROGRAMS_PER_SM,
                            split_tokens: int | None = None) -> torch.Tensor:
    """The Triton path; same arguments and result as ``torch_decode_attention``. ``splits``,
    ``block_n``, ``num_warps``, ``num_stages`` and ``programs_per_sm``: tuning overrides for
    tests and benchmarks (None and the defaults are what the engine runs: ``tile_config``,
    ``num_splits``). ``split_tokens`` (engine.batch_invariant; a multiple of the tile): the
    keys split at fixed positions, the reduce adding the splits in index order -- a row's bits
    then depend on its own keys alone, not on the batch's rows or table width. Host values
    read: shapes and strides only (graph-capturable)."""
    if triton is None:
        raise RuntimeError("triton is not importable: use the torch decode attention backend")
    B, heads, dim = q.shape
    blocks, block_size, g, kdim = kv_k.shape
    if kdim != dim or kv_v.shape != kv_k.shape or heads % g:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(kv_k.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_k.stride(-1) != 1 or kv_v.stride(-1) != 1:
        raise ValueError("the KV cache's head dim must be contiguous")
    n = heads // g
    width_tokens = tables.shape[1] * block_size
    out = torch.empty((B, heads, dim), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    if block_n is None or num_stages is None:
        auto_n, auto_stages = tile_config(q.device, dim, q.dtype)
        block_n = auto_n if block_n is None else block_n
        num_stages = auto_stages if num_stages is None else num_stages
    ordered = split_tokens is not None
    if ordered:
        if split_tokens % block_n:
            raise ValueError(f"split_tokens {split_tokens}: not a multiple of the tile's "
                             f"{block_n} keys")
    else:
        if splits is None:
            splits = num_splits(B, g, width_tokens, block_n, programs_per_sm=programs_per_sm)
        split_tokens = -(-(-(-width_tokens // splits)) // block_n) * block_n  # tile multiple
    splits = max(1, -(-width_tokens // split_tokens))
    n_pad, d_pad = pow2(n, 16), pow2(dim, 16)
    # fp32: exact products (no tf32). CPU tensors run only under the interpreter: upcast there
    upcast = not q.is_cuda
    prec = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    # one split: the single pass, whose acc / l rounded to q's dtype is the reduce's over one
    # split and empty ones (weights exp2(0) = 1 and 0) -- the same bits either way
    single = splits == 1
    if single:
        part, lse = out, out  # unused by the single pass
        sp = (out.stride(0), out.stride(1), 0)
        sl = (0, 0)
    else:
        part = torch.empty((B, heads, splits, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((B, heads, splits), dtype=torch.float32, device=q.device)
        sp = (part.stride(0), part.stride(1), part.stride(2))
        sl = (lse.stride(0), lse.stride(1))
    _decode_split_kernel[(B, g, splits)](
        q, kv_k, kv_v, tables, ctx_lens, part, lse,
        scale * 1.4426950408889634,  # log2(e): the softmax in exp2
        q.stride(0), q.stride(1),
        kv_k.stride(0), kv_k.stride(1), kv_k.stride(2),
        kv_v.stride(0), kv_v.stride(1), kv_v.stride(2),
        tables.stride(0), tables.stride(1), ctx_lens.stride(0),
        *sp, *sl,
        width_tokens, split_tokens,
        N_Q=n, N_PAD=n_pad, HEAD_DIM=dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SINGLE=single, DOT_PREC=prec, UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not single:
        reduce_splits(part, lse, out, ordered)
    return out


def reduce_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
                  ordered: bool = False) -> None:
    """Combine split-KV partials into ``out`` [B, heads, dim]: ``part`` [B, heads, splits,
    dim] (each split's normalised output, fp32) weighted by ``lse`` [B, heads, splits] (its
    log2-sum-exp; -inf for a split that saw no key). ``ordered``: split by split in index
    order (engine.batch_invariant)."""
    B, heads, splits, dim = part.shape
    _decode_reduce_kernel[(B, heads)](
        part, lse, out, part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), splits,
        HEAD_DIM=dim, D_PAD=pow2(dim, 16), S_PAD=pow2(splits), ORDERED=ordered, num_warps=4,
    )


def decode_attention(q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor,
                     tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                     backend: str = "auto", split_tokens: int | None = None) -> torch.Tensor:
    """D attention: q [B, heads, dim] (one token per row) against one layer's paged cache
    kv_k/kv_v [blocks, block_size, groups, dim] through tables [B, W] (int64 or int32; padding
    points at the sink block), keys 0..ctx_lens[b]-1 -> [B, heads, dim] in q's dtype.

    backend: "torch" (reference), "triton" (the kernel; also on CPU tensors under
    TRITON_INTERPRET=1, which the tests use), "auto" (triton on CUDA tensors when it imports,
    else torch). ``split_tokens``: the Triton path's batch-invariant splits (see
    ``triton_decode_attention``; the torch path computes each row on its own already)."""
    if backend == "auto":
        backend = "triton" if q.is_cuda and triton is not None else "torch"
    if backend == "triton":
        return triton_decode_attention(q, kv_k, kv_v, tables, ctx_lens, scale,
                                       split_tokens=split_tokens)
    if backend != "torch":
        raise ValueError(f"decode attention backend must be one of {BACKENDS}, got {backend!r}")
    return torch_decode_attention(q, kv_k, kv_v, tables, ctx_lens, scale)
