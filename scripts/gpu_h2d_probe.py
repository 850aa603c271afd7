"""Host time of a 4k P step's packed input copy and its parts, warm and cold (issue 16: in a
step, ``h2d_packed`` took 0.45 ms of host -- ~10x what its parts cost in a loop; session 19).

  PYTHONPATH=$PWD python3 scripts/gpu_h2d_probe.py [--tokens 4096] [--reps 200]

The arrays of one fresh sequence of ``--tokens`` tokens (ids, positions, slots, its block
table, context, last row, a small attention plan) go through ``runtime.device.h2d_packed``
with a ``PinnedStage``, as the runner sends them; each part is timed on its own too (the
numpy conversions, the concatenation into the pinned buffer, the copy call, the event, the
split). "warm": back to back; "cold": 64 MB of host memory written between calls (the CPU
caches flushed, as a step's head meets them after a step's worth of other work) and the GPU
left idle 2 ms. us per call, medians. Owns nothing of the engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from colo_rollout.runtime.device import PinnedStage, h2d_packed  # noqa: E402


def _arrays(T: int, bs: int = 16):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150000, T)
    pos = np.arange(T, dtype=np.int64)
    table = np.arange(3, 3 + (T + bs - 1) // bs, dtype=np.int64)[None, :]
    slots = table[0][pos // bs] * bs + pos % bs
    plan = np.zeros(8, dtype=np.int64)
    return [ids, pos, slots, table, [T], [T - 1], plan]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    dev = torch.device("cuda")
    arrays = _arrays(a.tokens)
    stage = PinnedStage()
    junk = np.empty(64 << 20, dtype=np.uint8)

    def parts():
        """The parts of h2d_packed, each timed (us)."""
        t = [time.perf_counter()]
        arr = [np.asarray(x, dtype=np.int64) for x in arrays]
        sizes = [x.size for x in arr]
        flat = [x.ravel() for x in arr]
        t.append(time.perf_counter())
        host = stage.take(sum(sizes))
        t.append(time.perf_counter())
        np.concatenate(flat, out=host.numpy())
        t.append(time.perf_counter())
        d = host.to(dev, non_blocking=True)
        t.append(time.perf_counter())
        stage.copied()
        t.append(time.perf_counter())
        views = torch.split(d, sizes)
        t.append(time.perf_counter())
        return [1e6 * (b - c) for c, b in zip(t, t[1:])]

    names = ("numpy conversions", "stage.take", "concatenate", "host.to(device)",
             "stage.copied", "torch.split")
    for mode in ("warm", "cold"):
        whole, split = [], []
        for _ in range(a.reps):
            if mode == "cold":
                torch.cuda.synchronize()
                junk[:] = 1  # the CPU caches flushed
                torch.cuda._sleep(int(2e-3 * 1.98e9))
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            h2d_packed(arrays, dev, stage)
            whole.append(1e6 * (time.perf_counter() - t0))
            if mode == "cold":
                torch.cuda.synchronize()
                junk[:] = 2
            split.append(parts())
        torch.cuda.synchronize()
        print(f"{mode}: h2d_packed {statistics.median(whole):8.1f} us (p90 "
              f"{sorted(whole)[int(0.9 * len(whole))]:.1f})")
        for i, n in enumerate(names):
            print(f"    {n:20s} {statistics.median(s[i] for s in split):8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
