"""Serve a few requests on 2 CPU ranks (EP2/ADP2) and print the outputs.

    python examples/generate.py
Under torchrun on GPUs, call `body` directly in each process instead of WorkerGroup.
"""

from colo_rollout.config import Config, EngineConfig, ModelConfig, ParallelConfig
from colo_rollout.engine.engine import Engine
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.sched.request import Request, SamplingParams
from colo_rollout.runtime.spawn import WorkerGroup


def body(rank: int, world: int) -> dict:
    cfg = Config(parallel=ParallelConfig(world_size=world, adp=2, ep=2, backend="gloo"),
                 model=ModelConfig(vocab_size=256, hidden_size=64, num_experts=8),
                 engine=EngineConfig(max_batch_size=8, decode_buckets=[1, 2, 4, 8]))
    engine = Engine(cfg, init_parallel(cfg.parallel))  # random weights from model.seed
    outs = engine.generate([
        Request("greedy", (1, 2, 3, 4), SamplingParams(max_tokens=8)),
        Request("sampled", (9, 8, 7), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8)),
    ])
    engine.close()  # on GPUs: drops the D graphs before the process groups go away
    return {rid: (o.tokens, [round(x, 3) for x in o.logprobs]) for rid, o in outs.items()}


if __name__ == "__main__":
    with WorkerGroup(2) as group:
        for rid, (tokens, logprobs) in group.run("__main__:body")[0].items():
            print(f"{rid}: {tokens}  logprobs {logprobs}")
