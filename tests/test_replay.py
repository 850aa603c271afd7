"""Trace replay and the bench on 2 gloo ranks: every turn completes in every mode with identical
work; waits delay releases; the report writes its table, JSON and plots."""

from __future__ import annotations

import json

import numpy as np

from colo_rollout.tools.bench import STEP_FIELDS, bench_trace, report, step_stats, variants
from colo_rollout.config import load_config

CFG = "configs/bench_cpu.yaml"


def _overrides(tmp_path, waits):
    return {"parallel.world_size": 2, "parallel.adp": 2, "parallel.ep": 2,
            "bench.conversations": 4, "bench.max_turns": 2, "bench.reps": 1,
            "bench.spans": [2], "bench.modes": ["normal", "fine"],
            "bench.wait_scales": waits, "bench.out_dir": str(tmp_path)}


def test_bench_replays_every_turn_with_identical_work(worker_groups, tmp_path, capsys):
    ov = _overrides(tmp_path, [0.0, 0.01])
    cfg = load_config(CFG, ov)
    assert [v for v, _ in variants(cfg)] == ["normal", "fine-2", "fine-sel", "fine-bal"]
    results = worker_groups(2).run("colo_rollout.tools.bench:run_bench", timeout=600,
                                   config_path=CFG, overrides=ov, progress=False)
    runs = results[0]["runs"]
    assert len(runs) == 2 * 4
    n = results[0]["trace"]["requests"]
    assert n == 8  # 4 conversations x 2 turns
    tokens = {r["output_tokens"] for r in runs}
    assert len(tokens) == 1  # fixed output lengths: every variant does the same work
    for r in runs:
        assert r["requests"] == n and r["makespan_s"] > 0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["request_p99_s"]
        assert r["trajectory_p99_s"] >= r["request_p99_s"] * 0.5
        assert len(r["request_completion_s"]) == n
    # a trajectory cannot finish before its (scaled) client waits have passed: x_i >= y_i for
    # every conversation implies the same for every quantile
    trace = bench_trace(cfg)
    waits = [0.01 * sum(t.wait_s for t in c.turns) for c in trace.conversations]
    by = {(r["wait_scale"], r["variant"]): r for r in runs}
    for v in ("normal", "fine-2"):
        assert by[(0.01, v)]["trajectory_p50_s"] >= float(np.percentile(waits, 50))
        assert by[(0.01, v)]["trajectory_p99_s"] >= float(np.percentile(waits, 99))
    summary = report(results, cfg, str(tmp_path))
    out = capsys.readouterr().out
    assert "fine-2" in out and "vs normal" in out
    assert set(summary) == {"0", "0.01"}
    data = json.loads((tmp_path / "bench.json").read_text())
    assert len(data["runs"]) == 8
    st = data["timeline_stats"]["normal"]  # host clock on CPU: P and D never overlap
    assert st["p_busy_ms"] > 0 and st["d_busy_ms"] > 0 and st["d_iterations"] > 0
    assert st["overlap_ms"] < 1e-6
    assert "timeline" in out
    # per-step rows of the timeline cells (rank 0, first rep, first wait scale)
    assert data["step_fields"] == list(STEP_FIELDS)
    for v in ("normal", "fine-2"):
        rows = by[(0.0, v)]["steps"]
        assert len(rows) == data["step_stats"][v]["steps"] > 0
        assert all(r[2] <= r[1] for r in rows)  # a D iteration runs only ready rows
        assert rows[0][1] == 0  # the first step: every prompt still waits for its P
        assert data["step_stats"][v]["p_alone"] >= 1
        assert any(r[2] > 0 for r in rows)  # D iterations ran
    assert "steps" not in by[(0.01, "normal")]  # only the timeline cells keep them
    assert "P alone" in out
    assert (tmp_path / "ccdf_request.png").stat().st_size > 1000
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def test_step_stats_split_p_steps_by_whether_d_was_ready():
    rows = [["PREFILL", 0, 0, 0.0, 0, 5.0, 1],  # P alone
            ["DECODE", 3, 3, 1.0, 2, 4.0, 1],  # D with an epoch in flight
            ["DECODE", 3, 3, 0.0, 0, 2.0, 0],  # D only: not a P step
            ["IDLE", 0, 0, 0.0, 0, 1.5, 1]]  # parked, waiting for P alone
    st = step_stats(rows)
    assert st == {"steps": 4, "p_steps": 3, "p_alone": 2, "p_alone_ms": 6.5,
                  "p_with_d": 1, "p_with_d_ms": 4.0}
    assert step_stats([])["p_steps"] == 0


def test_timeline_stats_split_busy_overlap_and_tail():
    from colo_rollout.tools.bench import timeline_stats

    spans = [("P", 0.0, 0.010), ("D", 0.005, 0.008), ("P", 0.012, 0.020),
             ("D", 0.018, 0.022), ("D", 0.030, 0.034), ("D", 0.040, 0.042)]
    st = timeline_stats(spans)
    assert abs(st["p_busy_ms"] - 18.0) < 1e-9  # 10 + 8
    assert abs(st["d_busy_ms"] - 13.0) < 1e-9  # 3 + 4 + 4 + 2
    assert abs(st["overlap_ms"] - 5.0) < 1e-9  # 3 inside the first P, 2 inside the second
    assert abs(st["d_tail_ms"] - 8.0) < 1e-9  # after P ends at 20 ms: 2 + 4 + 2
    assert abs(st["d_median_ms"] - 4.0) < 1e-9 and st["d_iterations"] == 4
    assert abs(st["d_max_ms"] - 4.0) < 1e-9
    assert timeline_stats(spans + [("D", 0.05, 52.05)])["d_max_ms"] == 52000.0
    assert timeline_stats([])["p_busy_ms"] == 0.0
