"""Where the host time of one engine step goes (diagnosis for the P/D benchmark).

  torchrun --standalone --nproc-per-node 2 scripts/profile_host.py configs/bench_gpu.yaml [--exchange-only]

Rank 0 prints: the control exchange and the rendezvous per call (gloo and shared memory), then a
cProfile of one P step of a burst of first prompts and one of short continuations (Normal
mode), sorted by own time. Every rank runs the same steps (the phases are collective).
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
from colo_rollout.inference.control import ControlPlane, Message
from colo_rollout.inference.engine import Engine
from colo_rollout.inference.model import random_state_dict
from colo_rollout.inference.parallel import init_parallel
from colo_rollout.inference.rendezvous import make_rendezvous
from colo_rollout.inference.request import Request, SamplingParams


def _per_call(fn, n: int = 300) -> float:
    for _ in range(20):
        fn(0)
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t) / n * 1e6


def main(path: str) -> None:
    cfg = load_config(path, {"engine.mode": "normal"})
    groups = init_parallel(cfg.parallel)
    rank, world = groups.rank, groups.layout.world_size
    rows = {}
    for shm in (False, True):
        cp = ControlPlane(groups.control, rank, world, 60.0, shm=shm)
        rows[f"control exchange ({'shm' if shm else 'gloo'})"] = _per_call(
            lambda i: cp.exchange(Message(rank=rank, step=i, sampled=[[i, 5, -0.1]] * 16)))
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
    main(sys.argv[1])
