"""Pairs sorted by local expert: the permutation between the router and the expert GEMMs.

Owns ``align``: the routed (token, top-k slot) pairs of a MoE layer -> the layout the grouped
expert GEMMs read (model/fused_moe.py) -- each pair's sorted position, its token row, the
per-expert group ends and the router probability in sorted order. Two backends, bitwise the
same result (a stable sort by (local expert, pair index)):

  * ``torch``: a stable ``torch.sort`` of the keys, ``searchsorted`` for the group ends and a
    gather of the probabilities (the reference; ~10 kernels, the sort's radix passes the
    costliest: 28 us per layer at 1024 pairs on an H200);
  * ``triton``: up to ``TRITON_MAX_PAIRS`` pairs (decode, short prefill), one kernel of one
    program: a bitonic sort (``tl.sort``) of the unique composites key * P_PAD + pair (so the
    order of equal keys is the pairs' own), the group ends a histogram's running sum. Past
    that (prefill), a counting sort over blocks of ``BLOCK_PAIRS`` pairs in three launches:
    each block's key histogram; per key the blocks' exclusive running sum (so block b's pairs
    of expert e follow every earlier block's -- the stable order); each block's own bitonic
    sort scattered to (expert's start + earlier blocks' count + rank in the block). Host values
    read: shapes only, so a CUDA graph replays either with new routing.

Keys: a pair routed to local expert e (global id - first_expert, in [0, E)) has key e; pairs
routed to other ranks' experts and the padding rows of a P graph's bucket (token >= n_valid)
have key E and sort last, past offs[-1].

Imports only torch (and triton when present): no megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colo_rollout.model.kernel_backend import pow2, tl, triton

# the one-program kernel's limit: past it one program's sort is slow (H200: 1.5 us at 8 pairs
# and 9 us at 1024, where torch's sort took 28 us; 186 us at 8192, where torch's took 48), and
# the counting sort over blocks of 1024 takes over (not yet timed on a GPU)
TRITON_MAX_PAIRS = 1024
# the sort's widths: three compiled variants (a few rows, tens, a hundred), so no shape met
# while serving compiles a new one (``warm`` compiles them at model build)
_WIDTHS = (64, 256, TRITON_MAX_PAIRS)
# the counting sort's block (one program's bitonic sort) and its scan's rows per iteration:
# fixed, so one compiled variant serves every prefill size. H200, Qwen3's 4096 x top-8 pairs
# over 128 experts (scripts/gpu_router_sweep.py, 2026-12-03; the three launches in a graph):
# blocks of 512 at 4 warps 13.1 us, of 1024 19.2, of 256 16.9
BLOCK_PAIRS = 512
ALIGN_WARPS = 4
_SCAN_ROWS = 64
# the scan's keys per program: its programs split the keys (each reads every block's counts
# for the keys before its own, and runs its own keys' sums over the blocks). One program
# walking all 256 bins of Qwen3's 128 experts took 12.8 us of the trio's ~20 at 8192 tokens
# (128 blocks; H100, 2026-12-06 -- the running sum over the blocks of a [64, 256] tile). The
# trio by keys per program (scripts/gpu_router_sweep.py --kernels scan, H100, 2026-12-06), us
# at 4096 / 8192 tokens: Qwen3 256 (one program) 13.4 / 18.9, 128 11.6 / 15.6, 64 10.7 /
# 13.7, 32 11.0 / 14.2, 16 11.6 / 15.4; the first shape's 64 experts (128 bins) 9.9-10.3 /
# 12.6-13.5 at every width
SCAN_KEYS = 64


@dataclass(frozen=True)
class Aligned:
    """The sorted layout of R = N x k pairs (pair index p = token * k + slot)."""

    order: torch.Tensor  # [R] the pair index at each sorted position
    token: torch.Tensor  # [R] the token row (of x) at each sorted position
    offs: torch.Tensor  # [E] int32 group ends: positions < offs[e] hold experts <= e
    prob: torch.Tensor  # [R] each sorted pair's router probability (the weights' dtype)
    where: torch.Tensor  # [R] each pair's sorted position: the inverse of ``order``


def torch_align(chosen: torch.Tensor, weight: torch.Tensor, first: int, experts: int,
                n_valid: torch.Tensor | None = None,
                expert_ids: torch.Tensor | None = None) -> Aligned:
    """The reference: chosen [N, k] global expert ids, weight [N, k] router probabilities;
    this rank's experts are [first, first + experts); ``n_valid`` (0-dim int64 on the device):
    rows >= n_valid are padding. ``expert_ids``: 0..experts-1 on the device (a cached
    constant; made here when absent)."""
    k = chosen.shape[1]
    local = chosen - first
    mine = (local >= 0) & (local < experts)
    if n_valid is not None:
        rows = torch.arange(chosen.shape[0], device=chosen.device)
        mine = mine & (rows < n_valid).unsqueeze(1)
    key = torch.where(mine, local, experts).flatten()
    sorted_key, order = torch.sort(key, stable=True)
    if expert_ids is None:
        expert_ids = torch.arange(experts, device=chosen.device)
    offs = torch.searchsorted(sorted_key, expert_ids, right=True, out_int32=True)
    where = torch.empty_like(order)
    where[order] = torch.arange(order.shape[0], device=order.device)
    return Aligned(order, order // k, offs, weight.flatten()[order], where)


def triton_align(chosen: torch.Tensor, weight: torch.Tensor, first: int, experts: int,
                 n_valid: torch.Tensor | None = None) -> Aligned:
    """``torch_align`` in one Triton launch (int32 order and token). CPU tensors run under
    TRITON_INTERPRET=1 only (the tests)."""
    if triton is None:
        raise RuntimeError("triton is not importable: use the torch moe kernel backend")
    n, k = chosen.shape
    pairs = n * k
    if not chosen.is_contiguous():
        chosen = chosen.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    dev = chosen.device
    order = torch.empty(pairs, dtype=torch.int32, device=dev)
    token = torch.empty(pairs, dtype=torch.int32, device=dev)
    prob = torch.empty(pairs, dtype=weight.dtype, device=dev)
    offs = torch.empty(experts, dtype=torch.int32, device=dev)
    where = torch.empty(pairs, dtype=torch.int32, device=dev)
    if pairs == 0:
        offs.zero_()
        return Aligned(order, token, offs, prob, where)
    if pairs > TRITON_MAX_PAIRS:
        return _blocked_align(chosen, weight, first, experts, n_valid,
                              Aligned(order, token, offs, prob, where))
    p_pad = next(w for w in _WIDTHS if pairs <= w)
    nv = n_valid if n_valid is not None else offs  # unread without HAS_NVALID
    _align_kernel[(1,)](
        chosen, weight, nv, order, token, prob, offs, where, pairs, first, experts,
        K=k, HAS_NVALID=n_valid is not None, P_PAD=p_pad, E_BINS=pow2(experts + 2, 16),
        num_warps=4 if p_pad <= 1024 else (8 if p_pad <= 4096 else 16),
    )
    return Aligned(order, token, offs, prob, where)


def _blocked_align(chosen: torch.Tensor, weight: torch.Tensor, first: int, experts: int,
                   n_valid: torch.Tensor | None, out: Aligned, block: int = BLOCK_PAIRS,
                   warps: int = ALIGN_WARPS, scan_keys: int = SCAN_KEYS) -> Aligned:
    """The counting sort over blocks (the module docstring) into ``out``'s tensors; ``block``,
    ``warps`` and ``scan_keys``: the sweep's overrides (scripts/gpu_router_sweep.py)."""
    n, k = chosen.shape
    pairs = n * k
    blocks = triton.cdiv(pairs, block)
    bins = pow2(experts + 2, 16)  # keys 0..E+1 (E + 1: past the last pair)
    dev = chosen.device
    counts = torch.empty((blocks, bins), dtype=torch.int32, device=dev)
    base = torch.empty((blocks, bins), dtype=torch.int32, device=dev)
    nv = n_valid if n_valid is not None else counts  # unread without HAS_NVALID
    kw = dict(K=k, HAS_NVALID=n_valid is not None, BLOCK=block, E_BINS=bins)
    _block_hist_kernel[(blocks,)](chosen, nv, counts, pairs, first, experts, **kw,
                                  num_warps=warps)
    keys = min(scan_keys, bins)
    _block_scan_kernel[(bins // keys,)](counts, base, out.offs, blocks, experts, E_BINS=bins,
                                        ROWS=_SCAN_ROWS, KEYS=keys, num_warps=4)
    _block_scatter_kernel[(blocks,)](chosen, weight, nv, base, out.order, out.token, out.prob,
                                     out.where, pairs, first, experts, **kw, num_warps=warps)
    return out


def warm(topk: int, experts: int, device: torch.device, weight_dtype: torch.dtype) -> None:
    """Compile the kernel's variants for a layer (every width, with and without padding rows,
    and the counting sort's three kernels) now, at model build: a first compile while
    serving stalls the host for a second."""
    if triton is None or device.type != "cuda":
        return
    # the widths, then one shape past them (the counting sort: one variant for all sizes)
    for rows in (*(max(1, w // topk) for w in _WIDTHS), TRITON_MAX_PAIRS // topk + 1):
        chosen = torch.zeros((rows, topk), dtype=torch.int64, device=device)
        weight = torch.zeros((rows, topk), dtype=weight_dtype, device=device)
        for n_valid in (None, torch.tensor(rows, device=device)):
            triton_align(chosen, weight, 0, experts, n_valid)


def use_triton(backend: str, pairs: int) -> bool:
    """Whether ``align`` takes the kernels for a layer whose expert GEMMs run on ``backend``
    ("torch" or "triton", resolved): every pair count (``pairs``, a host shape)."""
    return backend == "triton" and triton is not None


def align(chosen: torch.Tensor, weight: torch.Tensor, first: int, experts: int,
          n_valid: torch.Tensor | None = None, *, backend: str = "torch",
          expert_ids: torch.Tensor | None = None) -> Aligned:
    """The sorted layout of the pairs (see the module docstring): the kernel when
    ``use_triton(backend, pairs)``, else the torch reference."""
    if use_triton(backend, chosen.numel()):
        return triton_align(chosen, weight, first, experts, n_valid)
    return torch_align(chosen, weight, first, experts, n_valid, expert_ids)


if triton is not None:

    @triton.jit
    def _pair_keys(Chosen, NValid, idx, pairs, first, E, K: tl.constexpr,
                   HAS_NVALID: tl.constexpr):
        """Sort keys of the pairs ``idx``: the local expert, E for other ranks' experts and
        padding rows, E + 1 past the last pair (never counted as smaller or equal)."""
        inside = idx < pairs
        local = tl.load(Chosen + idx, mask=inside, other=0).to(tl.int32) - first
        mine = (local >= 0) & (local < E)
        if HAS_NVALID:
            mine = mine & ((idx // K) < tl.load(NValid).to(tl.int32))
        key = tl.where(mine, local, E)
        return tl.where(inside, key, E + 1)

    # the pair and expert counts change nothing in the code: one compiled kernel per top-k
    # and power-of-two bucket of pairs
    @triton.jit(do_not_specialize=["pairs", "first", "E"])
    def _align_kernel(Chosen, Weight, NValid, Order, Token, Prob, Offs, Where, pairs, first, E,
                      K: tl.constexpr, HAS_NVALID: tl.constexpr, P_PAD: tl.constexpr,
                      E_BINS: tl.constexpr):
        i = tl.arange(0, P_PAD)
        key = _pair_keys(Chosen, NValid, i, pairs, first, E, K, HAS_NVALID)  # <= E + 1
        # one sort of unique (key, pair) composites: the stable order by key
        src = tl.sort(key * P_PAD + i) % P_PAD
        ok = i < pairs
        tl.store(Order + i, src, mask=ok)
        tl.store(Token + i, src // K, mask=ok)
        tl.store(Prob + i, tl.load(Weight + src, mask=ok, other=0.0), mask=ok)
        tl.store(Where + src, i, mask=ok)
        # group ends: keys <= e, counted by a histogram (E_BINS > E + 1: every key in range)
        ends = tl.cumsum(tl.histogram(key, E_BINS), 0)
        e = tl.arange(0, E_BINS)
        tl.store(Offs + e, ends, mask=e < E)

    @triton.jit(do_not_specialize=["pairs", "first", "E"])
    def _block_hist_kernel(Chosen, NValid, Counts, pairs, first, E, K: tl.constexpr,
                           HAS_NVALID: tl.constexpr, BLOCK: tl.constexpr,
                           E_BINS: tl.constexpr):
        """Counts[b, e]: block b's pairs of key e."""
        b = tl.program_id(0).to(tl.int64)
        key = _pair_keys(Chosen, NValid, b * BLOCK + tl.arange(0, BLOCK), pairs, first, E, K,
                         HAS_NVALID)
        tl.store(Counts + b * E_BINS + tl.arange(0, E_BINS), tl.histogram(key, E_BINS))

    @triton.jit(do_not_specialize=["blocks", "E"])
    def _block_scan_kernel(Counts, Base, Offs, blocks, E, E_BINS: tl.constexpr,
                           ROWS: tl.constexpr, KEYS: tl.constexpr):
        """Base[b, e] = (pairs of keys < e) + (block b's predecessors' pairs of key e) -- where
        block b's first pair of key e goes -- and the group ends Offs[e] (keys <= e). Program
        j takes keys [j * KEYS, (j + 1) * KEYS), walking the blocks ROWS at a time (any block
        count, one compiled variant): first the pairs of every earlier key and its own keys'
        totals, then its keys' running sums over the blocks."""
        e = tl.arange(0, E_BINS)
        lo = tl.program_id(0) * KEYS
        own = lo + tl.arange(0, KEYS)
        earlier = tl.zeros([E_BINS], dtype=tl.int32)
        total = tl.zeros([KEYS], dtype=tl.int32)
        for start in range(0, blocks, ROWS):  # first pass: the earlier keys', own totals
            r = start + tl.arange(0, ROWS)
            inside = (r < blocks)[:, None]
            if KEYS < E_BINS:  # (one program: no key before its own)
                c = tl.load(Counts + r[:, None] * E_BINS + e[None, :],
                            mask=inside & (e < lo)[None, :], other=0)
                earlier += tl.sum(c, axis=0)
            c = tl.load(Counts + r[:, None] * E_BINS + own[None, :], mask=inside, other=0)
            total += tl.sum(c, axis=0)
        ends = tl.sum(earlier, 0) + tl.cumsum(total, 0)
        tl.store(Offs + own, ends, mask=own < E)
        run = ends - total  # the keys < e
        for start in range(0, blocks, ROWS):  # second pass: the blocks' running sums
            r = start + tl.arange(0, ROWS)
            inside = (r < blocks)[:, None]
            c = tl.load(Counts + r[:, None] * E_BINS + own[None, :], mask=inside, other=0)
            before = tl.cumsum(c, 0) - c  # earlier rows of this chunk
            tl.store(Base + r[:, None] * E_BINS + own[None, :], run[None, :] + before,
                     mask=inside)
            run += tl.sum(c, axis=0)

    @triton.jit(do_not_specialize=["pairs", "first", "E"])
    def _block_scatter_kernel(Chosen, Weight, NValid, Base, Order, Token, Prob, Where, pairs,
                              first, E, K: tl.constexpr, HAS_NVALID: tl.constexpr,
                              BLOCK: tl.constexpr, E_BINS: tl.constexpr):
        """Block b's pairs sorted by (key, pair) in the block, each stored at its global sorted
        position: Base[b, key] + its rank among the block's pairs of that key."""
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        key = _pair_keys(Chosen, NValid, b * BLOCK + i, pairs, first, E, K, HAS_NVALID)
        srt = tl.sort(key * BLOCK + i)
        key_s, src = srt // BLOCK, srt % BLOCK
        # the block's pairs of keys < key_s come first in the sorted block: rank = position -
        # their count (an exclusive running sum of the block's own histogram)
        hist = tl.histogram(key, E_BINS)
        excl = tl.cumsum(hist, 0) - hist
        # per sorted position: Base[b, key] - excl[key], read through memory (a vector cannot
        # index a vector); the block's row of Base becomes that difference first
        row = Base + b * E_BINS
        e = tl.arange(0, E_BINS)
        tl.store(row + e, tl.load(row + e) - excl)
        tl.debug_barrier()
        ok = key_s <= E  # E + 1: past the last pair
        dest = tl.load(row + key_s, mask=ok, other=0) + i
        pair = b * BLOCK + src
        tl.store(Order + dest, pair.to(tl.int32), mask=ok)
        tl.store(Token + dest, (pair // K).to(tl.int32), mask=ok)
        tl.store(Prob + dest, tl.load(Weight + pair, mask=ok, other=0.0), mask=ok)
        tl.store(Where + pair, dest.to(tl.int32), mask=ok)
