"""PD modes (the ordering ladder) on 4 CPU ranks, ADP2/ATP2/EP4: same greedy tokens as Normal,
D advances while a P epoch is in flight (Fine), cancellation mid-epoch drains before reuse."""

from __future__ import annotations

import pytest

C = "tests.cases_engine"


@pytest.fixture(scope="module")
def normal(worker_groups):
    return worker_groups(4).run(f"{C}:engine_mode_tokens", adp=2, ep=4, mode="normal")[0]


@pytest.mark.parametrize("mode,span", [("global_complete", 1), ("global_enqueue", 1),
                                       ("fine", 1), ("fine", 3)])
def test_mode_matches_normal_tokens(worker_groups, normal, mode, span):
    res = worker_groups(4).run(f"{C}:engine_mode_tokens", adp=2, ep=4, mode=mode, span=span)
    for r in res:
        assert r["tokens"] == normal["tokens"]
        for rid, lps in r["logprobs"].items():
            assert all(abs(a - b) < 1e-4 for a, b in zip(lps, normal["logprobs"][rid])), rid
        assert r["rendezvous"] > 0 and r["rendezvous"] % 2 == 0  # PreD/PostD pairs
    if mode == "fine":
        assert res[0]["d_during_p"] > 0  # D iterations ran while a P epoch was in flight


@pytest.mark.parametrize("batch,budget", [(4, 40), (8, 48)])
def test_normal_reading_p_steps_one_step_late_matches_normal(worker_groups, normal, batch,
                                                            budget):
    """engine.overlap_prefill: a P step's tokens read in the next step (after its work is
    enqueued) while prompts wait. Same tokens; the batch rows of sequences awaiting their first
    token held (no D step past max_batch_size); with a small P budget, P steps queued behind
    one another."""
    res = worker_groups(4).run(f"{C}:engine_mode_tokens", adp=2, ep=4, mode="normal",
                               overlap="always", max_batch_size=batch, max_prefill_tokens=budget)
    for r in res:
        assert r["tokens"] == normal["tokens"]
        for rid, lps in r["logprobs"].items():
            assert all(abs(a - b) < 1e-4 for a, b in zip(lps, normal["logprobs"][rid])), rid
        assert r["read_late"] == res[0]["read_late"] > 0
        assert r["most_d_rows"] <= 2 * batch  # two replicas
    assert normal["read_late"] == 0  # "auto": off on CPU
    assert res[0]["p_after_late"] > 0


def test_a_p_step_is_read_late_only_when_the_next_step_can_be_p(worker_groups):
    """One batch row per replica: the queue's head waits for a row after every P step, so no
    P step is read late (each would have bought an idle step -- found by a sweep: 16 idle
    steps of 80 on one rank); steps and tokens are Normal's."""
    kw = {"adp": 2, "ep": 4, "mode": "normal", "max_batch_size": 1, "max_prefill_tokens": 64}
    off = worker_groups(4).run(f"{C}:engine_mode_tokens", overlap="never", **kw)[0]
    on = worker_groups(4).run(f"{C}:engine_mode_tokens", overlap="always", **kw)[0]
    assert on["read_late"] == 0
    assert (on["rounds"], on["idle_steps"], on["tokens"]) == (off["rounds"], off["idle_steps"],
                                                              off["tokens"])


def test_fine_balanced_matches_normal_and_agrees_on_every_span(worker_groups, normal):
    """The balanced span moves every round from each rank's measurements, agreed through the
    control exchange: every rank must run the same permits. On CPU ranks D is synchronous, so
    every P boundary enqueued behind D holds a ready D back: after the first measured round the
    agreed span must shrink from the configured 3 to 1."""
    res = worker_groups(4).run(f"{C}:engine_mode_tokens", adp=2, ep=4, mode="fine", span=3,
                               policy="balanced")
    for r in res:
        assert r["tokens"] == normal["tokens"]
        assert r["turnstile"] == res[0]["turnstile"]  # identical protocol on every rank
    assert res[0]["d_during_p"] > 0
    permits: dict[int, list[int]] = {}  # epoch -> permits granted in it (0 at begin)
    for kind, epoch, boundary in res[0]["turnstile"]:
        if kind == "begin":
            permits[epoch] = [0]
        elif kind == "post_d":
            permits[epoch].append(boundary)
    steps = [b - a for ps in permits.values() for a, b in zip(ps, ps[1:])]  # K of each round
    assert steps and steps[0] == 3, steps  # the configured start
    first_one = steps.index(1)
    assert all(s == 1 for s in steps[first_one:]), steps


@pytest.mark.parametrize("lag", [0, 3])
def test_p_epoch_commits_on_the_same_step_when_one_rank_is_late(worker_groups, normal, lag):
    """A P epoch's first tokens are sent by each rank when its own P work is done; with one
    rank 3 step ends late, every rank still commits at the same step, and the tokens match."""
    res = worker_groups(4).run(f"{C}:deferred_p_commit", adp=2, ep=4, lag=lag)
    for r in res:
        assert r["tokens"] == normal["tokens"]
        assert r["in_flight"] == res[0]["in_flight"]  # epochs end at the same step everywhere
    if lag:
        on_time = worker_groups(4).run(f"{C}:deferred_p_commit", adp=2, ep=4, lag=0)[0]
        # each epoch now waits for the late rank: more steps with an epoch awaiting commit
        assert sum(res[0]["in_flight"]) > sum(on_time["in_flight"])


def test_fine_span1_interleaves_more_than_global(worker_groups):
    fine = worker_groups(4).run(f"{C}:engine_mode_tokens", adp=2, ep=4, mode="fine", span=1)[0]
    glob = worker_groups(4).run(f"{C}:engine_mode_tokens", adp=2, ep=4,
                                mode="global_enqueue")[0]
    assert fine["d_during_p"] > glob["d_during_p"]


def test_cancel_during_prefill_epoch_drains_then_frees(worker_groups):
    res = worker_groups(4).run(f"{C}:cancel_during_prefill_epoch", adp=2, ep=4)
    for r in res:
        assert r["in_flight_at_cancel"]
        assert len(r["draining_mid_epoch"]) == 1  # the victim's blocks, held back
        assert r["victim"] == ("cancelled", 0)
        for rid, (reason, n) in r["others"].items():
            assert reason == "length", rid
            assert n == (12 if rid.startswith("a") else 4), rid
    assert all(r == res[0] for r in res)


def test_injected_protocol_violation_raises_on_every_rank_within_timeout():
    from colo_rollout.runtime.spawn import WorkerGroup

    with WorkerGroup(4) as g:  # private: the protocol is broken afterwards
        res = g.run(f"{C}:injected_violation", timeout=120, adp=2, ep=4)
    bad = res[3]["raised"]
    assert bad.startswith("TurnstileError: rank 3, epoch 1, boundary")  # epoch 0 was A's P
    assert "non-monotone boundary" in bad
    for rank in range(3):
        msg = res[rank]["raised"]
        assert msg is not None and msg.startswith(f"ControlError: rank {rank}, step ")
        # the ranks share a host: the shared-memory exchange names the rank that never came
        assert "did not complete within 3 s; ranks [3] never arrived" in msg
        assert res[rank]["seconds"] < 3.0 + 5


def test_successor_engines_keep_the_model_and_serve_like_fresh_ones(worker_groups):
    res = worker_groups(4).run(f"{C}:successor_engines", adp=2, ep=4)
    for r in res:
        t = r["tokens"]
        assert t["fine"] == t["normal"] and t["global_enqueue"] == t["normal"]
        assert r["tokens"] == res[0]["tokens"]
        assert t["fine_d_during_p"] > 0  # the successor really ran Fine (D inside P epochs)
        e = r["errors"]
        assert "handed its worker" in e["old_fine"] and "handed" in e["old_global_enqueue"]
        assert "engine.num_kv_blocks" in e["kv"] and "model" in e["model"]
        assert e["still_serves"]
