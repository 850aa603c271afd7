"""MTP speculative decoding (engine.mtp; model/mtp.py, worker/speculate.py): one draft token per
D iteration, verified and re-drafted in one forward.

Against independent references, on CPU ranks in fp32: with MTP the engine emits exactly the
greedy tokens it emits without (every layout and mode below), its logprobs are megatron
GPTModel's, and every draft it proposes is the argmax of megatron's own MTP block
(MultiTokenPredictionBlock, teacher-forced over the final sequence). On random weights the
drafts are almost never accepted (the reject path); on "oracle" weights, under which the MTP
layer provably predicts the token two ahead (tests/cases_mtp.py), nearly all are, and D runs
about half as many iterations (the accept path: two tokens per iteration, the KV of both)."""

from __future__ import annotations

import pytest

from colo_rollout.config import ConfigError, config_from_dict
from colo_rollout.engine.engine import _from_wire, _to_wire
from colo_rollout.runtime.control import ControlError
from colo_rollout.sched.plan import Sampled

CASES = "tests.cases_mtp"
TOL = 1e-4


# (world, adp, ep, mode, against the engine without MTP too): every run is checked against
# megatron (tokens its greedy argmax, logprobs, drafts its MTP block's argmax); the runs
# without MTP (a second engine each) only where marked, to keep the module's time down
@pytest.mark.parametrize("world,adp,ep,mode,with_off,dispatch", [
    (1, 1, 1, "normal", True, "gather"),
    # EP2/ADP2: D iterations inside P epochs (the MTP pass's boundaries)
    (2, 2, 2, "fine", True, "gather"),
    (2, 2, 2, "global_enqueue", False, "gather"),
    # EP4/ADP2/ATP2: eh_proj column-parallel over ATP 2, its outputs gathered (P: the
    # zero-padded AllReduce boundary; D: the vocab-style gather)
    (4, 2, 4, "global_complete", False, "gather"),
    (4, 2, 4, "fine", True, "gather"),
    # the alltoall backend: the MTP layer's MoE through each phase's dispatcher -- at attention
    # TP 1 P computes its own rows (the MTP pass too: its dispatch split the one boundary it
    # adds), under ATP 2 the gather layout with the split between the MTP layer's gathers
    (2, 2, 2, "fine", True, "alltoall"),
    (4, 2, 4, "fine", False, "alltoall"),
])
def test_mtp_gives_the_same_greedy_tokens_and_megatrons_drafts(worker_groups, world, adp, ep,
                                                               mode, with_off, dispatch):
    group = worker_groups(world)
    for weights in ("random", "oracle"):
        on = group.run(f"{CASES}:mtp_tokens", adp=adp, ep=ep, mode=mode, mtp=True,
                       weights=weights, check_reference=True, dispatch=dispatch)
        r = on[0]
        if dispatch == "alltoall":  # the MTP pass's P boundaries: only its dispatch split
            # where P computes its own rows; else its gathers' 4 (+1 under ATP), the split
            assert r["p_boundaries"] == (2 + 1 if world == 2 else 2 * 2 + 2 + 2 + 4 + 1 + 1)
        if with_off:
            off = group.run(f"{CASES}:mtp_tokens", adp=adp, ep=ep, mode=mode, mtp=False,
                            weights=weights, dispatch=dispatch)
            assert r["tokens"] == off[0]["tokens"], weights  # greedy output unchanged by MTP
            if weights == "oracle":  # the accept path: ~2 tokens per D iteration
                assert r["d_iterations"] < 0.8 * off[0]["d_iterations"]
        assert all(x["tokens"] == r["tokens"] for x in on)
        # every token megatron's greedy argmax (near-tie tolerant), its logprob megatron's
        assert r["mismatches"] == [] and r["max_logprob_diff"] < TOL
        assert r["drafts_checked"] > 40 and r["draft_mismatches"] == []
        # each D row verified one draft and emitted 1 token, or 2 when it was accepted (the
        # bonus dropped when the first one ended the request)
        emitted = sum(max(len(t) - 1, 0) for t in r["tokens"].values())
        assert r["verified"] <= emitted <= r["verified"] + r["accepted"]
        if weights == "oracle":
            assert r["accepted"] >= 0.9 * r["verified"]
        else:
            assert r["accepted"] <= 0.1 * r["verified"]


def test_bonus_tokens_travel_in_order_and_malformed_rows_are_refused():
    samples = [Sampled(3, 10, -0.5, ((11, -0.25),), 12), Sampled(4, 20, -1.0, (), 21),
               Sampled(5, 30, -2.0)]
    assert _from_wire(_to_wire(samples)) == samples
    with pytest.raises(ControlError, match="does not follow"):
        _from_wire([(3, 11, -0.25, -1, 1)])  # a bonus row without its first token
    with pytest.raises(ControlError, match="does not follow"):
        _from_wire([(3, 10, -0.5, 12, 0), (4, 11, -0.25, -1, 1)])  # another lifetime's


def _cfg(**over):
    base = {"parallel": {"world_size": 1, "adp": 1, "ep": 1, "backend": "gloo"},
            "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 2,
                      "num_attention_heads": 4, "num_query_groups": 2,
                      "moe_ffn_hidden_size": 16, "num_experts": 4, "moe_router_topk": 2}}
    for key, val in over.items():
        sec, k = key.split(".")
        base.setdefault(sec, {})[k] = val
    return config_from_dict(base)


@pytest.mark.parametrize("over,key", [
    ({"engine.mtp": True}, "engine.mtp"),  # no MTP layer to draft with
    ({"model.mtp_num_layers": 2}, "model.mtp_num_layers"),  # one draft token per iteration
])
def test_mtp_it_cannot_hold_is_refused_naming_the_key(over, key):
    with pytest.raises(ConfigError) as err:
        _cfg(**over)
    assert key in str(err.value)


def test_sampled_rows_keep_the_targets_distribution(worker_groups):
    """Speculative sampling is exact: on the oracle weights (a Markov chain over tokens whose
    MTP layer drafts the chain's argmax two ahead) the k-th sampled token's distribution with
    MTP drafting equals the chain's exact marginal e_prompt P^(k+1) -- within the sampling
    noise of 600 draws (total variation: measured 0.015 / 0.066 / 0.105 with MTP, 0.027 / 0.057
    / 0.102 without; the chain moves each step -- consecutive marginals are 0.96 apart -- so a
    bonus token sampled from the wrong row lands far outside)."""
    r = worker_groups(1).run(f"{CASES}:mtp_sampling_marginals", adp=1, ep=1, n=600,
                             temperature=0.15)[0]
    assert 0.2 < r["acceptance"] < 0.95  # both paths taken: accepted drafts and rejections
    bounds = (0.08, 0.15, 0.2)  # the support widens along the chain: more noise per position
    for k, (emp, exact) in enumerate(zip(r["empirical"], r["exact"])):
        tv = 0.5 * sum(abs(a - b) for a, b in zip(emp, exact))
        assert tv < bounds[k], (k, tv)
