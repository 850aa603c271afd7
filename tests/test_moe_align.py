"""The pairs' sorted layout (model/moe_align.py): the torch path against a plain-Python stable
sort by (local expert, pair index), and the one-launch Triton kernel bitwise against the torch
path, run by Triton's CPU interpreter in a subprocess (tests/interpreted.py; skipped when
triton does not import): other ranks' experts, padding rows, more pairs than one program
ranks and more experts than one program counts; past one program's 1024 pairs, the counting
sort over blocks (its scan walking more than one chunk of blocks, its keys split over
programs or all in one)."""

from __future__ import annotations


import pytest
import torch

from colo_rollout.model import moe_align as ma
from tests.interpreted import HAS_TRITON, interpreted_main

# (N tokens, top-k, E_local, E_global, first expert, valid rows (None: all), weight dtype)
CASES = [
    (1, 1, 1, 1, 0, None, torch.float32),
    (1, 8, 64, 64, 0, None, torch.float32),
    (7, 2, 4, 8, 4, None, torch.float32),
    (40, 4, 8, 8, 0, 33, torch.float32),  # 160 pairs: three programs rank them
    (23, 8, 40, 128, 40, None, torch.bfloat16),  # 40 experts: three programs count ends
    (17, 3, 16, 64, 48, 0, torch.float32),  # every row padding
    (31, 2, 4, 64, 60, None, torch.float32),  # mostly other ranks' pairs
    (12, 1, 5, 5, 0, 12, torch.float32),  # one slot per row (the dispatch's local experts)
    (128, 8, 64, 64, 0, 120, torch.bfloat16),  # 1024 pairs (the widest), padding rows
    # past one program: the counting sort over blocks of BLOCK_PAIRS pairs (its scan walks
    # the blocks one at a time in the interpreted run: more than one chunk)
    (129, 8, 128, 128, 0, None, torch.float32),  # 1032 pairs: a last block of 8; 256 bins,
    # split by key over the scan's programs (SCAN_KEYS each)
    (260, 4, 8, 16, 8, 250, torch.bfloat16),  # 1040 pairs, other ranks' experts, padding;
    # 16 bins: one scan program
]


def _case(i):
    N, k, E, Eg, first, valid, wdt = CASES[i]
    gen = torch.Generator().manual_seed(i)
    logits = torch.randn(N, Eg, generator=gen)
    chosen = logits.topk(k, dim=1).indices
    weight = torch.softmax(logits, -1).gather(1, chosen).to(wdt)
    n_valid = None if valid is None else torch.tensor(valid)
    return chosen, weight, first, E, n_valid


def _reference(chosen, weight, first, E, n_valid):
    """Plain Python: keys, a stable sort by (key, pair), the group ends by counting."""
    N, k = chosen.shape
    keys = []
    for t in range(N):
        for s in range(k):
            e = int(chosen[t, s]) - first
            pad = n_valid is not None and t >= int(n_valid)
            keys.append(e if 0 <= e < E and not pad else E)
    order = sorted(range(N * k), key=lambda p: (keys[p], p))
    offs = [sum(1 for key in keys if key <= e) for e in range(E)]
    return order, [p // k for p in order], offs, [weight.flatten()[p] for p in order]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_torch_align_is_a_stable_sort_by_expert(i):
    chosen, weight, first, E, n_valid = _case(i)
    got = ma.torch_align(chosen, weight, first, E, n_valid)
    order, token, offs, prob = _reference(chosen, weight, first, E, n_valid)
    assert got.order.tolist() == order and got.token.tolist() == token
    assert got.offs.tolist() == offs and got.offs.dtype == torch.int32
    assert torch.equal(got.prob, torch.stack(prob)) and got.prob.dtype == weight.dtype
    assert got.where.tolist() == sorted(range(len(order)), key=order.__getitem__)


def test_use_triton_by_backend_and_size():
    assert not ma.use_triton("torch", 8)
    if HAS_TRITON:
        assert ma.use_triton("triton", 8) and ma.use_triton("triton", ma.TRITON_MAX_PAIRS)
        assert ma.use_triton("triton", 64 * ma.TRITON_MAX_PAIRS)  # the counting sort
    chosen, weight, first, E, n_valid = _case(2)  # torch backend: the reference, any size
    got = ma.align(chosen, weight, first, E, n_valid, backend="torch")
    assert got.order.dtype == torch.int64


def _interpreted() -> list[str]:
    ma._SCAN_ROWS = 1  # the counting sort's scan a block at a time (2 blocks: 2 chunks)
    fails = []
    for i in range(len(CASES)):
        chosen, weight, first, E, n_valid = _case(i)
        ref = ma.torch_align(chosen, weight, first, E, n_valid)
        got = ma.triton_align(chosen, weight, first, E, n_valid)
        for name in ("order", "token", "offs", "where"):
            if getattr(got, name).tolist() != getattr(ref, name).tolist():
                fails.append(f"case {i}: {name} {getattr(got, name).tolist()[:12]} != "
                             f"{getattr(ref, name).tolist()[:12]}")
        if not torch.equal(got.prob, ref.prob):
            fails.append(f"case {i}: prob differs")
        if chosen.numel() > 256:
            continue  # (align is triton_align there too: the interpreter's seconds saved)
        via = ma.align(chosen, weight, first, E, n_valid, backend="triton")
        if not torch.equal(via.order.long(), ref.order):
            fails.append(f"case {i}: align(backend='triton') differs")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_align_matches_torch_path_interpreted(interpreted):
    interpreted.check(__file__)


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)
