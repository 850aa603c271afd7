"""StreamRoute pieces that are plain host logic (the streams themselves are a GPU test)."""

import pytest
import torch

from colo_rollout.config import STREAM_PRIORITIES
from colo_rollout.multiplex.stream_route import HIGH_PRIORITY, StreamRoute, stream_priorities


def test_the_favoured_phase_gets_the_higher_priority():
    d, p = stream_priorities("decode")
    assert d == HIGH_PRIORITY < p == 0  # lower number = higher CUDA priority
    d, p = stream_priorities("prefill")
    assert p == HIGH_PRIORITY < d == 0
    assert stream_priorities("equal") == (0, 0)
    assert all(stream_priorities(c) for c in STREAM_PRIORITIES)  # every config value maps


def test_unknown_priority_is_refused():
    with pytest.raises(ValueError, match="stream priority 'high'"):
        stream_priorities("high")


def test_route_is_inactive_on_cpu_whatever_the_priority():
    r = StreamRoute.for_layout(torch.device("cpu"), True, 2, 2, "auto", False, "prefill")
    assert not r.active and r.d_stream is None and r.p_stream is None
    assert not r.route_p_collective


def test_overlap_stats_of_a_timeline():
    """The GPU timeline test's helper (tests/cases_gpu.py), on a hand-made timeline in seconds:
    a P epoch (two segments) from 1.0 to 1.5 s with two D iterations inside it."""
    from colo_rollout.multiplex.stream_route import Span
    from tests.cases_gpu import overlap_stats

    spans = [Span("D", 0.90, 0.92), Span("P", 1.00, 1.20, epoch=0), Span("D", 1.21, 1.23, 0),
             Span("P", 1.24, 1.40, epoch=0), Span("D", 1.41, 1.44, 0), Span("P", 1.45, 1.50, 0),
             Span("D", 1.60, 1.61), Span("P", 2.00, 2.05)]  # a shorter P step of its own
    got = overlap_stats(spans)
    assert got["p_window_ms"] == pytest.approx(500.0)
    assert got["d_inside"] == 2 and got["d_total"] == 4
    assert got["d_gap_max_ms"] == pytest.approx(290.0)  # 0.92 -> 1.21
    assert got["d_ms_inside"] == pytest.approx(25.0)  # (20 + 30) / 2
    assert got["d_ms_outside"] == pytest.approx(15.0)  # (20 + 10) / 2


@pytest.mark.parametrize("adp,atp,p_graphs,expected", [
    (2, 2, False, True),   # the crossed path
    (2, 1, False, False),  # eager P: full stream concurrency
    (1, 2, False, False),
    (2, 1, True, True),    # graphed P on two ranks: two communicators at once otherwise
    (1, 2, True, True),
    (1, 1, True, False),   # one rank: no collective pairs to cross
])
def test_auto_route_follows_layout_and_p_graphs(adp, atp, p_graphs, expected):
    from colo_rollout.multiplex.stream_route import routes_p_collective

    assert routes_p_collective("auto", adp, atp, p_graphs) is expected
    assert routes_p_collective("always", adp, atp, p_graphs) is True
    assert routes_p_collective("off", adp, atp, p_graphs) is False


class _Event:
    """A stand-in CUDA event: done after ``after`` queries (None: never)."""

    def __init__(self, after: int | None) -> None:
        self.after, self.queries, self.synced = after, 0, False

    def query(self) -> bool:
        self.queries += 1
        return self.after is not None and self.queries > self.after

    def synchronize(self) -> None:
        self.synced = True


def test_bounded_wait_returns_when_the_work_is_done():
    from colo_rollout.runtime.device import wait_event

    ev = _Event(after=50)
    wait_event(ev, 5.0, "D tokens")
    assert ev.queries == 51 and not ev.synced
    ev = _Event(after=None)
    wait_event(ev, None, "unbounded")  # no bound: the driver's own synchronize
    assert ev.synced and ev.queries == 0


def test_bounded_wait_raises_naming_what_it_waited_for():
    import time

    from colo_rollout.worker.runner import PendingSampled
    from colo_rollout.runtime.device import DeviceStall, wait_event

    t0 = time.monotonic()
    with pytest.raises(DeviceStall, match=r"rank 1, step 9: D tokens: .* within 0.05 s"):
        wait_event(_Event(after=None), 0.05, "rank 1, step 9: D tokens")
    assert 0.05 <= time.monotonic() - t0 < 2.0
    # a rank without tokens waits on its marker event, bounded the same way
    with pytest.raises(DeviceStall, match="P epoch"):
        PendingSampled(marker=_Event(after=None)).wait(0.05, "P epoch")
