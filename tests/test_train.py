"""Colocated GRPO and PPO on 2 CPU ranks learn the verifiable task; rollout and trainer logprobs agree."""

from __future__ import annotations

import json

import pytest

CFG = "configs/grpo_cpu.yaml"


# grpo releases the engine's memory while training, weights discarded and refilled by the
# sync: the logprob gap below would be O(1) if any inference weight were not refilled
@pytest.mark.parametrize("algorithm,release", [("grpo", "discard"), ("ppo", "off")])
def test_reward_rises_and_logprobs_agree(worker_groups, tmp_path, algorithm, release):
    res = worker_groups(2).run("colo_rollout.rl.train:run_train", timeout=600, config_path=CFG,
                               overrides={"rl.out_dir": str(tmp_path),
                                          "rl.algorithm": algorithm,
                                          "rl.release_memory": release}, quiet=True)
    h = res[0]["history"]
    assert len(h) == 20
    assert [x["reward"] for x in res[1]["history"]] == [x["reward"] for x in h]  # replicated
    first = sum(x["reward"] for x in h[:3]) / 3
    last = sum(x["reward"] for x in h[-3:]) / 3
    assert first < 0.2 and last > first + 0.5, (first, last)  # random policy: ~1/64
    # the trainer (megatron GPTModel, TP1xDP2) recomputes the rollout engine's (EP2/ADP2)
    # logprobs: only summation order differs
    assert max(x["logprob_gap_max"] for x in h) < 1e-4
    assert all(x["failed"] == 0 and x["sync_bytes"] > 0 for x in h)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(20))
    assert (tmp_path / "reward.png").stat().st_size > 1000
    if release != "off":
        assert all("mem_engine_released" in x for x in h)
    if algorithm == "ppo":  # the value head learns the (rising) return
        assert all("value_loss" in x for x in h)
