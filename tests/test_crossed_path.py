"""Crossed-path safety, shown on 4 CPU ranks (ADP2/ATP2).

Without the turnstile, independently scheduled replicas issue P's full-group AllReduce and D's
ATP ReduceScatter / full AllGather in different orders; with one collective resident per device
this is the distributed cycle of the paper's Figure 2 -- detected by the communicators' timeout,
after which the process group is torn down. With the turnstile and the selective route every rank
issues them in one order and all rounds complete with correct sums.
"""

from __future__ import annotations

from colo_rollout.runtime.spawn import WorkerGroup

C = "tests.cases_crossed"


def test_without_turnstile_the_crossed_path_hangs():
    with WorkerGroup(4) as g:  # a private group: its communicators are dead after the hang
        res = g.run(f"{C}:independent_replicas", timeout=120, timeout_s=3.0)
    for rank, r in enumerate(res):
        assert r["hung"], rank
        # each rank's collective timed out -- or, where a peer timed out first and tore its
        # side down, saw the connection close (gloo; seen under a loaded 2-core machine)
        assert any("timed out" in e.lower() or "connection closed" in e.lower()
                   for e in r["errors"]), r["errors"]
        assert r["seconds"] < 30
    assert any("timed out" in e.lower() for r in res for e in r["errors"]), res
    # the replica that went D-first got stuck in D's full AllGather: its D never finished
    assert res[0]["d_out"] == [] and res[2]["p_out"] == []


def test_with_turnstile_and_selective_route_all_rounds_complete(worker_groups):
    rounds = 6
    res = worker_groups(4).run(f"{C}:with_turnstile", timeout=300, rounds=rounds)
    for r in res:
        assert not r["hung"]
        # D: the replica sum of (rank+1) over its ATP pair, gathered from all 4 ranks:
        # 2 chunks of replica 0 with value 1+2=3 and 2 of replica 1 with 3+4=7, H columns each
        assert r["d_out"] == [float((3 + 3 + 7 + 7) * 8)] * (rounds + 1)
        assert r["p_out"] == [float(0 + 1 + 2 + 3)] * r["p_allreduces"]
        assert r["p_allreduces"] == rounds  # K=1: one P AllReduce admitted per round
    assert all(r["log"] == res[0]["log"] for r in res)
