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
