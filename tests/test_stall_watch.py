"""The stall watch (plain threads, no processes)."""

from __future__ import annotations

import io
import time

import pytest

from colo_rollout.engine.stall_watch import StallWatch


def _slow_part():
    time.sleep(0.3)


def test_an_interval_past_its_limit_prints_the_armed_threads_stack_once():
    buf = io.StringIO()
    watch = StallWatch(0.05, file=buf)
    try:
        watch.arm("rank 1 step 7")
        _slow_part()
        watch.disarm()
        text = buf.getvalue()
        assert "[stall watch] rank 1 step 7: still running after 0.05 s" in text
        assert "in _slow_part" in text  # where the armed thread was waiting
        assert watch.printed == 1  # once per interval, however long it runs
        watch.arm("fast")
        watch.disarm()
        time.sleep(0.15)
        assert "fast" not in buf.getvalue() and watch.printed == 1
    finally:
        watch.close()
    assert not watch._thread.is_alive()


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit > 0"):
        StallWatch(0.0)
