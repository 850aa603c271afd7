"""The prefill fc2's scattered store (issue 16): the engine's fc2 writes each sorted row at
its pair's place (``moe_gemm(..., scatter=order)``), and on sm90 the persistent kernel's
[128, 256] tile of 64-bit row addresses spills beside the accumulator (ptxas: 4,380 bytes of
spill stores per thread in one piece, 460 as two column halves, none without the scatter).
This times fc2 at 4096 and 8192 tokens on both bench shapes: the engine's tile storing its
scattered tile in one piece and in two (``Tile.store_split``), the same tile without the
scatter (what sessions 16-22's probes timed), and a 128-column tile (no spill), each checked
bitwise against the one-piece store.

  PYTHONPATH=$PWD python3 scripts/gpu_fc2_store.py [--json PATH]

CUDA graphs of four calls over two weight copies, median of replays (gpu_timing.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_fused_moe as g  # noqa: E402
from colo_rollout.model import fused_moe as fm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                   "fc2_store.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    base = fm.TILES[("prefill", "fc2")]
    variants = {
        "scatter, one piece": (dataclasses.replace(base, store_split=1), True),
        "scatter, two halves": (dataclasses.replace(base, store_split=2), True),
        "scatter, 128 columns": (dataclasses.replace(base, block_n=128, num_stages=4), True),
        "scatter, 128 columns, halves": (dataclasses.replace(
            base, block_n=128, num_stages=4, store_split=2), True),
        "no scatter (sorted rows)": (dataclasses.replace(base, store_split=1), False),
    }
    results = []
    for name, m in g.MODELS.items():
        ex = g.Experts(m["H"], m["F"], m["E"], dev, gen)
        H, F_, E, k = ex.H, ex.F, ex.E, m["k"]
        for N in (4096, 8192):
            logits = torch.randn(N, E, device=dev, generator=gen)
            key = logits.topk(k, dim=1).indices.flatten()
            _, order = torch.sort(key, stable=True)
            offs = torch.searchsorted(key.sort().values, torch.arange(E, device=dev),
                                      right=True, out_int32=True)
            rows = N * k
            h = torch.randn(rows, F_, device=dev, generator=gen).to(g.DTYPE)
            ys = [torch.empty(rows, H, device=dev, dtype=g.DTYPE) for _ in range(2)]
            ref = None
            for label, (tile, scatter) in variants.items():
                sc = order if scatter else None

                def fn(c, tile=tile, sc=sc):
                    return fm.moe_gemm(h, ex.fc2[c], offs, rows, zero_tail=True, out=ys[c],
                                       scatter=sc, tile=tile)
                same = ""
                got = fn(0).clone()
                if scatter:
                    if ref is None:
                        ref = got
                    same = " bitwise" if torch.equal(got, ref) else (
                        f" DIFFERS (max {(got.float() - ref.float()).abs().max().item():.2e})")
                s = g.graph_time([lambda c=c: fn(c) for c in (0, 1, 0, 1)], reps=7, warm=1)
                tf = 2 * rows * H * F_ / s / 1e12
                print(f"{name:10s} N={N:5d} fc2 {label:30s} {s * 1e3:7.3f} ms {tf:6.1f} "
                      f"TFLOP/s {100 * tf / 989:5.1f}%{same}", flush=True)
                results.append({"model": name, "N": N, "variant": label, "ms": s * 1e3,
                                "tflops": tf, "same": same.strip()})
    with open(args.json, "w") as fh:
        json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
