"""Pairs sorted by local expert: the permutation between the router and the expert GEMMs.

Owns ``align``: the routed (token, top-k slot) pairs of a MoE layer -> the layout the grouped
expert GEMMs read (model/fused_moe.py) -- each pair's sorted position, its token row, the
per-expert group ends and the router probability in sorted order. Two backends, bitwise the
same result (a stable sort by (local expert, pair index)):

  * ``torch``: a stable ``torch.sort`` of the keys, ``searchsorted`` for the group ends and a
    gather of the probabilities (the reference; ~10 kernels, the sort's radix passes the
    costliest: 28 us per layer at 1024 pairs on an H200);
  * ``triton``: one kernel of one program: a bitonic sort (``tl.sort``) of the unique
    composites key * P_PAD + pair (so the order of equal keys is the pairs' own), the group
    ends a histogram's running sum. Host values read: shapes only, so a CUDA graph replays it
    with new routing. Used up to ``TRITON_MAX_PAIRS`` pairs (decode, short prefill), which one
    program's registers hold.

Keys: a pair routed to local expert e (global id - first_expert, in [0, E)) has key e; pairs
routed to other ranks' experts and the padding rows of a P graph's bucket (token >= n_valid)
have key E and sort last, past offs[-1].

Imports only torch (and triton when present): no megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colo_rollout.model.kernel_backend import pow2, tl, triton

# the kernel sorts in one program: past this many pairs torch's multi-block radix sort is the
# better tool (H200: the kernel 1.5 us at 8 pairs and 9 us at 1024, where torch's sort took
# 28 us; 186 us at 8192, where torch's took 48)
TRITON_MAX_PAIRS = 1024
# the sort's widths: three compiled variants (a few rows, tens, a hundred), so no shape met
# while serving compiles a new one (``warm`` compiles them at model build)
_WIDTHS = (64, 256, TRITON_MAX_PAIRS)


@dataclass(frozen=True)
class Aligned:
    """The sorted layout of R = N x k pairs (pair index p = token * k + slot)."""

    order: torch.Tensor  # [R] the pair index at each sorted position
    token: torch.Tensor  # [R] the token row (of x) at each sorted position
    offs: torch.Tensor  # [E] int32 group ends: positions < offs[e] hold experts <= e
    prob: torch.Tensor  # [R] each sorted pair's router probability (the weights' dtype)


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
    return Aligned(order, order // k, offs, weight.flatten()[order])


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
    if pairs == 0:
        offs.zero_()
        return Aligned(order, token, offs, prob)
    p_pad = next(w for w in _WIDTHS if pairs <= w)
    nv = n_valid if n_valid is not None else offs  # unread without HAS_NVALID
    _align_kernel[(1,)](
        chosen, weight, nv, order, token, prob, offs, pairs, first, experts,
        K=k, HAS_NVALID=n_valid is not None, P_PAD=p_pad, E_BINS=pow2(experts + 2, 16),
        num_warps=4 if p_pad <= 1024 else (8 if p_pad <= 4096 else 16),
    )
    return Aligned(order, token, offs, prob)


def warm(topk: int, experts: int, device: torch.device, weight_dtype: torch.dtype) -> None:
    """Compile the kernel's variants for a layer (every width, with and without padding rows)
    now, at model build: a first compile while serving stalls the host for a second."""
    if triton is None or device.type != "cuda":
        return
    for width in _WIDTHS:
        rows = max(1, width // topk)
        chosen = torch.zeros((rows, topk), dtype=torch.int64, device=device)
        weight = torch.zeros((rows, topk), dtype=weight_dtype, device=device)
        for n_valid in (None, torch.tensor(rows, device=device)):
            triton_align(chosen, weight, 0, experts, n_valid)


def use_triton(backend: str, pairs: int) -> bool:
    """Whether ``align`` takes the kernel for a layer whose expert GEMMs run on ``backend``
    ("torch" or "triton", resolved) with ``pairs`` pairs (a host shape)."""
    return backend == "triton" and triton is not None and pairs <= TRITON_MAX_PAIRS


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
    def _align_kernel(Chosen, Weight, NValid, Order, Token, Prob, Offs, pairs, first, E,
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
        # group ends: keys <= e, counted by a histogram (E_BINS > E + 1: every key in range)
        ends = tl.cumsum(tl.histogram(key, E_BINS), 0)
        e = tl.arange(0, E_BINS)
        tl.store(Offs + e, ends, mask=e < E)
