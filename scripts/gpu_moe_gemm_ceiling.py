"""How far the prefill expert GEMMs are from what the H200 gives (issue 16, prefill >= 50%):
fc1 and fc2 of the fused-MoE kernel (model/fused_moe.py) at 4096 and 8192 tokens beside

  * the same kernel on a pre-permuted copy of x (fc1's A rows through TMA too; the gather's
    own time reported apart),
  * a persistent version of the kernel (one program per SM walking the tiles; ``flatten``:
    the next tile's loads pipelined under this tile's epilogue; ``warp_specialize``:
    Triton's producer/consumer warps, where this Triton compiles it for sm90),
  * ``torch._grouped_mm`` (CUTLASS's sm90 grouped GEMM) on the permuted rows -- the GEMM
    alone, no activation,
  * one dense cuBLAS GEMM of the same FLOPs (rows x K x N with every row in one group): the
    ceiling a grouping could at best reach.

  PYTHONPATH=$PWD python3 scripts/gpu_moe_gemm_ceiling.py [--json PATH]

TFLOP/s (fc1 4 R H F, fc2 2 R H F; R = tokens x k) and the fraction of the 989 TFLOP/s bf16
peak. CUDA graphs of four calls over two weight copies, median of replays (gpu_timing.py).
Kernel variants that fail to compile print their error and are skipped.
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
from colo_rollout.model import fused_moe as fm  # noqa: E402
from colo_rollout.model.kernel_backend import pow2, tl, triton  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

T = fm.Tile


@triton.jit
def _persistent(A, Tok, W, Offs, Prob, Out, n_out, k_dim, E, stride_am, stride_om, m_bound,
                E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, GATHER: tl.constexpr,
                GATED: tl.constexpr, PROB: tl.constexpr, A_TMA: tl.constexpr,
                NPROG: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr):
    start = tl.program_id(0)
    eids = tl.arange(0, E_PAD)
    inside = eids < E
    ends = tl.load(Offs + eids, mask=inside, other=0).to(tl.int32)
    starts = tl.load(Offs + eids - 1, mask=inside & (eids > 0), other=0).to(tl.int32)
    nblk = (tl.where(inside, ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(nblk, 0)
    total = tl.sum(nblk, 0)
    n_tiles = tl.cdiv(n_out, BLOCK_N)
    per_group = GROUP_M * n_tiles
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(start, total * n_tiles, NPROG, flatten=FLATTEN, warp_specialize=WS):
        first_m = (tile // per_group) * GROUP_M
        size_m = tl.minimum(total - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % size_m
        pid_n = (tile % per_group) // size_m
        e = tl.sum((cum <= pid_m).to(tl.int32), 0)
        sel = eids == e
        first_blk = tl.sum(tl.where(sel, cum - nblk, 0), 0)
        row_lo = tl.sum(tl.where(sel, starts, 0), 0) + (pid_m - first_blk) * BLOCK_M
        row_hi = tl.sum(tl.where(sel, ends, 0), 0)
        rows_m = row_lo + offs_m
        mmask = rows_m < row_hi
        if GATHER:
            a_rows = tl.load(Tok + rows_m, mask=mmask, other=0).to(tl.int64)
        else:
            a_rows = rows_m.to(tl.int64)
        w_row = e * (2 * n_out if GATED else n_out) + pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            if A_TMA:
                a = A.load([row_lo, k0])
            else:
                a = tl.load(A + a_rows[:, None] * stride_am + (k0 + offs_k)[None, :],
                            mask=mmask[:, None], other=0.0)
            acc = tl.dot(a, W.load([w_row, k0]).T, acc)
            if GATED:
                acc_up = tl.dot(a, W.load([w_row + n_out, k0]).T, acc_up)
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if PROB:
            p = tl.load(Prob + rows_m, mask=mmask, other=0.0).to(tl.float32)
            acc = acc * p[:, None]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(Out + rows_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 acc.to(Out.dtype.element_ty), mask=mmask[:, None] & (offs_n < n_out)[None, :])


def persistent_gemm(a, w, offs, out, *, tile, token=None, prob=None, gated=False,
                    flatten=True, ws=False, nprog=None):
    E, wn, K = w.shape
    n_out = wn // 2 if gated else wn
    nprog = nprog or torch.cuda.get_device_properties(a.device).multi_processor_count
    w_d = TensorDescriptor(w, [E * wn, K], [w.stride(1), 1], [tile.block_n, tile.block_k])
    a_tma = token is None
    a_arg = (TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [tile.block_m, tile.block_k])
             if a_tma else a)
    m_bound = fm.row_blocks(out.shape[0], E, tile.block_m)
    _persistent[(nprog,)](
        a_arg, token if token is not None else offs, w_d, offs,
        prob if prob is not None else offs, out, n_out, K, E, a.stride(0), out.stride(0),
        m_bound, E_PAD=pow2(E, 128), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, GROUP_M=tile.group_m, GATHER=token is not None, GATED=gated,
        PROB=prob is not None, A_TMA=a_tma, NPROG=nprog, FLATTEN=flatten, WS=ws,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                   "moe_gemm_ceiling.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    results = []
    fc1_tile, fc2_tile = fm.TILES[("prefill", "fc1")], fm.TILES[("prefill", "fc2")]
    P1 = [T(128, 128, 64, 8, 4, 8), T(128, 128, 64, 8, 3, 8), T(128, 64, 64, 8, 4, 8),
          T(128, 128, 64, 8, 4, 1)]
    P2 = [T(128, 256, 64, 8, 3, 8), T(128, 128, 64, 8, 4, 8), T(128, 256, 64, 8, 4, 8),
          T(128, 128, 64, 4, 4, 8)]
    for name, m in g.MODELS.items():
        ex = g.Experts(m["H"], m["F"], m["E"], dev, gen)
        H, F_, E = ex.H, ex.F, ex.E
        for N in (4096, 8192):
            token, _, offs, prob = g.routing(N, E, m["k"], dev, gen)
            x = torch.randn(N, H, device=dev, generator=gen).to(g.DTYPE)
            rows = N * m["k"]
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
                ("fc2", "kernel"): lambda c: fm.moe_gemm(
                    h0, ex.fc2[c], offs, rows, zero_tail=True, out=ys[c], tile=fc2_tile),
                ("fc2", "torch._grouped_mm"): lambda c: torch._grouped_mm(
                    h0, ex.fc2[c].transpose(1, 2), offs=offs),
                ("fc2", "dense cuBLAS same FLOPs"): lambda c: torch.mm(h0, dense2[c],
                                                                      out=ys[c]),
            }
            for t in P1:
                for fl, ws in ((True, False), (False, False), (True, True)):
                    for gather in (True, False):
                        key = ("fc1", f"persistent {g._fmt(t)} flat={int(fl)} ws={int(ws)} "
                               f"{'gather' if gather else 'permuted'}")
                        cases[key] = (lambda c, t=t, fl=fl, ws=ws, gather=gather: persistent_gemm(
                            x if gather else xs, ex.fc1[c], offs, hs[c], tile=t,
                            token=token if gather else None, prob=prob, gated=True,
                            flatten=fl, ws=ws))
            for t in P2:
                for fl, ws in ((True, False), (False, False), (True, True)):
                    key = ("fc2", f"persistent {g._fmt(t)} flat={int(fl)} ws={int(ws)}")
                    cases[key] = (lambda c, t=t, fl=fl, ws=ws: persistent_gemm(
                        h0, ex.fc2[c], offs, ys[c], tile=t, flatten=fl, ws=ws))
            # correctness of the persistent kernels against the current kernel (first copy)
            ref1 = fm.moe_gemm(x, ex.fc1[0], offs, rows, token=token, prob=prob, gated=True,
                               act=1, tile=fc1_tile).float()
            ref2 = fm.moe_gemm(h0, ex.fc2[0], offs, rows, tile=fc2_tile).float()
            for (which, label), fn in cases.items():
                flops = f1 if which == "fc1" else f2
                err = ""
                try:
                    if label.startswith("persistent"):
                        got = fn(0).float()
                        ref = ref1 if which == "fc1" else ref2
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


if __name__ == "__main__":
    sys.exit(main())
