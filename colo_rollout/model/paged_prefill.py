"""P (prefill) attention over the paged KV cache: a Triton varlen causal flash-attention forward.

Owns ``triton_prefill_attention`` -- the kernel ``PagedSelfAttention._prefill`` calls when the
P backend is triton -- with its launch description (``PrefillPlan``, built once per P epoch
from the host lists by ``plan_prefill`` and read by every layer), its tile defaults
(``tile_config``), a per-sequence torch reference taking the same arguments
(``torch_prefill_attention``: tests and the GPU check) and the backend's resolution at model
build (``resolve_backend``: ``engine.prefill_attention``). The CPU path, and the reference the
engine is checked on, stays the bucketed SDPA in attention.py.

The kernel:
  * queries packed [T, heads, dim]: every sequence's new tokens back to back; sequence s's
    query j sits at absolute position ctx_s - new_s + j and attends keys 0..that position
    (a continuation prefill: ctx > new; the new tokens' K/V are in the cache already).
  * one program per (query tile, head pack): ``BLOCK_M`` rows = ``BLOCK_M // PACK`` tokens of
    one sequence x ``PACK`` q heads of one KV group (PACK 1: one head; PACK = q heads per
    group: each K/V tile is loaded once for the whole group, and a tile spans fewer tokens,
    so less of it lies past the diagonal). K/V are never copied per head.
  * K/V read straight out of one layer's cache [blocks, block_size, groups, dim] through the
    block table, ``BLOCK_N`` keys a step; fp32 online softmax in exp2; tiles every row sees
    whole run unmasked, the diagonal tiles masked, tiles above the diagonal are never visited.
  * the grid is 1-D over (tiles x head packs); the host-built tile map (sequence, first
    token) lists the tiles longest first, so the heavy programs start in the first wave.
  * bf16/fp16/fp32 inputs (fp32 dots exact: "ieee"), fp32 accumulation, output in q's dtype.
    Under Triton's CPU interpreter (CPU tensors) the dot operands are upcast to fp32: the
    interpreter mis-computes bf16 dots.

P is eager (never graph-captured), so the plan reads host values: lengths, tiles and the grid.

Imports only torch (and triton when present): no megatron, so a GPU check can load it alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from colo_rollout.model.kernel_backend import BACKENDS, tl, triton, triton_available  # noqa: F401
from colo_rollout.model.kernel_backend import resolve_backend as _resolve
from colo_rollout.model.kernel_backend import pow2, smem_per_block


class TileConfig(NamedTuple):
    """One launch's tiling: rows (tokens x packed heads) and keys per step, warps, pipeline
    stages, and whether a program packs all the q heads of its KV group (True), holds one
    head (False), or None: packs only where that computes far fewer padded rows (``plan_pack``)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    pack_group: bool | None = None


# Defaults from a sweep on one H200 (scripts/gpu_prefill_attention.py; 32 q heads, 4 KV groups,
# head dim 128, bf16, block size 16; 1 x 4k fresh, 8 x 1k fresh, 16 x 512 new on 4k): 64 x 64
# tiles, 4 warps, 2 stages were the best on the three (3 or 4 stages within 3%); the best
# 128-row or 128-key tilings 7-10% slower (128 x 128, 8 warps), 8 warps at 64 rows 2x slower;
# at 64 rows, packing the group's 8 heads into a tile 3% slower on these long prefills (every
# tile full either way), so it is taken only where it saves padded rows (short prefills, which
# the sweep did not time).
DEFAULT = TileConfig()
PACK_SAVING = 0.75  # pack_group None: pack when it computes at most this fraction of the rows


def resolve_backend(requested: str, device: torch.device | str,
                    dtype: torch.dtype | None = None, head_dim: int | None = None) -> str:
    """``engine.prefill_attention`` -> the backend a model on ``device`` (in ``dtype``, with
    ``head_dim``; None: not checked) uses (model/kernel_backend.py); "cudnn": this kernel plus
    cuDNN's dense attention for fresh sequences (model/dense_prefill.py), which needs CUDA,
    cuDNN 9, triton, a 16-bit model and a head dim cuDNN's fused kernels take; "flash": the
    same with FlashAttention-4's kernel for the dense calls of one sequence (``flash_attn.cute``
    installed, an sm_90 / sm_100 GPU; batched calls stay cuDNN's). "auto" takes flash where
    it can run, else cudnn (measured 1.0-1.16x the kernel alone per P step on one H200, docs/
    benchmarks.md session 16), else triton on CUDA, else torch."""
    from colo_rollout.config.attention_support import choose_dense_kernel, dense_kernel_problem

    def problem(backend: str) -> str | None:
        why = dense_kernel_problem(backend, device, dtype, head_dim)
        return why or (None if triton_available() else "triton does not import")

    # auto: the fastest dense kernel that can run (session 27's rows) -- any of them needs
    # CUDA and triton, where the key's own resolution gives triton
    dense = choose_dense_kernel(requested, ("flash", "cudnn"), problem,
                                "'triton', 'torch' or 'auto'")
    return dense or _resolve("engine.prefill_attention", requested, device)


def group_pack(q_per_group: int, block_m: int) -> int:
    """q heads per program when packing the group: the largest power of two that divides the
    group's q heads and leaves at least one token per tile (all of them for the usual
    power-of-two groups)."""
    pack = 1
    while q_per_group % (pack * 2) == 0 and pack * 2 <= block_m:
        pack *= 2
    return pack


def plan_pack(seq_lens_new: list[int], q_per_group: int, cfg: TileConfig) -> int:
    """q heads per program for this epoch: ``cfg.pack_group`` True -> ``group_pack``, False ->
    1, None -> ``group_pack`` where its tiles hold at most ``PACK_SAVING`` of the rows (padded
    tails included) that one head per program computes -- short prefills (new = 1: 1/pack of
    them); long ones tie and keep one head, the faster on the sweep."""
    pack = group_pack(q_per_group, cfg.block_m)
    if cfg.pack_group is not None or pack == 1:
        return pack if cfg.pack_group else 1

    def rows(p: int) -> int:
        tok = cfg.block_m // p
        return sum(-(-n // tok) * cfg.block_m for n in seq_lens_new) // p

    return pack if rows(pack) <= PACK_SAVING * rows(1) else 1


_TILES: dict[tuple, TileConfig] = {}


def tile_config(device: torch.device, dim: int, dtype: torch.dtype) -> TileConfig:
    """The default tiling, shrunk (stages, then keys, then rows per tile) until the q tile and
    the K and V tiles of every stage fit the device's shared memory per block."""
    key = (device.type, device.index, dim, dtype)
    got = _TILES.get(key)
    if got is None:
        smem = smem_per_block(device) or 99 * 1024  # the interpreter: a conservative bound
        esize = torch.finfo(dtype).bits // 8
        d = pow2(dim, 16)
        m, n, stages = DEFAULT.block_m, DEFAULT.block_n, DEFAULT.num_stages

        def need() -> int:
            return (stages * 2 * n + m) * d * esize + m * n * 4  # + the fp32 scores

        while need() > smem and (stages > 2 or n > 16 or m > 16):
            if stages > 2:
                stages -= 1
            elif n > 32 or (n > 16 and n >= m):
                n //= 2
            else:
                m //= 2
        got = _TILES[key] = DEFAULT._replace(block_m=m, block_n=n, num_stages=stages)
    return got


@dataclass
class PrefillPlan:
    """One P epoch's launch description, the same for every layer: the per-sequence tables
    (device int32: first query row, new tokens, context length) and the tile map [tiles, 2]
    (sequence, first token), longest tile first; plus the host values that size the grid."""

    q_starts: torch.Tensor  # [S] int32 first row of each sequence in the packed queries
    new_lens: torch.Tensor  # [S] int32 new tokens (queries) of each sequence
    ctx_lens: torch.Tensor  # [S] int32 context after this P (keys 0..ctx-1)
    tiles: torch.Tensor  # [n_tiles, 2] int32 (sequence, first token of the tile)
    n_tiles: int
    tokens: int  # T: rows of q and of the output
    q_per_group: int
    cfg: TileConfig
    pack: int  # q heads per program (rows of one token in a tile)
    # (sequence, first row, new tokens) of the sequences left out of the tiles: their rows
    # are computed by the dense kernel (model/dense_prefill.py) and unwritten by this one
    dense: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class PlanHost:
    """A P epoch's plan before its tables reach the device: ``flat`` the int32 tables (first
    rows, new counts, contexts, then the tiles' (sequence, first token)) and the host values
    that size the grid. ``packed`` is ``flat`` as int64 words (two int32 per word, padded),
    to ride in another int64 host->device copy (``runtime/device.h2d_packed``); ``on_device``
    makes the plan from either copy."""

    flat: tuple[int, ...]
    S: int
    n_tiles: int
    tokens: int
    q_per_group: int
    cfg: TileConfig
    pack: int
    dense: tuple[tuple[int, int, int], ...]

    def packed(self) -> np.ndarray:
        host = np.zeros(len(self.flat) + len(self.flat) % 2 or 2, dtype=np.int32)
        host[: len(self.flat)] = self.flat
        return host.view(np.int64)

    def on_device(self, dev: torch.Tensor) -> PrefillPlan:
        """The plan over ``dev``: the device copy of ``flat`` (int32) or of ``packed``
        (int64, reinterpreted)."""
        if dev.dtype == torch.int64:
            dev = dev.view(torch.int32)
        S, n = self.S, self.n_tiles
        return PrefillPlan(q_starts=dev[:S], new_lens=dev[S : 2 * S],
                           ctx_lens=dev[2 * S : 3 * S],
                           tiles=dev[3 * S : 3 * S + 2 * n].view(n, 2), n_tiles=n,
                           tokens=self.tokens, q_per_group=self.q_per_group, cfg=self.cfg,
                           pack=self.pack, dense=self.dense)


def plan_prefill_host(seq_lens_new: list[int], context_lens: list[int], q_per_group: int,
                      dim: int, dtype: torch.dtype, device: torch.device | str,
                      cfg: TileConfig | None = None, dense: tuple[int, ...] = ()) -> PlanHost:
    """The host half of ``plan_prefill`` (its arguments): the tables, nothing copied."""
    device = torch.device(device)
    if len(seq_lens_new) != len(context_lens):
        raise ValueError("one new count per context length")
    if cfg is None:
        cfg = tile_config(device, dim, dtype)
    skip = set(dense)
    if any(not 0 <= s < len(seq_lens_new) for s in skip):
        raise ValueError(f"dense sequences {sorted(skip)} are not among {len(seq_lens_new)}")
    pack = plan_pack([n for s, n in enumerate(seq_lens_new) if s not in skip], q_per_group, cfg)
    per_tile = cfg.block_m // pack
    starts, tiles, off, held = [], [], 0, []
    for s, (n, c) in enumerate(zip(seq_lens_new, context_lens)):
        if n > c:
            raise ValueError(f"sequence {s}: {n} new tokens exceed its context {c}")
        starts.append(off)
        off += n
        if s in skip:
            held.append((s, off - n, n))
            continue
        for t0 in range(0, n, per_tile):
            tiles.append((c - n + min(t0 + per_tile, n), s, t0))  # keys its last row sees
    tiles.sort(key=lambda t: -t[0])  # stable: ties keep sequence order
    flat = starts + list(seq_lens_new) + list(context_lens)
    for _, s, t0 in tiles:
        flat += (s, t0)
    return PlanHost(tuple(flat), len(seq_lens_new), len(tiles), off, q_per_group, cfg, pack,
                    tuple(held))


def plan_prefill(seq_lens_new: list[int], context_lens: list[int], q_per_group: int,
                 dim: int, dtype: torch.dtype, device: torch.device | str,
                 cfg: TileConfig | None = None, dense: tuple[int, ...] = ()) -> PrefillPlan:
    """The plan of one P epoch from the host lists (what ``AttnMetadata`` carries): tiles of
    ``block_m // pack`` tokens per sequence, sorted by keys visited (longest first), all in one
    host->device copy (pinned, no host wait on CUDA). ``cfg`` None: ``tile_config``.
    ``dense``: indices of sequences given no tiles (another kernel computes their rows)."""
    device = torch.device(device)
    host = plan_prefill_host(seq_lens_new, context_lens, q_per_group, dim, dtype, device, cfg,
                             dense)
    flat = torch.tensor(host.flat or [0], dtype=torch.int32)
    if device.type == "cuda":
        dev = flat.pin_memory().to(device, non_blocking=True)
    else:
        dev = flat.to(device)
    return host.on_device(dev)


def torch_prefill_attention(q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor,
                            tables: torch.Tensor, plan: PrefillPlan,
                            scale: float) -> torch.Tensor:
    """The reference of the kernel, with its arguments: per sequence, each KV group's q heads
    as one matrix against that group's keys (no copy per head), fp32 scores and softmax, the
    causal offset of a continuation prefill. Reads the plan's tables back to the host (a sync:
    tests and checks only)."""
    T, heads, dim = q.shape
    g = kv_k.shape[2]
    n = heads // g
    out = q.new_zeros((T, heads, dim))
    starts, news, ctxs = (x.tolist() for x in (plan.q_starts, plan.new_lens, plan.ctx_lens))
    bs = kv_k.shape[1]
    for s, (q0, new, ctx) in enumerate(zip(starts, news, ctxs)):
        if new == 0:
            continue
        nb = -(-ctx // bs)
        k = kv_k[tables[s, :nb].long()].flatten(0, 1)[:ctx]  # [ctx, g, dim]
        v = kv_v[tables[s, :nb].long()].flatten(0, 1)[:ctx]
        qs = q[q0 : q0 + new].view(new, g, n, dim).permute(1, 2, 0, 3)  # [g, n, new, dim]
        scores = torch.matmul(qs.float(), k.float().permute(1, 2, 0)[:, None]) * scale
        qpos = torch.arange(ctx - new, ctx, device=q.device)[:, None]
        keep = torch.arange(ctx, device=q.device)[None, :] <= qpos  # [new, ctx]
        probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        o = torch.matmul(probs, v.float().permute(1, 0, 2)[:, None])  # [g, n, new, dim]
        out[q0 : q0 + new] = o.permute(2, 0, 1, 3).reshape(new, heads, dim).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _prefill_tiles(
        acc, l_i, m_i, q, qpos, lo, hi,
        k_base, v_base, tab, stride_tw, stride_kb, stride_kt, stride_vb, stride_vt,
        offs_d, dmask, scale_log2,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
        EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """Keys lo..hi-1 (tile multiples from lo) into the running (acc, l_i, m_i). MASKED:
        the diagonal tiles (keys past a row's position, or at/past hi, are dropped); else
        every row sees every key and nothing is masked."""
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            if MASKED:
                nmask = offs_n < hi
                blk = tl.load(tab + (offs_n // BLOCK_SIZE) * stride_tw, mask=nmask, other=0)
            else:
                blk = tl.load(tab + (offs_n // BLOCK_SIZE) * stride_tw)
            blk = blk.to(tl.int64)
            tok = offs_n % BLOCK_SIZE
            k_ptr = k_base + (blk * stride_kb + tok * stride_kt)[:, None] + offs_d[None, :]
            v_ptr = v_base + (blk * stride_vb + tok * stride_vt)[:, None] + offs_d[None, :]
            if MASKED:
                kvmask = nmask[:, None] & dmask[None, :]
                k = tl.load(k_ptr, mask=kvmask, other=0.0)
            elif EVEN_D:
                k = tl.load(k_ptr)
            else:
                k = tl.load(k_ptr, mask=dmask[None, :], other=0.0)
            k = k.to(q.dtype)
            if UPCAST:  # the interpreter's dot reads bf16 as integers: exact fp32 products
                k = k.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
            if MASKED:
                keep = (offs_n[None, :] <= qpos[:, None]) & nmask[None, :]
                qk = tl.where(keep, qk * scale_log2, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                p = tl.exp2(qk - m_new[:, None])
            else:
                m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
                p = tl.exp2(qk * scale_log2 - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if MASKED:
                v = tl.load(v_ptr, mask=kvmask, other=0.0)
            elif EVEN_D:
                v = tl.load(v_ptr)
            else:
                v = tl.load(v_ptr, mask=dmask[None, :], other=0.0)
            p = p.to(q.dtype)  # the probabilities in the input dtype, as flash attention
            v = v.to(q.dtype)
            if UPCAST:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _prefill_kernel(
        Q, K, V, Tab, QStart, New, Ctx, Tiles, Out,
        scale_log2, programs_per_tile,
        stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kg,
        stride_vb, stride_vt, stride_vg,
        stride_tb, stride_tw,
        stride_ot, stride_oh,
        N_Q: tl.constexpr, PACK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    ):
        TOK: tl.constexpr = BLOCK_M // PACK  # tokens per tile
        EVEN_D: tl.constexpr = HEAD_DIM == D_PAD
        pid = tl.program_id(0)
        tile = pid // programs_per_tile
        hp = pid % programs_per_tile  # which PACK q heads
        seq = tl.load(Tiles + 2 * tile)
        tok0 = tl.load(Tiles + 2 * tile + 1)
        q0 = tl.load(QStart + seq)
        new = tl.load(New + seq)
        ctx = tl.load(Ctx + seq)
        base = ctx - new  # position of the sequence's first query

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < HEAD_DIM
        tok = tok0 + offs_m // PACK  # row -> (token, head): heads of a token side by side
        head = hp * PACK + offs_m % PACK
        mvalid = tok < new
        qpos = base + tok
        rows = (q0 + tok).to(tl.int64)
        qmask = mvalid[:, None] & dmask[None, :]
        q = tl.load(Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=qmask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        g = (hp * PACK) // N_Q  # PACK divides N_Q: one KV group per program
        k_base = K + g * stride_kg
        v_base = V + g * stride_vg
        tab = Tab + seq.to(tl.int64) * stride_tb
        hi = base + tl.minimum(tok0 + TOK, new)  # the tile's last query's position + 1
        full = ((base + tok0 + 1) // BLOCK_N) * BLOCK_N  # whole tiles every row sees

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        # key 0 is in the first tile visited and every row sees it: the max is finite at once
        acc, l_i, m_i = _prefill_tiles(
            acc, l_i, m_i, q, qpos, 0, full, k_base, v_base, tab, stride_tw,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_d, dmask, scale_log2,
            BLOCK_SIZE, BLOCK_N, False, EVEN_D, DOT_PREC, UPCAST)
        acc, l_i, m_i = _prefill_tiles(
            acc, l_i, m_i, q, qpos, full, hi, k_base, v_base, tab, stride_tw,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_d, dmask, scale_log2,
            BLOCK_SIZE, BLOCK_N, True, EVEN_D, DOT_PREC, UPCAST)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(Out + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=qmask)


def triton_prefill_attention(q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor,
                             tables: torch.Tensor, plan: PrefillPlan,
                             scale: float) -> torch.Tensor:
    """P attention: q [T, heads, dim] (the plan's sequences' new tokens back to back) against
    one layer's paged cache kv_k/kv_v [blocks, block_size, groups, dim] through tables [S, W]
    (int64 or int32; padding points at the sink block) -> [T, heads, dim] in q's dtype. Also
    runs on CPU tensors under TRITON_INTERPRET=1 (the tests). Zero sequences: zero rows."""
    if triton is None:
        raise RuntimeError("triton is not importable: use the torch prefill attention backend")
    T, heads, dim = q.shape
    blocks, block_size, g, kdim = kv_k.shape
    if kdim != dim or kv_v.shape != kv_k.shape or heads % g:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(kv_k.shape)}")
    if T != plan.tokens or heads // g != plan.q_per_group:
        raise ValueError(f"q {tuple(q.shape)} is not the plan's ({plan.tokens} tokens, "
                         f"{plan.q_per_group} q heads per group)")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_k.stride(-1) != 1 or kv_v.stride(-1) != 1:
        raise ValueError("the KV cache's head dim must be contiguous")
    out = torch.empty((T, heads, dim), dtype=q.dtype, device=q.device)
    if plan.n_tiles == 0:
        return out
    cfg, pack = plan.cfg, plan.pack
    per_tile = heads // pack
    # fp32: exact products (no tf32). CPU tensors run only under the interpreter: upcast there
    upcast = not q.is_cuda
    prec = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    _prefill_kernel[(plan.n_tiles * per_tile,)](
        q, kv_k, kv_v, tables, plan.q_starts, plan.new_lens, plan.ctx_lens, plan.tiles, out,
        scale * 1.4426950408889634, per_tile,  # log2(e): the softmax in exp2
        q.stride(0), q.stride(1),
        kv_k.stride(0), kv_k.stride(1), kv_k.stride(2),
        kv_v.stride(0), kv_v.stride(1), kv_v.stride(2),
        tables.stride(0), tables.stride(1),
        out.stride(0), out.stride(1),
        N_Q=heads // g, PACK=pack, HEAD_DIM=dim, D_PAD=pow2(dim, 16),
        BLOCK_SIZE=block_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        DOT_PREC=prec, UPCAST=upcast, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
