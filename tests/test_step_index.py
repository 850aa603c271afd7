"""A P step's positions and KV slots made on the device (model/step_index.py) from one row per
sequence and the block tables: the kernel (Triton's CPU interpreter, in a subprocess) against
the host's numpy arrays (worker/runner.py: ``prefill_index``) and the torch reference, on the
views the step's packed copy gives it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from colo_rollout.model import step_index as si
from colo_rollout.runtime.device import h2d_packed
from colo_rollout.sched.plan import PrefillItem
from colo_rollout.worker.runner import prefill_index, prefill_meta
from tests.interpreted import HAS_TRITON, interpreted_main

SINK = 999


def _items(rng: random.Random, n_items: int, bs: int) -> list[PrefillItem]:
    items, block = [], 0
    for i in range(n_items):
        start = rng.choice([0, 0, rng.randrange(1, 3000)])
        new = rng.choice([1, rng.randrange(1, 60), rng.randrange(1000, 2500)])
        nblocks = -(-(start + new) // bs) + rng.randrange(0, 2)  # some tables longer
        table = tuple(rng.sample(range(block, block + 4 * nblocks), nblocks))
        block += 4 * nblocks
        items.append(PrefillItem(lifetime=i, tokens=tuple(rng.randrange(32000) for _ in range(new)),
                                 start=start, table=table))
    return items


@pytest.mark.parametrize("n_items, bs", [(1, 16), (3, 1), (8, 64), (5, 48)])
def test_the_torch_reference_is_the_host_arrays(n_items, bs):
    rng = random.Random(n_items * 7 + bs)
    items = _items(rng, n_items, bs)
    ids, pos, slots, tables = prefill_index(items, bs, SINK)
    ids2, meta, tables2 = prefill_meta(items, bs, SINK)
    assert np.array_equal(ids, ids2) and np.array_equal(tables, tables2)
    assert meta.shape == (n_items, 3) and meta.dtype == np.int64
    p, s = si.positions_and_slots_torch(torch.from_numpy(meta), torch.from_numpy(tables),
                                        len(ids), bs)
    assert p.tolist() == pos.tolist() and s.tolist() == slots.tolist()


def test_prefill_meta_names_an_item_past_its_own_table():
    """Checked per item, against its own table (not the step's widest)."""
    ok = PrefillItem(lifetime=0, tokens=(1,) * 40, start=0, table=(1, 2, 3))
    short = PrefillItem(lifetime=1, tokens=(1,) * 20, start=0, table=(3,))
    with pytest.raises(IndexError, match=r"position 19 is past its block table \(1 blocks of "
                                         r"16\)"):
        prefill_meta([ok, short], 16, SINK)
    ids, meta, tables = prefill_meta([], 16, SINK)
    assert ids.shape == (0,) and meta.shape == (0, 3) and tables.shape == (0, 1)


def _interpreted() -> list[str]:
    fails = []
    for seed, n_items, bs in ((0, 1, 16), (1, 4, 64), (2, 9, 1), (3, 3, 48)):
        rng = random.Random(seed)
        items = _items(rng, n_items, bs)
        ids, pos, slots, _ = prefill_index(items, bs, SINK)
        ids2, meta, tables = prefill_meta(items, bs, SINK)
        # as the runner passes them: views at any 8-byte offset of one packed tensor
        ids_d, meta_d, tables_d = h2d_packed([ids2, meta, tables], torch.device("cpu"))
        longest = int(meta[:, 1].max())
        p, s = si.positions_and_slots(meta_d, tables_d, len(ids), bs, longest)
        if p.tolist() != pos.tolist() or s.tolist() != slots.tolist():
            fails.append(f"seed {seed}: the kernel's positions or slots differ from the host's")
    p, s = si.positions_and_slots(torch.zeros((0, 3), dtype=torch.int64),
                                  torch.zeros((0, 1), dtype=torch.int64), 0, 16, 0)
    if p.shape != (0,) or s.shape != (0,):
        fails.append("no items: not two empty arrays")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_step_index_kernel_matches_the_host_interpreted(interpreted):
    interpreted.check(__file__)


if __name__ == "__main__":  # the interpreted run (the kernel test above starts it)
    interpreted_main(_interpreted)
