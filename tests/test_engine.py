"""Engine correctness (Normal mode) against megatron GPTModel full recompute, on 1, 2 and 4 ranks,
plus the architecture surface (cases_engine.ARCHS), bad input and cancellation. One spawned
process group per world size for the module."""

from __future__ import annotations

import pytest

import tests.cases_engine as C

CASES = "tests.cases_engine"

LAYOUTS = [  # (world, adp, ep): ADP1, ADP2/EP2, ATP2, EP2/ATP2, ADP2/ATP2/EP4, ADP4/EP2
    (1, 1, 1), (2, 2, 2), (2, 1, 1), (2, 1, 2), (4, 2, 4), (4, 4, 2),
]


@pytest.mark.parametrize("world,adp,ep", LAYOUTS)
def test_greedy_tokens_and_logprobs_match_megatron_reference(worker_groups, world, adp, ep):
    from tests.cases_engine import LOGPROB_TOL

    res = worker_groups(world).run(f"{CASES}:engine_matches_reference", adp=adp, ep=ep)
    r0 = res[0]
    assert r0["checked"] > 40
    assert r0["prefill_after_decode"]  # admission in waves was exercised
    assert r0["mismatches"] == []
    assert r0["max_logprob_diff"] < LOGPROB_TOL
    assert r0["lengths"] == r0["expected"]  # ignore_eos: exactly max_tokens each
    assert set(r0["reasons"].values()) == {"length"}
    assert r0["owners_left"] == 0
    assert r0["grouped"] == [False, False]  # auto on CPU: megatron's experts forward
    assert r0["warmup_graphs"] == 0  # no D graphs on CPU; warmup's collective still matched
    for r in res[1:]:  # replicated state: every rank has every token
        assert r["tokens"] == r0["tokens"]


@pytest.mark.parametrize("world,adp,ep,mode", [(1, 1, 1, "normal"), (2, 2, 2, "fine")])
def test_on_demand_kv_preempts_and_keeps_megatrons_tokens(worker_groups, world, adp, ep, mode):
    """engine.kv_reservation on_demand with blocks too few for every budget at once: rows are
    preempted and prefilled again (Normal steps, and Fine's rounds on two replicas), and the
    outputs are still megatron's greedy tokens and logprobs, every one of max_tokens."""
    from tests.cases_engine import LOGPROB_TOL

    res = worker_groups(world).run(f"{CASES}:on_demand_matches_reference", adp=adp, ep=ep,
                                   mode=mode)
    r0 = res[0]
    assert r0["preemptions"] > 0
    assert r0["mismatches"] == [] and r0["max_logprob_diff"] < LOGPROB_TOL
    assert r0["lengths"] == r0["expected"] and r0["owners_left"] == 0
    for r in res[1:]:
        assert r["tokens"] == r0["tokens"] and r["preemptions"] == r0["preemptions"]


# The host-sync-free grouped expert path against the same megatron reference: ETP1, ETP2 (ATP2
# with EP1 shards each expert's FFN) and EP4 with experts split over ranks.
@pytest.mark.parametrize("world,adp,ep", [(1, 1, 1), (2, 1, 1), (4, 2, 4)])
def test_grouped_expert_path_matches_megatron_reference(worker_groups, world, adp, ep):
    from tests.cases_engine import LOGPROB_TOL

    res = worker_groups(world).run(f"{CASES}:engine_matches_reference", adp=adp, ep=ep,
                                   moe_compute="grouped")
    r0 = res[0]
    assert r0["grouped"] == [True, True]
    assert r0["checked"] > 40 and r0["mismatches"] == []
    assert r0["max_logprob_diff"] < LOGPROB_TOL
    for r in res[1:]:
        assert r["tokens"] == r0["tokens"]


@pytest.mark.parametrize("world,adp,ep", [(1, 1, 1), (2, 1, 2)])
def test_padded_expert_rows_take_no_work_and_leave_the_tokens_exact(worker_groups, world, adp,
                                                                    ep):
    # the contract P's MoE graphs rely on (EP2/ATP2: padding rows also meet other ranks' experts)
    res = worker_groups(world).run(f"{CASES}:padded_moe_rows", adp=adp, ep=ep)
    for r in res:
        assert r["max_diff"] < 1e-5
        assert r["pad_max"] == 0.0
        assert "needs the grouped expert path" in r["errors"]["megatron_path"]


def test_prefill_graph_data_path_equals_the_modules(worker_groups):
    # EP2/ADP2: every rank's graph sees all replicas' tokens, padding meets both ranks' experts
    res = worker_groups(2).run(f"{CASES}:prefill_graph_data_path", adp=2, ep=2)
    for r in res:
        assert r["max_diff"] < 1e-5
        # buckets 32, 48 (for 33) and the 100-token cap, per layer; none for the 130-token step
        assert r["keys"] == [("partial", i, T) for i in range(2) for T in (32, 48, 100)]
        assert r["residual_layers"] == []  # two ranks: the combine is an AllReduce
        assert r["engine_kinds"] == ["partial"]
        assert r["engine_replays"] > 0 and r["engine_same"]
    # the engine's P wrote h into the graphs' input (no copy); the direct calls copied
    assert r["engine_in_place"] == [True] and r["direct_in_place"] == [False]


def test_one_rank_prefill_graphs_sum_the_slots_into_the_residual(worker_groups):
    # one rank, no shared experts: P's combine is the identity, so the graph returns the new
    # residual (the slots summed into h in one kernel) -- the same numbers as the modules'
    r = worker_groups(1).run(f"{CASES}:prefill_graph_data_path", adp=1, ep=1)[0]
    assert r["max_diff"] < 1e-5
    assert r["residual_layers"] == [0, 1] and r["max_diff_residual"] < 1e-5  # bucket-sized GEMMs
    # and with the norms around the block fused (the tiny model's norms are torch's RMSNorm)
    assert r["normed_layers"] == [0, 1] and r["max_diff_normed"] < 1e-5
    assert r["keys"] == sorted((kind, i, T) for kind in ("partial", "residual", "normed")
                               for i in range(2) for T in (32, 48, 100))
    # the engine's P steps take the normed graphs only
    assert r["engine_kinds"] == ["normed"]
    assert r["engine_replays"] > 0 and r["engine_same"]
    # the engine's P wrote h and u into the graphs' inputs (no copy); the direct calls copied
    assert r["engine_in_place"] == [True] and r["direct_in_place"] == [False]
    assert r["engine_u_in_place"] == [True] and r["direct_u_in_place"] == [False]


def test_the_direct_qkv_call_is_megatrons_column_linear_bitwise(worker_groups):
    r = worker_groups(1).run(f"{CASES}:plain_qkv_is_the_module", adp=1, ep=1)[0]
    assert r == {"False": [(True, False, True)] * 2, "True": [(True, True, True)] * 2}


def test_stall_dump_prints_each_ranks_stacks_from_a_slow_step(worker_groups):
    res = worker_groups(2).run(f"{CASES}:stall_dump", adp=2, ep=2)
    for r in res:  # a 0.1 ms threshold: every step is "slow"
        assert r["0.0001"] == {"dumped": True, "in_step": True}
        assert r["0.0"] == {"dumped": False, "in_step": False}


def test_a_device_stall_wedges_the_engine_and_close_does_not_wait_on_the_device(worker_groups):
    res = worker_groups(2).run(f"{CASES}:wedged_close", adp=2, ep=2)
    for rank, r in enumerate(res):
        assert r["error"].startswith(f"rank {rank}, step ")
        assert "D tokens: the GPU work was not done within" in r["error"]
        assert r["close_wedged=True"] == "ok"
        assert r["close_wedged=False"] == "drained a wedged device"  # the stand-in bites


def test_grouped_expert_weights_follow_in_place_updates_and_replacement(worker_groups):
    from tests.cases_engine import LOGPROB_TOL

    res = worker_groups(2).run(f"{CASES}:grouped_weights_follow_updates", adp=1, ep=1)
    r0 = res[0]
    assert r0["checked"] > 10 and r0["mismatches"] == []
    assert r0["max_logprob_diff"] < LOGPROB_TOL  # the reloaded weights, not the first ones
    assert all(r["changed_after_replace"] for r in res)


@pytest.mark.parametrize("world,adp,ep", [(2, 2, 2), (4, 2, 4)])
def test_bad_input_is_isolated(worker_groups, world, adp, ep):
    from tests.cases_engine import LOGPROB_TOL

    res = worker_groups(world).run(f"{CASES}:bad_input_isolated", adp=adp, ep=ep)
    r0 = res[0]
    bad = r0["bad"]
    assert bad["too-long"][0] == "rejected" and "exceeds engine.max_seq_len" in bad["too-long"][1]
    assert "empty prompt" in bad["empty"][1]
    assert "temperature" in bad["bad-temp"][1]
    assert "top_p" in bad["bad-topp"][1]
    assert "outside the vocabulary" in bad["oov"][1]
    assert "duplicate request id" in bad["dup"][1]
    assert r0["dup_original"] == "length"
    for rid, (reason, n, want) in r0["good"].items():
        assert reason == "length" and n == want, rid
    assert r0["mismatches"] == [] and r0["max_logprob_diff"] < LOGPROB_TOL
    turns = r0["session_turns"]
    assert turns["s-t1"] == ("length", None)
    assert turns["s-t2"][0] == "rejected" and "already has a turn" in turns["s-t2"][1]
    for r in res:
        # the served requests' outputs, not the refusals of their ids (every rank alike)
        assert r["shadow"] == {"x": ("length", 3, None), "y": ("length", 2, None),
                               "z": ("length", 1, None)}
        assert r["bad_here"] == res[0]["bad_here"] and len(r["bad_here"]) == 5
        assert r["session_turns"] == turns  # refused at the exchange: on every rank too
        assert "unknown request id" in r["errors"]["cancel_unknown"]
        # generate() handed the finished output back and forgot it: unknown since
        assert "unknown request id" in r["errors"]["cancel_finished"]
        assert r["errors"]["output_unknown"].startswith("output of request 'nope': unknown")
        assert "expected request ids" in r["errors"]["forget_none"]
        assert "got str 'abc'" in r["errors"]["forget_str"]
        # rank 0's argument is read; its refusal raised on every rank (the others name it)
        assert r["errors"]["generate_str"].endswith("generate: requests must be a list of "
                                                    "Request, got str")
        # an iterator raising partway: refused on every rank, nothing of it left to serve
        assert r["errors"]["generate_raising"].endswith(
            "generate: reading the requests raised ValueError: the dataset ran dry")
        assert r["errors"]["after_raising"] == []
        # a numpy.str_ id is served under its plain text, a 0-d prompt refused, the request
        # after it served in the same call
        assert r["odd"] == {"after": ("length", "str", 2), "np-id": ("length", "str", 2),
                            "zero-d": ("rejected", "str", 0)}
        assert "request ids are strings, got list" in r["errors"]["forget_unhashable"]
        assert r["errors"]["on_finish_not_callable"].endswith(
            "generate: on_finish must be callable, got int")
        assert r["errors"]["after_on_finish"] == []
        assert "expected a list of keys" in r["errors"]["take_routings_str"]
        assert "this engine is closed" in r["errors"]["hand_over_closed"]
        assert "this engine is closed" in r["errors"]["resume_closed"]


def test_cancel_running_and_waiting_and_cross_rank_duplicate(worker_groups):
    res = worker_groups(2).run(f"{CASES}:cancel_and_cross_rank_duplicates", adp=2, ep=2)
    for r in res:
        out = r["outputs"]
        assert r["states_before_cancel"]["c5"] is None  # still waiting when cancelled
        assert isinstance(r["states_before_cancel"]["c0"], int)  # running (has a lifetime)
        assert out["c0"][0] == "cancelled" and 0 < out["c0"][1] < 20
        assert out["c5"] == ("cancelled", 0)
        for rid in ("c1", "c2", "c3", "c4"):
            assert out[rid] == ("length", 20)
        assert out["same"][0] == "length"
        assert [rid for rid, _ in r["rejected"]] == ["same"]
        assert "duplicate request id" in r["rejected"][0][1]
    # the caller learns it: rank 1's submission lost to rank 0's, and rank 1's next step()
    # raised a RequestError (SubmissionRefused) naming it, after completing the step
    assert res[0]["refused_here"] is None
    lost = res[1]["refused_here"]
    assert lost["is_request_error"]
    assert lost["refused"] == [("same", "rejected", "request 'same': duplicate request id")]
    assert "request 'same': duplicate request id" in lost["message"]
    for r in res:
        del r["refused_here"]
    assert res[0] == res[1]


def test_cancelling_a_p_step_whose_tokens_are_read_late(worker_groups):
    res = worker_groups(2).run(f"{CASES}:cancel_a_p_step_read_late", adp=2, ep=2)
    r0 = res[0]
    assert r0["late_p"] >= 2 and r0["cancelled"]  # P steps were read late, one cancelled
    for r in res:
        assert r["outputs"] == r0["outputs"] and r["cancelled"] == r0["cancelled"]
    for rid, (reason, tokens) in r0["outputs"].items():
        if rid in r0["cancelled"]:
            assert (reason, tokens) == ("cancelled", [])
        else:
            assert reason == "length" and len(tokens) == 5, rid
            # every position but the last output token's was routed and recorded (a
            # session's turn leaves its routing to Engine.take_routing)
            assert r0["routed"][rid] == (None if rid == "o3" else r0["plens"][rid] + 4), rid
    assert len(r0["outputs"]) == 10


def test_tp2_megatron_reference_equals_tp1(worker_groups):
    """The TP-matched yardstick (megatron GPTModel at TP2 loaded from the full state dict with
    our sharding rules) computes the same function as the TP1 reference."""
    res = worker_groups(2).run(f"{CASES}:tp_reference_matches_tp1")
    for r in res:
        assert r["spread"] > 0.05  # a non-degenerate model
        assert r["max_diff"] < 1e-4


@pytest.mark.parametrize("world,adp,ep", [(2, 1, 2), (4, 2, 4)])
def test_engine_loads_a_megatron_gptmodel_state_dict(worker_groups, world, adp, ep):
    from tests.cases_engine import LOGPROB_TOL

    res = worker_groups(world).run(f"{CASES}:engine_loads_megatron_gptmodel_state_dict",
                                   adp=adp, ep=ep)
    r0 = res[0]
    assert r0["extra_state_keys"] > 0  # a real megatron state dict, not our own format
    assert r0["checked"] > 20 and r0["mismatches"] == []
    assert r0["max_logprob_diff"] < LOGPROB_TOL


def test_prefill_segments_interleaved_with_decode_equal_straight_prefill(worker_groups):
    res = worker_groups(4).run(f"{CASES}:prefill_segments_with_decode_between", adp=2, ep=4)
    for r in res:
        assert r["boundaries"] == list(range(r["expected"]))  # 0..2L+1, monotone, one producer
        assert r["d_rows"] > 0 and r["p_rows"] > 0
        assert r["p_equal"] and r["d_equal"]


@pytest.mark.parametrize("mode", ["normal", "fine"])
def test_memory_release_and_resume(worker_groups, mode):
    res = worker_groups(2).run(f"{CASES}:memory_release_resume", adp=2, ep=2, mode=mode)
    for r in res:
        # the shared-memory host agreement outlives a release (it once closed with the graphs)
        assert r["shm_before"] and r["shm_after"] and r["gloo_fallbacks"] == 0
        assert r["offload_equal"] and r["reload_equal"]
        assert r["evicted"] == 1  # the retained multi-turn context
        assert "while requests are in flight" in r["errors"]["busy"]
        assert "resume_memory() first" in r["errors"]["released_step"]
        assert "weights were discarded" in r["errors"]["discarded_step"]
        assert r["paused_outputs"] == {}
        assert r["errors"]["load_released"].endswith(  # ("rank 0: " on the other rank)
            "the engine's memory is released (engine.release_memory); call "
            "engine.resume_memory() first, then load the weights"), r["errors"]


def test_decode_graph_key_is_the_same_on_every_rank(worker_groups):
    """A rank capturing a graph runs eager warm-up collectives; a peer choosing another key
    would replay instead and never join them (this hung a 2-GPU run)."""
    res = worker_groups(2).run(f"{CASES}:graph_key_agrees", adp=2, ep=2)
    assert res[0]["keys"] == res[1]["keys"] and len(res[0]["keys"]) > 10
    assert res[0]["local"] != res[1]["local"]  # the replicas' own longest tables do differ
    for r in res:
        assert all(w >= loc for (_, w), loc in zip(r["keys"], r["local"]))


# ---- the architecture surface against megatron's GPTModel (variants in cases_engine.ARCHS)
ARCH_LAYOUTS = [(1, 1, 1), (2, 2, 2), (4, 2, 4)]  # single, EP2/ADP2, EP4/ADP2/ATP2


@pytest.mark.parametrize("world,adp,ep", ARCH_LAYOUTS)
@pytest.mark.parametrize("arch", sorted(C.ARCHS))
def test_architecture_matches_megatron_reference(worker_groups, arch, world, adp, ep):
    from tests.cases_engine import LOGPROB_TOL

    res = worker_groups(world).run(f"{CASES}:engine_matches_reference", adp=adp, ep=ep,
                                   n_requests=10, model_kw=C.ARCHS[arch])
    r0 = res[0]
    assert r0["checked"] > 30
    assert r0["mismatches"] == []
    assert r0["max_logprob_diff"] < LOGPROB_TOL
    for r in res[1:]:
        assert r["tokens"] == r0["tokens"]


@pytest.mark.parametrize("arch", ["glm", "qwen2"])
def test_architecture_on_the_grouped_expert_path_and_in_fine_mode(worker_groups, arch):
    # the host-sync-free experts (what GPUs run) and the segment turnstile (P cut at its
    # boundaries: dense layers and shared experts keep one combine per layer)
    from tests.cases_engine import LOGPROB_TOL

    res = worker_groups(4).run(f"{CASES}:engine_matches_reference", adp=2, ep=4,
                               n_requests=10, model_kw=C.ARCHS[arch], moe_compute="grouped",
                               mode="fine")
    r0 = res[0]
    assert all(r0["grouped"])
    assert r0["checked"] > 30 and r0["mismatches"] == []
    assert r0["max_logprob_diff"] < LOGPROB_TOL


def test_a_failed_collective_in_a_step_names_the_rank_and_step(worker_groups):
    (r,) = worker_groups(1).run(f"{CASES}:a_failed_collective_is_named")
    kind, text = r["gloo"]
    assert kind == "ControlError" and text.startswith(
        "rank 0, step 0: a collective of the step failed: not every rank took part within the "
        "timeout"), text
    assert r["own"] == ("RuntimeError", "this engine handed its worker to another engine")


def test_an_engine_built_beside_another_call_refuses_on_every_rank(worker_groups):
    res = worker_groups(2).run(f"{CASES}:engine_build_beside_generate")
    for r in res:
        assert "(rank 0 in Engine(), rank 1 in generate())" in r["error"], r
        assert r["after"] == "length"


def test_ranks_built_from_different_configs_refuse_on_every_rank(worker_groups):
    res = worker_groups(2).run(f"{CASES}:config_divergence")
    for r in res:
        assert r["key"] == "engine.num_kv_blocks", r
        assert r["error"].startswith("rank 1's config differs from rank 0's at "
                                     "engine.num_kv_blocks: 48 vs 64 (every rank runs from one config"), r
        assert r["hidden"].startswith("rank 1's config differs from rank 0's at "
                                      "model.head_dim: 8 vs 16; also model.hidden_size"), r


def test_session_protocol_never_spins_drops_a_close_or_forgets_a_cancel(worker_groups):
    r = worker_groups(1).run(f"{CASES}:session_protocol", timeout=120)[0]
    assert r["both_turns"] == [("A1", "length"), ("B1", "length")]
    assert r["closed_then_new_is_fresh"]
    assert r["both_returned"] == [("d0", "length"), ("d1", "rejected")]
    assert "session 'E' was ended by the cancel of 'e0'" in r["after_cancel"], r
    assert r["reused"] == "length"
    assert r["id_is_a_session"] == ("request 'F': its id is a session's (a request without a "
                                    "session needs an id no session has)")
