"""`colo-rollout bench CONFIG`: the ordering ladder on one trace, with repetitions.

Owns the benchmark matrix (wait scale x mode variant x repetition), its aggregation (medians and
IQRs), the table, the JSON and the plots (CCDFs of request and trajectory completion; a per-rank
timeline of P segments and D iterations). Per-rank work is ``run_bench`` (spawned CPU ranks or
torchrun); ``report`` runs in the launching process.

Mode variants: normal, global_complete, global_enqueue, fine-K for every K in bench.spans, and
fine-sel (the load-selected span) and fine-bal (the balanced span). All variants replay the
same trace with the same fixed output lengths, so they do identical work; a fresh engine
serves every run on the previous run's worker (worker/worker.py: the same model, KV storage
and D graphs; ``Engine(cfg, groups, worker=...)``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

from colo_rollout.config import Config, load_config
from colo_rollout.engine.engine import Engine, check_same_config
from colo_rollout.model.weights import random_state_dict
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.workloads.replay import replay
# (bench_trace: the door's check, imported here as this module's own)
from colo_rollout.door import bench_trace, bench_trace_offered, turn_cap  # noqa: F401
from colo_rollout.quiet import quiet_known_warnings
from colo_rollout.workloads.trace import Trace
from colo_rollout.config.files import output_errors, strict_json, write_output

METRICS = ("makespan_s", "requests_per_s", "request_p50_s", "request_p99_s",
           "trajectory_p50_s", "trajectory_p99_s", "ttft_p50_s", "ttft_p99_s", "mean_d_wait_ms",
           "evictions", "mean_span")


# columns of a run's "steps" rows (rank 0, the timeline cell): one row per engine step
STEP_FIELDS = ("phase", "d_ready", "d_rows", "d_wait_ms", "span", "step_ms", "p_in_flight")


def step_stats(steps: list[list]) -> dict:
    """Where a replay's steps went, from its "steps" rows: steps with P work in flight (a P
    step, or a P epoch in flight), and of those the ones with no D row ready anywhere -- P that
    no ordering can hide -- against the ones where D rows were ready; host ms of each."""
    idx = {k: i for i, k in enumerate(STEP_FIELDS)}
    out = {"steps": len(steps), "p_steps": 0, "p_alone": 0, "p_alone_ms": 0.0,
           "p_with_d": 0, "p_with_d_ms": 0.0}
    for row in steps:
        if not (row[idx["p_in_flight"]] or row[idx["phase"]] == "PREFILL"):
            continue
        out["p_steps"] += 1
        key = "p_alone" if row[idx["d_ready"]] == 0 else "p_with_d"
        out[key] += 1
        out[key + "_ms"] += row[idx["step_ms"]]
    return out


def variants(cfg: Config) -> list[tuple[str, dict]]:
    """(table name, engine settings) of every variant the bench runs."""
    return cfg.bench.variant_settings()


def run_bench(rank: int, world: int, config_path: str, overrides: dict | None = None,
              progress: bool = True) -> dict:
    quiet_known_warnings()
    cfg = load_config(config_path, overrides)
    groups = init_parallel(cfg.parallel)
    # the command's own sections (each Engine() checks the model, engine and parallel ones)
    check_same_config(cfg, groups, ("workload", "bench"), "bench")
    offered, trace = bench_trace_offered(cfg, os.fspath(config_path))
    # turns past what the engine holds are dropped with the rest of their conversation (door.
    # bench_trace): said once, not found by counting the report's requests
    dropped = offered.num_requests - trace.num_requests
    if rank == 0 and dropped:
        lost = len(offered.conversations) - len(trace.conversations)
        print(f"bench: {dropped} of {offered.num_requests} turns dropped ({lost} of "
              f"{len(offered.conversations)} conversations entirely): each does not fit the "
              f"engine (context + prompt + output past the {turn_cap(cfg.engine)} tokens one "
              "turn may hold) or follows one that does not", flush=True)
    # drawn where the model runs: a multi-GB MoE takes minutes to draw on one CPU thread
    sd = random_state_dict(cfg.model, device=groups.device)
    runs, timelines = [], {}
    max_context = max(sum(t.prompt_tokens + t.output_tokens for t in c.turns)
                      for c in trace.conversations)
    cells = [(w, name, kw, rep) for w in cfg.bench.wait_scales for name, kw in variants(cfg)
             for rep in range(cfg.bench.reps)]
    bar = None
    if rank == 0 and progress:
        from tqdm import tqdm

        bar = tqdm(total=len(cells), unit="run", desc="bench", dynamic_ncols=True)
    partial = None
    if rank == 0:
        partial_path = os.path.join(cfg.bench.out_dir, "runs_partial.jsonl")
        with output_errors(partial_path, "the partial runs"):
            os.makedirs(cfg.bench.out_dir, exist_ok=True)
            partial = open(partial_path, "w")
    gpu = groups.device.type == "cuda"
    # One untimed replay first: the process's first P and D shapes pay one-off costs (kernel
    # selection, allocator growth, lazy library init) that would otherwise land in whichever
    # cell runs first (on 2x H200 it doubled Normal's first makespan).
    engine = None
    if cfg.bench.warmup_replay:
        engine = _serve(cfg, groups, sd, trace, cfg.bench.wait_scales[0], max_context)[0]
    for w, name, kw, rep in cells:
        timeline_cell = rep == 0 and w == cfg.bench.wait_scales[0]
        # on a GPU the timeline cell records CUDA events: what the GPU ran, not host enqueue
        ecfg = dataclasses.replace(cfg, engine=dataclasses.replace(
            cfg.engine, **kw, cuda_timing=gpu and timeline_cell))
        engine, metrics, raw, gpu_spans = _serve(ecfg, groups, sd, trace, w, max_context,
                                                 engine)
        row = {"wait_scale": w, "variant": name, "rep": rep, **metrics.to_json()}
        if rank == 0:
            outs = engine.scheduler.by_id
            row["request_completion_s"] = [o.finish_time - o.submit_time
                                           for rid, o in outs.items() if rid in raw["done"]]
            row["ttft_s"] = {rid: o.first_token_time - o.submit_time
                             for rid, o in outs.items() if rid in raw["done"]}
            row["host_s"] = engine.host_seconds()
            if timeline_cell:  # per step, to read a timeline by: is D held, or is none ready?
                row["steps"] = [[h.phase.name, h.d_ready, h.d_rows, round(1e3 * h.d_wait_s, 3),
                                 h.span, round(1e3 * h.seconds, 3), int(h.p_in_flight)]
                                for h in engine.history]
        runs.append(row)
        if partial is not None:  # survives a run that is cut short (device time limits)
            with output_errors(partial_path, "the partial runs"):
                partial.write(strict_json({k: v for k, v in row.items()
                                           if k not in ("request_completion_s", "ttft_s",
                                                        "steps")}) + "\n")
                partial.flush()
        if timeline_cell:  # what the GPU ran where it was timed, else the host's enqueue
            spans = gpu_spans or engine.timeline
            t0 = min((s.start for s in spans), default=0.0)
            timelines[name] = [(s.kind, s.start - t0, s.end - t0) for s in spans]
        if bar is not None:
            bar.set_postfix_str(f"{name} x{w:g} #{rep}: {metrics.makespan_s:.2f}s")
            bar.update(1)
    if engine is not None:
        engine.close()
    if bar is not None:
        bar.close()
    if partial is not None:
        partial.close()
    stats = trace.stats()
    return {"runs": runs if rank == 0 else [], "timelines": timelines, "rank": rank,
            "clock": "GPU (CUDA events)" if gpu else "host",
            "layout": groups.layout.name, "trace": {"source": trace.source,
                                                    "requests": trace.num_requests,
                                                    "conversations": stats.conversations,
                                                    "dropped_turns": dropped}}


def _serve(cfg: Config, groups, sd, trace: Trace, wait_scale: float, max_context: int,
           prev: Engine | None = None):
    """One replay on a fresh engine: D graphs and communicators are set up before the clock
    starts. With ``prev`` (the previous cell's engine) the fresh engine takes over its worker: new
    scheduler, control plane, turnstile, streams and policy, the same model, KV storage and D
    graphs (rebuilding those took most of a cell on the larger MoE; the served work does not
    depend on them). The caller closes the last engine. Returns (engine, metrics, raw, GPU
    spans -- empty unless engine.cuda_timing)."""
    engine = (Engine(cfg, groups, sd) if prev is None
              else Engine(cfg, groups, worker=prev.worker))
    engine.warmup(max_context)
    metrics, raw = replay(engine, trace, wait_scale=wait_scale)
    spans = engine.route.gpu_spans()
    return engine, metrics, raw, spans


def _median_iqr(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), q[2] - q[0]


def report(results: list[dict], cfg: Config, out_dir: str) -> dict:
    """Table on stdout, JSON and plots in ``out_dir``; returns the aggregate."""
    os.makedirs(out_dir, exist_ok=True)
    runs = results[0]["runs"]
    agg: dict = {}
    for r in runs:
        cell = agg.setdefault(f"{r['wait_scale']:g}", {}).setdefault(r["variant"], {})
        for m in METRICS:
            cell.setdefault(m, []).append(r[m])
    summary = {w: {v: {m: dict(zip(("median", "iqr"), _median_iqr(vals)))
                       for m, vals in cell.items()} for v, cell in cells.items()}
               for w, cells in agg.items()}
    t = results[0]["trace"]
    print(f"\nbench: {t['requests']} requests / {t['conversations']} conversations "
          f"({t['source']}), layout {results[0]['layout']}, {cfg.bench.reps} reps; "
          "median (IQR)")
    head = (f"{'wait':>5s} {'variant':>16s} {'makespan s':>15s} {'req/s':>8s} "
            f"{'req p99 s':>10s} {'traj p99 s':>11s} {'TTFT p50 ms':>12s} {'TTFT p99 ms':>12s} "
            f"{'D wait ms':>10s} "
            f"{'evict':>5s} {'K':>5s}  vs normal")
    print(head)
    for w, cells in summary.items():
        base = cells.get("normal", {}).get("makespan_s", {}).get("median")
        for v, c in cells.items():
            ms = c["makespan_s"]
            rel = f"{100 * (ms['median'] / base - 1):+6.1f}%" if base else ""
            print(f"{w:>5s} {v:>16s} {ms['median']:8.2f} ({ms['iqr']:4.2f}) "
                  f"{c['requests_per_s']['median']:8.2f} {c['request_p99_s']['median']:10.2f} "
                  f"{c['trajectory_p99_s']['median']:11.2f} "
                  f"{1e3 * c['ttft_p50_s']['median']:12.1f} "
                  f"{1e3 * c['ttft_p99_s']['median']:12.1f} "
                  f"{c['mean_d_wait_ms']['median']:10.2f} {c['evictions']['median']:5.0f} "
                  f"{c['mean_span']['median']:5.1f}  {rel}")
    tl = results[0]["timelines"]  # rank 0, first repetition of the first wait scale
    tstats = {v: timeline_stats(spans) for v, spans in tl.items()}
    if tstats:
        print(f"\ntimeline, rank 0, first rep ({results[0].get('clock', 'host')} clock; ms): "
              "P busy, D busy, P and D at once, D-only tail, median and longest D iteration")
        for v, st in tstats.items():
            print(f"{v:>22s} {st['p_busy_ms']:9.1f} {st['d_busy_ms']:9.1f} "
                  f"{st['overlap_ms']:9.1f} {st['d_tail_ms']:9.1f} {st['d_median_ms']:7.2f} "
                  f"{st['d_max_ms']:9.1f}")
    host = {}  # first wait scale, first repetition: where the host time went (rank 0)
    for r in runs:
        if r["rep"] == 0 and r["wait_scale"] == runs[0]["wait_scale"] and "host_s" in r:
            host[r["variant"]] = r["host_s"]
    if host:
        parts = ("steps", "exchange", "plan", "D_enqueue", "rendezvous", "P_enqueue", "resolve")
        print("\nhost time, rank 0, first rep (ms): " + ", ".join(parts))
        for v, h in host.items():
            print(f"{v:>22s} " + " ".join(f"{1e3 * h.get(k, 0.0):9.1f}" for k in parts))
    steps = {r["variant"]: step_stats(r["steps"]) for r in runs
             if r["rep"] == 0 and r["wait_scale"] == runs[0]["wait_scale"] and "steps" in r}
    if steps:
        print("\nsteps, rank 0, first rep: all, with P in flight; of those with no D row "
              "ready (P alone) and with D rows ready (count, host ms)")
        for v, st in steps.items():
            print(f"{v:>22s} {st['steps']:6d} {st['p_steps']:6d} {st['p_alone']:6d} "
                  f"{st['p_alone_ms']:9.1f} {st['p_with_d']:6d} {st['p_with_d_ms']:9.1f}")
    report = {"summary": summary, "runs": runs, "trace": t,
              "layout": results[0]["layout"], "timeline_stats": tstats,
              "step_fields": STEP_FIELDS, "step_stats": steps,
              # every rank's: a stall on one rank is explained by what its peers ran
              "timelines_by_rank": [r["timelines"] for r in results]}
    write_output(os.path.join(out_dir, "bench.json"), strict_json(report, indent=1),
                 "the report")
    with output_errors(out_dir, "the plots"):
        _plots(results, runs, cfg, out_dir)
    return summary


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return 1e3 * total


def timeline_stats(spans: list[tuple[str, float, float]]) -> dict:
    """Where one run's time went, from its (kind, start s, end s) spans: busy time of P and of
    D (unions), time both ran at once, the D-only tail after the last P, the median and the
    longest D span (a stalled D iteration shows there)."""
    p = [(a, b) for k, a, b in spans if k == "P"]
    d = [(a, b) for k, a, b in spans if k == "D"]
    p_busy, d_busy = _union_ms(p), _union_ms(d)
    both = _union_ms(p + d)
    last_p = max((b for _, b in p), default=float("-inf"))
    tail = [(max(a, last_p), b) for a, b in d if b > last_p]
    durations = sorted(b - a for a, b in d)
    return {"p_busy_ms": p_busy, "d_busy_ms": d_busy,
            "overlap_ms": p_busy + d_busy - both,
            "d_tail_ms": _union_ms(tail),
            "d_median_ms": 1e3 * durations[len(durations) // 2] if durations else 0.0,
            "d_max_ms": 1e3 * durations[-1] if durations else 0.0,
            "d_iterations": len(d)}


def _plots(results: list[dict], runs: list[dict], cfg: Config, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    w0 = cfg.bench.wait_scales[0]
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        if r["rep"] == 0 and r["wait_scale"] == w0:
            x = np.sort(r["request_completion_s"])
            ax.step(x, 1 - np.arange(len(x)) / len(x), where="post", label=r["variant"])
    ax.set_xlabel("request completion (s)")
    ax.set_ylabel("CCDF")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title(f"request completion, wait x{w0:g}")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ccdf_request.png"), dpi=120)
    plt.close(fig)

    # Normal and one Fine variant (fine-2 where it ran, else the first Fine variant)
    have = list(results[0]["timelines"])
    fine = [n for n in ("fine-2", *have) if n in have and n.startswith("fine")][:1]
    names = [n for n in ("normal", *fine) if n in have]
    if not names:
        return
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 1.2 + 0.6 * len(results) * len(names)),
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        for res in results:
            y = res["rank"]
            for kind, a, b in res["timelines"].get(name, []):
                ax.barh(y, b - a, left=a, height=0.35 if kind == "P" else 0.7,
                        color="tab:orange" if kind == "P" else "tab:blue")
        ax.set_yticks([r["rank"] for r in results])
        ax.set_ylabel("rank")
        ax.set_title(f"{name}: P segments (orange) and D iterations (blue), "
                     f"{results[0].get('clock', 'host')} clock")
    axes[-1, 0].set_xlabel("seconds since first work")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "timeline.png"), dpi=120)
    plt.close(fig)
