"""The ordering ladder at 8 ranks (CPU, gloo): what the CPUs allow of the 8-GPU layouts of
issue 6. EP8/ADP2 (ATP4: P's full AllReduce crosses D's ATP and full collectives) and EP8/ADP8:
every PD mode gives Normal's greedy tokens on every rank, and Fine runs D while P is in flight."""

from __future__ import annotations

import pytest

from colo_rollout.runtime.spawn import WorkerGroup

C = "tests.cases_engine"
MODEL = {"num_query_groups": 4}  # ATP4 needs KV groups divisible by 4


@pytest.fixture(scope="module")
def eight():
    with WorkerGroup(8) as g:  # one spawned group for the module
        yield g


@pytest.mark.parametrize("adp,n_requests", [(2, 14), (8, 40)])
def test_modes_match_normal_on_eight_ranks(eight, adp, n_requests):
    kw = dict(timeout=900, adp=adp, ep=8, model_kw=MODEL, n_requests=n_requests)
    normal = eight.run(f"{C}:engine_mode_tokens", mode="normal", **kw)[0]
    for mode, span in [("global_enqueue", 1), ("fine", 1)]:
        res = eight.run(f"{C}:engine_mode_tokens", mode=mode, span=span, **kw)
        for r in res:
            assert r["tokens"] == normal["tokens"], (mode, span)
            for rid, lps in r["logprobs"].items():
                assert all(abs(a - b) < 1e-4 for a, b in zip(lps, normal["logprobs"][rid])), rid
        if mode == "fine":
            assert res[0]["d_during_p"] > 0  # D ran while a P epoch was in flight
            assert res[0]["rendezvous"] > 0 and res[0]["rendezvous"] % 2 == 0


def test_alltoall_dispatch_gives_gathers_tokens_on_eight_ranks(eight):
    """Issue 17 item 5 at 8 ranks: EP8/ADP2 (ATP4) in Fine, the routed all-to-all backend
    (P's and D's own communicators, P's split-phase boundary) against the gather backend."""
    from tests.test_dispatch import TOL

    res = eight.run("tests.cases_dispatch:alltoall_matches_gather", timeout=900, adp=2, ep=8,
                    mode="fine", model_kw=MODEL)
    for r in res:
        assert r["same_tokens"] and r["max_logprob_diff"] < TOL
        assert min(r["a2a"]) > 0 and r["tokens"] == res[0]["tokens"]
    assert res[0]["d_during_p"] > 0
