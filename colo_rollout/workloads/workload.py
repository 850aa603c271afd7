"""Synthetic request mixes (seeded) for the demo and tests: varied prompt and output lengths."""

from __future__ import annotations

import random

from colo_rollout.config import Config
from colo_rollout.sched.request import Request, SamplingParams


def synthetic_requests(cfg: Config) -> list[Request]:
    w = cfg.workload
    rng = random.Random(w.seed)
    params = dict(temperature=w.temperature, top_k=w.top_k, top_p=w.top_p, ignore_eos=True)
    reqs = []
    for i in range(w.num_requests):
        # log-uniform lengths: many short requests and a long tail, like real traffic
        plen = int(round(_log_uniform(rng, w.prompt_len_min, w.prompt_len_max)))
        olen = int(round(_log_uniform(rng, w.output_len_min, w.output_len_max)))
        prompt = tuple(rng.randrange(cfg.model.vocab_size) for _ in range(plen))
        reqs.append(Request(f"req-{i:05d}", prompt, SamplingParams(max_tokens=olen, **params)))
    return reqs


def _log_uniform(rng: random.Random, lo: int, hi: int) -> float:
    import math

    return math.exp(rng.uniform(math.log(lo), math.log(hi)))
