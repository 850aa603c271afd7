"""The scheduling mode as a typed strategy: each rung of the ladder says what differs."""

from __future__ import annotations

import pytest

from colo_rollout.config import EngineConfig
from colo_rollout.multiplex.segment_policy import BalancedSpan
from colo_rollout.engine.strategy import Fine, Global, Normal, strategy_for


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


# ---- the rounds, on recording fakes: the order in which each strategy enqueues the phases ----

class _Pending:
    def done(self):
        return True

    def wait(self, timeout_s, what):
        pass


class _Runner:
    """P epochs of ``segments`` advance() calls; every call is logged."""

    def __init__(self, log, segments=2):
        self.log, self.segments, self.left = log, segments, 0

    @property
    def epoch_active(self):
        return self.left > 0

    def run(self, plan):
        self.log.append("P" if plan.has_prefill else "D" if plan.has_decode else "idle")
        return _Pending()

    def run_decode(self, plan, epoch=-1):
        self.log.append("D")
        return _Pending()

    def start_epoch(self, plan):
        self.left = self.segments

    def advance(self, ctl, clock):  # to the permitted endpoint: ``span`` more boundaries
        self.log.append("P")
        self.left -= min(self.left, max(ctl.span, 1))
        return _Pending() if self.left == 0 else None


class _Turnstile:
    def __init__(self, log):
        self.log, self.epoch, self.reached, self.span, self.active = log, -1, 0, 0, False

    def begin(self, epoch, d_enqueued, span):
        self.epoch, self.span, self.active = epoch, span, True

    def set_span(self, k):
        self.span = k

    def post_d(self):
        self.log.append("post_d")


class _Rendezvous:
    def __init__(self, log):
        self.log = log

    def pre_d(self, epoch, reached):
        self.log.append("pre_d")

    def post_d(self, epoch, reached):
        self.log.append("PostD")


class _Route:
    def __init__(self, log):
        self.log = log

    def fence_p(self, timeout):
        assert timeout == 7.0  # the fence is bounded by the engine's wait bound
        self.log.append("fence")


class _Plan:
    def __init__(self, prefill, decode):
        from colo_rollout.sched.plan import Phase

        self.has_prefill, self.has_decode = prefill, decode
        self.step = 0
        self.phase = (Phase.ROUND if prefill and decode else Phase.PREFILL if prefill
                      else Phase.DECODE if decode else Phase.IDLE)
        w = type("W", (), {"decode": [0] * decode, "prefill_tokens": 8 * prefill})()
        self.replicas = [w]


def _parts(log, segments=2):
    from colo_rollout.engine.recorder import Recorder
    from colo_rollout.engine.strategy import RoundParts

    sched = type("S", (), {"seqs": {}, "waiting": [], "epoch": "the epoch"})()
    return RoundParts(_Runner(log, segments), _Turnstile(log), _Rendezvous(log), _Route(log),
                      sched, Recorder(), 7.0, max_batch_size=4, max_prefill_tokens=64,
                      boundaries=2)


@pytest.mark.parametrize("mode,expect", [
    # Fine: ready D first, P's segment enqueued behind it
    ("fine", ["pre_d", "D", "PostD", "post_d", "P"]),
    # Global-Enqueue: the whole epoch, then D
    ("global_enqueue", ["P", "pre_d", "D", "PostD", "post_d"]),
    # Global-Complete: the whole epoch, the bounded fence, then D
    ("global_complete", ["P", "fence", "pre_d", "D", "PostD", "post_d"]),
])
def test_the_round_enqueues_d_and_p_in_the_strategys_order(mode, expect):
    log: list[str] = []
    parts = _parts(log)
    s = strategy_for(EngineConfig(mode=mode, segment_span=1), boundaries=2)
    out = s.run(_Plan(prefill=True, decode=True), parts, d_ready=1)
    assert log == expect
    assert len(out.pending) == 1  # D's tokens: the step's one host wait
    assert (out.epoch_plan is not None) == (mode != "fine")  # Fine: P still has a segment
    h = parts.recorder
    assert [sp.kind for sp in h.timeline] == [x for x in expect if x in ("P", "D")]


def test_with_no_p_anywhere_the_pd_round_is_normal_decode():
    log: list[str] = []
    out = strategy_for(EngineConfig(mode="fine"), 2).run(_Plan(False, True), _parts(log), 1)
    assert log == ["D"] and len(out.pending) == 1  # no rendezvous, no turnstile


def test_with_no_d_anywhere_p_runs_to_the_end_of_its_epoch():
    log: list[str] = []
    out = strategy_for(EngineConfig(mode="fine", segment_span=1), 3).run(
        _Plan(True, False), _parts(log, segments=3), 0)
    assert log == ["P", "post_d", "P", "post_d", "P"]
    assert out.p_out is not None and out.pending == []


def test_normal_runs_one_phase_and_counts_p_as_d_wait_when_d_was_ready():
    log: list[str] = []
    parts = _parts(log)
    Normal().run(_Plan(True, False), parts, d_ready=3)
    Normal().run(_Plan(False, True), parts, d_ready=3)
    assert log == ["P", "D"]
    parts.recorder.end_step(_Plan(False, True), p_in_flight=False, d_ready=3)
    assert parts.recorder.history[-1].d_wait_s > 0 and parts.recorder.history[-1].d_rows == 1


def test_the_recorder_keeps_the_latest_steps_and_whole_run_totals(monkeypatch):
    """history / timeline keep the latest HISTORY_KEPT / TIMELINE_KEPT entries (a long RL
    run's memory stays bounded; found by probing: ~20 entries per rollout step, for ever),
    while host_seconds still covers every step since the engine was made."""
    import time
    from types import SimpleNamespace

    from colo_rollout.engine import recorder as rec_mod
    from colo_rollout.sched.plan import Phase

    monkeypatch.setattr(rec_mod, "HISTORY_KEPT", 5)
    monkeypatch.setattr(rec_mod, "TIMELINE_KEPT", 7)
    r = rec_mod.Recorder()
    spent = {"steps": 0.0, "D_enqueue": 0.0}
    for i in range(20):
        r.begin_step()
        with r.phase("D") as t:
            time.sleep(0.0005)
        spent["D_enqueue"] += t.end - t.start
        r.end_step(SimpleNamespace(step=i, phase=Phase.DECODE, replicas=[]), p_in_flight=False,
                   d_ready=0)
        spent["steps"] += r.history[-1].seconds
    assert len(r.history) == 5 and [h.step for h in r.history] == [15, 16, 17, 18, 19]
    assert len(r.timeline) == 7
    host = r.host_seconds()
    assert host["steps"] == pytest.approx(spent["steps"]) and host["steps"] > sum(
        h.seconds for h in r.history)
    assert host["D_enqueue"] == pytest.approx(spent["D_enqueue"]) and host["P_enqueue"] == 0.0
