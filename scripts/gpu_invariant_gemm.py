"""The batch-invariant linear (model/batch_invariant.py) against F.linear (cuBLAS) on one GPU,
at D's row counts and the bench shapes' projections: time per call (CUDA events, median of
50 after warm-up), the weight's bytes over that time against the HBM roofline, and whether
cuBLAS's rows change bits with the batch (a row computed alone vs inside the batch).

    PYTHONPATH=$PWD python3 scripts/gpu_invariant_gemm.py [--rows 1 8 32 64 128 256]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from colo_rollout.model.batch_invariant import invariant_linear

HBM = 4.0e12  # bytes/s (the roofline)
SHAPES = {  # name: (K, N, out dtype)
    "first qkv": (2048, 3072, None), "first proj": (2048, 2048, None),
    "first output": (2048, 32768, None), "first gate": (2048, 64, torch.float32),
    "qwen3 qkv": (2048, 5120, None), "qwen3 proj": (4096, 2048, None),
    "qwen3 output": (2048, 151936, None), "qwen3 gate": (2048, 128, torch.float32),
}


def timed(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{'shape':14} {'rows':>5} {'cuBLAS us':>10} {'inv us':>8} {'ratio':>6} "
          f"{'inv % HBM':>9} {'cuBLAS rows vary':>16}")
    for name, (K, N, out) in SHAPES.items():
        w = torch.randn(N, K, device=dev).bfloat16() * 0.02
        for m in args.rows:
            x = torch.randn(m, K, device=dev).bfloat16()
            if out is None:
                ref = lambda: F.linear(x, w)  # noqa: E731
            else:
                ref = lambda: torch.mm(x, w.t(), out_dtype=out)  # noqa: E731
            t_ref = timed(ref)
            t_inv = timed(lambda: invariant_linear(x, w, out_dtype=out))
            full = ref()
            vary = any(not torch.equal(full[i], (F.linear(x[i:i + 1], w) if out is None else
                                                 torch.mm(x[i:i + 1], w.t(), out_dtype=out))[0])
                       for i in range(min(m, 4)))
            roof = 100 * (N * K * 2 / HBM * 1e6) / t_inv
            print(f"{name:14} {m:5d} {t_ref:10.1f} {t_inv:8.1f} {t_inv / t_ref:6.2f} "
                  f"{roof:8.1f}% {str(vary):>16}")


if __name__ == "__main__":
    main()
