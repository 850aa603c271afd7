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
    short = r0["short"][0]
    assert short["status"] == "truncated" and len(short["tokens"]) <= 40
    # every generated token's logprob equals megatron's full recompute over the trajectory:
    # continuation prefills on the retained context, no re-tokenising
    assert r0["max_logprob_diff"] < LOGPROB_TOL and not math.isnan(r0["max_logprob_diff"])


def test_replicas_use_different_random_streams(worker_groups):
    r = worker_groups(2).run(f"{C}:replicas_sample_independently")[0]
    assert sorted(r["replicas"]) == [0, 1]  # one request per replica
    assert r["tokens"][0] != r["tokens"][1]
