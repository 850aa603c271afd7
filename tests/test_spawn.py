"""The spawned process group's failures (runtime/spawn.py): a failed call ends within its
grace, and reports the rank whose error caused the others'."""

from __future__ import annotations

import time

import pytest

from colo_rollout.runtime.spawn import WorkerError, WorkerGroup


def test_a_rank_stuck_after_a_peer_failed_ends_the_call_within_the_grace():
    """Found by fault injection: a rank stuck in a reward function held a failed CLI run for
    the run's whole hour, printing nothing."""
    with WorkerGroup(2) as group:
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            group.run("tests.cases_spawn:one_rank_stuck", timeout=120, grace=2.0)
        took = time.monotonic() - start
        assert took < 45, took  # (rank 0 sleeps 60 s: without the grace the call waits for it)
        text = str(info.value)
        assert "ZeroDivisionError: rank 1's own failure" in text, text
        assert "rank(s) [0] still running 2 s after it, group torn down; rank 1:" in text, text
        assert not group.alive


def test_the_reported_rank_is_the_cause_not_the_peer_that_saw_it_missing():
    """Found by fault injection: rank 0's "ranks [1] never arrived" was reported and rank 1's
    own exception appeared nowhere."""
    with WorkerGroup(2) as group:
        with pytest.raises(WorkerError) as info:
            group.run("tests.cases_spawn:the_cause_arrives_second", timeout=60)
        text = str(info.value)
        assert text.startswith("tests.cases_spawn:the_cause_arrives_second failed on ranks "
                               "[0, 1]; rank 1:"), text
        assert "ZeroDivisionError: rank 1's own failure" in text, text
