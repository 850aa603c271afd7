"""Probe: DeepGEMM's SM90 BF16 m-grouped GEMM (contiguous layout) against the engine's Triton
expert GEMMs, at the bench shapes' fc2 and fc1 (issue 16: the expert GEMMs run at 506-584
TFLOP/s in a Qwen3 8 x 1k P step, cuBLAS's dense projections of the same step at 764-829).

  PYTHONPATH=$site:$PWD:$PWD/.dg/DeepGEMM python3 scripts/gpu_deepgemm_grouped.py [--json PATH]

What it answers before any engine path is built on it: how fast is
``deep_gemm.m_grouped_bf16_gemm_nt_contiguous`` (warp-specialised, TMA-multicast, JIT-compiled
with nvcc at its first call per shape) on the pairs of random top-k routing laid out as it
needs them -- each expert's rows padded to ``get_mk_alignment_for_contiguous_layout()`` (128),
a per-row expert index (-1: padding) -- against the engine's kernel on the same routing in the
engine's layout (unpadded, group ends ``offs``): fc2 storing sorted rows (the branch
fc2-sorted-store's layout; the engine's own scatter beside it), and fc1's gated GEMM on the
gathered rows (DeepGEMM has no gather: its time is on rows already permuted, the gather's own
time beside it). TFLOP/s count the useful rows only (padding excluded), CUDA graphs of four
calls (scripts/gpu_fused_moe.py's timing), medians of ``--reps`` rounds in turn. The max abs
difference from the Triton kernel's output is printed for every DeepGEMM row (fp32
accumulation both: ~bf16 rounding).

DeepGEMM on the GPU host (no package index there): carry ``.dg/DeepGEMM`` -- DeepGEMM at commit
3f71de7 (2025-09-25: SM90 BF16 grouped GEMMs, CUTLASS 4.2), its ``third-party/fmt`` at 553ec11
(the submodule's pin: ``include/`` only) and ``third-party/cutlass/include`` from the
nvidia-cutlass==4.2.0.0 wheel (``cutlass_library/source/include``; 27 MB) -- then, there:

  cd .dg/DeepGEMM && cp -r third-party/cutlass/include/cute third-party/cutlass/include/cutlass \
      deep_gemm/include/ && CXX=/usr/bin/g++ CC=/usr/bin/gcc python3 setup.py build_ext \
      --inplace && cd -

(the host extension: about a minute; each kernel shape then JIT-compiles at its first call).
The system compiler matters: built with the host's default ``CXX`` (/opt/gcc's g++ 13.3) the
extension segfaulted in ``deep_gemm_cpp.init`` at import; with /usr/bin/g++ it loads.

Answered on an H100 (2026-12-06, docs/benchmarks.md session 39): no -- DeepGEMM's grouped GEMM
runs at the Triton kernels' rate (fc2 0.91-1.04x, fc1 without its gather 0.89-1.08x), the
expert GEMMs are not behind what this library reaches at these shapes.

Owns nothing of the engine; loads model/fused_moe.py and the sweep helpers of
scripts/gpu_fused_moe.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_fused_moe as g  # noqa: E402
from gpu_timing import print_row  # noqa: E402
from colo_rollout.model import fused_moe as fm  # noqa: E402


def padded_layout(offs: torch.Tensor, rows: int, align: int):
    """The engine's sorted layout (group ends ``offs``) -> DeepGEMM's contiguous one: each
    expert's rows padded to ``align``. Returns (the padded position of each sorted row [rows]
    (-1: past offs[-1]), the per-row expert index [M] (-1: padding), M)."""
    ends = offs.long().tolist()
    starts = [0] + ends[:-1]
    counts = [e - s for s, e in zip(starts, ends)]
    padded = [-(-c // align) * align for c in counts]
    M = max(sum(padded), align)
    m_indices = torch.full((M,), -1, dtype=torch.int32)
    place = torch.full((rows,), -1, dtype=torch.int64)
    at = 0
    for e, (s, c, p) in enumerate(zip(starts, counts, padded)):
        m_indices[at:at + c] = e
        place[s:s + c] = torch.arange(at, at + c)
        at += p
    return place.to(offs.device), m_indices.to(offs.device), M


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    import deep_gemm

    align = deep_gemm.get_mk_alignment_for_contiguous_layout()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    results = []
    for name, m, ex, N, token, offs, prob, rows in g.shape_routings(dev, gen):
        R = int(offs[-1])
        place, m_idx, M = padded_layout(offs, rows, align)
        ok = place >= 0
        x = torch.randn(N, ex.H, device=dev, generator=gen).to(g.DTYPE)
        h = torch.randn(rows, ex.F, device=dev, generator=gen).to(g.DTYPE)
        h_pad = torch.zeros(M, ex.F, device=dev, dtype=g.DTYPE)
        h_pad[place[ok]] = h[ok]
        x_pad = torch.zeros(M, ex.H, device=dev, dtype=g.DTYPE)
        x_pad[place[ok]] = x[token[ok].long()]
        y_sorted = torch.empty(rows, ex.H, device=dev, dtype=g.DTYPE)
        y_pad = torch.empty(M, ex.H, device=dev, dtype=g.DTYPE)
        h1 = torch.empty(rows, ex.F, device=dev, dtype=g.DTYPE)
        u_pad = torch.empty(M, 2 * ex.F, device=dev, dtype=g.DTYPE)
        order = torch.randperm(rows, device=dev, generator=gen)
        # the gather's index pair made outside the timed calls (a boolean mask syncs, which a
        # graph capture refuses)
        dst, src = place[ok], token[ok].long()
        fc2_tile = fm.tile_for("prefill", "fc2", pairs=rows)
        fc1_tile = fm.TILES[("prefill", "fc1")]
        calls = {
            "fc2 triton, sorted store": lambda c: fm.moe_gemm(
                h, ex.fc2[c], offs, rows, zero_tail=True, out=y_sorted, tile=fc2_tile),
            "fc2 triton, scatter (engine)": lambda c: fm.moe_gemm(
                h, ex.fc2[c], offs, rows, zero_tail=True, out=y_sorted, tile=fc2_tile,
                scatter=order),
            "fc2 deepgemm (padded)": lambda c: deep_gemm.m_grouped_bf16_gemm_nt_contiguous(
                h_pad, ex.fc2[c], y_pad, m_idx),
            "fc1 triton (gather, SwiGLU, prob)": lambda c: fm.moe_gemm(
                x, ex.fc1[c], offs, rows, token=token, prob=prob, gated=True, act=1,
                out=h1, tile=fc1_tile),
            "fc1 deepgemm (permuted, no epilogue)":
                lambda c: deep_gemm.m_grouped_bf16_gemm_nt_contiguous(
                    x_pad, ex.fc1[c], u_pad, m_idx),
            "fc1's gather alone (x[token] into the padded rows)":
                lambda c: x_pad.index_copy_(0, dst, x.index_select(0, src)),
        }
        flops = {"fc2": 2 * R * ex.H * ex.F, "fc1": 4 * R * ex.H * ex.F}
        times = {k: [] for k in calls}
        for _ in range(args.reps):
            for label, fn in calls.items():
                if isinstance(times[label], str):  # failed in an earlier round: its error stays
                    continue
                try:
                    times[label].append(g.graph_time(
                        [lambda c=c, fn=fn: fn(c) for c in (0, 1, 0, 1)], reps=5, warm=1))
                except Exception as e:  # a build or shape DeepGEMM does not take
                    times[label] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
                    break
        # DeepGEMM's rows against the Triton kernel's (same weights copy 0)
        fm.moe_gemm(h, ex.fc2[0], offs, rows, zero_tail=True, out=y_sorted, tile=fc2_tile)
        diff = {}
        if isinstance(times["fc2 deepgemm (padded)"], list):
            deep_gemm.m_grouped_bf16_gemm_nt_contiguous(h_pad, ex.fc2[0], y_pad, m_idx)
            diff["fc2"] = (y_pad[place[ok]].float() - y_sorted[ok].float()).abs().max().item()
        for label, ts in times.items():
            row = {"model": name, "tokens": N, "variant": label, "padded_rows": M,
                   "rows": R}
            if isinstance(ts, str):
                row["error"] = ts
            else:
                s = sorted(ts)[len(ts) // 2]
                row["ms"] = 1e3 * s
                which = label[:3]
                if which in flops and "gather" not in label:
                    row["tflops"] = flops[which] / s / 1e12
                if "deepgemm" in label and which in diff:
                    row["max_abs_diff"] = diff[which]
            results.append(row)
            print_row(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
