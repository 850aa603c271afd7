"""Prefill tile probe of the fused-MoE expert GEMMs (model/fused_moe.py): fc1 and fc2 at
prefill sizes (N = 4096 and 8192 tokens) with the hard-coded prefill tiles against a short list
of larger or deeper-pipelined candidates, TFLOP/s each (2 N k H F per GEMM for fc2, twice that
for the gated fc1), so a tile that beats TILES[("prefill", ...)] shows with its margin.

  PYTHONPATH=$PWD python3 scripts/gpu_moe_prefill_tiles.py [--json PATH]

Uses scripts/gpu_fused_moe.py's inputs and graph timing (CUDA graphs of several calls over two
weight copies, median of replays). One CUDA device, torch + triton only.
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

T = fm.Tile
FC1 = [fm.TILES[("prefill", "fc1")], T(128, 128, 64, 8, 3, 1), T(128, 128, 64, 8, 5, 1),
       T(128, 128, 128, 8, 3, 1), T(128, 64, 64, 8, 4, 1), T(64, 128, 64, 4, 4, 1),
       T(128, 128, 64, 8, 4, 8), T(128, 128, 32, 8, 5, 1)]
FC2 = [fm.TILES[("prefill", "fc2")], T(128, 256, 64, 8, 3, 8), T(128, 256, 64, 8, 4, 8),
       T(256, 128, 64, 8, 3, 8), T(128, 128, 64, 8, 4, 8), T(128, 128, 128, 8, 3, 8),
       T(128, 256, 32, 8, 5, 8), T(128, 128, 64, 8, 5, 8)]
# the same kernel fed by TMA descriptors (the weights; fc2's contiguous A too): the current
# tiles and the deeper or wider ones that TMA's freed registers may now afford
FC1 += [dataclasses.replace(t, tma=True) for t in (FC1[0], FC1[1], FC1[2], FC1[3])] + [
    T(128, 128, 64, 8, 4, 8, True), T(128, 64, 64, 4, 4, 1, True), T(64, 128, 64, 4, 4, 1, True)]
FC2 += [dataclasses.replace(t, tma=True) for t in (FC2[0], FC2[1], FC2[2], FC2[4])] + [
    T(128, 256, 64, 8, 3, 1, True), T(128, 128, 128, 8, 3, 8, True), T(128, 128, 64, 4, 4, 8, True)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                   "moe_prefill_tiles.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    for name, m, ex, N, token, offs, prob, rows in g.shape_routings(dev, gen):
        x = torch.randn(N, ex.H, device=dev, generator=gen).to(g.DTYPE)
        rows, R = N * m["k"], g.calls_per_graph(N)
        h0 = torch.randn(rows, ex.F, device=dev, generator=gen).to(g.DTYPE)
        hs = [torch.empty(rows, ex.F, device=dev, dtype=g.DTYPE) for _ in range(2)]
        ys = [torch.empty(rows, ex.H, device=dev, dtype=g.DTYPE) for _ in range(2)]
        for which, tiles, flops in (("fc1", FC1, 4 * rows * ex.H * ex.F),
                                    ("fc2", FC2, 2 * rows * ex.H * ex.F)):
            res = {}
            for tile in tiles:
                if which == "fc1":
                    fns = [lambda c=c, t=tile: fm.moe_gemm(
                        x, ex.fc1[c], offs, rows, token=token, prob=prob, gated=True,
                        act=1, out=hs[c], tile=t) for c in (0, 1) * (R // 2)]
                else:
                    fns = [lambda c=c, t=tile: fm.moe_gemm(
                        h0, ex.fc2[c], offs, rows, zero_tail=True, out=ys[c], tile=t)
                        for c in (0, 1) * (R // 2)]
                try:
                    s = g.graph_time(fns, reps=3, warm=1)
                except Exception as e:  # noqa: BLE001 - out of resources: skipped
                    print(f"{name} N={N} {which} {g._fmt(tile)}: {type(e).__name__}")
                    torch.cuda.synchronize()
                    continue
                res[g._fmt(tile)] = flops / s / 1e12
            base = res.get(g._fmt(tiles[0]), float("nan"))
            best = max(res, key=res.get)
            print(f"{name:10s} N={N:5d} {which}: current {base:6.1f} TFLOP/s ({100 * base / 989:4.1f}%),"
                  f" best {best} {res[best]:6.1f} ({res[best] / base:.3f}x)", flush=True)
            out.append({"model": name, "N": N, "gemm": which, "tflops": res})
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
