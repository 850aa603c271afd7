"""Where the host time of one engine step goes (diagnosis for the P/D benchmark).

  torchrun --standalone --nproc-per-node 2 scripts/profile_host.py configs/bench_gpu.yaml [--exchange-only]
  torchrun --standalone --nproc-per-node 2 scripts/profile_host.py configs/bench_gpu.yaml --replay fine-sel [--set KEY=VALUE ...]

Rank 0 prints: the control exchange and the rendezvous per call (gloo and shared memory), then a
cProfile of one P step of a burst of first prompts and one of short continuations (Normal
mode), sorted by own time. Every rank runs the same steps (the phases are collective).

``--replay VARIANT`` (a bench variant: normal, fine-2, fine-sel, ...): every rank replays the
bench trace once untimed, then once timed and once under cProfile, and prints (rank by rank) its
host-time breakdown and the engine's calls by cumulative time -- where a round's host time goes,
and whether one rank waits for the other in the control exchange.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import sys
import time

import torch
import torch.distributed as dist

from colo_rollout.config import load_config
from colo_rollout.runtime.control import ControlPlane, Message
from colo_rollout.engine.engine import Engine
from colo_rollout.model.weights import random_state_dict
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.multiplex.rendezvous import make_rendezvous
from colo_rollout.sched.request import Request, SamplingParams


def _per_call(fn, n: int = 300) -> float:
    for _ in range(20):
        fn(0)
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t) / n * 1e6


def replay_profile(path: str, variant: str) -> None:
    import dataclasses

    from colo_rollout.tools.bench import _serve, bench_trace, variants

    import yaml

    sets = [a.split("=", 1) for i, a in enumerate(sys.argv) if i and sys.argv[i - 1] == "--set"]
    cfg = load_config(path, {k: yaml.safe_load(v) for k, v in sets})
    kw = dict(variants(dataclasses.replace(
        cfg, bench=dataclasses.replace(cfg.bench, modes=["normal", "fine"], spans=[1, 2, 3, 4]))))
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, **kw[variant]))
    groups = init_parallel(cfg.parallel)
    rank, world = groups.rank, groups.layout.world_size
    trace = bench_trace(cfg)
    sd = random_state_dict(cfg.model, device=groups.device)
    ctx = max(sum(t.prompt_tokens + t.output_tokens for t in c.turns) for c in trace.conversations)
    w = cfg.bench.wait_scales[0]
    engine = _serve(cfg, groups, sd, trace, w, ctx)[0]  # untimed: one-off costs
    engine, metrics, _, _ = _serve(cfg, groups, sd, trace, w, ctx, engine)
    host = engine.host_seconds()
    steps = len(engine.history)
    prof = cProfile.Profile()
    prof.enable()
    engine = _serve(cfg, groups, sd, trace, w, ctx, engine)[0]
    prof.disable()
    engine.close()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(r"colo_rollout|all_reduce|all_gather|replay|_grouped_mm", 45)
    st.sort_stats("tottime").print_stats(30)
    lines = s.getvalue().splitlines()
    for r in range(world):  # rank by rank, so the outputs do not interleave
        if r == rank:
            print(f"\n==== rank {rank}: {variant}, makespan {metrics.makespan_s:.3f} s, {steps} steps; "
                  f"host ms (per step us) ====")
            for k, v in sorted(host.items(), key=lambda kv: -kv[1]):
                print(f"  {k:12s} {v * 1e3:9.1f}  ({v / steps * 1e6:7.0f})")
            print("\n".join(ln for ln in lines if ln.strip())[-7000:])
            sys.stdout.flush()
        dist.barrier(group=groups.control)
    dist.destroy_process_group()


def main(path: str) -> None:
    if "--replay" in sys.argv:
        return replay_profile(path, sys.argv[sys.argv.index("--replay") + 1])
    cfg = load_config(path, {"engine.mode": "normal"})
    groups = init_parallel(cfg.parallel)
    rank, world = groups.rank, groups.layout.world_size
    rows = {}
    for shm in (False, True):
        cp = ControlPlane(groups.control, rank, world, 60.0, shm=shm)
        rows[f"control exchange ({'shm' if shm else 'gloo'})"] = _per_call(
            lambda i: cp.exchange(Message(rank=rank, step=i, sampled=[(i, 5, -0.1, -1, 0)] * 16)))
        cp.close()
    for kind in ("gloo", "shm"):
        rv = make_rendezvous(groups.control, rank, world, 60.0, kind)
        rows[f"rendezvous ({kind})"] = _per_call(lambda i: rv.pre_d(0, i))
    if "--exchange-only" in sys.argv:
        if rank == 0:
            print("\nper call (us):")
            for k, v in rows.items():
                print(f"  {k:48s} {v:10.0f}")
        dist.destroy_process_group()
        return
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    engine.warmup()
    V = cfg.model.vocab_size
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)

    def p_step(tag: str, n: int, length: int) -> pstats.Stats:
        if rank == 0:
            for i in range(n):
                engine.submit(Request(f"{tag}{i}", tuple(rng.randrange(1, V) for _ in range(length)), sp))
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        engine.step()  # intake + the P step
        prof.disable()
        rows[f"P step host, {n} x {length} tokens (ms x1000)"] = (time.perf_counter() - t) * 1e6
        while engine.busy():
            engine.step()
        return pstats.Stats(prof)

    def d_replays(rows: int, n: int = 50) -> tuple[float, float]:
        """Host us per D graph replay: one at a time on an idle GPU, and back to back."""
        g = engine.runner.graphs
        key = min(k for k in g.keys if k[0] >= rows)
        graph = g._graphs[key].graph  # noqa: SLF001
        torch.cuda.synchronize()
        alone = 0.0
        for _ in range(n):
            t = time.perf_counter()
            graph.replay()
            alone += time.perf_counter() - t
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            graph.replay()
        queued = time.perf_counter() - t
        torch.cuda.synchronize()
        gpu = (time.perf_counter() - t) / n
        return alone / n * 1e6, queued / n * 1e6, gpu * 1e6

    if engine.runner.graphs is not None:
        for b in (1, 16):
            a, q, g_us = d_replays(b)
            rows[f"D graph replay, {b} rows: host idle / host queued / GPU (us)"] = a
            rows[f"  queued {b}"] = q
            rows[f"  GPU per replay {b}"] = g_us

    def p_gpu(tag: str, n: int, length: int) -> None:
        """P forward of one epoch, straight (as Normal runs it): enqueue vs enqueue + drain."""
        items = [tuple(rng.randrange(1, V) for _ in range(length)) for _ in range(n)]
        if rank == 0:
            for i, p in enumerate(items):
                engine.submit(Request(f"{tag}{i}", p, sp))
        real_run = engine.runner.run
        got = {}

        def timed(plan):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = real_run(plan)
            got["enqueue"] = time.perf_counter() - t
            torch.cuda.synchronize()
            got["total"] = time.perf_counter() - t
            return out

        engine.runner.run = timed
        engine.step()
        engine.runner.run = real_run
        rows[f"P {n} x {length}: enqueue / enqueue + GPU drain (us)"] = got["enqueue"] * 1e6
        rows[f"  drained {n} x {length}"] = got["total"] * 1e6
        while engine.busy():
            engine.step()

    p_gpu("g0", 16, 300)
    p_gpu("g1", 16, 300)
    p_gpu("g2", 8, 30)
    p_step("warm", 16, 300)
    p_step("warm2", 8, 30)
    first = p_step("a", 16, 300)
    cont = p_step("b", 8, 30)
    if rank == 0:
        print("\nper call (us):")
        for k, v in rows.items():
            print(f"  {k:48s} {v:10.0f}")
        for name, st in (("16 x 300", first), ("8 x 30", cont)):
            s = io.StringIO()
            st.stream = s
            st.sort_stats("tottime").print_stats(28)
            print(f"\n==== cProfile, P step {name}, by own time ====")
            print("\n".join(s.getvalue().splitlines()[4:40]))
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help") or sys.argv[1].startswith("-"):
        print(__doc__.strip())  # (its usage: the arguments are read by hand below)
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    main(sys.argv[1])
