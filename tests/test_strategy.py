"""The scheduling mode as a typed strategy: each rung of the ladder says what differs."""

from __future__ import annotations

import pytest

from colo_rollout.config import EngineConfig
from colo_rollout.multiplex.segment_policy import BalancedSpan
from colo_rollout.multiplex.strategy import Fine, Global, Normal, strategy_for


@pytest.mark.parametrize("mode,kind,pd,d_first,fence,whole,graphs", [
    ("normal", Normal, False, False, False, True, True),
    ("global_complete", Global, True, False, True, True, False),
    ("global_enqueue", Global, True, False, False, True, False),
    ("fine", Fine, True, True, False, False, False),
])
def test_each_mode_builds_its_strategy(mode, kind, pd, d_first, fence, whole, graphs):
    s = strategy_for(EngineConfig(mode=mode), boundaries=10)
    assert type(s) is kind
    assert (s.pd, s.d_first, s.fence, s.whole_epoch, s.p_graphs_by_default) == (
        pd, d_first, fence, whole, graphs)
    assert (s.policy is None) == (kind is not Fine)


def test_fine_carries_its_span_policy():
    s = strategy_for(EngineConfig(mode="fine", segment_policy="balanced"), boundaries=10)
    assert isinstance(s.policy, BalancedSpan) and s.balanced
    assert not strategy_for(EngineConfig(mode="fine"), boundaries=10).balanced
