"""StreamRoute pieces that are plain host logic (the streams themselves are a GPU test)."""

import pytest
import torch

from colo_rollout.config import STREAM_PRIORITIES
from colo_rollout.inference.stream_route import HIGH_PRIORITY, StreamRoute, stream_priorities


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
    from colo_rollout.inference.stream_route import Span
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
    from colo_rollout.inference.stream_route import routes_p_collective

    assert routes_p_collective("auto", adp, atp, p_graphs) is expected
    assert routes_p_collective("always", adp, atp, p_graphs) is True
    assert routes_p_collective("off", adp, atp, p_graphs) is False
