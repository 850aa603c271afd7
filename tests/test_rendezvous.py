"""Rendezvous and the model-free turnstile stress on 4 gloo ranks; violations never hang."""

from __future__ import annotations

import time

import pytest

from colo_rollout.runtime.spawn import WorkerTimeout

C = "tests.cases_turnstile"


@pytest.mark.parametrize("kind", ["shm", "gloo"])
def test_stress_small_completes_with_identical_logs_and_delayed_p(worker_groups, kind):
    # 256 control cycles: with 64, a loaded 2-core host (the whole suite beside it) once saw
    # every P burst done by the time D was acknowledged (session 26, 1 run in ~8)
    res = worker_groups(4).run("colo_rollout.tools.stress:stress_turnstile", timeout=300,
                               seeds=2, cycles=64, max_skew_ms=5.0, span=2, control_cycles=256,
                               rendezvous=kind)
    for r in res:
        assert r["completed"] == r["expected"] == 128
        assert r["identical_logs"]
        assert r["rendezvous"] == 2 * (128 + 256)
    # the delayed-P control: D is acknowledged while submitted P work is still running
    assert res[0]["control_d_acked_while_p_incomplete"] > 0


@pytest.mark.parametrize("kind", ["shm", "gloo"])
def test_phase_divergence_raises_on_every_rank(worker_groups, kind):
    res = worker_groups(4).run(f"{C}:phase_divergence", timeout=60, kind=kind)
    for rank, r in enumerate(res):
        assert r["raised"] is not None, rank
        assert r["raised"].startswith(f"rank {rank}, epoch 5, boundary 3:")
        assert "disagree on the rendezvous phase" in r["raised"]
        assert r["seconds"] < 5


@pytest.mark.parametrize("kind", ["shm", "gloo"])
def test_stalled_peer_raises_within_timeout(worker_groups, kind):
    timeout_s = 2.0
    res = worker_groups(4).run(f"{C}:stalled_peer", timeout=60, timeout_s=timeout_s, kind=kind)
    assert res[3].get("stalled")
    for rank in range(3):
        msg = res[rank]["raised"]
        assert msg is not None and msg.startswith(f"rank {rank}, epoch 1, boundary 0:")
        assert "PostD rendezvous did not complete within 2 s" in msg
        if kind == "shm":
            assert "ranks [3] never arrived" in msg  # the shared-memory path names the peer
        assert res[rank]["seconds"] < timeout_s + 3
    if kind == "shm":  # the late rank finds the rendezvous abandoned (fault injection)
        assert "gave up on a PostD rendezvous" in res[3]["late"], res[3]["late"]


def test_dead_rank_fails_the_group_fast():
    from colo_rollout.runtime.spawn import WorkerGroup

    with WorkerGroup(2) as g:
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeout, match=r"rank\(s\) \[1\] died"):
            g.run(f"{C}:die", timeout=120)
        assert time.monotonic() - t0 < 30


def test_all_gather_json_round_trips(worker_groups):
    res = worker_groups(4).run("tests.cases_turnstile:gather_json")
    for r in res:
        assert r == [{"rank": i, "xs": list(range(i))} for i in range(4)]


@pytest.mark.parametrize("shm", [True, False])
def test_control_exchange_delivers_every_message_in_rank_order(worker_groups, shm):
    res = worker_groups(4).run(f"{C}:control_exchanges", shm=shm)
    for step in range(40):
        expect = []
        for r in range(4):
            big = step % 7 == 3 and r == step % 4
            expect.append((r, step, 1000 if big else 1, f"r{r}s{step}", r,
                           None if r else 1.5))
        for rank in range(4):
            assert res[rank]["got"][step] == expect, (rank, step)
    for r in res:  # steps 3, 10, 17, 24, 31, 38 carry a message larger than the 4 KiB slot
        assert r["shm"] == shm and r["fallbacks"] == (6 if shm else 0)


def test_shm_control_exchange_names_a_stalled_peer_within_timeout(worker_groups):
    res = worker_groups(4).run(f"{C}:control_stalled_peer", timeout=60, timeout_s=2.0)
    assert res[3].get("stalled")
    for rank in range(3):
        msg = res[rank]["raised"]
        assert msg is not None and msg.startswith(f"rank {rank}, step 1:"), msg
        assert "did not complete within 2 s; ranks [3] never arrived" in msg
        assert res[rank]["seconds"] < 2.0 + 3
    # the late rank does not take the abandoned exchange as complete (found by fault
    # injection: it applied its peers' messages, then failed in gloo)
    assert res[3]["late"].startswith("rank 3, step 1: ranks [0, 1, 2] gave up"), res[3]["late"]
