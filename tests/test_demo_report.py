"""The demo's report from a run's outputs and the engine's step history (no processes)."""

from __future__ import annotations

from types import SimpleNamespace

from colo_rollout.sched.plan import Phase
from colo_rollout.tools.demo import print_report, summarize


def _run(phases_d_rows):
    outs = {f"r{i}": SimpleNamespace(tokens=[1] * (i + 1), submit_time=0.0,
                                     first_token_time=0.1 * (i + 1), finish_time=1.0 * (i + 1),
                                     finish_reason=SimpleNamespace(value="length"))
            for i in range(4)}
    requests = [SimpleNamespace(request_id=r) for r in outs]
    engine = SimpleNamespace(history=[SimpleNamespace(phase=p, d_rows=d)
                                      for p, d in phases_d_rows])
    return summarize(outs, requests, 2.0, engine)


def test_a_pd_modes_rounds_are_counted(capsys):
    """(found by probing: every PD-mode demo reported 0 prefill, 0 decode steps)"""
    rep = _run([(Phase.ROUND, 0), (Phase.ROUND, 3), (Phase.ROUND, 2)])
    assert rep["steps"] == {"prefill": 0, "decode": 0, "rounds": 3, "rounds_with_d": 2}
    rep.update(layout="1 rank", warmup_s=0.0, graphs=0)
    print_report(rep)
    assert "steps      : 3 PD rounds (2 with a D iteration)" in capsys.readouterr().out


def test_normal_modes_steps_are_prefill_and_decode(capsys):
    rep = _run([(Phase.PREFILL, 0), (Phase.DECODE, 4), (Phase.DECODE, 4)])
    assert rep["steps"] == {"prefill": 1, "decode": 2, "rounds": 0, "rounds_with_d": 0}
    assert rep["generated_tokens"] == 10 and rep["tokens_per_s"] == 5.0
    assert rep["latency_s"]["p50"] <= rep["latency_s"]["p90"] <= rep["latency_s"]["p99"]
    rep.update(layout="1 rank", warmup_s=0.0, graphs=0)
    print_report(rep)
    assert "steps      : 1 prefill, 2 decode" in capsys.readouterr().out
