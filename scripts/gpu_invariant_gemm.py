"""The batch-invariant linear (model/batch_invariant.py) against F.linear (cuBLAS) on one GPU,
at D's row counts and the bench shapes' projections: GPU time per call (a CUDA graph of 20
calls replayed, CUDA events; the median of 20 replays), the weight's bytes over that time
against the HBM roofline, and whether cuBLAS's rows change bits with the batch (a row computed
alone vs inside the batch). ``--sweep``: every candidate tile per shape and row count, the
best against the shipped one (what ``linear_tile`` should pick).

    PYTHONPATH=$PWD python3 scripts/gpu_invariant_gemm.py [--rows 1 8 32 64 128 256] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from colo_rollout.model.batch_invariant import LinearTile, invariant_linear, linear_tile

HBM = 4.0e12  # bytes/s (the roofline)
SHAPES = {  # name: (K, N, out dtype)
    "first qkv": (2048, 3072, None), "first proj": (2048, 2048, None),
    "first output": (2048, 32768, None), "first gate": (2048, 64, torch.float32),
    "qwen3 qkv": (2048, 5120, None), "qwen3 proj": (4096, 2048, None),
    "qwen3 output": (2048, 151936, None), "qwen3 gate": (2048, 128, torch.float32),
}
CALLS = 20


def gpu_us(fn) -> float:
    """Median GPU microseconds of one call: CALLS calls captured in a graph, replayed."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    g.replay()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def cublas(x, w, out):
    return F.linear(x, w) if out is None else torch.mm(x, w.t(), out_dtype=out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{'shape':14} {'rows':>5} {'cuBLAS us':>10} {'inv us':>8} {'ratio':>6} "
          f"{'inv % HBM':>9} {'cuBLAS rows vary':>16}")
    weights = {}
    for name, (K, N, out) in SHAPES.items():
        w = weights[name] = torch.randn(N, K, device=dev).bfloat16() * 0.02
        for m in args.rows:
            x = torch.randn(m, K, device=dev).bfloat16()
            t_ref = gpu_us(lambda: cublas(x, w, out))
            t_inv = gpu_us(lambda: invariant_linear(x, w, out_dtype=out))
            full = cublas(x, w, out)
            vary = any(not torch.equal(full[i], cublas(x[i:i + 1], w, out)[0])
                       for i in range(min(m, 4)))
            roof = 100 * (N * K * 2 / HBM * 1e6) / t_inv
            print(f"{name:14} {m:5d} {t_ref:10.2f} {t_inv:8.2f} {t_inv / t_ref:6.2f} "
                  f"{roof:8.1f}% {str(vary):>16}", flush=True)
    if not args.sweep:
        return
    tiles = [LinearTile(bn, bk, sk, st) for bn, bk, sk, st in
             itertools.product((16, 32, 64), (64, 128), (1, 2, 4), (3, 4))]
    print(f"\nsweep: {len(tiles)} tiles; best per shape and rows against the shipped tile")
    print(f"{'shape':14} {'rows':>5} {'shipped us':>10} {'best us':>8} {'best tile'}")
    for name, (K, N, out) in SHAPES.items():
        w = weights[name]
        for m in (1, 64, 256):
            x = torch.randn(m, K, device=dev).bfloat16()
            res = []
            for t in tiles:
                try:
                    res.append((gpu_us(lambda: invariant_linear(x, w, out_dtype=out, tile=t)), t))
                except Exception as e:  # noqa: BLE001 -- a tile that does not fit: skipped
                    print(f"  {t}: {type(e).__name__}")
            shipped = gpu_us(lambda: invariant_linear(x, w, out_dtype=out))
            best = min(res, key=lambda r: r[0])
            print(f"{name:14} {m:5d} {shipped:10.2f} {best[0]:8.2f} {best[1]} "
                  f"(shipped {linear_tile(N, K)})", flush=True)


if __name__ == "__main__":
    main()
