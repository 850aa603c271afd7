"""MLA's D attention over the paged latent cache: a Triton split-KV (flash-decoding) kernel.

Owns ``mla_decode``, the one entry point ``PagedMLAttention._decode`` calls, with its two
backends: ``torch_mla_decode_attention`` (gather the table's entries, two matmuls, fp32 masked
softmax: the CPU path and the reference) and ``mla_decode_attention``, the kernel: absorbed
queries ([B, heads, latent] and their rotated rope part
[B, heads, rope]) against one layer's latent cache [blocks, block_size, latent + rope] through
the block table -> [B, heads, latent], the probability-weighted latents (the caller applies
the value half of ``linear_kv_up_proj``).

The kernel:
  * grid (rows, head blocks, splits): a program holds ``BLOCK_H`` query heads (16: the
    tensor-core dot's least rows) and walks its split's share of the table in tiles of
    ``BLOCK_N`` tokens; each tile's cached entries are read once for those heads -- the
    latent part as both key and value (MLA's value is its latent), the rope part as key.
    Scores = q_latent . latent + q_rope . rope (two dots: no power-of-two padding of the
    576-wide entry), online softmax in fp32 (exp2), fp32 accumulation.
  * context lengths are read on the device and the grid depends on the rows, heads and table
    width only (``num_splits``): D's graphs replay it with new lengths and tables. Keys at or
    past a row's length are masked, tiles past it skipped; a row of length <= 0 gives zeros.
  * every split writes its normalised partial and log2-sum-exp; ``reduce_splits``
    (model/paged_attention.py) combines them -- also for one split, so there is one path.

Imports only torch (and triton when present). ``engine.decode_attention`` picks it as for GQA
("auto": on CUDA where triton imports).
"""

from __future__ import annotations

import torch

from colo_rollout.model.kernel_backend import as_dtype, pow2, tl, triton
from colo_rollout.model.paged_attention import num_splits, reduce_splits

BLOCK_H = 16  # query heads per program (the tensor-core dot's least M)
BLOCK_N = 32  # tokens per tile: a [32, 512] latent tile and its [32, 64] rope tile per stage
NUM_WARPS = 4
NUM_STAGES = 2

if triton is not None:

    @triton.jit
    def _mla_split_kernel(
        QL, QR, C, Tab, Ctx, Part, Lse,
        scale_log2,
        stride_qlb, stride_qlh, stride_qrb, stride_qrh,
        stride_cb, stride_ct,
        stride_tb, stride_tw, stride_c,
        stride_pb, stride_ph, stride_ps,
        stride_lb, stride_lh,
        heads, width_tokens, split_tokens,
        LAT: tl.constexpr, LAT_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    ):
        b = tl.program_id(0)
        hb = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(Ctx + b * stride_c).to(tl.int32)
        ctx = tl.minimum(ctx, width_tokens)  # never read past the table
        lo = s * split_tokens
        hi = tl.minimum(lo + split_tokens, ctx)

        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_l = tl.arange(0, LAT_PAD)
        offs_r = tl.arange(0, ROPE_PAD)
        hmask = offs_h < heads
        lmask = offs_l < LAT
        rmask = offs_r < ROPE
        ql = tl.load(QL + b * stride_qlb + offs_h[:, None] * stride_qlh + offs_l[None, :],
                     mask=hmask[:, None] & lmask[None, :], other=0.0)
        qr = tl.load(QR + b * stride_qrb + offs_h[:, None] * stride_qrh + offs_r[None, :],
                     mask=hmask[:, None] & rmask[None, :], other=0.0)
        if UPCAST:  # the interpreter's dot reads bf16 as integers: exact fp32 products instead
            ql = ql.to(tl.float32)
            qr = qr.to(tl.float32)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, LAT_PAD], dtype=tl.float32)
        tab = Tab + b * stride_tb
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            nmask = offs_n < hi
            blk = tl.load(tab + (offs_n // BLOCK_SIZE) * stride_tw, mask=nmask, other=0)
            row = C + blk.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct
            lat = tl.load(row[:, None] + offs_l[None, :], mask=nmask[:, None] & lmask[None, :],
                          other=0.0)
            rope = tl.load(row[:, None] + LAT + offs_r[None, :],
                           mask=nmask[:, None] & rmask[None, :], other=0.0)
            lat = lat.to(QL.dtype.element_ty)
            rope = rope.to(QL.dtype.element_ty)
            if UPCAST:
                lat = lat.to(tl.float32)
                rope = rope.to(tl.float32)
            qk = tl.dot(ql, tl.trans(lat), input_precision=DOT_PREC)
            qk += tl.dot(qr, tl.trans(rope), input_precision=DOT_PREC)
            qk = tl.where(nmask[None, :], qk * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(QL.dtype.element_ty)  # the probabilities in the input dtype (flash's)
            if UPCAST:
                p = p.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, lat, input_precision=DOT_PREC)
            m_i = m_new

        filled = l_i > 0.0
        out = acc / tl.where(filled, l_i, 1.0)[:, None]  # an empty split (or row): zeros
        tl.store(Part + b * stride_pb + offs_h[:, None] * stride_ph + s * stride_ps
                 + offs_l[None, :], out, mask=hmask[:, None] & lmask[None, :])
        lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
        tl.store(Lse + b * stride_lb + offs_h * stride_lh + s, lse, mask=hmask)


def cached_entries(cache: torch.Tensor, tables: torch.Tensor, ctx_lens: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent-cache entries of ``tables`` [S, W] -> ([S, W * block_size, latent + rope]
    in ``dtype``, keep mask [S, W * block_size]). Slots past a row's context may hold anything
    (another request's entries, NaN after a bad load): they are zeroed, as the kernel never
    loads them, before they meet a zero probability."""
    entries = cache[tables].flatten(1, 2)
    keep = torch.arange(entries.shape[1], device=entries.device)[None, :] < ctx_lens[:, None]
    return torch.where(keep[:, :, None], as_dtype(entries, dtype), 0.0), keep


def torch_mla_decode_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                               tables: torch.Tensor, ctx_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """The reference (and CPU) path; same arguments and result as ``mla_decode_attention``."""
    lat = q_lat.shape[-1]
    entries, keep = cached_entries(cache, tables, ctx_lens, q_lat.dtype)
    q = torch.cat((q_lat, q_rope), dim=-1)
    scores = torch.matmul(q, entries.transpose(1, 2)).float() * scale  # [B, heads, keys]
    scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, entries[..., :lat])


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
               tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
               backend: str = "torch") -> torch.Tensor:
    """MLA's D attention by ``backend``: "torch" or "triton" (the kernel; also on CPU tensors
    under TRITON_INTERPRET=1, which the tests use)."""
    if backend == "triton":
        return mla_decode_attention(q_lat, q_rope, cache, tables, ctx_lens, scale)
    if backend != "torch":
        raise ValueError(f"MLA decode attention backend must be torch or triton, got "
                         f"{backend!r}")
    return torch_mla_decode_attention(q_lat, q_rope, cache, tables, ctx_lens, scale)


def mla_decode_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                         tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float, *,
                         splits: int | None = None, block_n: int = BLOCK_N,
                         num_warps: int = NUM_WARPS,
                         num_stages: int = NUM_STAGES) -> torch.Tensor:
    """q_lat [B, heads, latent], q_rope [B, heads, rope] (rotated), ``cache`` one layer's
    [blocks, block_size, latent + rope], ``tables`` [B, W] block ids, ``ctx_lens`` [B] ->
    [B, heads, latent] in q's dtype: softmax(scale * (q_lat . latent + q_rope . rope)) over
    keys 0..ctx-1, weighting the latents. ``splits``, ``block_n``, ``num_warps``,
    ``num_stages``: tuning overrides (None: ``num_splits``). Host values read: shapes and
    strides only (graph-capturable)."""
    if triton is None:
        raise RuntimeError("triton is not importable: use the torch decode attention backend")
    B, heads, lat = q_lat.shape
    rope = q_rope.shape[-1]
    if q_rope.shape[:2] != (B, heads) or cache.shape[-1] != lat + rope or cache.dim() != 3:
        raise ValueError(f"queries {tuple(q_lat.shape)} + {tuple(q_rope.shape)} do not fit "
                         f"the latent cache {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError("the latent cache's last dim must be contiguous")
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    block_size = cache.shape[1]
    width_tokens = tables.shape[1] * block_size
    out = torch.empty((B, heads, lat), dtype=q_lat.dtype, device=q_lat.device)
    if B == 0:
        return out
    head_blocks = -(-heads // BLOCK_H)
    if splits is None:
        splits = num_splits(B, head_blocks, width_tokens, block_n)
    split_tokens = -(-(-(-width_tokens // splits)) // block_n) * block_n  # a tile multiple
    splits = max(1, -(-width_tokens // split_tokens))
    part = torch.empty((B, heads, splits, lat), dtype=torch.float32, device=q_lat.device)
    lse = torch.empty((B, heads, splits), dtype=torch.float32, device=q_lat.device)
    # fp32: exact products (no tf32). CPU tensors run only under the interpreter: upcast there
    upcast = not q_lat.is_cuda
    prec = "ieee" if q_lat.dtype == torch.float32 or upcast else "tf32"
    _mla_split_kernel[(B, head_blocks, splits)](
        q_lat, q_rope, cache, tables, ctx_lens, part, lse,
        scale * 1.4426950408889634,  # log2(e): the softmax in exp2
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1),
        cache.stride(0), cache.stride(1),
        tables.stride(0), tables.stride(1), ctx_lens.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        heads, width_tokens, split_tokens,
        LAT=lat, LAT_PAD=pow2(lat, 16), ROPE=rope, ROPE_PAD=pow2(rope, 16), BLOCK_H=BLOCK_H,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, DOT_PREC=prec, UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )
    reduce_splits(part, lse, out)
    return out
