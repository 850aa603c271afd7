"""GPU check and timing of the router's one-launch top-k + softmax (model/router_topk.py)
against megatron's dense softmax routing (``topk_routing_with_score_function``, the torch ops
it replaces) on the gate's fp32 logits, one CUDA device:

  PYTHONPATH=$PWD:<megatron site> python3 scripts/gpu_router.py [--json PATH]

For E = 64 / 128 experts top-8 (the two bench-speed shapes), post- and pre-softmax, N = 1, 8,
32, 128, 4096 rows: the same experts per row (as sets) and the largest probability gap, then us
per call of each (a CUDA graph of 20 calls, median of replays) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_timing  # noqa: E402
from colo_rollout.model import router_topk as rt  # noqa: E402
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function  # noqa: E402

CALLS = 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "router.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"{'E':>4} {'pre':>5} {'N':>5} {'same experts':>12} {'max dp':>8} {'megatron us':>11}"
          f" {'kernel us':>9} {'speed-up':>8}")
    for E in (64, 128):
        for pre in (False, True):
            for N in (1, 8, 32, 128, 4096):
                logits = torch.randn(N, E, device=dev, generator=gen)
                mp, mi = topk_routing_with_score_function(
                    logits, 8, use_pre_softmax=pre, score_function="softmax", dense_output=True)
                kp, ki = rt.softmax_topk(logits, 8, pre_softmax=pre)
                ms, mo = mi.sort(1)
                ks, ko = ki.sort(1)
                same = bool(torch.equal(ms, ks))
                dp = (mp.gather(1, mo) - kp.gather(1, ko)).abs().max().item()
                t_m = gpu_timing.graph_time([lambda: topk_routing_with_score_function(
                    logits, 8, use_pre_softmax=pre, score_function="softmax",
                    dense_output=True)] * CALLS) * 1e6
                t_k = gpu_timing.graph_time(
                    [lambda: rt.softmax_topk(logits, 8, pre_softmax=pre)] * CALLS) * 1e6
                print(f"{E:4d} {str(pre):>5} {N:5d} {str(same):>12} {dp:8.1e} {t_m:11.2f}"
                      f" {t_k:9.2f} {t_m / t_k:7.2f}x", flush=True)
                rows.append(dict(E=E, pre=pre, N=N, same_experts=same, max_dp=dp,
                                 megatron_us=t_m, kernel_us=t_k))
    with open(args.json, "w") as fh:
        json.dump(rows, fh, indent=1)
    return 0 if all(r["same_experts"] and r["max_dp"] < 1e-5 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
