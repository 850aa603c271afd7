"""Count the torch ops one P step dispatches (each is host launch time on a GPU, where P's
enqueue is the critical path of a Fine round; see docs/benchmarks.md).

  torchrun --standalone --nproc-per-node 1 scripts/count_p_ops.py configs/bench_gpu.yaml

Runs on CPU or GPU, on one rank, with the config's model and the grouped expert path (the one
the GPU runs). Prints the total for one P step of 8 prompts of 30 tokens and the most frequent
ops. A proxy, not a timing: a view costs less than a kernel launch.
"""

from __future__ import annotations

import collections
import random
import sys

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from colo_rollout.config import load_config
from colo_rollout.engine.engine import Engine
from colo_rollout.model.weights import random_state_dict
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.sched.request import Request, SamplingParams


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.by_part: collections.Counter = collections.Counter()
        self.part: list[str] = ["other"]  # innermost tracked module (a stack)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        self.by_part[self.part[-1]] += 1
        return func(*args, **(kwargs or {}))

    def track(self, model) -> None:
        """Attribute ops to the part of a layer that dispatched them (hooks push/pop names)."""
        parts = {"self_attention": "attention", "mlp.router": "router", "mlp": "moe experts",
                 "input_layernorm": "norms", "pre_mlp_layernorm": "norms"}
        def enter(part: str):
            def hook(module, args) -> None:
                self.part.append(part)
            return hook

        def leave(module, args, output) -> None:  # returning None keeps the output
            self.part.pop()

        for name, mod in model.named_modules():
            tail = name.split(".layers.")[-1].split(".", 1)[-1] if ".layers." in name else ""
            if tail in parts:
                mod.register_forward_pre_hook(enter(parts[tail]))
                mod.register_forward_hook(leave)


def main(path: str) -> None:
    import torch

    over = {"parallel.world_size": 1, "parallel.adp": 1, "parallel.ep": 1,
            "engine.mode": "normal", "engine.cuda_graphs": False, "model.moe_compute": "grouped"}
    if not torch.cuda.is_available():
        over["parallel.backend"] = "gloo"
    cfg = load_config(path, over)
    groups = init_parallel(cfg.parallel)
    engine = Engine(cfg, groups, random_state_dict(cfg.model, device=groups.device))
    V = cfg.model.vocab_size
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=1, ignore_eos=True)

    def burst(tag: str) -> None:
        for i in range(8):
            engine.submit(Request(f"{tag}{i}", tuple(rng.randrange(1, V) for _ in range(30)), sp))

    burst("warm")
    engine.step()
    while engine.busy():
        engine.step()
    burst("p")
    count = _Count()
    count.track(engine.model)
    with count:
        engine.step()  # intake and the P step
    n_layers = cfg.model.num_layers
    total = sum(count.ops.values())
    print(f"ops dispatched by one P step ({n_layers} layers, 8 x 30 tokens): {total} "
          f"(~{total / n_layers:.0f} per layer)")
    print("by part of the step (per layer): " + ", ".join(
        f"{p} {n / n_layers:.0f}" for p, n in count.by_part.most_common()))
    for op, n in count.ops.most_common(20):
        print(f"  {n:5d} {op}")
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help") or sys.argv[1].startswith("-"):
        print(__doc__.strip())  # (its usage: the arguments are read by hand below)
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    main(sys.argv[1])
