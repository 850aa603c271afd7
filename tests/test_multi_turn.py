"""Trajectories: continuation prefill on a retained KV context, eviction and re-prefill, checked
against megatron full recompute over the whole trajectory; Normal and Fine modes."""

from __future__ import annotations

import pytest

C = "tests.cases_engine"


@pytest.mark.parametrize("mode,blocks", [("normal", 128), ("normal", 24), ("fine", 128),
                                         ("fine", 24)])
def test_multi_turn_matches_reference(worker_groups, mode, blocks):
    from tests.cases_engine import LOGPROB_TOL

    res = worker_groups(4).run(f"{C}:multi_turn_matches_reference", adp=2, ep=4, mode=mode,
                               num_kv_blocks=blocks)
    r0 = res[0]
    assert r0["checked"] > 50
    assert r0["mismatches"] == [] and r0["max_logprob_diff"] < LOGPROB_TOL
    if blocks == 128:
        assert r0["evictions"] == 0 and r0["retained_before_close"] == 5
    else:  # 24 blocks of 4 tokens per replica: contexts must be evicted and re-prefilled
        assert r0["evictions"] > 0
    assert all(r["tokens"] == r0["tokens"] for r in res)


@pytest.mark.parametrize("world,adp,ep", [(1, 1, 1), (2, 2, 2)])
def test_a_session_follows_new_weights_and_a_hand_over(worker_groups, world, adp, ep):
    """A turn after a weight load is served under the new weights over its whole context (the
    retained KV was the old weights'); the engine a worker is handed to goes on with the
    session (found by probing: the first mixed two models, the second started a new
    conversation without a word)."""
    from tests.cases_engine import LOGPROB_TOL

    res = worker_groups(world).run(f"{C}:sessions_follow_new_weights_and_hand_over", adp=adp,
                                   ep=ep)
    r0 = res[0]
    assert r0["mismatches"] == [] and r0["max_logprob_diff"] < LOGPROB_TOL
    assert r0["retained"] == 1 and all(len(t) == 4 for t in r0["tokens"])
    assert all(r["tokens"] == r0["tokens"] for r in res)


def test_a_hand_over_one_rank_must_refuse_is_refused_on_every_rank(worker_groups):
    res = worker_groups(2).run(f"{C}:hand_over_is_refused_on_every_rank")
    for r in res:
        assert "hand_over() of an engine with requests in flight or unsent" in r["refused"], r
        assert r["after"] == 2 and r["closed_waiting"] == 0, r
    assert res[1]["refused"].startswith("rank 0: "), res[1]
