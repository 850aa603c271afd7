"""The router's top-k and softmax in one launch: megatron's dense softmax routing
(``topk_routing_with_score_function(score_function="softmax", dense_output=True)``) on the
gate's fp32 logits, for the routers that have nothing else to do (no expert groups, no expert
bias, no replay).

Owns ``supports`` (which router configurations the kernel computes) and ``softmax_topk``.
Where it runs: the grouped MoE path on CUDA with the Triton expert kernels (model/moe.py
``GatherMoE.route``); every other router, and CPU, keeps megatron's function. At B = 1 the
torch ops are three to four launches per layer (``torch.topk``'s gatherTopK alone ~5 us per
layer in the Qwen3 shape's replayed decode step, docs/benchmarks.md); this is one.

Semantics, megatron's for ``use_pre_softmax``:
  * False (default; Mixtral / Qwen3-MoE with renormalised top-k): the k largest logits, then
    the softmax over those k;
  * True: the softmax over all E logits, then the k largest probabilities.
Then ``scaling_factor`` multiplies the probabilities. The ids come in descending score order,
ties to the lower expert id (torch.topk's order with ``sorted=False`` is unspecified; every
consumer here takes the k ids as a set: the pairs' sort, the routing record and its replay).
The selection compares the same fp32 values torch.topk compares, so the chosen experts are
megatron's; the probabilities differ from torch's softmax in the last bits (the exponential's
and the sum's rounding: ~1e-7 relative), as a fused router kernel's do (TE's, SGLang's).

Imports only torch (and triton when present): no megatron.
"""

from __future__ import annotations

import torch

from colo_rollout.model.kernel_backend import pow2, tl, triton

MAX_EXPERTS = 1024  # one row's logits in one program's registers
MAX_TOPK = 32
CHUNK = 32  # columns per rank-counting step
# From this many rows (P steps; D's rows stay below it) the k-rounds kernel: one program per
# ROWS rows, k row-wide max reductions -- the rank count's E x E comparisons per row took
# 25 us per layer for a 4k Qwen3 prefill (E = 128), 2% of the step. The two kernels choose
# the same experts in the same order; their probabilities may differ in the last bit (the
# softmax's sum is reduced over another layout). Per program ~128 scores in ONE warp (each
# round's two row reductions are warp shuffles, no shared-memory barrier): H200, 4096 rows,
# top-8 (scripts/gpu_router_sweep.py, 2026-12-03): E 128 4.7 us (16 rows x 4 warps: 12.6),
# E 64 4.3 us (7.0).
ROUNDS_FROM = 512
ROUND_SCORES = 128  # rows per program: this many padded scores, at least one row


def rounds_launch(e_pad: int) -> tuple[int, int]:
    """(rows per program, warps) of the k-rounds kernel for a padded expert count."""
    return max(1, ROUND_SCORES // e_pad), max(1, min(4, e_pad // 256))


def supports(score_function: str, num_groups, group_topk, expert_bias, router_replay,
             topk: int, experts: int) -> bool:
    """Whether ``softmax_topk`` computes this router's routing."""
    return (triton is not None and score_function == "softmax" and not group_topk
            and not num_groups and expert_bias is None and router_replay is None
            and 1 <= topk <= min(MAX_TOPK, experts) and experts <= MAX_EXPERTS)


def softmax_topk(logits: torch.Tensor, topk: int, pre_softmax: bool = False,
                 scaling_factor: float | None = None, *, rows: int | None = None,
                 warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32 -> (probs [N, k] fp32, ids [N, k] int64), megatron's dense softmax
    routing (module docstring). Host values read: shapes only (graph-capturable). ``rows``,
    ``warps``: the k-rounds kernel's rows per program and warps (the sweep's overrides)."""
    if triton is None:
        raise RuntimeError("triton is not importable")
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be [N, E] fp32, got {tuple(logits.shape)} {logits.dtype}")
    N, E = logits.shape
    if not 1 <= topk <= min(MAX_TOPK, E) or E > MAX_EXPERTS:
        raise ValueError(f"top-{topk} of {E} experts is outside the kernel's range")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    probs = torch.empty((N, topk), dtype=torch.float32, device=logits.device)
    ids = torch.empty((N, topk), dtype=torch.int64, device=logits.device)
    if N == 0:
        return probs, ids
    e_pad = pow2(E, 16)
    scale = 1.0 if not scaling_factor else float(scaling_factor)
    if N >= ROUNDS_FROM:  # P: k rounds of a row-wide max over ROWS rows per program
        r0, w0 = rounds_launch(e_pad)
        rows, warps = rows or r0, warps or w0
        _softmax_topk_rounds_kernel[(triton.cdiv(N, rows),)](
            logits, probs, ids, N, E, logits.stride(0), scale, K=topk, E_PAD=e_pad,
            ROWS=rows, PRE=bool(pre_softmax), num_warps=warps)
        return probs, ids
    chunk = min(CHUNK, e_pad)
    _softmax_topk_kernel[(N,)](
        logits, probs, ids, E, logits.stride(0), scale,
        K=topk, E_PAD=e_pad, CHUNK=chunk, PRE=bool(pre_softmax),
        num_warps=max(1, min(4, e_pad * chunk // 1024)))
    return probs, ids


if triton is not None:

    @triton.jit
    def _scores(Logits, row, e, E, mx, total, PRE: tl.constexpr):
        """Row ``row``'s scores at experts ``e`` (-inf past E): the logits, or (PRE) their
        softmax given the row's max and sum of exponentials."""
        x = tl.load(Logits + row + e, mask=e < E, other=float("-inf"))
        if PRE:
            x = tl.where(e < E, tl.exp(x - mx) / total, float("-inf"))
        return x

    # one program per row. The k chosen are the experts of rank < k, rank = how many experts
    # score higher, or equal with a lower id (descending order, ties to the lower id); the
    # ranks are counted over column chunks in parallel -- no k serial rounds of row-wide
    # reductions, which cost a B = 1 step more than the torch ops this replaces
    @triton.jit(do_not_specialize=["E", "stride"])
    def _softmax_topk_kernel(Logits, Probs, Ids, E, stride, scale, K: tl.constexpr,
                             E_PAD: tl.constexpr, CHUNK: tl.constexpr, PRE: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        row = r * stride
        e = tl.arange(0, E_PAD)
        x = tl.load(Logits + row + e, mask=e < E, other=float("-inf"))
        mx = tl.max(x, 0)
        total = 1.0
        if PRE:  # the softmax over every expert first; the selection on its probabilities
            total = tl.sum(tl.where(e < E, tl.exp(x - mx), 0.0), 0)
            x = _scores(Logits, row, e, E, mx, total, PRE)
        rank = tl.zeros([E_PAD], tl.int32)
        for j0 in tl.static_range(0, E_PAD, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            xj = _scores(Logits, row, j, E, mx, total, PRE)
            beats = (xj[None, :] > x[:, None]) | ((xj[None, :] == x[:, None])
                                                 & (j[None, :] < e[:, None]))
            rank += tl.sum(beats.to(tl.int32), 1)
        chosen = (rank < K) & (e < E)
        if PRE:
            p = x
        else:  # the softmax over the k chosen logits (the row's max is among them)
            p = tl.where(chosen, tl.exp(x - mx), 0.0)
            p = p / tl.sum(p, 0)
        out = r * K + rank
        tl.store(Probs + out, p * scale, mask=chosen)
        tl.store(Ids + out, e.to(tl.int64), mask=chosen)

    # ROWS rows per program, k rounds: each takes the row's largest score among the experts
    # not taken yet, ties to the lowest id -- the rank kernel's order (a stable descending
    # sort) -- and records the round as that expert's rank
    @triton.jit(do_not_specialize=["N", "E", "stride"])
    def _softmax_topk_rounds_kernel(Logits, Probs, Ids, N, E, stride, scale, K: tl.constexpr,
                                    E_PAD: tl.constexpr, ROWS: tl.constexpr,
                                    PRE: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        rmask = r < N
        e = tl.arange(0, E_PAD)
        real = rmask[:, None] & (e[None, :] < E)
        x = tl.load(Logits + r[:, None] * stride + e[None, :], mask=real,
                    other=float("-inf"))
        mx = tl.max(x, 1)
        if PRE:  # the softmax over every expert first; the selection on its probabilities
            total = tl.sum(tl.where(real, tl.exp(x - mx[:, None]), 0.0), 1)
            x = tl.where(real, tl.exp(x - mx[:, None]) / total[:, None], float("-inf"))
        rank = tl.full([ROWS, E_PAD], K, tl.int32)
        taken = e[None, :] >= E  # padding lanes are never chosen
        for k in tl.static_range(K):
            best = tl.max(tl.where(taken, float("-inf"), x), 1)
            pick = tl.min(tl.where((x == best[:, None]) & ~taken, e[None, :], E_PAD), 1)
            now = e[None, :] == pick[:, None]
            rank = tl.where(now, k, rank)
            taken = taken | now
        chosen = (rank < K) & real
        if PRE:
            p = x
        else:  # the softmax over the k chosen logits (the row's max is among them)
            p = tl.where(chosen, tl.exp(x - mx[:, None]), 0.0)
            p = p / tl.sum(p, 1)[:, None]
        out = r[:, None] * K + rank
        tl.store(Probs + out, p * scale, mask=chosen)
        tl.store(Ids + out, (e[None, :] + tl.zeros([ROWS, E_PAD], tl.int32)).to(tl.int64),
                 mask=chosen)
