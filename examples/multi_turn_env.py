"""rollout() with a multi-turn environment: observations are continuation prefills.

    python examples/multi_turn_env.py
"""

from colo_rollout.config import Config, EngineConfig, ModelConfig, ParallelConfig
from colo_rollout.engine.engine import Engine
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.sched.request import SamplingParams
from colo_rollout.rl.rollout import rollout
from colo_rollout.runtime.spawn import WorkerGroup


class EchoEnv:
    """Deterministic toy tool: answers with the count of even tokens; done after 3 turns."""

    def __init__(self, seed: int) -> None:
        self.seed, self.turn = seed, 0

    def reset(self) -> list[int]:
        self.turn = 0
        return [self.seed + 1, 2, 3]

    def step(self, generated: list[int]) -> tuple[list[int], float, bool]:
        self.turn += 1
        evens = sum(t % 2 == 0 for t in generated)
        return [100 + evens], float(evens), self.turn == 3


def body(rank: int, world: int) -> list:
    cfg = Config(parallel=ParallelConfig(world_size=world, adp=2, ep=2, backend="gloo"),
                 model=ModelConfig(vocab_size=256, hidden_size=64, num_experts=8),
                 engine=EngineConfig(max_batch_size=8, decode_buckets=[1, 2, 4, 8]))
    engine = Engine(cfg, init_parallel(cfg.parallel))
    trajs = rollout(engine, envs=[EchoEnv(s) for s in range(4)],
                    params=SamplingParams(temperature=1.0, max_tokens=5))
    engine.close()  # on GPUs: drops the D graphs before the process groups go away
    return [(t.status, t.reward, t.tokens, t.loss_mask) for t in trajs]


if __name__ == "__main__":
    with WorkerGroup(2) as group:
        for status, reward, tokens, mask in group.run("__main__:body")[0]:
            print(f"{status} reward={reward} tokens={tokens}\n{'':>22s}mask={mask}")
