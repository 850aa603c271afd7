"""MoE dispatch backends (model/dispatch.py, model.moe_dispatch): the alltoall backend gives the
gather backend's greedy tokens and logprobs in every engine mode (EP2/ADP2, EP4/ADP2/ATP2,
family-shaped models), its P and D round trips equal the gather MoE's summed partials, a
padded D capacity that overflows raises on every rank, and the config refuses what it cannot
run."""

from __future__ import annotations

import pytest

from colo_rollout.config import Config, ConfigError, ModelConfig, ParallelConfig, config_from_dict

from tests.cases_engine import ARCHS

CASES = "tests.cases_dispatch"
TOL = 1e-4  # fp32: the backends differ in summation order only


@pytest.mark.parametrize("world,adp,ep,mode,model_kw", [
    (2, 2, 2, "normal", None),
    (2, 2, 2, "fine", None),
    (4, 2, 4, "normal", {"shared_expert_ffn_hidden_size": 48, "shared_expert_gate": True}),
    (4, 2, 4, "fine", None),
    # the other modes, on family-shaped models: GLM (dense first layer, sigmoid routing with
    # expert bias and groups, an ungated shared expert), Qwen2 (softmax without renormalising)
    (4, 2, 4, "global_complete", ARCHS["glm"]),
    (4, 2, 4, "global_enqueue", ARCHS["qwen2"]),
])
def test_alltoall_gives_the_gather_backends_tokens_and_logprobs(worker_groups, world, adp, ep,
                                                                 mode, model_kw):
    res = worker_groups(world).run(f"{CASES}:alltoall_matches_gather", adp=adp, ep=ep,
                                   mode=mode, model_kw=model_kw)
    for r in res:
        assert r["same_tokens"]
        assert r["max_logprob_diff"] < TOL
        assert r["n_tokens"] > 40
        assert min(r["a2a"]) > 0 and r["gather_a2a"] == [0, 0]  # the backend really ran
        assert r["tokens"] == res[0]["tokens"]
    if mode != "normal":
        assert res[0]["d_during_p"] > 0  # D ran inside P epochs: the phases interleaved


@pytest.mark.parametrize("world,adp,ep", [(2, 2, 2), (4, 2, 4)])
def test_round_trip_equals_the_gather_moe(worker_groups, world, adp, ep):
    res = worker_groups(world).run(f"{CASES}:round_trip", adp=adp, ep=ep)
    for r in res:
        rows = [k for k in r if k[0] in "PD" and k[1:].isdigit()]
        assert len(rows) == 7  # 4 P sizes (rank 0: 0, 1, 5, 17; others: 3, 9, 4, 0), 3 D
        for key in rows:
            assert r[key] < 1e-5, (key, r[key])
        assert r["P0"] == 0.0  # no rows: an empty result, the collectives still matched
        assert r["p_collectives"] == 16 and r["d_collectives"] == 9  # P: counts + 3, D: 3
        assert r["distinct_groups"] and r["world_groups"]


def test_padded_capacity_overflow_raises_on_every_rank(worker_groups):
    res = worker_groups(2).run(f"{CASES}:overflow", adp=2, ep=2)
    for r in res:
        for key in ("error", "tight_error"):
            msg = r[key]
            assert msg is not None and "layer 3" in msg and "model.moe_dispatch_capacity" in msg
            assert "rank(s)" in msg and "sent up to" in msg
        assert r["fit_diff"] < 1e-5  # a capacity that just fits is exact
    # every rank names the same overflowing ranks (the counts were exchanged)
    heads = {r["error"].split(" (seen on")[0] for r in res}
    assert len(heads) == 1


def _cfg(**model_kw) -> dict:
    return {"parallel": {"world_size": 4, "adp": 2, "ep": model_kw.pop("ep", 4)},
            "model": {"num_experts": 8, **model_kw}}


def test_config_moe_dispatch_choices():
    assert ModelConfig().moe_dispatch == "gather"
    assert config_from_dict(_cfg(moe_dispatch="alltoall")).model.moe_dispatch == "alltoall"
    with pytest.raises(ConfigError, match="model.moe_dispatch.*DeepEP backend does not exist"):
        ModelConfig(moe_dispatch="deepep")
    with pytest.raises(ConfigError, match="model.moe_dispatch.*expected one of"):
        ModelConfig(moe_dispatch="nvshmem")
    with pytest.raises(ConfigError, match="model.moe_dispatch_capacity"):
        ModelConfig(moe_dispatch_capacity=-1)
    # expert TP > 1 (ep < world): refused at load, naming the key
    with pytest.raises(ConfigError, match="model.moe_dispatch.*parallel.ep 2 must equal"):
        config_from_dict(_cfg(moe_dispatch="alltoall", ep=2))
    Config(parallel=ParallelConfig(world_size=4, adp=2, ep=2),
           model=ModelConfig(num_experts=8))  # gather: any layout
