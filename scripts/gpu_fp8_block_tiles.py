"""Tile probe of the blockwise FP8 GEMMs (issue 19: ``model.fp8_recipe: blockwise``'s prefill
ran 4.5x slower than rowwise's in session 21): fc1 (gated, rows gathered) and fc2 of the
fused-MoE kernel at prefill sizes, and a dense projection through the same kernel as one
group (``fp8_linear``'s blockwise path), each with the tile the engine picks and a few with a
smaller accumulator or a 128-wide K step -- beside the rowwise FP8 and bf16 launches of the
same shape.

  PYTHONPATH=$PWD python3 scripts/gpu_fp8_block_tiles.py [--json PATH]

ms per call and TFLOP/s (fc1 4 R H F, fc2 2 R H F, the projection 2 M K N) against the 989
TFLOP/s bf16 peak; max relative error of each blockwise tile against the engine's tile. CUDA
graphs of four calls over two weight copies, median of replays (gpu_timing.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_fused_moe as g  # noqa: E402
from colo_rollout.model import fp8  # noqa: E402
from colo_rollout.model.fp8_linear import fp8_linear  # noqa: E402
from colo_rollout.model import fused_moe as fm  # noqa: E402

T = fm.Tile
# candidates: the accumulator at most 128 x 128 fp32 per 8 warps (64 registers a thread)
# beside the per-K-step partial product, K steps of 64 and 128 (one rescale per scale block)
FC1 = [T(128, 128, 64, 8, 4), T(128, 64, 128, 8, 3), T(128, 64, 64, 8, 4),
       T(64, 128, 128, 4, 3), T(64, 64, 128, 4, 3), T(128, 128, 128, 8, 3)]
FC2 = [T(128, 256, 64, 8, 3, 8), T(128, 128, 128, 8, 3, 8), T(128, 128, 64, 8, 4, 8),
       T(64, 128, 128, 4, 3, 8), T(128, 64, 128, 4, 3, 8), T(64, 256, 128, 8, 3, 8)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                   "fp8_block_tiles.json"))
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    N, out = args.tokens, []

    def run(label, which, flops, fns, ref=None):
        try:
            got = fns[0]().float()
            s = g.graph_time([fns[c % 2] for c in range(4)], reps=5, warm=1)
        except Exception as ex:  # noqa: BLE001 - a tile that does not compile or fit
            print(f"  {which} {label}: {type(ex).__name__}: {str(ex).splitlines()[0][:140]}",
                  flush=True)
            torch.cuda.synchronize()
            return None
        err = "" if ref is None else f" err {g.rel_err(got, ref):.1e}"
        tf = flops / s / 1e12
        print(f"  {which} {label:44s} {s * 1e3:8.3f} ms {tf:6.1f} TFLOP/s "
              f"{100 * tf / 989:5.1f}%{err}", flush=True)
        out.append({"which": which, "variant": label, "ms": s * 1e3, "tflops": tf})
        return got

    for name, m in g.MODELS.items():
        print(f"{name} N={N}", flush=True)
        ex = g.Experts(m["H"], m["F"], m["E"], dev, gen)
        H, F_, k = ex.H, ex.F, m["k"]
        token, _, offs, prob = g.routing(N, ex.E, k, dev, gen)
        rows = N * k
        x = torch.randn(N, H, device=dev, generator=gen).to(g.DTYPE)
        h0 = torch.randn(rows, F_, device=dev, generator=gen).to(g.DTYPE)
        blk = [(fp8.Fp8Weight.of(ex.fc1[c], 128), fp8.Fp8Weight.of(ex.fc2[c], 128))
               for c in (0, 1)]
        roww = [(fp8.Fp8Weight.of(ex.fc1[c]), fp8.Fp8Weight.of(ex.fc2[c])) for c in (0, 1)]
        xq, xs = fp8.quantize_rows(x, pad=False, group=128)
        hq, hs = fp8.quantize_rows(h0, pad=False, group=128)
        xr, xrs = fp8.quantize_rows(x, pad=False)
        hr, hrs = fp8.quantize_rows(h0, pad=False)
        f1, f2 = 4 * rows * H * F_, 2 * rows * H * F_
        pre1, pre2 = fm.TILES[("prefill", "fc1")], fm.TILES[("prefill", "fc2")]
        run("bf16 (engine tile)", "fc1", f1, [lambda c=c: fm.moe_gemm(
            x, ex.fc1[c], offs, rows, token=token, prob=prob, gated=True, act=1,
            tile=pre1) for c in (0, 1)])
        run("rowwise FP8 (engine tile)", "fc1", f1, [lambda c=c: fm.moe_gemm(
            xr, roww[c][0].q, offs, rows, token=token, prob=prob, gated=True, act=1,
            tile=pre1, a_scale=xrs, w_scale=roww[c][0].scale, out_dtype=g.DTYPE)
            for c in (0, 1)])
        ref = None
        for t in FC1:
            got = run(f"blockwise {g._fmt(t)}", "fc1", f1, [lambda c=c, t=t: fm.moe_gemm(
                xq, blk[c][0].q, offs, rows, token=token, prob=prob, gated=True, act=1,
                tile=t, a_scale=xs, w_scale=blk[c][0].scale, out_dtype=g.DTYPE)
                for c in (0, 1)], ref)
            ref = got if ref is None else ref
        run("bf16 (engine tile)", "fc2", f2, [lambda c=c: fm.moe_gemm(
            h0, ex.fc2[c], offs, rows, zero_tail=True, tile=pre2) for c in (0, 1)])
        run("rowwise FP8 (engine tile)", "fc2", f2, [lambda c=c: fm.moe_gemm(
            hr, roww[c][1].q, offs, rows, zero_tail=True, tile=pre2, a_scale=hrs,
            w_scale=roww[c][1].scale, out_dtype=g.DTYPE) for c in (0, 1)])
        ref = None
        for t in FC2:
            got = run(f"blockwise {g._fmt(t)}", "fc2", f2, [lambda c=c, t=t: fm.moe_gemm(
                hq, blk[c][1].q, offs, rows, zero_tail=True, tile=t, a_scale=hs,
                w_scale=blk[c][1].scale, out_dtype=g.DTYPE) for c in (0, 1)], ref)
            ref = got if ref is None else ref
        # a QKV-sized projection (32 q + 2 x 4 kv heads of 128) as one group
        wq = [(torch.randn(5120, H, device=dev, generator=gen) * H ** -0.5).to(g.DTYPE)
              for _ in (0, 1)]
        wqb = [fp8.Fp8Weight.of(w, 128) for w in wq]
        wqr = [fp8.Fp8Weight.of(w) for w in wq]
        fl = 2 * N * H * 5120
        ends = torch.full((1,), N, dtype=torch.int32, device=dev)
        run("bf16 torch.mm", "qkv", fl, [lambda c=c: x @ wq[c].T for c in (0, 1)])
        run("rowwise FP8 _scaled_mm (fp8_linear)", "qkv", fl,
            [lambda c=c: fp8_linear(x, wqr[c]) for c in (0, 1)])
        run("blockwise fp8_linear (engine)", "qkv", fl,
            [lambda c=c: fp8_linear(x, wqb[c]) for c in (0, 1)])
        ref = None
        for t in FC2:
            got = run(f"blockwise GEMM alone {g._fmt(t)}", "qkv", fl, [
                lambda c=c, t=t: fm.moe_gemm(xq, wqb[c].q[None], ends, N, tile=t, a_scale=xs,
                                             w_scale=wqb[c].scale[None], out_dtype=g.DTYPE)
                for c in (0, 1)], ref)
            ref = got if ref is None else ref
        run("blockwise quantize_rows(x) alone", "qkv", fl,
            [lambda: fp8.quantize_rows(x, pad=False, group=128)[0]] * 2)
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
