"""How far the prefill expert GEMMs are from what the H200 gives (issue 16, prefill >= 50%):
fc1 and fc2 of the fused-MoE kernel (model/fused_moe.py) at 4096 and 8192 tokens beside

  * fc1 on a pre-permuted copy of x (its A rows through TMA too; the gather's own time
    reported apart),
  * fc1 with its gate and up weight tiles in one TMA box and one MMA (``Tile.paired``),
    at a few tiles,
  * fc2 on the persistent kernel (``Tile.persistent``: one program per SM walking the tiles,
    the tile loop flattened into the K loop) with a few tiles, the one-tile-per-program
    kernel's tile among them,
  * ``torch._grouped_mm`` (CUTLASS's sm90 grouped GEMM) on the permuted rows -- the GEMM
    alone, no activation,
  * one dense cuBLAS GEMM of the same FLOPs (rows x K x N with every row in one group): the
    ceiling a grouping could at best reach.

  PYTHONPATH=$PWD python3 scripts/gpu_moe_gemm_ceiling.py [--json PATH]

TFLOP/s (fc1 4 R H F, fc2 2 R H F; R = tokens x k) and the fraction of the 989 TFLOP/s bf16
peak. CUDA graphs of four calls over two weight copies, median of replays (gpu_timing.py).
(Session 16 also timed an fc1 persistent variant and Triton's warp specialisation here; the
numbers are in docs/benchmarks.md, the variants were dropped with their verdict.)
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                   "moe_gemm_ceiling.json"))
    ap.add_argument("--fc1-sweep", type=int, default=0, metavar="REPS",
                    help="only fc1: the picked tile beside paired tiles of group sizes 1-8, "
                         "REPS rounds in turn (a variant's median over rounds: one "
                         "machine's clock drifts by ~5%% between back-to-back timings)")
    ap.add_argument("--fc2-sweep", type=int, default=0, metavar="REPS",
                    help="only fc2: the persistent tile storing each row at its pair's place "
                         "(the engine's scatter) against storing the sorted rows, REPS rounds")
    args = ap.parse_args()
    if args.fc1_sweep:
        return fc1_sweep(args.fc1_sweep, args.json)
    if args.fc2_sweep:
        return fc2_sweep(args.fc2_sweep, args.json)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    results = []
    fc1_tile, fc2_tile = fm.TILES[("prefill", "fc1")], fm.TILES[("prefill", "fc2")]
    # the persistent fc2 with tiles around the picked one
    P2 = [fc2_tile, T(128, 256, 64, 8, 4, 8, True, True), T(128, 128, 64, 8, 4, 8, True, True)]
    for name, m, ex, N, token, offs, prob, rows in g.shape_routings(dev, gen):
        H, F_ = ex.H, ex.F
        x = torch.randn(N, H, device=dev, generator=gen).to(g.DTYPE)
        xs = x[token].contiguous()
        h0 = torch.randn(rows, F_, device=dev, generator=gen).to(g.DTYPE)
        hs = [torch.empty(rows, F_, device=dev, dtype=g.DTYPE) for _ in range(2)]
        h2 = [torch.empty(rows, 2 * F_, device=dev, dtype=g.DTYPE) for _ in range(2)]
        ys = [torch.empty(rows, H, device=dev, dtype=g.DTYPE) for _ in range(2)]
        dense1 = [w.reshape(-1, H)[: 2 * F_].T.contiguous() for w in ex.fc1]  # [H, 2F]
        dense2 = [w.reshape(-1, F_)[:H].T.contiguous() for w in ex.fc2]  # [F, H]
        f1, f2 = 4 * rows * H * F_, 2 * rows * H * F_
        cases = {
            ("fc1", "kernel (gather)"): lambda c: fm.moe_gemm(
                x, ex.fc1[c], offs, rows, token=token, prob=prob, gated=True, act=1,
                out=hs[c], tile=fc1_tile),
            ("fc1", "kernel, permuted A (TMA)"): lambda c: fm.moe_gemm(
                xs, ex.fc1[c], offs, rows, prob=prob, gated=True, act=1, out=hs[c],
                tile=fc1_tile),
            ("fc1", "gather x[token] alone"): lambda c: torch.index_select(
                x, 0, token, out=xs),
            ("fc1", "torch._grouped_mm (no act)"): lambda c: torch._grouped_mm(
                xs, ex.fc1[c].transpose(1, 2), offs=offs),
            ("fc1", "dense cuBLAS same FLOPs"): lambda c: torch.mm(xs, dense1[c],
                                                                  out=h2[c]),
            ("fc2", "kernel (one tile per program)"): lambda c: fm.moe_gemm(
                h0, ex.fc2[c], offs, rows, zero_tail=True, out=ys[c],
                tile=dataclasses.replace(fc2_tile, persistent=False)),
            ("fc2", "torch._grouped_mm"): lambda c: torch._grouped_mm(
                h0, ex.fc2[c].transpose(1, 2), offs=offs),
            ("fc2", "dense cuBLAS same FLOPs"): lambda c: torch.mm(h0, dense2[c],
                                                                  out=ys[c]),
        }
        # an expert's last row block of <= tail_m rows as a tail_m-row tile in place
        for tm in (16, 32, 64):
            cases[("fc1", f"kernel (gather), tails <= {tm} as {tm}-row tiles")] = (
                lambda c, tm=tm: fm.moe_gemm(
                    x, ex.fc1[c], offs, rows, token=token, prob=prob, gated=True, act=1,
                    out=hs[c], tile=dataclasses.replace(fc1_tile, tail_m=tm)))
        # the gate and up tiles in one [2, n, k] TMA box and one MMA of 2n columns
        for label, t in (
                ("paired (the tile)", dataclasses.replace(fc1_tile, paired=True)),
                ("paired, no tails", dataclasses.replace(fc1_tile, paired=True, tail_m=0)),
                ("paired, 3 stages", dataclasses.replace(fc1_tile, paired=True,
                                                         num_stages=3)),
                ("paired, 128x64x64 w8 s4", T(128, 64, 64, 8, 4, 1, True, tail_m=64,
                                              paired=True)),
                ("paired, 128x64x64 w4 s4", T(128, 64, 64, 4, 4, 1, True, tail_m=64,
                                              paired=True)),
                ("paired, 64x128x64 w4 s4", T(64, 128, 64, 4, 4, 1, True, paired=True)),
                ("paired, 128x128x64 w8 s4 g4", T(128, 128, 64, 8, 4, 4, True, tail_m=64,
                                                  paired=True))):
            cases[("fc1", f"kernel (gather), {label}")] = (
                lambda c, t=t: fm.moe_gemm(
                    x, ex.fc1[c], offs, rows, token=token, prob=prob, gated=True, act=1,
                    out=hs[c], tile=t))
        for t in P2:
            key = ("fc2", f"persistent {g._fmt(t)}")
            cases[key] = (lambda c, t=t: fm.moe_gemm(
                h0, ex.fc2[c], offs, rows, zero_tail=True, out=ys[c], tile=t))
        # the persistent fc2 against the one-tile-per-program kernel (first copy)
        ref2 = fm.moe_gemm(h0, ex.fc2[0], offs, rows,
                           tile=dataclasses.replace(fc2_tile, persistent=False)).float()
        ref1 = fm.moe_gemm(x, ex.fc1[0], offs, rows, token=token, prob=prob, gated=True,
                           act=1, tile=fc1_tile).float()
        for (which, label), fn in cases.items():
            flops = f1 if which == "fc1" else f2
            err = ""
            try:
                if (label.startswith("persistent") or "tails" in label
                        or "paired" in label):
                    ref = ref2 if which == "fc2" else ref1
                    got = fn(0).float()
                    e = ((got - ref).abs().max() / ref.abs().max()).item()
                    err = f" err {e:.1e}"
                s = g.graph_time([lambda c=c: fn(c) for c in (0, 1, 0, 1)], reps=5, warm=1)
            except Exception as ex_:  # noqa: BLE001 - a variant that does not compile
                print(f"{name} N={N} {which} {label}: {type(ex_).__name__}: "
                      f"{str(ex_).splitlines()[0][:160] if str(ex_) else ''}", flush=True)
                torch.cuda.synchronize()
                continue
            tf = flops / s / 1e12
            print(f"{name:10s} N={N:5d} {which} {label:52s} {s * 1e3:7.3f} ms "
                  f"{tf:6.1f} TFLOP/s {100 * tf / 989:5.1f}%{err}", flush=True)
            results.append({"model": name, "N": N, "gemm": which, "variant": label,
                            "ms": s * 1e3, "tflops": tf})
    with open(args.json, "w") as fh:
        json.dump(results, fh, indent=1)
    return 0


def _rounds(model: str, N: int, gemm: str, variants: dict, call, flops: int, reps: int,
            base: str) -> list[dict]:
    """Every variant's ``call(variant, copy)`` timed in turn, ``reps`` rounds (CUDA graphs of
    four calls over the two weight copies); prints each variant's median against ``base``'s
    and returns the rows (a variant's median over rounds: one machine's clock drifts by ~5%
    between back-to-back timings)."""
    times = {k: [] for k in variants}
    for _ in range(reps):
        for label, v in variants.items():
            times[label].append(g.graph_time([lambda c=c, v=v: call(v, c) for c in (0, 1, 0, 1)],
                                             reps=5, warm=1))
    base_s = sorted(times[base])[reps // 2]
    rows = []
    for label, ts in times.items():
        s = sorted(ts)[reps // 2]
        tf = flops / s / 1e12
        print(f"{model:10s} N={N:5d} {gemm} {label:34s} {s * 1e3:7.3f} ms {tf:6.1f} TFLOP/s "
              f"{100 * tf / 989:5.1f}%"
              f"  x{base_s / s:5.3f}  (all: {' '.join(f'{v * 1e3:.3f}' for v in ts)})",
              flush=True)
        rows.append({"model": model, "N": N, "gemm": gemm, "variant": label, "ms": s * 1e3,
                     "all_ms": [v * 1e3 for v in ts], "tflops": tf})
    return rows


def fc1_sweep(reps: int, path: str) -> int:
    """fc1 at the prefill regime's tile against paired tiles (group sizes 1, 2, 4, 8), every
    shape at 4096 and 8192 tokens, the variants timed in turn ``reps`` times."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    t0 = fm.TILES[("prefill", "fc1")]
    variants = {"the tile": t0}
    for gm in (1, 2, 4, 8):
        variants[f"paired g{gm}"] = dataclasses.replace(t0, paired=True, group_m=gm)
    results = []
    for name, m, ex, N, token, offs, prob, rows in g.shape_routings(dev, gen):
        x = torch.randn(N, ex.H, device=dev, generator=gen).to(g.DTYPE)
        hs = [torch.empty(rows, ex.F, device=dev, dtype=g.DTYPE) for _ in range(2)]
        flops = 4 * rows * ex.H * ex.F
        ref = fm.moe_gemm(x, ex.fc1[0], offs, rows, token=token, prob=prob, gated=True,
                          act=1, tile=t0)

        def call(t, c):
            return fm.moe_gemm(x, ex.fc1[c], offs, rows, token=token, prob=prob,
                               gated=True, act=1, out=hs[c], tile=t)
        for label, t in variants.items():
            if not torch.equal(call(t, 0), ref):
                print(f"{name} N={N} {label}: NOT the tile's output", flush=True)
        results += _rounds(name, N, "fc1", variants, call, flops, reps, "the tile")
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1)
    return 0


def fc2_sweep(reps: int, path: str) -> int:
    """fc2 on the prefill regime's persistent tile as the engine runs it -- each row stored at
    its pair's own place (``scatter``: the pairs' order, so the norm after the MoE reads a
    token's k rows together) -- against the same tile storing the rows in sorted order, the
    tile with 4 stages, and 64-row tiles (an expert's padded last row block half as wide: at
    Qwen3's ~512 pairs per expert ~12% of a 128-row tile's MMA rows are padding), one program
    per SM or two (``x2``: two 64-row programs share an SM where their stages fit); every
    shape at 4096 and 8192 tokens, ``reps`` rounds in turn."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    t0 = fm.TILES[("prefill", "fc2")]
    s4 = dataclasses.replace(t0, num_stages=4)
    m64 = T(64, 256, 64, 4, 4, 8, True, True)
    m64s2 = T(64, 256, 64, 4, 2, 8, True, True)
    m64n128 = T(64, 128, 64, 4, 4, 8, True, True)
    # (tile, scatter, programs per SM)
    variants = {"scatter": (t0, True, 1), "sorted": (t0, False, 1),
                f"scatter {g._fmt(s4)}": (s4, True, 1), f"sorted {g._fmt(s4)}": (s4, False, 1),
                f"scatter {g._fmt(m64)}": (m64, True, 1),
                f"scatter {g._fmt(m64s2)} x2": (m64s2, True, 2),
                f"scatter {g._fmt(m64n128)} x2": (m64n128, True, 2)}
    programs = fm._programs
    results = []
    for name, m, ex, N, token, offs, prob, rows in g.shape_routings(dev, gen):
        order = torch.randperm(rows, device=dev, generator=gen)  # (a permutation)
        h0 = torch.randn(rows, ex.F, device=dev, generator=gen).to(g.DTYPE)
        ys = [torch.empty(rows, ex.H, device=dev, dtype=g.DTYPE) for _ in range(2)]
        flops = 2 * rows * ex.H * ex.F
        ref = fm.moe_gemm(h0, ex.fc2[0], offs, rows, zero_tail=True, tile=t0,
                          scatter=order)

        def call(v, c):
            t, sc, per_sm = v
            fm._programs = lambda d: per_sm * programs(d)
            try:
                return fm.moe_gemm(h0, ex.fc2[c], offs, rows, zero_tail=True, out=ys[c],
                                   tile=t, scatter=order if sc else None)
            finally:
                fm._programs = programs
        for label, v in variants.items():
            if v[1] and not torch.equal(call(v, 0), ref):
                print(f"{name} N={N} {label}: NOT the tile's output", flush=True)
        results += _rounds(name, N, "fc2", variants, call, flops, reps, "scatter")
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
