"""The command line interrupted (found by fault injection): SIGTERM to `colo-rollout` left its
spawned ranks running (they trained on, then waited for ever); a parent killed outright left
them too; Ctrl-C waited 10 s a rank and printed a traceback. Now SIGTERM is an interrupt --
one line, exit code 130, the ranks torn down -- and ranks exit once their parent is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo_cpu.yaml")


def _start(tmp_path):
    """`colo-rollout demo` on a long workload, in a session of its own; returns the process
    once its ranks serve (the progress bar is out)."""
    err = open(tmp_path / "err.txt", "w")
    p = subprocess.Popen([sys.executable, "-m", "colo_rollout.cli", "demo", DEMO, "--set",
                          "workload.num_requests=100000"], cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=err, start_new_session=True)
    deadline = time.monotonic() + 120
    while "demo" not in (tmp_path / "err.txt").read_text() and time.monotonic() < deadline:
        assert p.poll() is None, (tmp_path / "err.txt").read_text()
        time.sleep(0.5)
    time.sleep(2)  # into serving
    return p


def _session_gone(pgid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.skipif(sys.platform != "linux", reason="process groups and signals of Linux")
def test_sigterm_is_an_interrupt_and_the_ranks_go_with_it(tmp_path):
    p = _start(tmp_path)
    start = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 130
    assert time.monotonic() - start < 10  # the ranks are killed, not waited for
    lines = (tmp_path / "err.txt").read_text().strip().splitlines()
    # (the resource tracker may warn of the killed ranks' semaphores after it)
    assert "error: interrupted" in lines[-3:], lines[-5:]
    assert not any("Traceback" in line for line in lines)
    assert _session_gone(p.pid, 10), "ranks left behind"


@pytest.mark.skipif(sys.platform != "linux", reason="process groups and signals of Linux")
def test_ranks_exit_once_their_parent_is_killed(tmp_path):
    p = _start(tmp_path)
    p.kill()  # no teardown at all
    p.wait(timeout=10)
    assert _session_gone(p.pid, 15), "ranks left behind"


def test_a_rank_start_failing_on_the_launchers_gone_resources_prints_nothing(capsys):
    """An interrupt while the ranks start: a forkserver child fails inside multiprocessing's
    bootstrap on a semaphore the exiting launcher removed, and stays quiet (found by probing:
    its FileNotFoundError traceback followed the launcher's `error: interrupted`); an error
    with the package's own frames still prints."""
    import multiprocessing.synchronize as mps
    import sys

    before = sys.excepthook
    try:
        from colo_rollout.preload import _quiet_orphan_start
    finally:
        sys.excepthook = before
    try:
        object.__new__(mps.SemLock).__setstate__((0, 1, 1, "/colo-no-such-semaphore"))
    except OSError as e:
        tb = e.__traceback__.tb_next  # (from multiprocessing's frames on, as in the child)
        _quiet_orphan_start(type(e), e, tb)
        assert capsys.readouterr().err == ""
        _quiet_orphan_start(type(e), e, e.__traceback__)  # (this test's frame too)
        assert "FileNotFoundError" in capsys.readouterr().err
