"""Routing replay (issue 18 item 1) on 2 CPU ranks: the engine (EP2/ADP2, a different layout
from the trainer's TP1 x DP2) records every input token's experts in P and D, in Normal and
Fine mode, single- and multi-turn; the trainer replays them exactly; the recorded routing is
the trainer's own (fp32); errors at the door and in the trainer for bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from colo_rollout.config import Config, ConfigError, EngineConfig, ModelConfig, RLConfig
from colo_rollout.engine.routing_store import RoutingStore


# moe_compute grouped: the sync-free expert path (the GPU's) records from its own top-k;
# mtp: MTP drafting (two verify rows per sequence, positions n and n + 1; a rejected draft's
# n + 1 re-recorded by the next iteration, and cut from a trajectory that ended at n + 1)
@pytest.mark.parametrize("mode,moe_compute,mtp", [("normal", "auto", False),
                                                  ("fine", "auto", False),
                                                  ("fine", "grouped", False),
                                                  ("fine", "auto", True)])
def test_recorded_routing_is_replayed_by_the_trainer(worker_groups, mode, moe_compute, mtp):
    r0, r1 = worker_groups(2).run("tests.cases_routing:routing_round_trip", timeout=300,
                                  adp=2, ep=2, mode=mode, moe_compute=moe_compute, mtp=mtp)
    assert r0["shapes_ok"] and r0["leftover"] == 0 and r0["plain_ok"]
    assert r0["routing"] == r1["routing"]  # every rank returns the same trajectories
    assert r0["compared"] > 200  # (position, layer) rows of 11 trajectories
    # the replayed forward routes exactly as recorded; the trainer's own fp32 routing agrees
    # with the engine's (the tiny model has no near-ties at this precision)
    assert r0["replay_disagree"] == 0 and r0["own_disagree"] == 0
    assert r0["replay_vs_free_logp"] < 1e-5
    assert r0["rollout_vs_replay_logp"] < 1e-4  # the rollout's logprobs, recomputed
    # a different routing replayed: the forward follows it, and the logprobs move
    assert r0["shift_disagree"] == 0 and r0["shift_vs_free_logp"] > 1e-3
    assert len(r0["errors"]) == 4
    assert "no recorded routing" in r0["errors"][0]
    assert "does not fit" in r0["errors"][1]
    assert "outside the trainer's 8 experts [0, 8)" in r0["errors"][2], r0["errors"][2]
    assert "routing must be an integer numpy array" in r0["errors"][3], r0["errors"][3]


@pytest.mark.parametrize("mtp", [False, True])
def test_attention_tp_records_an_odd_last_buckets_padded_rows(worker_groups, mtp):
    """EP2/ATP2 with decode buckets [1, 3]: the planner pads a D batch to a multiple of the
    attention TP (3 -> 4 rows), and the routing record holds those rows (found by probing:
    its D buffer was sized by the last bucket, 3, and the first full D step raised)."""
    r0, r1 = worker_groups(2).run("tests.cases_routing:routing_round_trip", timeout=300,
                                  adp=1, ep=2, mode="normal", mtp=mtp,
                                  engine_kw={"decode_buckets": [1, 3], "max_batch_size": 3})
    assert r0["shapes_ok"] and r0["leftover"] == 0 and r0["plain_ok"]
    assert r0["routing"] == r1["routing"]
    assert r0["replay_disagree"] == 0 and r0["own_disagree"] == 0


@pytest.mark.parametrize("world,adp,ep,mode", [(2, 2, 2, "normal"), (2, 2, 2, "fine"),
                                               (4, 2, 4, "normal"), (4, 2, 4, "fine")])
def test_alltoall_records_each_replicas_rows_and_rollout_merges_them(worker_groups, world, adp,
                                                                     ep, mode):
    """With the alltoall backend each rank routes and records only its rows -- its replica's
    at attention TP 1 (EP2/ADP2), its ATP chunk of them under attention TP (EP4/ADP2/ATP2);
    rollout() merges them over the ranks: every rank returns every trajectory's routing,
    which the trainer replays exactly and which equals its own fp32 routing; the same ids as
    the gather backend records for the same rollout."""
    kw = {"moe_dispatch": "alltoall"}
    rs = worker_groups(world).run("tests.cases_routing:routing_round_trip", timeout=300,
                                  adp=adp, ep=ep, mode=mode, model_kw=kw)
    g0 = worker_groups(world).run("tests.cases_routing:routing_round_trip", timeout=300,
                                  adp=adp, ep=ep, mode=mode)[0]
    r0, r1 = rs[0], rs[-1]
    assert all(r["shapes_ok"] and r["leftover"] == 0 for r in rs), [r["leftover"] for r in rs]
    assert all(r["routing"] == r0["routing"] for r in rs)
    # the same experts per (token, layer) as the gather backend (its megatron path lists them
    # in expert order, the grouped router by probability: compared as sets)
    for a, b in zip(r0["routing"], g0["routing"]):
        assert np.array_equal(np.sort(np.array(a), axis=-1), np.sort(np.array(b), axis=-1))
    assert r0["compared"] > 200
    assert r0["replay_disagree"] == 0 and r0["own_disagree"] == 0
    assert r0["rollout_vs_replay_logp"] < 1e-4
    if adp == world:  # a plain request's routing comes with its output on its replica's rank
        assert r0["plain_ok"] != r1["plain_ok"]
    else:  # under attention TP no rank holds it whole: none (rollout() assembles them)
        assert not any(r["plain_ok"] for r in rs)


def test_store_keeps_positions_in_order_and_forgets_on_take():
    st = RoutingStore(moe_layers=2, topk=2, num_experts=8)
    st.add("a", 0, torch.tensor([[[1, 2], [3, 4]]] * 3, dtype=torch.int16))  # positions 0-2
    st.add("a", 3, torch.tensor([[[5, 6], [7, 0]]], dtype=torch.int16))  # a D row
    st.add("a", 10, torch.tensor([[[1, 1], [1, 1]]], dtype=torch.int16))  # a gap: not known
    got = st.take("a")
    assert got.dtype == np.uint8 and got.shape == (4, 2, 2)
    assert got[3].tolist() == [[5, 6], [7, 0]]
    assert st.take("a") is None and len(st) == 0
    assert RoutingStore(1, 8, 512).dtype == np.int16
    st.add("b", 0, torch.zeros((2, 2, 2), dtype=torch.int16))
    st.add("b", 0, torch.ones((3, 2, 2), dtype=torch.int16))  # a re-prefill writes again
    assert st.take("b").tolist() == np.ones((3, 2, 2)).tolist()
    # a rank's chunk: holes kept with their stamps (0: never written), up to the last write
    st.add("c", 2, torch.full((2, 2, 2), 3, dtype=torch.int16), stamp=5)
    st.add("c", 0, torch.full((1, 2, 2), 4, dtype=torch.int16), stamp=7)
    ids, stamps = st.take_partial("c")
    assert stamps.tolist() == [7, 0, 5, 5] and ids[:, 0, 0].tolist() == [4, 0, 3, 3]
    assert st.take_partial("c") is None
    st.add("d", 1, torch.ones((4, 2, 2), dtype=torch.int16), stamp=2)
    assert st.take_partial("d", inputs=3)[1].tolist() == [0, 2, 2]
    with pytest.raises(ValueError, match="stamp"):
        st.add("e", 0, torch.ones((1, 2, 2), dtype=torch.int16), stamp=0)


def test_door_refuses_replay_without_record_and_takes_record_with_alltoall():
    with pytest.raises(ConfigError, match="rl.routing_replay"):
        Config(rl=RLConfig(routing_replay=True))
    from colo_rollout.config import ParallelConfig

    # a dispatch backend under attention TP (each rank routes a chunk of its replica's
    # rows: take_routings assembles them)
    assert Config(parallel=ParallelConfig(world_size=2, adp=1, ep=2),
                  model=ModelConfig(moe_dispatch="alltoall"),
                  engine=EngineConfig(record_routing=True)).engine.record_routing
    assert Config(parallel=ParallelConfig(world_size=2, adp=2, ep=2),
                  model=ModelConfig(moe_dispatch="alltoall"),
                  engine=EngineConfig(record_routing=True)).engine.record_routing
    ok = Config(engine=EngineConfig(record_routing=True), rl=RLConfig(routing_replay=True))
    assert dataclasses.asdict(ok)["rl"]["routing_replay"]


def test_recompute_needs_gpus_at_the_door():
    from colo_rollout.config import ParallelConfig

    with pytest.raises(ConfigError, match="rl.recompute"):
        Config(rl=RLConfig(recompute="full"))  # gloo
    with pytest.raises(ConfigError, match="rl.recompute"):
        RLConfig(recompute="selective")
    assert Config(parallel=ParallelConfig(backend="nccl"), rl=RLConfig(recompute="full"))


def test_a_sessions_routing_with_mtp_is_one_row_per_input(worker_groups):
    r = worker_groups(1).run("tests.cases_routing:session_routing_with_mtp", timeout=300)[0]
    for key in ("open", "closed"):
        for mtp in (False, True):
            rows, inputs = r[f"{key}_{mtp}"]
            assert rows == inputs, (key, mtp, rows, inputs)
        # greedy tokens are the same with MTP, so the routing of the same inputs is too
        assert r[f"{key}_True_ids"] == r[f"{key}_False_ids"], key


def test_the_routing_store_stays_bounded_and_a_reused_session_starts_afresh(worker_groups):
    r = worker_groups(1).run("tests.cases_routing:routing_store_stays_bounded", timeout=300)[0]
    assert r["after_closed"] <= 1, r
    assert r["kept_rows"] == 6, r  # 3 prompt + 4 new tokens: 6 inputs
    assert r["reused_rows"] == 6, r  # the new conversation's, not the old one's 59
    assert r["after_interrupts"] <= 6 and r["at_rest"] == 0, r
