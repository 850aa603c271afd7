"""A P step's host index arrays (worker/runner.py: ``prefill_index``) and their one packed
host->device transfer (runtime/device.py: ``h2d_packed``), against the per-token definition."""

import dataclasses
import random

import numpy as np
import pytest
import torch

from colo_rollout.runtime.device import PinnedStage, h2d_packed
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


@pytest.mark.parametrize("n_items", [1, 3])
def test_items_ids_arrays_give_the_same_index_arrays(n_items):
    """PrefillItem.ids (the scheduler's int64 array of a fresh prompt) stands for the tokens:
    the same arrays as from the Python ints, one item's ids taken as they are (no copy)."""
    rng = random.Random(7 + n_items)
    plain = _items(rng, n_items, 16)
    with_ids = [dataclasses.replace(it, ids=np.array(it.tokens, dtype=np.int64)) if i % 2 == 0
                else it for i, it in enumerate(plain)]
    got, want = prefill_index(with_ids, 16, SINK), prefill_index(plain, 16, SINK)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))
    if n_items == 1:
        assert got[0] is with_ids[0].ids


def test_prefill_index_of_no_items_is_empty_with_one_table_column():
    ids, pos, slots, tables = prefill_index([], 16, SINK)
    assert ids.shape == pos.shape == slots.shape == (0,) and tables.shape == (0, 1)


def test_prefill_index_names_a_table_too_short_for_its_tokens():
    item = PrefillItem(lifetime=0, tokens=(1,) * 20, start=0, table=(3,))
    with pytest.raises(IndexError):
        prefill_index([item], 16, SINK)
    # checked against the item's own table, not the step's widest (its padding is the sink)
    wide = PrefillItem(lifetime=1, tokens=(1,) * 40, start=0, table=(1, 2, 3))
    with pytest.raises(IndexError, match=r"position 19 is past its block table \(1 blocks "
                                         r"of 16\)"):
        prefill_index([wide, item], 16, SINK)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (pinned memory)")
def test_a_pinned_stage_is_reused_only_once_its_copy_is_done():
    """``PinnedStage``: the packed copy's pinned buffer is written again only after the copy
    that read it completed; while it is queued (behind a long kernel) a new buffer is taken,
    and neither copy sees the other's values."""
    dev = torch.device("cuda")
    stage = PinnedStage()
    first = h2d_packed([np.arange(4096)], dev, stage)[0]
    torch.cuda.synchronize()
    buf = stage.take(1).data_ptr()
    second = h2d_packed([np.arange(4096) + 1], dev, stage)[0]  # first's copy done: reused
    torch.cuda.synchronize()
    assert stage.take(1).data_ptr() == buf
    torch.cuda._sleep(200_000_000)  # the next copy queues behind ~0.1 s of GPU work
    third = h2d_packed([np.arange(4096) + 2], dev, stage)[0]
    # third's copy still queued: written into its buffer, third would read fourth's values
    fourth = h2d_packed([np.arange(4096) + 3], dev, stage)[0]
    # a buffer taken while the last copy is queued has the same size: no growth step by step
    cap = stage.capacity
    torch.cuda._sleep(200_000_000)
    for _ in range(5):
        h2d_packed([np.arange(4096)], dev, stage)
    assert stage.capacity == cap
    torch.cuda.synchronize()
    for i, t in enumerate((first, second, third, fourth)):
        assert t.tolist() == list(range(i, 4096 + i))


def test_the_step_inputs_carry_the_attention_plan_in_their_one_copy():
    """``ModelRunner._prefill_inputs`` with a kernel backend: the model's plan (its host
    half) rides the step's packed copy, and the metadata holds the plan ``plan_prefill``
    makes on its own -- the dense calls with it (a fresh 1100-token sequence goes dense)."""
    from types import SimpleNamespace

    from colo_rollout.model import paged_prefill as pp
    from colo_rollout.model.dense_prefill import dense_sequences
    from colo_rollout.sched.plan import Phase, ReplicaWork, StepPlan
    from colo_rollout.worker.runner import ModelRunner

    bs, cfg = 16, pp.TileConfig(16, 16, 4, 2, False)
    rng = random.Random(5)
    items = (PrefillItem(lifetime=0, tokens=tuple(rng.randrange(100) for _ in range(1100)),
                         start=0, table=tuple(range(69)), params=None),
             PrefillItem(lifetime=1, tokens=(1, 2, 3), start=20, table=(70, 71), params=None))
    new, ctx = [1100, 3], [1100, 23]

    def plan(n, c):
        return pp.plan_prefill_host(n, c, 2, 64, torch.float32, "cpu", cfg,
                                    dense=dense_sequences(n, c))

    runner = SimpleNamespace(
        groups=SimpleNamespace(replica=0), block_size=bs, kv=SimpleNamespace(sink_block=SINK),
        device=torch.device("cpu"), prefill_merge_pairs=0, _p_stage=PinnedStage(),
        model=SimpleNamespace(prefill_plan=plan, prefill_attention="cudnn",
                              bucketed_prefill=False, varlen_prefill=False,
                              dense_prefill=lambda n, c: ()))
    step = StepPlan(step=0, phase=Phase.PREFILL, replicas=(ReplicaWork(prefill=items),))
    meta = ModelRunner._prefill_inputs(runner, step).attn
    want = pp.plan_prefill(new, ctx, 2, 64, torch.float32, "cpu", cfg, dense=(0,))
    got = meta.prefill_plan
    for name in ("q_starts", "new_lens", "ctx_lens", "tiles"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.dense == want.dense == ((0, 0, 1100),)
    assert [(c.length, c.seqs) for c in meta.dense_calls] == [(1280, ((0, 0, 1100),))]
    # the torch backend: no plan (its buckets instead)
    runner.model = SimpleNamespace(prefill_plan=lambda n, c: None, prefill_attention="torch",
                                   bucketed_prefill=True, varlen_prefill=False,
                                   dense_prefill=lambda n, c: ())
    meta = ModelRunner._prefill_inputs(runner, step).attn
    assert meta.prefill_plan is None and meta.dense_calls == [] and meta.buckets
    # MLA with a dense backend: no kernel plan; its own dense sequences in calls, the rest
    # (only those) in buckets
    runner.model = SimpleNamespace(prefill_plan=lambda n, c: None, prefill_attention="cudnn",
                                   bucketed_prefill=True, varlen_prefill=False,
                                   dense_prefill=lambda n, c: ((0, 0, 1100),))
    meta = ModelRunner._prefill_inputs(runner, step).attn
    assert [(c.length, c.seqs) for c in meta.dense_calls] == [(1280, ((0, 0, 1100),))]
    assert [b.seqs.tolist() for b in meta.buckets] == [[1]] and meta.varlen is None
    # ... and flash: the rest in one variable-length call (sequence 1: rows 1100-1102, its
    # 23 keys through its table: blocks 70, 71)
    runner.model = SimpleNamespace(prefill_plan=lambda n, c: None, prefill_attention="flash",
                                   bucketed_prefill=False, varlen_prefill=True,
                                   dense_prefill=lambda n, c: ((0, 0, 1100),))
    meta = ModelRunner._prefill_inputs(runner, step).attn
    assert meta.buckets == [] and len(meta.dense_calls) == 1
    vc = meta.varlen
    assert vc.q_rows.tolist() == [1100, 1101, 1102]
    assert vc.cu_q.tolist() == [0, 3] and vc.cu_k.tolist() == [0, 23]
    assert (vc.max_q, vc.max_k) == (3, 23)
    assert vc.kv_slots.tolist() == [70 * bs + p for p in range(16)] + [71 * bs + p
                                                                        for p in range(7)]
