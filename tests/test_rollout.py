"""rollout(): GRPO groups, multi-turn environments as continuation prefills, statuses."""

from __future__ import annotations

import math

from tests.cases_engine import LOGPROB_TOL

C = "tests.cases_rl"


def test_grpo_groups(worker_groups):
    res = worker_groups(2).run(f"{C}:grpo_groups")
    trajs = res[0]["trajs"]
    assert res[1]["trajs"] == trajs  # every rank returns the same trajectories
    assert [(t["group"], t["sample"]) for t in trajs] == [(g, k) for g in range(3) for k in range(3)]
    prompts = [[5, 6, 7], [9, 1], [4] * 10]
    for t in trajs:
        p = prompts[t["group"]]
        assert t["tokens"][: len(p)] == p
        n_gen = len(t["tokens"]) - len(p)
        assert 1 <= n_gen <= 6
        assert t["loss_mask"] == [0] * len(p) + [1] * n_gen
        assert all(lp == 0.0 for lp in t["logprobs"][: len(p)])
        assert all(lp <= 0.0 for lp in t["logprobs"][len(p):])
        assert t["reward"] == float(sum(t["tokens"][len(p):]) % 3)
        assert t["status"] == "completed" and t["weight_version"] == 7 and t["turns"] == 1
    # temperature 1: the 3 samples of a group are not all the same
    for g in range(3):
        outs = {tuple(t["tokens"]) for t in trajs if t["group"] == g}
        assert len(outs) > 1


def test_environments_multi_turn_and_faults(worker_groups):
    res = worker_groups(2).run(f"{C}:env_multi_turn")
    trajs, r0 = res[0]["trajs"], res[0]
    assert res[1]["trajs"] == trajs
    ok = trajs[:4]
    for t in ok:
        assert t["status"] == "completed" and t["turns"] == 3 and t["weight_version"] == 3
        # obs0(3) gen(5) obs(2) gen(5) obs(2) gen(5): observations are masked out
        assert len(t["tokens"]) == 3 + 5 + 2 + 5 + 2 + 5
        assert t["loss_mask"] == [0] * 3 + [1] * 5 + [0] * 2 + [1] * 5 + [0] * 2 + [1] * 5
        assert t["tokens"][8:10] == [1, 25] and t["tokens"][15:17] == [2, 25]
        assert 0.0 <= t["reward"] <= 3.0
    failed_step, nan_reward = trajs[4], trajs[5]
    assert failed_step["status"] == "failed" and "tool crashed" in failed_step["error"]
    assert failed_step["turns"] == 2
    assert nan_reward["status"] == "failed" and "not finite" in nan_reward["error"]
    empty = trajs[6]  # an environment's empty observation is its error, named as such
    assert empty["status"] == "failed" and empty["turns"] == 1 and empty["error"] == (
        "environment step returned no observation tokens with done False (return done=True "
        "to end the trajectory)")
    short = r0["short"][0]
    assert short["status"] == "truncated" and len(short["tokens"]) <= 40
    # every generated token's logprob equals megatron's full recompute over the trajectory:
    # continuation prefills on the retained context, no re-tokenising
    assert r0["max_logprob_diff"] < LOGPROB_TOL and not math.isnan(r0["max_logprob_diff"])


def test_replicas_use_different_random_streams(worker_groups):
    r = worker_groups(2).run(f"{C}:replicas_sample_independently")[0]
    assert sorted(r["replicas"]) == [0, 1]  # one request per replica
    assert r["tokens"][0] != r["tokens"][1]


def test_rollout_under_misuse_loses_nothing_and_never_hangs(worker_groups):
    res = worker_groups(2).run(f"{C}:rollout_misuse", timeout=240)
    r0 = res[0]
    assert res[1]["mixed"] == r0["mixed"]
    mixed = {g: (status, error, n) for g, status, error, n in r0["mixed"]}
    assert mixed[0][0] == "completed" and mixed[0][2] == 2 + 4
    assert mixed[1][0] == "failed" and "group 1" in mixed[1][1] and "NoneType" in mixed[1][1]
    assert mixed[2][0] == "failed" and "encode text first" in mixed[2][1]
    assert mixed[3][0] == "failed" and "8.5 at position 1 is a float" in mixed[3][1]
    assert mixed[4][0] == "failed" and "prompt of 300 tokens leaves no room" in mixed[4][1]
    assert mixed[5][0] == "failed" and "reward is not a number: str '0.5'" in mixed[5][1]
    assert r0["capped"] == [256]  # engine.max_seq_len, not a refusal
    assert r0["interrupt"] == "raised"
    assert r0["after_interrupt"] == ["completed"] * 4 and r0["kv_empty_after_interrupt"]
    statuses = [s for s, _ in r0["paused"]]
    assert "aborted" in statuses and r0["kv_empty_after_pause"], r0["paused"]
    assert any("cancelled outside this rollout() call" in e for _, e in r0["paused"])
    (status, error), = r0["str_done"]
    assert status == "failed" and "done must be a bool, got str 'False'" in error
    for r in res:  # every rank raises, naming the trajectory
        assert r["by_rank"].startswith("rollout(): rank 1 ended trajectory (group 0, sample 0)")
        assert r["raised_by_rank"].startswith(
            "rollout(): rank 1 ended trajectory (group 0, sample 0)"), r["raised_by_rank"]
        # an environment that ends the last live episode on one rank only: named at the step
        # it happened, on every rank, well within the groups' timeout; nothing left behind
        assert r["env_by_rank"].startswith(
            "rollout(): rank 1 ended trajectory (group 0, sample 0)"), r["env_by_rank"]
        assert r["env_by_rank_s"] < 2.0
        assert r["after_diverge"] == ["completed"] and r["kv_empty_after_diverge"]
        assert "memory is released" in r["released"]
        assert r["after_release"] == ["completed"] and r["kv_empty"]
    # the rank where the reward raised says so; the other only that the ranks differ
    assert "failed" not in res[0]["raised_by_rank"]
    assert res[1]["raised_by_rank"].endswith(
        "(on rank 1 it failed: reward raised RuntimeError('reward exploded on rank 1'))")


def test_a_reward_is_a_finite_real_number_or_its_trajectory_fails():
    """``_score`` (no processes): numbers of every kind kept, the rest failing their own
    trajectory with the reason -- an int past float's range aborted the whole rollout() call
    with OverflowError (found by probing)."""
    import numpy as np
    import torch

    from colo_rollout.rl.rollout import Trajectory, _score

    def scored(value, accumulate=False):
        t = Trajectory(group=0, sample=0, reward=1.0)
        _score(t, lambda: value, accumulate)
        return t.status, t.reward, t.error

    assert scored(0.5) == ("completed", 0.5, None)
    assert scored(np.float32(2.0), accumulate=True) == ("completed", 3.0, None)
    assert scored(True) == ("completed", 1.0, None)
    assert scored(torch.tensor(4.0)) == ("completed", 4.0, None)
    status, _, error = scored(10 ** 400)
    assert status == "failed" and "reward is not finite (int past float's range)" in error
    status, _, error = scored(float("nan"))
    assert status == "failed" and "not finite" in error
    status, _, error = scored("0.5")
    assert status == "failed" and "reward is not a number: str '0.5'" in error
