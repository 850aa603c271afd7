"""Parallel layouts: pure arithmetic, rejections, and live group membership on 1, 2, 4 ranks."""

from __future__ import annotations

import pytest

from colo_rollout.config import ConfigError, ParallelConfig
from colo_rollout.runtime.parallel import Layout, LayoutError

CASE = "tests.cases_parallel:layout_membership"

# Expected memberships written out by hand from DESIGN.md's definitions (rank = replica*ATP + a).
EXPECTED = {
    # (world, adp, ep): per-rank {group: members}
    (1, 1, 1): {"atp": [[0]], "adp": [[0]], "ep": [[0]], "etp": [[0]]},
    (2, 2, 2): {"atp": [[0], [1]], "adp": [[0, 1], [0, 1]], "ep": [[0, 1], [0, 1]],
                "etp": [[0], [1]]},  # EP2/ADP2
    (2, 1, 1): {"atp": [[0, 1], [0, 1]], "adp": [[0], [1]], "ep": [[0], [1]],
                "etp": [[0, 1], [0, 1]]},  # ATP2, experts TP-sharded (ETP2)
    (2, 1, 2): {"atp": [[0, 1], [0, 1]], "adp": [[0], [1]], "ep": [[0, 1], [0, 1]],
                "etp": [[0], [1]]},  # EP2/ATP2
    (4, 2, 4): {"atp": [[0, 1], [0, 1], [2, 3], [2, 3]],
                "adp": [[0, 2], [1, 3], [0, 2], [1, 3]],
                "ep": [[0, 1, 2, 3]] * 4, "etp": [[0], [1], [2], [3]]},  # EP4/ADP2/ATP2
    (4, 2, 2): {"atp": [[0, 1], [0, 1], [2, 3], [2, 3]],
                "adp": [[0, 2], [1, 3], [0, 2], [1, 3]],
                "ep": [[0, 2], [1, 3], [0, 2], [1, 3]],
                "etp": [[0, 1], [0, 1], [2, 3], [2, 3]]},  # EP2/ADP2/ATP2, ETP2
}


@pytest.mark.parametrize("world,adp,ep", list(EXPECTED))
def test_group_membership(worker_groups, world, adp, ep):
    results = worker_groups(world).run(CASE, adp=adp, ep=ep)
    want = EXPECTED[(world, adp, ep)]
    atp = world // adp
    for rank, got in enumerate(results):
        for name, per_rank in want.items():
            assert got[name] == per_rank[rank], (rank, name)
        assert got["full_p"] == got["full_d"] == got["control"] == list(range(world))
        assert got["distinct_p_d"]
        assert got["replica"] == rank // atp and got["atp_rank"] == rank % atp
        assert got["mcore_tp"] == got["atp"] and got["mcore_ep"] == got["ep"]
        assert got["mcore_tp_size"] == atp


def test_layout_names_and_crossing():
    assert Layout(8, 2, 8).name == "EP8/ADP2/ATP4" and Layout(8, 2, 8).atp == 4
    assert Layout(8, 8, 8).name == "EP8/ADP8" and not Layout(8, 8, 8).crossed
    assert Layout(4, 2, 4).crossed and not Layout(2, 2, 2).crossed and not Layout(2, 1, 2).crossed
    assert Layout(4, 2, 2).etp == 2


@pytest.mark.parametrize("world,adp,ep,needle", [
    (6, 4, 1, "not divisible by ADP 4"),
    (4, 1, 3, "not divisible by EP 3"),
    (4, 0, 1, "adp must be >= 1"),
])
def test_impossible_layouts_rejected(world, adp, ep, needle):
    with pytest.raises(LayoutError, match=needle):
        Layout(world, adp, ep)


def test_config_rejects_layout_with_key():
    with pytest.raises(ConfigError, match="parallel.adp"):
        ParallelConfig(world_size=6, adp=4, ep=1)


def test_process_count_must_match_config():
    with pytest.raises(LayoutError, match="world_size is 4 but 2 processes"):
        Layout.from_config(ParallelConfig(world_size=4, adp=2, ep=2), world_size=2)


@pytest.mark.parametrize("group", ["default", "atp", "ep"])
def test_every_group_takes_the_configs_timeout(worker_groups, group):
    """Spawned ranks start with torch's default group (gloo: 30 minutes); init_parallel bounds
    it by parallel.timeout_s -- weight sync and export run collectives on it -- and megatron's
    groups the model's collectives run on too (found by probing: megatron's timeout in whole
    minutes, at least one, let an attention-TP peer stall for 60 s)."""
    r0 = worker_groups(2).run("tests.cases_parallel:default_group_is_bounded", timeout=60,
                              group=group)[0]
    assert r0["error"] is not None and r0["seconds"] < 3.5, r0  # (megatron's: 60 s)


@pytest.mark.parametrize("key, theirs, mine", [("adp", "1", "2"), ("ep", "1", "2"),
                                              ("timeout_s", "30.0", "20.0")])
def test_ranks_given_different_layouts_are_told_the_key(worker_groups, key, theirs, mine):
    for r in worker_groups(2).run("tests.cases_parallel:layouts_that_differ", timeout=120,
                                  key=key):
        assert r["error"] == (f"rank 1's parallel.{key} is {theirs} where rank 0's is {mine} "
                              "(every rank sets up one layout: give the ranks one parallel "
                              f"section)", f"parallel.{key}"), r
        assert r["seconds"] < 5 and r["again"] == [0, 1], r


@pytest.mark.parametrize("key, value, default", [("rl.lr", 0.5, 0.01),
                                                 ("bench.reps", 2, 3),
                                                 ("workload.num_requests", 3, 32)])
def test_a_commands_own_section_is_the_same_on_every_rank(worker_groups, key, value, default):
    for r in worker_groups(2).run("tests.cases_parallel:command_sections_that_differ",
                                  timeout=120, key=key, value=value):
        assert r[3] is None, r  # the engine's sections alone: equal
        text, named = r[4]
        assert named == key and text.startswith(
            f"rank 1's config differs from rank 0's at {key}: {value} vs {default}"), r
        assert text.endswith(f"(every rank runs from one config: model, engine, parallel, "
                             f"{key.split('.')[0]})"), r


def test_a_weight_sync_waits_for_its_peers_as_long_as_the_layout_says():
    from colo_rollout.runtime.spawn import WorkerGroup

    with WorkerGroup(2) as group:  # (its own: a half-built group is left behind)
        r0, r1 = group.run("tests.cases_parallel:sync_built_on_one_rank", timeout=120)
    assert r0["timeout"] == r1["timeout"] == 3.0, (r0, r1)
    assert r0["seconds"] < 15, r0
    assert "not every rank took part within 3 s" in r0["error"], r0


def test_a_process_no_launcher_started_runs_one_rank_and_refuses_more(monkeypatch):
    """`python script.py` without torchrun (RANK unset): world_size 1 makes its own one-rank
    group and serves; world_size 2 is one error naming torchrun, before any group exists
    (found by probing: torch's 'environment variable RANK expected' from the README's
    snippet)."""
    import os
    import subprocess
    import sys

    from colo_rollout.runtime.parallel import init_parallel

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="run it under torchrun --nproc-per-node 2"):
        init_parallel(ParallelConfig(world_size=2, adp=2, ep=2, backend="gloo"))
    script = (
        "from colo_rollout.config import config_from_dict\n"
        "from colo_rollout.runtime.parallel import init_parallel\n"
        "from colo_rollout.engine.engine import Engine\n"
        "from colo_rollout.sched.request import Request, SamplingParams\n"
        "from colo_rollout.model.weights import random_state_dict\n"
        "cfg = config_from_dict({'parallel': {'world_size': 1, 'adp': 1, 'ep': 1, "
        "'backend': 'gloo'}, 'model': {'num_layers': 1, 'hidden_size': 32, "
        "'num_attention_heads': 2, 'num_query_groups': 1, 'num_experts': 2, "
        "'moe_router_topk': 2, 'moe_ffn_hidden_size': 16, 'vocab_size': 64}})\n"
        "e = Engine(cfg, init_parallel(cfg.parallel), random_state_dict(cfg.model))\n"
        "print('tokens', len(e.generate([Request('a', (1, 2), "
        "SamplingParams(max_tokens=3))])['a'].tokens))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=240, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert got.returncode == 0 and "tokens 3" in got.stdout, got.stderr[-2000:]
