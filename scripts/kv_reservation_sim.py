"""What ``engine.kv_reservation`` does to an RL rollout batch's schedule: the scheduler alone
(pure Python, no model), fed a stand-in model that ends each request at a drawn output length,
run once per reservation policy on the same KV capacity. Prints, per policy: D iterations to
finish the batch, mean and peak rows per D iteration, P steps, preemptions and the tokens
prefilled again for them -- the schedule a GPU run would follow (a D iteration's time grows far
slower than its rows in the memory-bound regime: docs/benchmarks.md, bench-speed's decode
rows). Not a GPU measurement.

  python3 scripts/kv_reservation_sim.py [--requests 256] [--prompt 512] [--max-tokens 8192]
      [--median-output 1500] [--kv-tokens 600000] [--block 16] [--batch 256]
      [--prefill-tokens 16384] [--seed 0]
(defaults: a 32 x 8 GRPO batch on a Qwen3-30B-A3B-sized KV cache of one H200)
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time

sys.path.insert(0, ".")

from colo_rollout.config import EngineConfig  # noqa: E402
from colo_rollout.sched.plan import Phase, Sampled  # noqa: E402
from colo_rollout.sched.request import Request, SamplingParams  # noqa: E402
from colo_rollout.sched.scheduler import Scheduler  # noqa: E402

EOS, TOKEN = 2, 7


def run(policy: str, a, lengths: list[int]) -> dict:
    blocks = a.kv_tokens // a.block
    buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < a.batch] + [a.batch]
    cfg = EngineConfig(max_batch_size=a.batch, max_prefill_tokens=a.prefill_tokens,
                       kv_block_size=a.block, num_kv_blocks=blocks,
                       max_seq_len=a.prompt + a.max_tokens, decode_buckets=buckets,
                       eos_token_id=EOS, kv_reservation=policy)
    s = Scheduler(cfg, 1, 1, 100)
    ends = {}
    for i, n in enumerate(lengths):
        rid = f"r{i}"
        ends[rid] = n
        s.add(Request(rid, (TOKEN,) * a.prompt, SamplingParams(max_tokens=a.max_tokens)))

    def token(lifetime: int) -> Sampled:  # EOS at the request's drawn length
        out = s.by_id[s.seqs[lifetime].request.request_id]
        return Sampled(lifetime, EOS if len(out.tokens) + 1 >= ends[out.request_id] else TOKEN,
                       -1.0)

    d_iters = p_steps = rows = peak = refill = 0
    t0 = time.perf_counter()
    while s.has_work():
        plan = s.plan()
        w = plan.replicas[0]
        if plan.phase is Phase.PREFILL:
            p_steps += 1
            refill += sum(len(p.tokens) - a.prompt for p in w.prefill)
            s.commit(plan, [token(p.lifetime) for p in w.prefill])
        elif plan.phase is Phase.DECODE:
            d_iters += 1
            rows += len(w.decode)
            peak = max(peak, len(w.decode))
            s.commit(plan, [token(d.lifetime) for d in w.decode])
    return {"policy": policy, "d_iterations": d_iters, "mean_rows": rows / max(d_iters, 1),
            "peak_rows": peak, "p_steps": p_steps, "preemptions": s.preemptions,
            "refill_tokens": refill, "host_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--median-output", type=int, default=1500)
    ap.add_argument("--kv-tokens", type=int, default=600_000)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefill-tokens", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    # log-normal output lengths (sigma 0.8) around the median, clipped to max_tokens
    lengths = [max(1, min(a.max_tokens, int(a.median_output * math.exp(rng.gauss(0, 0.8)))))
               for _ in range(a.requests)]
    print(f"{a.requests} requests, prompt {a.prompt}, max_tokens {a.max_tokens}, outputs: median "
          f"{sorted(lengths)[len(lengths) // 2]}, max {max(lengths)}; KV {a.kv_tokens} tokens in "
          f"blocks of {a.block}; max_batch_size {a.batch}")
    print("| policy | D iterations | mean rows / D | peak rows | P steps | preemptions | "
          "tokens prefilled again |")
    print("|---|---|---|---|---|---|---|")
    for policy in ("full", "on_demand"):
        r = run(policy, a, lengths)
        print(f"| {r['policy']} | {r['d_iterations']} | {r['mean_rows']:.1f} | {r['peak_rows']} | "
              f"{r['p_steps']} | {r['preemptions']} | {r['refill_tokens']} |", flush=True)


if __name__ == "__main__":
    main()
