"""Per-rank bodies of the rollout() tests."""

from __future__ import annotations

import math

import torch

from colo_rollout.inference.reference import (
    build_reference,
    reference_logprobs,
    singleton_pg_collection,
)
from colo_rollout.inference.request import SamplingParams
from colo_rollout.rl.rollout import rollout
from tests.cases_engine import LOGPROB_TOL, _engine


class CountingEnv:
    """Deterministic toy environment: observation = [turn, len(generated) % 7 + 20]; reward 1 per
    turn whose generation contains an even token; done after ``turns`` turns. Optional faults."""

    def __init__(self, seed: int, turns: int = 3, fail_at: int | None = None,
                 nan_at: int | None = None) -> None:
        self.seed, self.turns, self.fail_at, self.nan_at = seed, turns, fail_at, nan_at
        self.t = 0

    def reset(self) -> list[int]:
        self.t = 0
        return [self.seed % 50 + 1, 2, 3]

    def step(self, generated: list[int]) -> tuple[list[int], float, bool]:
        self.t += 1
        if self.fail_at == self.t:
            raise RuntimeError("tool crashed")
        reward = float("nan") if self.nan_at == self.t else float(
            any(g % 2 == 0 for g in generated))
        return [self.t, len(generated) % 7 + 20], reward, self.t >= self.turns


def _as_dicts(trajs):
    return [dict(group=t.group, sample=t.sample, tokens=t.tokens, logprobs=t.logprobs,
                 loss_mask=t.loss_mask, reward=t.reward, status=t.status, error=t.error,
                 turns=t.turns, weight_version=t.weight_version) for t in trajs]


def grpo_groups(rank: int, world: int) -> dict:
    cfg, groups, sd, engine = _engine(world, 2, 2)
    prompts = [[5, 6, 7], [9, 1], [4] * 10]
    trajs = rollout(engine, prompts, n=3, params=SamplingParams(temperature=1.0, max_tokens=6),
                    reward_fn=lambda p, c: float(sum(c) % 3), weight_version=7)
    engine.check_integrity()
    for kv in engine.scheduler.kv:
        kv.assert_empty()
    return {"trajs": _as_dicts(trajs)}


def env_multi_turn(rank: int, world: int) -> dict:
    cfg, groups, sd, engine = _engine(world, 2, 2)
    envs = [CountingEnv(s) for s in range(4)] + [CountingEnv(9, fail_at=2),
                                                 CountingEnv(11, nan_at=1)]
    trajs = rollout(engine, envs=envs, params=SamplingParams(max_tokens=5, ignore_eos=True),
                    max_turns=8, weight_version=3)
    short = rollout(engine, envs=[CountingEnv(13, turns=50)],
                    params=SamplingParams(max_tokens=5, ignore_eos=True), max_turns=50,
                    max_total_tokens=40, tag="short")
    engine.check_integrity()
    for kv in engine.scheduler.kv:
        kv.assert_empty()
    res = {"trajs": _as_dicts(trajs), "short": _as_dicts(short)}
    if rank == 0:  # teacher-force every trajectory through the megatron reference
        ref = build_reference(cfg.model, sd, singleton_pg_collection(), torch.device("cpu"))
        worst = 0.0
        for t in trajs + short:
            if t.status == "failed" and t.turns == 0:
                continue
            lp = reference_logprobs(ref, t.tokens[:-1])
            for i in range(1, len(t.tokens)):
                if t.loss_mask[i]:
                    worst = max(worst, abs(float(lp[i - 1, t.tokens[i]]) - t.logprobs[i]))
        res["max_logprob_diff"] = worst
    else:
        singleton_pg_collection()
    return res


__all__ = ["CountingEnv", "grpo_groups", "env_multi_turn", "LOGPROB_TOL", "math"]
