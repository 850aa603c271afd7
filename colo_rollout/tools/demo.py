"""`colo-rollout demo`: serve a synthetic workload with the engine (engine.mode: Normal, or a PD
mode) and report.

Runs on every rank (spawned CPU processes, or torchrun on GPUs). The engine is warmed up first
(decode and prefill CUDA graphs captured for the workload's contexts, the P communicator made),
so the timed run measures steady state; the warm-up time is reported apart. Rank 0 submits the
workload, shows a progress bar, and prints throughput and latency percentiles when all requests
finish.
"""

from __future__ import annotations

import json
import time

import numpy as np

from colo_rollout.config import load_config
from colo_rollout.engine.engine import Engine, check_same_config
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.quiet import quiet_known_warnings
from colo_rollout.workloads.workload import synthetic_requests
from colo_rollout.config.files import strict_json, write_output


def run_demo(rank: int, world: int, config_path: str, overrides: dict | None = None,
             quiet: bool = False, report: str | None = None) -> dict:
    quiet_known_warnings()
    cfg = load_config(config_path, overrides)
    groups = init_parallel(cfg.parallel)
    # the command's own section (Engine() checks the model, engine and parallel ones)
    check_same_config(cfg, groups, ("workload",), "demo")
    engine = Engine(cfg, groups)
    requests = synthetic_requests(cfg)
    bar = None
    if rank == 0 and not quiet and engine.load_stats is not None:
        st = engine.load_stats
        print(f"loaded {cfg.model.checkpoint}: {st.bytes_read / 1e9:.2f} GB (this rank's "
              f"slices) in {st.seconds:.2f} s, {st.gb_per_s:.2f} GB/s", flush=True)
    if rank == 0 and not quiet:
        print("warming up: capturing decode and prefill graphs ..."
              if cfg.parallel.backend == "nccl" else "warming up ...", flush=True)
    t0 = time.perf_counter()
    graphs = engine.warmup(max_context=max(len(r.prompt) + r.params.max_tokens
                                           for r in requests))
    warm = time.perf_counter() - t0
    if rank == 0 and not quiet:
        print(f"warm-up: {graphs} graphs in {warm:.1f} s (outside the timed run)", flush=True)
    if rank == 0 and not quiet:
        from tqdm import tqdm

        total_tokens = sum(r.params.max_tokens for r in requests)
        print(f"serving {len(requests)} requests ({sum(len(r.prompt) for r in requests)} prompt "
              f"tokens, {total_tokens} output tokens) on {world} rank(s), layout "
              f"{groups.layout.name}", flush=True)
        bar = tqdm(total=len(requests), unit="req", desc=f"demo {groups.layout.name}",
                   dynamic_ncols=True)

    t0 = time.perf_counter()
    outs = engine.generate(requests, on_finish=(lambda o: bar.update(1)) if bar else None)
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    engine.check_integrity()
    engine.close()  # D graphs hold NCCL collectives: drop them before the groups go away
    rep = summarize(outs, requests, wall, engine)
    rep["warmup_s"], rep["graphs"] = warm, graphs
    rep["layout"] = groups.layout.name
    rep["device"] = str(groups.device)
    if cfg.engine.mtp:  # MTP drafting: the share of drafts accepted
        sched = engine.scheduler
        rep["mtp"] = {"drafts": sched.drafts_verified, "accepted": sched.drafts_accepted,
                      "acceptance": sched.drafts_accepted / max(sched.drafts_verified, 1)}
    if rank == 0 and not quiet:
        print_report(rep)
    if rank == 0 and report:  # its folder made if missing (the door checked it can be)
        write_output(report, strict_json(rep, indent=1), "the report")
    return rep


def summarize(outs, requests, wall: float, engine: Engine) -> dict:
    done = [outs[r.request_id] for r in requests]
    gen = sum(len(o.tokens) for o in done)
    lat = np.array([o.finish_time - o.submit_time for o in done])
    ttft = np.array([o.first_token_time - o.submit_time for o in done])
    phases = [h.phase.value for h in engine.history]
    pct = lambda a, q: float(np.percentile(a, q))  # noqa: E731
    return {
        "requests": len(done), "generated_tokens": gen, "wall_s": wall,
        "requests_per_s": len(done) / wall, "tokens_per_s": gen / wall,
        "latency_s": {f"p{q}": pct(lat, q) for q in (50, 90, 99)},
        "ttft_s": {f"p{q}": pct(ttft, q) for q in (50, 90, 99)},
        # Normal mode's steps are P or D; a PD mode's are rounds (D rows and P segments
        # together: found by probing, they were reported as 0 prefill, 0 decode)
        "steps": {"prefill": phases.count("prefill"), "decode": phases.count("decode"),
                  "rounds": phases.count("round"),
                  "rounds_with_d": sum(1 for h in engine.history
                                       if h.phase.value == "round" and h.d_rows)},
        "finish_reasons": sorted({o.finish_reason.value for o in done}),
    }


def print_report(rep: dict) -> None:
    print(f"\n{rep['requests']} requests, {rep['generated_tokens']} generated tokens in "
          f"{rep['wall_s']:.2f} s  ({rep['layout']})")
    print(f"  throughput : {rep['requests_per_s']:.2f} req/s, {rep['tokens_per_s']:.1f} tok/s")
    print(f"  {'':10s} {'p50':>9s} {'p90':>9s} {'p99':>9s}")
    for name in ("latency_s", "ttft_s"):
        v = rep[name]
        print(f"  {name:10s} {v['p50']:9.3f} {v['p90']:9.3f} {v['p99']:9.3f}")
    st = rep["steps"]
    if st.get("rounds"):
        print(f"  steps      : {st['rounds']} PD rounds ({st['rounds_with_d']} with a D "
              "iteration)")
    else:
        print(f"  steps      : {st['prefill']} prefill, {st['decode']} decode")
    if "mtp" in rep:
        m = rep["mtp"]
        print(f"  MTP drafts : {m['drafts']} verified, {m['accepted']} accepted "
              f"({100 * m['acceptance']:.1f}%)")
    if "warmup_s" in rep:
        print(f"  warm-up    : {rep['warmup_s']:.2f} s, {rep['graphs']} graphs (not in the above)")
    print(json.dumps({k: rep[k] for k in ('requests_per_s', 'tokens_per_s')}))
