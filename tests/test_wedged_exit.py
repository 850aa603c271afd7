"""A rank whose GPU cannot be drained exits with its error instead of hanging in teardown.

Seen on 2x H200 (docs/benchmarks.md, session 7): a P AllReduce hung beside D's graph-captured
collectives; the step's bounded wait raised, and then the launcher's teardown synchronized the
device and hung silently, so the error never appeared. These tests run the launcher in a
subprocess shaped as one torchrun rank (the device's wedge is a stand-in: CPU has none)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from colo_rollout.runtime import parallel
from colo_rollout.runtime.device import DeviceStall

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(target: str, timeout_s: float = 1.0) -> tuple[subprocess.CompletedProcess, float]:
    code = textwrap.dedent(f"""
        from colo_rollout.launch import _launch
        print(_launch({target!r}, "configs/tiny_cpu.yaml", {{"parallel.timeout_s": {timeout_s},
              "parallel.world_size": 1, "parallel.adp": 1, "parallel.ep": 1}}))
    """)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    return res, time.monotonic() - t


def test_a_device_stall_exits_with_its_error():
    res, _ = _launch("tests.cases_launch:stall")
    assert res.returncode == 1, res.stderr
    assert "DeviceStall: rank 0, step 12: D tokens" in res.stderr
    assert "rank 0: the GPU cannot be drained; aborting the communicators" in res.stderr
    assert "None" not in res.stdout  # nothing returned as if it had succeeded


def test_a_wedged_device_after_another_error_exits_within_the_bound():
    res, took = _launch("tests.cases_launch:peer_died_device_wedged", timeout_s=1.0)
    assert res.returncode == 1, res.stderr
    # the original error is printed, then the drain's, naming its bound
    assert "RuntimeError: control exchange: rank 1 sent nothing" in res.stderr
    assert "the device did not drain within 1 s" in res.stderr
    assert took < 60  # interpreter start + 1 s, not a hang


def test_a_clean_run_still_returns_and_tears_down():
    res, _ = _launch("tests.cases_launch:fine")
    assert res.returncode == 0, res.stderr
    assert "[{'rank': 0}]" in res.stdout


def test_drain_device_bounds_a_synchronize_that_never_returns(monkeypatch):
    never = threading.Event()
    monkeypatch.setattr(parallel, "_device_sync", never.wait)
    t = time.monotonic()
    with pytest.raises(DeviceStall, match="did not drain within 0.2 s"):
        parallel.drain_device(0.2)
    assert time.monotonic() - t < 5
    never.set()  # release the left-behind thread


def test_drain_device_returns_when_drained_and_surfaces_its_errors(monkeypatch):
    calls = []
    monkeypatch.setattr(parallel, "_device_sync", lambda: calls.append(1))
    parallel.drain_device(5.0)
    parallel.drain_device(None)
    assert calls == [1, 1]

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(parallel, "_device_sync", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        parallel.drain_device(5.0)
