"""MoE dispatch backends (model/dispatch.py, model.moe_dispatch): the alltoall backend gives the
gather backend's greedy tokens and logprobs in every engine mode (EP2/ADP2, EP4/ADP2/ATP2,
family-shaped models), its P and D round trips equal the gather MoE's summed partials, a
padded D capacity that overflows raises on every rank, P's dispatch split (after the count
exchange) is a turnstile boundary D can run at, and the config refuses what it cannot run."""

from __future__ import annotations

import re

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
    with pytest.raises(ConfigError, match="model.moe_dispatch.*expected one of"):
        ModelConfig(moe_dispatch="nvshmem")
    with pytest.raises(ConfigError, match="model.moe_dispatch_capacity"):
        ModelConfig(moe_dispatch_capacity=-1)
    # expert TP > 1 (ep < world): refused at load, naming the key
    with pytest.raises(ConfigError, match="model.moe_dispatch.*parallel.ep 2 must equal"):
        config_from_dict(_cfg(moe_dispatch="alltoall", ep=2))
    Config(parallel=ParallelConfig(world_size=4, adp=2, ep=2),
           model=ModelConfig(num_experts=8))  # gather: any layout


@pytest.mark.parametrize("adp", [2, 1])
@pytest.mark.parametrize("model_kw", [None, {"first_k_dense": 1, "num_layers": 3}])
def test_alltoall_dispatch_split_is_a_turnstile_boundary(worker_groups, model_kw, adp):
    """P's dispatch split (after the expert-count exchange, before the counts' host read and
    the payload all-to-all) is a boundary: ids monotone, as many as boundaries_per_prefill,
    the counts exchanged before its yield and read and sent after, D iterations run while P
    is parked there, tokens and logprobs equal gather's. At attention TP 1 (EP2/ADP2) P
    computes its own rows and the splits are the epoch's only boundaries (the backend is
    the one producer); under ATP (EP2/ATP2) the gather points stay and the split is one
    more per MoE layer."""
    res = worker_groups(2).run(f"{CASES}:split_boundary", adp=adp, ep=2, model_kw=model_kw)
    for r in res:
        n, kinds = r["expected"], r["kinds"]
        layers = r["gather_layers"]
        assert r["gather_boundaries"] == 2 * layers + 2
        moe_layers = layers - (model_kw or {}).get("first_k_dense", 0)
        own = adp == 2
        assert r["producer"] == ("alltoall" if own else "gather")
        assert r["boundaries_per_prefill"] == n == (moe_layers if own
                                                    else 2 * layers + 2 + moe_layers)
        assert r["epochs"]
        for prev, log in zip([None] + r["epochs"], r["epochs"]):
            ids = [b for b, _, _ in log[:-1]]
            assert ids == list(range(n))  # monotone from 0, one per boundary, none skipped
            assert log[-1][0] == "end"
            if own:  # embedding .. first count exchange | read, payload, combine, next count
                steps = [(c1 - c0, h1 - h0) for (_, c0, h0), (_, c1, h1) in zip(log, log[1:])]
                assert steps == [(4, 1)] * (n - 1) + [(3, 1)], log
                if prev is not None:  # (the counters are P's, cumulative over epochs)
                    assert (log[0][1] - prev[-1][1], log[0][2] - prev[-1][2]) == (1, 0)
                continue
            for (b, c0, h0), (_, c1, h1) in zip(log, log[1:]):
                kind = kinds[str(b)]  # what runs between boundary b's yield and the next
                nxt = kinds.get(str(b + 1))
                if nxt == "split":  # the attention gather, then route + count exchange only
                    assert (c1 - c0, h1 - h0) == (1, 0), (b, log)
                elif kind == "split":  # the counts' host read, payload + metadata, combine
                    assert (c1 - c0, h1 - h0) == (3, 1), (b, log)
                else:  # no P dispatch collective anywhere else
                    assert (c1 - c0, h1 - h0) == (0, 0), (b, log)
        assert r["d_during_p"] > 0
        assert "split" in r["parked"]  # a D iteration ran between P's counts and its payload
        assert r["same_tokens"] and r["max_logprob_diff"] < TOL and r["n_tokens"] > 40
    assert res[0]["parked"] == res[1]["parked"]  # every rank parked at the same boundaries


def _deepep(**kw) -> dict:
    d = {"parallel": {"world_size": 2, "adp": 2, "ep": 2, "backend": "nccl"},
         "model": {"num_experts": 8, "hidden_size": 2048, "moe_dispatch": "deepep"}}
    for key, value in kw.items():
        section, name = key.split("__")
        d[section][name] = value
    return d


def test_config_deepep_refuses_what_deepep_cannot_run():
    """model.moe_dispatch deepep: the layouts, shapes and backends DeepEP V1 cannot run are
    refused at load, one line naming the key (before any rank starts)."""
    assert config_from_dict(_deepep()).model.moe_dispatch == "deepep"
    assert config_from_dict(_deepep(model__deepep_p_sms=12)).model.deepep_p_sms == 12
    cases = [
        ({"model__hidden_size": 512}, "model.moe_dispatch.*hidden sizes 2048, 2560"),
        ({"model__moe_router_topk": 12, "model__num_experts": 16},
         "model.moe_dispatch.*top-k <= 11"),
        ({"parallel__backend": "gloo"}, "model.moe_dispatch.*GPU ranks"),
        ({"parallel__ep": 1}, "model.moe_dispatch.*parallel.ep 1 must equal world_size 2"),
        ({"parallel__world_size": 6, "parallel__adp": 6, "parallel__ep": 6,
          "model__num_experts": 12}, "model.moe_dispatch.*2, 4 or 8 EP ranks"),
        ({"model__deepep_p_sms": 7}, "model.deepep_p_sms.*even"),
    ]
    for kw, match in cases:
        with pytest.raises(ConfigError, match=match):
            config_from_dict(_deepep(**kw))


def test_door_refuses_deepep_without_the_package(tmp_path, monkeypatch):
    """Where deep_ep does not import, a deepep config is one error line at the door."""
    import importlib.util

    import yaml

    from colo_rollout import door

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deep_ep" else real(name, *a))
    path = tmp_path / "deepep.yaml"
    path.write_text(yaml.safe_dump(_deepep()))
    with pytest.raises(ConfigError) as e:
        door.load("demo", path, {})
    msg = str(e.value)
    assert "\n" not in msg  # (the key's line in the file: FILE:LINE)
    assert re.match(rf"{re.escape(str(path))}:[0-9]+: model.moe_dispatch: 'deepep' needs", msg)
    assert door.is_user_error(e.value)


@pytest.mark.parametrize("counts,M", [([3, 0, 2], 4), ([0, 0], 2), ([2, 2], 2), ([1], 4)])
def test_low_latency_rows_as_sorted_pairs(counts, M):
    """DeepEP's low-latency receive layout (expert-major, M rows per expert, the first
    count[e] valid) as the fused MoE's sorted pairs, without a sort: valid rows expert by
    expert in row order, then the padding rows; a permutation; group ends = cumsum."""
    import torch

    from colo_rollout.model.deepep import grouped_rows

    count = torch.tensor(counts, dtype=torch.int32)
    order, offs = grouped_rows(count, M)
    valid = [e * M + c for e in range(len(counts)) for c in range(counts[e])]
    padding = [r for r in range(len(counts) * M) if r not in valid]
    assert order.tolist() == valid + padding
    assert offs.dtype == torch.int32 and offs.tolist() == torch.tensor(counts).cumsum(0).tolist()
