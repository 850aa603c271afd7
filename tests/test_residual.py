"""The residual add of an fp32 partial (model/residual.py): the Triton kernel bitwise equal to
``res + partial.to(res.dtype)``, and the k-slot sum fused into it (``add_rounded_slots``)
bitwise equal to its torch path -- the slots summed in fp32 one after the other, rounded,
added -- run by Triton's CPU interpreter in a subprocess (tests/interpreted.py; skipped when
triton does not import), and the torch expressions where the kernels do not apply."""

from __future__ import annotations


import pytest
import torch

from colo_rollout.model.residual import SortedSlots, add_rounded, add_rounded_slots, slot_sum
from tests.interpreted import HAS_TRITON, interpreted_main

CASES = [((1, 37), torch.bfloat16), ((3, 2048), torch.bfloat16), ((5, 1100), torch.float16)]
# (rows n, slots k, hidden H, dtype): decode's one row, k = 1 and Qwen3's k = 8, odd H
SLOT_CASES = [(1, 1, 37, torch.bfloat16), (1, 8, 2048, torch.bfloat16),
              (3, 8, 7, torch.bfloat16), (2, 3, 1, torch.bfloat16),
              (4, 2, 1100, torch.float16), (1, 8, 1031, torch.float16)]


def _case(i):
    shape, dtype = CASES[i]
    g = torch.Generator().manual_seed(i)
    res = (torch.randn(shape, generator=g) * 4).to(dtype)
    # magnitudes from 1e-3 to 1e3: roundings at every exponent, ties included
    partial = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])
    partial[..., :4] = torch.tensor([0.5, -0.0, 1 + 2 ** -8, 1 + 3 * 2 ** -9])  # ties, zero
    return res, partial


def test_torch_expression_where_the_kernel_does_not_apply():
    res, partial = _case(1)
    want = res + partial.to(res.dtype)
    assert torch.equal(add_rounded(res, partial), want)  # backend torch
    assert torch.equal(add_rounded(res, partial.to(res.dtype), "triton"), want)  # equal dtypes
    assert torch.equal(add_rounded(res.float(), partial, "triton"), res.float() + partial)


def _slot_case(i):
    n, k, H, dtype = SLOT_CASES[i]
    g = torch.Generator().manual_seed(100 + i)
    res = (torch.randn(n, H, generator=g) * 4).to(dtype)
    # each slot at its own scale (1e-3 .. 1e3 across slots and columns): fp32 sums whose
    # value depends on the order of the adds, and roundings at every exponent
    scale = torch.logspace(-3, 3, k * H).view(k, H)[torch.randperm(k, generator=g)]
    pairs = (torch.randn(n, k, H, generator=g) * scale).to(dtype)
    pairs[0, :, 0] = 0.0  # a zero sum
    return res, pairs


def test_slot_sum_is_sequential_from_slot_zero_and_leaves_the_pairs():
    res, pairs = _slot_case(2)
    want = pairs[:, 0].float()
    for j in range(1, pairs.shape[1]):
        want = want + pairs[:, j].float()
    assert torch.equal(slot_sum(pairs), want)
    p32 = pairs.float()
    before = p32.clone()
    slot_sum(p32)  # fp32 pairs: the first slot is copied, not accumulated into
    assert torch.equal(p32, before)
    # the cases can tell the orders apart: a pairwise sum differs somewhere (so the bitwise
    # kernel test below would catch a kernel that sums in another order)
    _, pairs8 = _slot_case(1)
    v = pairs8.float()
    tree = ((v[:, 0] + v[:, 1]) + (v[:, 2] + v[:, 3])) + ((v[:, 4] + v[:, 5]) + (v[:, 6] + v[:, 7]))
    assert not torch.equal(slot_sum(pairs8), tree)


def test_slots_torch_path_is_the_unfused_add():
    for i in range(len(SLOT_CASES)):
        res, pairs = _slot_case(i)
        want = add_rounded(res, slot_sum(pairs))  # the sum, then the rounded add
        assert torch.equal(add_rounded_slots(res, pairs), want)
        # the kernel does not apply: fp32 model, non-contiguous pairs -> the same expression
        assert torch.equal(add_rounded_slots(res.float(), pairs.float(), "triton"),
                           res.float() + slot_sum(pairs.float()))
        strided = pairs.transpose(0, 1).contiguous().transpose(0, 1)
        if not strided.is_contiguous():
            assert torch.equal(add_rounded_slots(res, strided, "triton"), want)
    # k <= 4 with H a multiple of the vector width: torch.sum over the slots (the unfused
    # gather MoE's combine) is sequential on CPU too, so it is the same (measured; not for
    # k >= 5 with odd H, hence slot_sum)
    res, pairs = _slot_case(4)
    assert torch.equal(add_rounded_slots(res, pairs),
                       res + pairs.sum(dim=1, dtype=torch.float32).to(res.dtype))
    with pytest.raises(ValueError, match="do not match"):
        add_rounded_slots(res, pairs[:, :, :-1])


def sorted_slots(pairs: torch.Tensor, seed: int, dtype=torch.int32) -> SortedSlots:
    """``pairs`` [n, k, H] as fc2 leaves them sorted: the n * k rows in a shuffled order among
    rows no slot names (NaN: a read of one shows), each pair's row in ``where``."""
    n, k, H = pairs.shape
    g = torch.Generator().manual_seed(seed)
    rows = torch.full((n * k + 3, H), float("nan"), dtype=pairs.dtype)
    place = torch.randperm(n * k + 3, generator=g)[: n * k]
    rows[place] = pairs.reshape(-1, H)
    return SortedSlots(rows, place.view(n, k).to(dtype))


def test_sorted_slots_sum_as_the_slots_in_place():
    for i in range(len(SLOT_CASES)):
        res, pairs = _slot_case(i)
        for dtype in (torch.int32, torch.int64):
            s = sorted_slots(pairs, i, dtype)
            assert s.shape == pairs.shape and torch.equal(s.in_place(), pairs)
            assert torch.equal(slot_sum(s), slot_sum(pairs))
            assert torch.equal(add_rounded_slots(res, s), add_rounded_slots(res, pairs))
    res, pairs = _slot_case(1)
    s = sorted_slots(pairs, 0)
    for bad in (SortedSlots(s.rows[:, :-1], s.where), SortedSlots(s.rows, s.where[:-1]),
                SortedSlots(s.rows, s.where.float())):
        with pytest.raises(ValueError, match="do not match res"):
            add_rounded_slots(res, bad)


def _interpreted() -> list[str]:
    fails = []
    for i in range(len(CASES)):
        res, partial = _case(i)
        got = add_rounded(res, partial, "triton")
        want = res + partial.to(res.dtype)
        if got.dtype != res.dtype or not torch.equal(got, want):
            fails.append(f"case {i}: {int((got != want).sum())} elements differ")
    for i in range(len(SLOT_CASES)):
        res, pairs = _slot_case(i)
        before = pairs.clone()
        got = add_rounded_slots(res, pairs, "triton")
        want = add_rounded_slots(res, pairs, "torch")
        unfused = add_rounded(res, slot_sum(pairs), "triton")  # the two launches it replaces
        if got.dtype != res.dtype or not torch.equal(got, want) or not torch.equal(got, unfused):
            fails.append(f"slot case {i}: {int((got != want).sum())} elements differ from the "
                         f"torch path, {int((got != unfused).sum())} from the unfused kernels")
        if not torch.equal(pairs, before):
            fails.append(f"slot case {i}: the pairs were written")
        for dtype in (torch.int32, torch.int64):  # the rows where fc2 left them, by index
            s = sorted_slots(pairs, i, dtype)
            got_s = add_rounded_slots(res, s, "triton")
            if not torch.equal(got_s, want):
                fails.append(f"slot case {i}, sorted ({dtype}): "
                             f"{int((got_s != want).sum())} elements differ")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_is_bitwise_the_torch_expression_interpreted(interpreted):
    interpreted.check(__file__)


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)
