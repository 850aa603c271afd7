"""Where a P step's GPU sits idle (diagnosis for issue 16's prefill target).

  torchrun --standalone --nproc-per-node 1 scripts/gpu_prefill_timeline.py CONFIG [--tokens 4096]
      [--shapes 4096,8192,8x1024] [--attention triton,cudnn] [--json PATH] [--clock]
      [--host-split] [--head-ms X [--stack]] [--busy-head MS] [--load-head MS]
      [--pipelined N]

``--shapes`` (N or SxN, comma-separated) and ``--attention`` (P attention backends, set on the
built model's attention modules in turn: ``engine.prefill_attention``'s values) run every
combination on one engine build (the build is most of a run's time); the full report is
printed for the first combination, a summary line for each.

Builds bench-speed's one-rank engine on CONFIG (random weights), times one fresh prefill of
``--tokens`` tokens as bench-speed does (graphs as configured), then records two more steps
under torch.profiler (CPU ops and CUDA kernels, graph replays included) and reads the trace:

  * the step's wall time, the union of its kernels' intervals (GPU busy) and the rest (idle);
  * the idle time before the first kernel (host preparation of the step), between kernels,
    and after the last one (the host's read-back of the sampled tokens);
  * every idle interval between kernels charged to the host op that launched the kernel
    after it (the innermost CPU op around that kernel's launch call): which launches come
    late, summed over the step;
  * the kernels by name (count, total us) -- the same list bench-speed's JSON has;
  * with ``--clock``: per layer, when the host reached its attention and when the GPU did
    (CUDA events, no profiler), and the timed step once more with Python's collector off;
    with ``--busy-head MS`` also per layer with the GPU in a spin kernel through the head,
    with ``--load-head MS`` in bf16 GEMMs (heavy load) through it;
  * with ``--pipelined N``: N steps enqueued back to back (each step's head under the previous
    step's kernels) against the same N one by one: what keeping the GPU fed across P steps
    would gain;
  * with ``--host-split``: the host time (unprofiled, perf_counter around each call) of the
    step's parts -- its inputs (index arrays, attention plan, the packed copy, dense calls),
    the forward, each attention, the rope launch, the dense call, the fused adds, the
    graph replays, the GEMM calls -- summed per step, mean of 5 steps;
  * with ``--head-ms X``: the step's first X ms in time order -- each kernel launch (host time
    of the call, the op or Python function around it, the kernel's start and length) and the
    host ops longer than 20 us between them; ``--stack`` profiles one more step with Python
    functions recorded (slower host, but every host gap named) and prints its head too.

Owns nothing of the engine. Plain numbers on stdout (and the JSON with --json).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gc
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch


def _events(trace: dict) -> tuple[list, list, dict]:
    """(kernels, cpu ops, launch calls by correlation id) of a chrome trace."""
    kernels, ops, launches = [], [], {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append(ev)
        elif cat in ("cpu_op", "user_annotation", "python_function"):
            ops.append(ev)
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            corr = ev.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = ev
    kernels.sort(key=lambda e: e["ts"])
    ops.sort(key=lambda e: e["ts"])
    return kernels, ops, launches


def _innermost(ops: list, starts: list, ts: float, tid) -> str:
    """Name of the innermost CPU op on thread ``tid`` whose span holds ``ts``: nested ops
    start after their parents, so it is the latest-starting op that holds it."""
    for i in range(bisect.bisect_right(starts, ts) - 1, -1, -1):
        op = ops[i]
        if op.get("tid") == tid and ts <= op["ts"] + op["dur"]:
            return op["name"]
    return "(no op)"


def analyse(trace: dict) -> dict:
    kernels, ops, launches = _events(trace)
    starts = [op["ts"] for op in ops]
    marks = [op for op in ops if op["name"].startswith("timeline.step")]
    out = {"steps": []}
    for mark in marks:
        t0, t1 = mark["ts"], mark["ts"] + mark["dur"]
        ks = [k for k in kernels if t0 <= k["ts"] <= t1]
        if not ks:
            continue
        busy, end, idle_between = 0.0, ks[0]["ts"], collections.Counter()
        gaps, detail, prev_name = [], [], ""
        for k in ks:
            s, e = k["ts"], k["ts"] + k["dur"]
            if s > end:
                gap = s - end
                corr = k.get("args", {}).get("correlation")
                launch = launches.get(corr)
                who = (_innermost(ops, starts, launch["ts"], launch.get("tid")) if launch is not None
                       else f"(graph node) {k['name'][:40]}")
                idle_between[who] += gap
                gaps.append(gap)
                # lag > 0: the launch call came after the GPU ran dry (host-bound); lag << gap:
                # the kernel waited on the GPU side (a stream/event dependency, a copy engine)
                detail.append({"at_us": s - t0, "gap_us": gap, "who": who,
                               "lag_us": (launch["ts"] - end) if launch is not None else None,
                               "prev": prev_name[:50], "next": k["name"][:50]})
                busy += e - s
                end = e
            elif e > end:
                busy += e - end
                end = e
            prev_name = k["name"] if e >= end else prev_name
        runtime = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for ev in launches.values():
            if t0 <= ev["ts"] <= t1:
                r = runtime[ev["name"]]
                r[0] += 1
                r[1] += ev["dur"]
                r[2] = max(r[2], ev["dur"])
        by_kernel = collections.defaultdict(lambda: [0, 0.0])
        durations = collections.defaultdict(list)  # per kernel name, in launch order
        for k in ks:
            by_kernel[k["name"][:90]][0] += 1
            by_kernel[k["name"][:90]][1] += k["dur"]
            durations[k["name"][:90]].append(k["dur"])
        # kernels that run once a layer: their length layer by layer (a slow first few
        # layers: the kernels themselves, or the gaps between them?)
        per_layer = {name: d for name, d in durations.items() if len(d) >= 8
                     and len(d) == max(len(x) for x in durations.values() if len(x) < 40)}
        out["steps"].append({
            "wall_us": t1 - t0, "busy_us": busy, "kernels": len(ks),
            "before_first_us": ks[0]["ts"] - t0, "after_last_us": t1 - end,
            "between_us": sum(idle_between.values()),
            "gaps_over_20us": sum(1 for g in gaps if g > 20),
            "idle_by_launcher_us": dict(idle_between.most_common(25)),
            "largest_gaps": sorted(detail, key=lambda d: -d["gap_us"])[:24],
            "runtime_calls": dict(sorted(runtime.items(), key=lambda kv: -kv[1][1])[:12]),
            "kernels_by_name": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:30]),
            "per_layer_us": dict(sorted(per_layer.items(), key=lambda kv: -sum(kv[1]))[:6]),
        })
    return out


def head(trace: dict, ms: float) -> list[str]:
    """The first ``ms`` of the last profiled step, in time order (see the module text)."""
    kernels, ops, launches = _events(trace)
    marks = [op for op in ops if op["name"].startswith("timeline.step")]
    if not marks:
        return []
    t0 = marks[-1]["ts"]
    t1 = t0 + 1e3 * ms
    by_corr = {k.get("args", {}).get("correlation"): k for k in kernels}
    starts = [op["ts"] for op in ops]
    rows = []
    for corr, ev in launches.items():
        k = by_corr.get(corr)
        if k is None or not t0 <= ev["ts"] <= t1:
            continue
        who = _innermost(ops, starts, ev["ts"], ev.get("tid"))
        rows.append((ev["ts"], f"{(ev['ts'] - t0) / 1e3:7.3f} launch {who[:40]:40s} -> "
                               f"{k['name'][:38]:38s} gpu {(k['ts'] - t0) / 1e3:7.3f} "
                               f"+{k['dur']:6.1f}us"))
    for op in ops:
        if t0 < op["ts"] <= t1 and op["dur"] > 20 and not op["name"].startswith("timeline"):
            rows.append((op["ts"], f"{(op['ts'] - t0) / 1e3:7.3f}   host {op['dur']:7.1f}us "
                                   f"{op.get('cat', '')[:6]:6s} {op['name'][:70]}"))
    return [r for _, r in sorted(rows)]


def pipelined(bench, plan, steps: int, reps: int = 3) -> tuple[float, float]:
    """ms per P step (median of ``reps``): ``steps`` steps one after the other as bench-speed
    runs them (each to its tokens on the host), and the same steps enqueued back to back --
    each step's host head under the previous step's kernels, the tokens read at the end --
    what an engine that prepares its next P step while this one runs would see (the GPU never
    idle between steps: no head, no clock ramp after it)."""
    from colo_rollout.sched.plan import Phase

    assert plan.phase is Phase.PREFILL
    alone, overlapped = [], []
    for _ in range(reps):
        bench.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            bench.step(plan)
        alone.append((time.perf_counter() - t0) / steps)
        bench.sync()
        t0 = time.perf_counter()
        outs = [bench.runner.run(plan) for _ in range(steps)]
        for o in outs:
            o.resolve(bench.wait_s, "pipelined P steps")
        overlapped.append((time.perf_counter() - t0) / steps)
    return 1e3 * statistics.median(alone), 1e3 * statistics.median(overlapped)


def _gemm_load(ms: float) -> None:
    """About ``ms`` of bf16 GEMMs (8192^3, ~1.4 ms each at ~800 TFLOP/s) enqueued now: the GPU
    under tensor-core load, at the power it draws in a P step's layers."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(max(1, round(ms / 1.4))):
        torch.mm(a, a)


def clock(bench, plan, reps: int = 5, busy_ms: float = 0.0,
          load_ms: float = 0.0) -> list[tuple[float, float]]:
    """Unprofiled: for each layer, when the host called its attention (ms from the step's
    start) and when the GPU reached that point (a CUDA event recorded there), medians of
    ``reps`` steps; the last pair is the step's end (host back from the step, GPU at its
    last event). GPU time - host time near 0: the GPU was waiting for that launch.
    ``busy_ms``: a spin kernel of about that long enqueued first, so the GPU is busy through
    the step's head instead of idle (does an idle head slow the layers after it?).
    ``load_ms``: bf16 GEMMs of about that long instead (the GPU at a P layer's power when
    layer 0 starts: do the first layers' kernels still run slower -- the clocks' ramp into
    heavy load -- or not?)."""
    layers = bench.runner.model.decoder.layers
    marks: list[tuple[float, torch.cuda.Event]] = []

    def hook(_mod, _args):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((time.perf_counter(), ev))

    handles = [layer.self_attention.register_forward_pre_hook(hook) for layer in layers]
    rows = []
    try:
        for _ in range(reps):
            marks.clear()
            bench.sync()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            if busy_ms:
                torch.cuda._sleep(int(busy_ms * 1e-3 * SPIN_HZ))
            if load_ms:
                _gemm_load(load_ms)
            t0 = time.perf_counter()
            bench.step(plan)
            t1 = time.perf_counter()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            bench.sync()
            rows.append([(1e3 * (t - t0), start.elapsed_time(ev)) for t, ev in marks]
                        + [(1e3 * (t1 - t0), start.elapsed_time(end))])
    finally:
        for h in handles:
            h.remove()
    return [(statistics.median(r[i][0] for r in rows), statistics.median(r[i][1] for r in rows))
            for i in range(min(len(r) for r in rows))]


SPIN_HZ = 1.98e9  # torch.cuda._sleep's cycles per second on an H200 (its SM clock)


# (module, attribute path) of what --host-split times; module-level functions are timed
# where the engine's modules hold them (each module that imported the same object)
HOST_SPLIT = (
    ("colo_rollout.worker.runner", "ModelRunner._prefill_inputs"),
    ("colo_rollout.worker.runner", "prefill_index"),
    ("colo_rollout.model.model", "InferenceGPT.prefill_plan"),
    ("colo_rollout.runtime.device", "h2d_packed"),
    ("colo_rollout.model.paged_prefill", "PlanHost.on_device"),
    ("colo_rollout.model.dense_prefill", "dense_calls"),
    ("colo_rollout.model.model", "InferenceGPT.forward_prefill"),
    ("colo_rollout.model.attention", "PagedSelfAttention.forward"),
    ("colo_rollout.model.rope_kv", "rope_and_store"),
    ("colo_rollout.model.dense_prefill", "dense_prefill_attention"),
    ("colo_rollout.model.norm_add", "add_rms_norm"),
    ("colo_rollout.model.norm_add", "add_slots_rms_norm"),
    ("colo_rollout.model.norm_add", "embed_rms_norm"),
    ("colo_rollout.model.norm_add", "_launch"),
    ("colo_rollout.model.rope_kv", "_launch"),
    ("triton.runtime.jit", "JITFunction.run"),
    ("torch", "empty"),
    ("torch.cuda.graphs", "CUDAGraph.replay"),
    ("torch", "matmul"),
    ("torch.nn.functional", "linear"),
    ("torch.nn.functional", "embedding"),
    ("torch.nn.functional", "rms_norm"),
    ("colo_rollout.worker.runner", "ModelRunner._prefill_out"),
)


def host_split(bench, plan, reps: int = 5) -> list[tuple[str, float, float]]:
    """(name, calls per step, host ms per step) of HOST_SPLIT's functions over ``reps``
    unprofiled steps, the step itself first. Inclusive times: nested parts are inside their
    callers' rows."""
    import importlib
    acc: dict[str, list[float]] = {}
    undo = []

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cell = acc.setdefault(name, [0, 0.0])
                cell[0] += 1
                cell[1] += time.perf_counter() - t0
        return wrapper

    for mod_name, path in HOST_SPLIT:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # (triton absent: its launcher is not timed)
            continue
        *owner_path, attr = path.split(".")
        owner = mod
        for part in owner_path:
            owner = getattr(owner, part)
        fn = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        wrapped = timed(f"{mod_name.rsplit('.', 1)[-1]}.{path}", fn)
        holders = [owner] if isinstance(owner, type) else [
            m for n, m in list(sys.modules.items())
            if m is not None and (n.startswith("colo_rollout") or m is owner)
            and getattr(m, attr, None) is fn]
        for h in holders:
            undo.append((h, attr, fn))
            setattr(h, attr, wrapped)
    try:
        bench.step(plan)  # warm the wrappers' path
        bench.sync()
        acc.clear()
        total = 0.0
        for _ in range(reps):
            bench.sync()
            t0 = time.perf_counter()
            bench.step(plan)
            total += time.perf_counter() - t0
            bench.sync()
    finally:
        for h, attr, fn in reversed(undo):
            setattr(h, attr, fn)
    rows = [("step (host, to its sampled tokens)", 1.0, 1e3 * total / reps)]
    rows += [(n, c / reps, 1e3 * t / reps) for n, (c, t) in acc.items()]
    return rows


def _report(res: dict, prof_host) -> None:
    s = res["steps"][-1]
    print("  idle between kernels, by the host op launching the kernel after the gap (us):")
    for who, us in s["idle_by_launcher_us"].items():
        print(f"    {us:9.1f}  {who}")
    print("  largest gaps (at ms into the step, gap us, launch lag us, launcher: prev -> next):")
    for d in sorted(s["largest_gaps"], key=lambda d: d["at_us"]):
        lag = "-" if d["lag_us"] is None else f"{d['lag_us']:.1f}"
        print(f"    {d['at_us'] / 1e3:7.2f} {d['gap_us']:7.1f} {lag:>7}  {d['who'][:28]}: "
              f"{d['prev'][:34]} -> {d['next'][:34]}")
    print("  CUDA runtime calls (count, total us, max us):")
    for name, (c, us, mx) in s["runtime_calls"].items():
        print(f"    {c:5d} {us:10.1f} {mx:9.1f}  {name}")
    print("  host functions of 3 steps by own time (cProfile):")
    buf = io.StringIO()
    pstats.Stats(prof_host, stream=buf).sort_stats("tottime").print_stats(24)
    print("\n".join("    " + ln for ln in buf.getvalue().splitlines()
                    if ln.strip() and not ln.startswith(("   Ordered", "   List"))))
    print("  kernels by name (count, us):")
    for name, (c, us) in s["kernels_by_name"].items():
        print(f"    {c:5d} {us:10.1f}  {name}")


def _shape(text: str) -> tuple[int, int]:
    """"N" or "SxN" -> (sequences, tokens per sequence)."""
    if "x" in text:
        seqs, n = text.split("x")
        return int(seqs), int(n)
    return 1, int(text)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--shapes", help="N or SxN, comma-separated (overrides --tokens/--seqs)")
    ap.add_argument("--attention", default="", help="P attention backends to run in turn")
    ap.add_argument("--json")
    ap.add_argument("--head-ms", type=float, default=0.0)
    ap.add_argument("--stack", action="store_true")
    ap.add_argument("--clock", action="store_true")
    ap.add_argument("--pipelined", type=int, default=0,
                    help="also time this many P steps enqueued back to back against the same "
                         "steps one by one")
    ap.add_argument("--load-head", type=float, default=0.0,
                    help="with --clock: also clock steps whose head the GPU spends in bf16 "
                         "GEMMs of about this many ms")
    ap.add_argument("--busy-head", type=float, default=0.0,
                    help="with --clock: also clock steps whose head the GPU spends in a spin "
                         "kernel of this many ms")
    ap.add_argument("--host-split", action="store_true")
    args = ap.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile, record_function

    from colo_rollout.config import load_config
    from colo_rollout.runtime.parallel import init_parallel
    from colo_rollout.tools.bench_speed import _Bench, prefill_plan

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    cfg = load_config(args.config, {"bench_speed.hf_peer": False})
    groups = init_parallel(cfg.parallel)
    bench = _Bench(cfg, groups)
    shapes = ([_shape(t) for t in args.shapes.split(",")] if args.shapes
              else [(args.seqs, args.tokens // args.seqs)])
    attentions = [a for a in args.attention.split(",") if a] or [None]
    out = []
    try:
        for backend in attentions:
            if backend is not None:
                for layer in bench.runner.model.decoder.layers:
                    layer.self_attention.prefill_backend = backend
            for seqs, n in shapes:
                plan = prefill_plan([(0, n)] * seqs, bench.rng, cfg.model.vocab_size,
                                    cfg.engine.kv_block_size)
                times = bench.timed(plan, 5)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for i in range(2):
                        with record_function(f"timeline.step{i}"):
                            bench.step(plan)
                            bench.sync()
                prof_host = cProfile.Profile()
                prof_host.enable()
                for _ in range(3):
                    bench.step(plan)
                    bench.sync()
                prof_host.disable()
                with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
                    prof.export_chrome_trace(f.name)
                    trace = json.load(open(f.name))
                res = analyse(trace)
                res.update(config=args.config, tokens=seqs * n, seqs=seqs, attention=backend,
                           timed_ms=[1e3 * t for t in times])
                out.append(res)
                print(f"{args.config}: prefill {seqs} x {n}, attention {backend or 'as built'}, "
                      f"timed step median {1e3 * statistics.median(times):.2f} ms")
                for st in res["steps"]:
                    print(f"  profiled step: wall {st['wall_us'] / 1e3:.2f} ms, busy "
                          f"{st['busy_us'] / 1e3:.2f}, {st['kernels']} kernels; idle before "
                          f"first {st['before_first_us'] / 1e3:.2f}, between "
                          f"{st['between_us'] / 1e3:.2f} ({st['gaps_over_20us']} gaps > 20 us), "
                          f"after last {st['after_last_us'] / 1e3:.2f}")
                last = res["steps"][-1] if res["steps"] else {}
                if last.get("per_layer_us"):
                    print("  once-a-layer kernels, us by layer (the last profiled step):")
                    for name, d in last["per_layer_us"].items():
                        pick = [d[i] for i in (0, 1, 2, 3, 5, 8, 12, 16) if i < len(d)] + [d[-1]]
                        print(f"    {name[:28]:28s} " + " ".join(f"{x:6.1f}" for x in pick)
                              + "  (layers 0 1 2 3 5 8 12 16 last)")
                if args.clock:
                    marks = clock(bench, plan)
                    print("  unprofiled clock (ms from the step's start): layer: host, GPU, "
                          "GPU - host")
                    for i, (h, g) in enumerate(marks):
                        name = "end" if i == len(marks) - 1 else f"{i:3d}"
                        print(f"    {name}: {h:7.2f} {g:7.2f} {g - h:7.2f}")
                    for what, kw, ms in (("spin", "busy_ms", args.busy_head),
                                         ("GEMM load", "load_ms", args.load_head)):
                        if not ms:
                            continue
                        busy = clock(bench, plan, **{kw: ms})
                        print(f"  the same, the GPU in {ms} ms of {what} through the head: "
                              "layer: GPU ms from the last layer (idle head, busy)")
                        for i in range(1, min(len(marks), len(busy))):
                            print(f"    {i:3d}: {marks[i][1] - marks[i - 1][1]:7.3f} "
                                  f"{busy[i][1] - busy[i - 1][1]:7.3f}")
                    gc.collect()
                    gc.freeze()
                    gc.disable()
                    off = bench.timed(plan, 5)
                    gc.enable()
                    print(f"  timed step with the collector frozen and off: median "
                          f"{1e3 * statistics.median(off):.2f} ms")
                if args.pipelined:
                    one, piped = pipelined(bench, plan, args.pipelined)
                    print(f"  {args.pipelined} steps, ms per step: one by one {one:.2f}, "
                          f"enqueued back to back {piped:.2f} ({one / piped:.3f}x)")
                if args.host_split:
                    print("  host time per step, unprofiled (calls, ms; inclusive):")
                    for name, calls, ms in host_split(bench, plan):
                        print(f"    {calls:6.1f} {ms:8.3f}  {name}")
                if args.head_ms:
                    print(f"  the step's first {args.head_ms} ms (ms from its start):")
                    print("\n".join("    " + r for r in head(trace, args.head_ms)))
                if args.stack and args.head_ms:
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                 with_stack=True) as prof_s:
                        with record_function("timeline.step_stack"):
                            bench.step(plan)
                            bench.sync()
                    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
                        prof_s.export_chrome_trace(f.name)
                        trace_s = json.load(open(f.name))
                    print(f"  with Python functions recorded, the first {args.head_ms} ms:")
                    print("\n".join("    " + r for r in head(trace_s, args.head_ms)))
                if not res["steps"]:
                    print("  no CUDA kernel in the trace (a CPU run, or CUPTI unavailable)")
                elif len(out) == 1 or os.environ.get("TIMELINE_FULL"):
                    _report(res, prof_host)
    finally:
        bench.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
