"""A P step's host index arrays (worker/runner.py: ``prefill_index``) and their one packed
host->device transfer (runtime/device.py: ``h2d_packed``), against the per-token definition."""

import random

import numpy as np
import pytest
import torch

from colo_rollout.runtime.device import h2d_packed
from colo_rollout.sched.plan import PrefillItem
from colo_rollout.worker.runner import prefill_index

SINK = 999


def _reference(items, bs):
    """Per token, as the engine defines them: ids, positions start.., the slot of each
    position in the item's table, the tables padded with the sink block."""
    ids, pos, slots = [], [], []
    for it in items:
        for j, t in enumerate(it.tokens):
            p = it.start + j
            ids.append(t)
            pos.append(p)
            slots.append(it.table[p // bs] * bs + p % bs)
    width = max((len(it.table) for it in items), default=1)
    tables = [list(it.table) + [SINK] * (width - len(it.table)) for it in items]
    return ids, pos, slots, tables


def _items(rng, n_items, bs):
    items, block = [], 0
    for i in range(n_items):
        start = rng.choice([0, 0, rng.randrange(1, 70)])
        new = rng.randrange(1, 60)
        nblocks = -(-(start + new) // bs) + rng.randrange(0, 2)  # some tables longer
        table = tuple(rng.sample(range(block, block + 4 * nblocks), nblocks))
        block += 4 * nblocks
        items.append(PrefillItem(lifetime=i, tokens=tuple(rng.randrange(32000) for _ in range(new)),
                                 start=start, table=table))
    return items


@pytest.mark.parametrize("n_items", [1, 2, 7])
@pytest.mark.parametrize("bs", [1, 16])
def test_prefill_index_is_the_per_token_definition(n_items, bs):
    rng = random.Random(n_items * 31 + bs)
    items = _items(rng, n_items, bs)
    ids, pos, slots, tables = prefill_index(items, bs, SINK)
    want = _reference(items, bs)
    assert [a.dtype for a in (ids, pos, slots, tables)] == [np.int64] * 4
    assert ids.tolist() == want[0] and pos.tolist() == want[1]
    assert slots.tolist() == want[2] and tables.tolist() == want[3]


def test_prefill_index_of_no_items_is_empty_with_one_table_column():
    ids, pos, slots, tables = prefill_index([], 16, SINK)
    assert ids.shape == pos.shape == slots.shape == (0,) and tables.shape == (0, 1)


def test_prefill_index_names_a_table_too_short_for_its_tokens():
    item = PrefillItem(lifetime=0, tokens=(1,) * 20, start=0, table=(3,))
    with pytest.raises(IndexError):
        prefill_index([item], 16, SINK)


def test_h2d_packed_gives_each_array_back_in_its_shape_from_one_tensor():
    arrays = [np.arange(5), np.zeros((0,), np.int64), np.arange(6).reshape(2, 3), [7, 8]]
    out = h2d_packed(arrays, torch.device("cpu"))
    assert [tuple(t.shape) for t in out] == [(5,), (0,), (2, 3), (2,)]
    assert [t.tolist() for t in out] == [list(range(5)), [], [[0, 1, 2], [3, 4, 5]], [7, 8]]
    assert all(t.dtype == torch.int64 for t in out)
    # one storage: the packed transfer, not one copy per array
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1
    # a copy, not a view of the caller's numpy memory
    arrays[0][0] = 42
    assert out[0][0].item() == 0
