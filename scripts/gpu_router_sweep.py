"""The router's P kernels at a 4k step's shapes, swept (issue 16: per Qwen3 4k layer the
k-rounds top-k took 15.4 us, the counting sort's scatter 11.0, scan 5.8, histogram 2.4 --
~1 ms of a 30 ms step; session 19's profile):

  * ``softmax_topk``'s k-rounds kernel: rows per program x warps;
  * ``moe_align``'s counting sort (histogram + scan + scatter, three launches): pairs per
    block x warps; and (``--kernels scan``) the scan's keys per program.

  PYTHONPATH=$PWD python3 scripts/gpu_router_sweep.py [--tokens 4096,8192]
      [--kernels topk,align,scan] [--json PATH]

Every variant's outputs are compared bitwise with the shipped configuration's (ids, probs;
order, token, offs, prob) before it is timed (median us per call over CUDA-graph replays:
``triton.testing.do_bench_cudagraph``). Prints one table per shape; owns nothing of the
engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from colo_rollout.model import moe_align as ma  # noqa: E402
from colo_rollout.model import router_topk as rt  # noqa: E402

SHAPES = (("qwen3", 128, 8), ("first", 64, 8))  # (name, experts, top-k)


def _bench(fn) -> float:
    """GPU us per call: replays of a CUDA graph of many calls (a launch costs more host time
    than these kernels take, so eager timing would time the host)."""
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def _align(chosen, weight, E, block, warps, keys=ma.SCAN_KEYS):
    n, k = chosen.shape
    dev = chosen.device
    out = ma.Aligned(torch.empty(n * k, dtype=torch.int32, device=dev),
                     torch.empty(n * k, dtype=torch.int32, device=dev),
                     torch.empty(E, dtype=torch.int32, device=dev),
                     torch.empty(n * k, dtype=weight.dtype, device=dev),
                     torch.empty(n * k, dtype=torch.int32, device=dev))
    return ma._blocked_align(chosen, weight, 0, E, None, out, block=block, warps=warps,
                             scan_keys=keys)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--shapes", default="qwen3,first")
    ap.add_argument("--kernels", default="topk,align")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                   "router_sweep.json"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    res = []
    for N in (int(t) for t in a.tokens.split(",")):
        for name, E, k in (s for s in SHAPES if s[0] in a.shapes.split(",")):
            g = torch.Generator(device=dev).manual_seed(N + E)
            logits = torch.randn(N, E, device=dev, generator=g)
            want_p, want_i = rt.softmax_topk(logits, k)
            # megatron's routing in torch (top-k of the logits, softmax over them): the
            # shipped kernel within the tests' bounds (ids equal, probs to 1e-6)
            ref_v, ref_i = logits.topk(k, dim=-1)
            ref_ok = torch.equal(want_i, ref_i) and torch.allclose(
                want_p, torch.softmax(ref_v, dim=-1), rtol=1e-6, atol=1e-7)
            print(f"{name} N={N}: shipped top-k against torch's: "
                  f"{'within bounds' if ref_ok else 'OUTSIDE BOUNDS'}")
            res.append(dict(kernel="topk_vs_torch", shape=name, N=N, ok=ref_ok))
            print(f"{name} N={N} E={E} k={k}: top-k (shipped: rows, warps "
                  f"{rt.rounds_launch(max(16, 1 << (E - 1).bit_length()))})")
            for rows in ((1, 2, 4, 8, 16, 32) if "topk" in a.kernels else ()):
                for warps in (1, 2, 4, 8):
                    if rows * E < 32 * warps:  # fewer elements than threads
                        continue
                    p, i = rt.softmax_topk(logits, k, rows=rows, warps=warps)
                    same = torch.equal(i, want_i) and torch.equal(p, want_p)
                    us = _bench(lambda: rt.softmax_topk(logits, k, rows=rows, warps=warps))
                    res.append(dict(kernel="topk", shape=name, N=N, rows=rows, warps=warps,
                                    us=us, same=same))
                    print(f"  rows {rows:2d} warps {warps}: {us:7.2f} us"
                          + ("" if same else "  DIFFERS"))
            chosen = want_i
            weight = want_p.to(torch.bfloat16)
            want = _align(chosen, weight, E, ma.BLOCK_PAIRS, ma.ALIGN_WARPS)
            ref = ma.torch_align(chosen, weight, 0, E)  # the reference (a stable torch.sort)
            ref_same = all(torch.equal(x.long(), y.long()) for x, y in
                           zip((want.order, want.token, want.offs, want.where),
                               (ref.order, ref.token, ref.offs, ref.where))
                           ) and torch.equal(want.prob, ref.prob)
            print(f"{name} N={N}: shipped align against torch's: "
                  f"{'bitwise equal' if ref_same else 'DIFFERS'}")
            res.append(dict(kernel="align_vs_torch", shape=name, N=N, same=ref_same))
            print(f"{name} N={N}: align (shipped: block {ma.BLOCK_PAIRS}, warps "
                  f"{ma.ALIGN_WARPS})")
            for block in ((128, 256, 512, 1024, 2048) if "align" in a.kernels else ()):
                for warps in (1, 2, 4, 8, 16):
                    if block < 32 * warps:
                        continue
                    got = _align(chosen, weight, E, block, warps)
                    same = all(torch.equal(x, y) for x, y in
                               zip((got.order, got.token, got.offs, got.prob),
                                   (want.order, want.token, want.offs, want.prob)))
                    us = _bench(lambda: _align(chosen, weight, E, block, warps))
                    res.append(dict(kernel="align", shape=name, N=N, block=block,
                                    warps=warps, us=us, same=same))
                    print(f"  block {block:4d} warps {warps:2d}: {us:7.2f} us"
                          + ("" if same else "  DIFFERS"))
            if "scan" in a.kernels:  # the scan's keys per program, at the shipped block
                print(f"{name} N={N}: align by the scan's keys per program (shipped: "
                      f"{ma.SCAN_KEYS}; 256 and more: one program)")
            for keys in ((256, 128, 64, 32, 16, 8) if "scan" in a.kernels else ()):
                got = _align(chosen, weight, E, ma.BLOCK_PAIRS, ma.ALIGN_WARPS, keys)
                same = all(torch.equal(x, y) for x, y in
                           zip((got.order, got.token, got.offs, got.prob, got.where),
                               (want.order, want.token, want.offs, want.prob, want.where)))
                us = _bench(lambda: _align(chosen, weight, E, ma.BLOCK_PAIRS, ma.ALIGN_WARPS,
                                           keys))
                res.append(dict(kernel="scan_keys", shape=name, N=N, keys=keys, us=us,
                                same=same))
                print(f"  keys {keys:3d}: {us:7.2f} us" + ("" if same else "  DIFFERS"))
    with open(a.json, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
