"""`colo-rollout bench-decode-overhead`: decode-only cost of PD mode vs Normal, same run.

Every repetition serves the same decode-heavy workload (short prompts, long outputs, all
admitted in one P step, then only D) once per mode, alternating the order, and times the
decode iterations only. With no P pending the P/D machinery is off, so the ratio should be ~1.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from colo_rollout.config import load_config
from colo_rollout.engine.engine import Engine
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.sched.plan import Phase
from colo_rollout.sched.request import Request, SamplingParams
from colo_rollout.quiet import quiet_known_warnings


def decode_overhead(rank: int, world: int, config_path: str, overrides: dict | None = None,
                    reps: int = 3, modes: tuple[str, ...] = ("normal", "fine")) -> dict:
    quiet_known_warnings()
    base = load_config(config_path, overrides)
    groups = init_parallel(base.parallel)
    n = base.engine.max_batch_size * groups.layout.adp
    out_len = min(128, base.engine.max_seq_len - 8)
    requests = [Request(f"d{i}", tuple(range(1, 9)), SamplingParams(max_tokens=out_len,
                                                                     ignore_eos=True))
                for i in range(n)]
    times: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(reps):
        order = modes if rep % 2 == 0 else tuple(reversed(modes))
        for mode in order:
            cfg = dataclasses.replace(base, engine=dataclasses.replace(base.engine, mode=mode))
            engine = Engine(cfg, groups)
            reqs = [dataclasses.replace(r, request_id=f"{r.request_id}-{rep}-{mode}")
                    for r in requests]
            engine.generate(reqs)
            engine.close()
            d = [h.seconds for h in engine.history if h.phase in (Phase.DECODE, Phase.ROUND)
                 and h.rows > 0]
            times[mode].append(float(np.sum(d)) / max(len(d), 1))
    return {m: times[m] for m in modes}
