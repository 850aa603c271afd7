"""Colocated GRPO and PPO on 2 CPU ranks learn the verifiable task; rollout and trainer logprobs agree."""

from __future__ import annotations

import json

import pytest

CFG = "configs/grpo_cpu.yaml"


# grpo releases the engine's memory while training, weights discarded and refilled by the
# sync: the logprob gap below would be O(1) if any inference weight were not refilled
# ppo also runs the mismatch correction (token-level truncated IS): fp32 here, so its weights
# stay at ~1 and the task is learnt as without it
# grpo also replays the rollout's routing in the trainer (engine.record_routing on); ppo
# trains with its experts split over the two ranks (rl.trainer_ep 2: EP2 x DP1 beside the
# engine's EP2/ADP2); the third trains TP2 (sequence parallel, experts TP-sharded) with
# replay, each TP rank replaying its shard of the sequence
# the fourth drafts with an MTP layer (engine.mtp, sampled rows at temperature 1: two tokens
# per D iteration when a draft is accepted) that the trainer trains too (megatron's MTP loss),
# records and replays the routing of both verify rows, and releases memory with the MTP
# layer's KV; the trainer's logprobs of every emitted token must still be the engine's
def test_the_kl_term_pulls_toward_the_first_steps_policy(worker_groups, tmp_path):
    """rl.kl_coef: the reference is the policy of step 0 (its KL there exactly 0), then the
    k3 estimate grows as the policy moves; a strong pull trains another policy than none
    (found by probing: the key was read and ignored -- every loss equal)."""
    runs = {}
    for kl in (0.0, 5.0):
        res = worker_groups(2).run("colo_rollout.rl.train:run_train", timeout=600,
                                   config_path=CFG, overrides={
                                       "rl.out_dir": str(tmp_path / str(kl)), "rl.steps": 8,
                                       "rl.kl_coef": kl}, quiet=True)
        runs[kl] = res[0]["history"]
    h = runs[5.0]
    assert "kl_ref" not in runs[0.0][0] and h[0]["kl_ref"] == 0.0
    assert max(x["kl_ref"] for x in h[1:]) > 0
    assert [x["loss"] for x in h[1:]] != [x["loss"] for x in runs[0.0][1:]]
    assert max(x["logprob_gap_max"] for x in h) < 1e-4  # the weights came back exactly


def test_a_tempered_rollout_trains_the_policy_it_drew_from(worker_groups, tmp_path):
    """rl.temperature 0.6: the rollouts report their tokens' logprobs under softmax(logits /
    0.6) and the trainer divides its logits by 0.6 -- the two agree as at temperature 1 (the
    trainer at T = 1 against the rollout's tempered numbers would be O(1) apart)."""
    res = worker_groups(2).run("colo_rollout.rl.train:run_train", timeout=600, config_path=CFG,
                               overrides={"rl.out_dir": str(tmp_path), "rl.steps": 3,
                                          "rl.temperature": 0.6}, quiet=True)
    h = res[0]["history"]
    assert len(h) == 3 and max(x["logprob_gap_max"] for x in h) < 1e-4, h


def test_a_frozen_mtp_layer_syncs_and_stays_frozen(worker_groups, tmp_path):
    """rl.mtp_loss_scale 0 freezes the trainer's MTP layer (megatron then reads no MTP count
    from its config): the sync still pairs the two models' MTP layers (found by probing: the
    first sync refused the trainer's count None against the engine's 1)."""
    res = worker_groups(2).run("colo_rollout.rl.train:run_train", timeout=600, config_path=CFG,
                               overrides={"rl.out_dir": str(tmp_path), "rl.steps": 4,
                                          "model.mtp_num_layers": 1, "engine.mtp": True,
                                          "rl.mtp_loss_scale": 0.0}, quiet=True)
    h = res[0]["history"]
    assert len(h) == 4 and all(x["failed"] == 0 and x["sync_bytes"] > 0 for x in h)
    assert max(x["logprob_gap_max"] for x in h) < 1e-4


@pytest.mark.parametrize("algorithm,release,is_level,replay,trainer_ep,trainer_tp,mtp", [
    ("grpo", "discard", "none", True, 1, 1, False), ("ppo", "off", "token", False, 2, 1, False),
    ("grpo", "off", "none", True, 1, 2, False), ("grpo", "discard", "none", True, 1, 1, True)])
def test_reward_rises_and_logprobs_agree(worker_groups, tmp_path, algorithm, release, is_level,
                                         replay, trainer_ep, trainer_tp, mtp):
    res = worker_groups(2).run("colo_rollout.rl.train:run_train", timeout=600, config_path=CFG,
                               overrides={"rl.out_dir": str(tmp_path),
                                          "rl.algorithm": algorithm,
                                          "rl.release_memory": release,
                                          "rl.is_level": is_level,
                                          # dual-clip where the mismatch stays in the ratio
                                          "rl.dual_clip": 3.0 if is_level == "none" else 0.0,
                                          "engine.record_routing": replay,
                                          "rl.routing_replay": replay,
                                          "rl.trainer_ep": trainer_ep,
                                          "rl.trainer_tp": trainer_tp,
                                          "model.mtp_num_layers": int(mtp),
                                          "engine.mtp": mtp}, quiet=True)
    h = res[0]["history"]
    assert len(h) == 20
    if mtp:  # the trainer trains the MTP layer (rl.mtp_loss_scale 0.1): its drafts follow
        # the policy -- measured 0.01-0.03 at the start, 1.0 at the end (frozen: 0.0 at the end)
        acc = [x["mtp_acceptance"] for x in h]
        assert all(x["mtp_drafts"] > 0 for x in h)
        assert sum(acc[:3]) / 3 < 0.2 and sum(acc[-3:]) / 3 > 0.8, acc
    assert [x["reward"] for x in res[1]["history"]] == [x["reward"] for x in h]  # replicated
    first = sum(x["reward"] for x in h[:3]) / 3
    last = sum(x["reward"] for x in h[-3:]) / 3
    assert first < 0.2 and last > first + 0.5, (first, last)  # random policy: ~1/64
    # the trainer (megatron GPTModel, TP1xDP2, EP2 or TP2) recomputes the rollout engine's
    # (EP2/ADP2) logprobs: only summation order differs
    assert max(x["logprob_gap_max"] for x in h) < 1e-4
    assert all(x["failed"] == 0 and x["sync_bytes"] > 0 for x in h)
    # groups whose samples all scored alike (no GRPO signal): every one once the task is
    # learnt (all samples hit the target), fewer at the random start
    flat = [x["flat_groups"] for x in h]
    assert all(0.0 <= f <= 1.0 for f in flat) and flat[-1] > min(flat), flat
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(20))
    assert (tmp_path / "reward.png").stat().st_size > 1000
    if release != "off":
        assert all("mem_engine_released" in x for x in h)
    if algorithm == "ppo":  # the value head learns the (rising) return
        assert all("value_loss" in x for x in h)
    assert all(x["mismatch_kl_k3"] < 1e-8 and x["mismatch_clip_frac"] == 0.0 for x in h)
    if is_level != "none":
        assert all(abs(x["is_weight_mean"] - 1) < 1e-4 and x["is_corrected_frac"] == 0.0
                   for x in h)
        assert all("is_weight_mean" in r for r in rows)
    if replay:  # fp32: the trainer's own routing is the rollout's, so replay changes nothing
        assert all(x["routing_disagree_frac"] == 0.0 and x["logprob_gap_max_no_replay"] < 1e-4
                   for x in h)


def test_reward_rises_with_a_tensor_and_expert_parallel_trainer(worker_groups, tmp_path):
    """4 CPU ranks: the trainer TP2 x EP2 (x DP2: sequence parallel, experts whole over EP
    groups {0,1}/{2,3}, data-parallel over {0,2}/{1,3}) beside the engine's EP4/ADP2/ATP2,
    with routing replay; every step's sync reshards TP2 x EP2 -> EP4/ADP2/ATP2."""
    res = worker_groups(4).run("colo_rollout.rl.train:run_train", timeout=600, config_path=CFG,
                               overrides={"rl.out_dir": str(tmp_path),
                                          "parallel.world_size": 4, "parallel.adp": 2,
                                          "parallel.ep": 4, "rl.trainer_tp": 2,
                                          "rl.trainer_ep": 2, "engine.record_routing": True,
                                          "rl.routing_replay": True}, quiet=True)
    h = res[0]["history"]
    assert len(h) == 20
    assert all([x["reward"] for x in r["history"]] == [x["reward"] for x in h] for r in res)
    first = sum(x["reward"] for x in h[:3]) / 3
    last = sum(x["reward"] for x in h[-3:]) / 3
    assert first < 0.2 and last > first + 0.5, (first, last)
    assert max(x["logprob_gap_max"] for x in h) < 1e-4
    assert all(x["failed"] == 0 and x["sync_bytes"] > 0 for x in h)
    assert all(x["routing_disagree_frac"] == 0.0 for x in h)


def _hf_checkpoint(tmp_path):
    """A tiny Qwen3-MoE checkpoint transformers saved, and a copy of CFG whose model section
    leaves the architecture to it: (the model, its directory, the config path)."""
    import torch
    import yaml

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, moe_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256))
    src = tmp_path / "src"
    hf.save_pretrained(src)
    # the YAML's own architecture keys describe the toy model, not this checkpoint: drop them
    data = yaml.safe_load(open(CFG))
    data["model"] = {"init_method_std": 0.02}
    cfg_path = tmp_path / "grpo.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    return hf, src, cfg_path


@pytest.mark.parametrize("trainer_tp", [1, 2])
def test_train_from_a_hf_checkpoint_and_export(worker_groups, tmp_path, trainer_tp):
    # the engine (EP2/ADP2) and the trainer (TP1 x DP2, or TP2 sequence parallel) each read
    # their slices of a checkpoint transformers saved; their logprobs agree from the first
    # step; the trained weights are exported as a checkpoint transformers loads (TP2: the
    # TP group gathers each tensor)
    import torch

    transformers = pytest.importorskip("transformers")
    hf, src, cfg_path = _hf_checkpoint(tmp_path)
    out = tmp_path / "exported"
    overrides = {"rl.out_dir": str(tmp_path / "run"), "rl.steps": 3,
                 "model.checkpoint": str(src), "rl.export_dir": str(out),
                 "rl.trainer_tp": trainer_tp}
    res = worker_groups(2).run("colo_rollout.rl.train:run_train", timeout=600,
                               config_path=str(cfg_path), overrides=overrides, quiet=True)
    h = res[0]["history"]
    assert len(h) == 3 and max(x["logprob_gap_max"] for x in h) < 1e-4
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    before, after = hf.state_dict(), back.state_dict()
    assert sorted(before) == sorted(after)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained


def test_expert_parallel_trainer_exports_every_expert_in_place(worker_groups, tmp_path):
    # trainer TP1 x EP2 (each rank half the experts, whole): the export broadcasts each expert
    # from its EP rank to the writer. With a learning rate too small to move a weight, the
    # exported checkpoint is the source one bit for bit -- every expert at its own index
    import torch

    transformers = pytest.importorskip("transformers")
    hf, src, cfg_path = _hf_checkpoint(tmp_path)
    out = tmp_path / "exported"
    overrides = {"rl.out_dir": str(tmp_path / "run"), "rl.steps": 1, "rl.lr": 1e-30,
                 "model.checkpoint": str(src), "rl.export_dir": str(out),
                 "rl.trainer_ep": 2}
    worker_groups(2).run("colo_rollout.rl.train:run_train", timeout=600,
                         config_path=str(cfg_path), overrides=overrides, quiet=True)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    before, after = hf.state_dict(), back.state_dict()
    assert sorted(before) == sorted(after)
    experts = [k for k in before if ".experts." in k]
    assert experts and all(torch.equal(before[k], after[k]) for k in before)


def test_tensor_and_expert_parallel_trainer_reads_a_hf_checkpoint(worker_groups, tmp_path):
    # trainer TP2 x EP2 on 4 ranks: each rank reads its TP slices of the dense tensors and
    # its EP rank's experts whole; the engine (EP4/ADP2/ATP2) its own slices -- their
    # logprobs agree from the first step
    _, src, cfg_path = _hf_checkpoint(tmp_path)
    overrides = {"rl.out_dir": str(tmp_path / "run"), "rl.steps": 2,
                 "model.checkpoint": str(src), "parallel.world_size": 4, "parallel.adp": 2,
                 "parallel.ep": 4, "rl.trainer_tp": 2, "rl.trainer_ep": 2}
    res = worker_groups(4).run("colo_rollout.rl.train:run_train", timeout=600,
                               config_path=str(cfg_path), overrides=overrides, quiet=True)
    h = res[0]["history"]
    assert len(h) == 2 and max(x["logprob_gap_max"] for x in h) < 1e-4


def test_reverse_task_needs_the_prompt_and_is_learnt(worker_groups, tmp_path):
    """A task of several tokens (rl/tasks.py: Reverse): the completion must read the prompt
    at a position that moves with each output token. A prompt-blind policy scores at most
    0.25; within 100 steps (~30 s) GRPO with routing replay gets past 0.4."""
    res = worker_groups(2).run("colo_rollout.rl.train:run_train", timeout=600,
                               config_path="configs/grpo_reverse_cpu.yaml",
                               overrides={"rl.out_dir": str(tmp_path), "rl.steps": 100},
                               quiet=True)
    h = res[0]["history"]
    first = sum(x["reward"] for x in h[:10]) / 10
    last = sum(x["reward"] for x in h[-25:]) / 25
    assert first < 0.2 and last > 0.4, (first, last)
    assert all(x["routing_disagree_frac"] == 0.0 for x in h)


def test_partial_rollout_in_the_training_loop(worker_groups, tmp_path):
    """rl.finish_groups: each step trains on the groups done first (4 of 8; 4 rows per
    replica admit the samples in waves); the paused rest are resumed by the next step under
    the new weights (a second segment), and the task is still learnt. Their first segments'
    logprobs are the older policy's: the logprob gap shows it."""
    res = worker_groups(2).run("colo_rollout.rl.train:run_train", timeout=600, config_path=CFG,
                               overrides={"rl.out_dir": str(tmp_path), "rl.finish_groups": 4,
                                          "engine.max_batch_size": 4,
                                          "rl.is_level": "token"}, quiet=True)
    h = res[0]["history"]
    assert any(x["carried"] > 0 for x in h) and any(x["resumed_segments"] > 0 for x in h)
    assert max(x["carried"] for x in h) <= 4 * 4  # the backlog stays under 8 - 4 groups
    first = sum(x["reward"] for x in h[:3]) / 3
    last = sum(x["reward"] for x in h[-3:]) / 3
    assert first < 0.2 and last > first + 0.3, (first, last)
    assert max(x["logprob_gap_max"] for x in h) > 1e-3  # the resumed segments' older policy


def test_an_export_that_fails_raises_on_every_rank(worker_groups, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    target = str(afile / "out")
    r0, r1 = worker_groups(2).run("tests.cases_rl:export_failure_is_collective", timeout=120,
                                  directory=target)
    assert r0["error"].startswith(f"export to {target} failed: ") and "Not a directory" in \
        r0["error"], r0
    assert r1["error"] == f"export to {target} failed on another rank", r1


def test_a_diverged_step_raises_on_every_rank_before_the_weights_move(worker_groups, tmp_path):
    """rl.lr 1e30 under PPO (its value loss has a gradient on every step, whatever the
    rewards): the loss goes non-finite within a few steps; the trainer raises on every rank
    before its optimizer writes NaN weights (the run used to finish, reporting them)."""
    from colo_rollout.runtime.spawn import WorkerError

    with pytest.raises(WorkerError) as e:
        worker_groups(2).run("colo_rollout.rl.train:run_train", timeout=300, config_path=CFG,
                             overrides={"rl.out_dir": str(tmp_path), "rl.lr": 1.0e+30,
                                        "rl.algorithm": "ppo", "rl.steps": 6})
    msg = str(e.value)
    assert "ranks [0, 1]" in msg and "TrainingDiverged: rl step: the loss or a gradient is " \
        "not finite" in msg, msg
    # the command's one error line (user-facing), naming the coefficients to look at
    line = e.value.user_line
    assert line.startswith("rl step: the loss or a gradient is not finite") and \
        "rl.lr 1e+30" in line and "rl.vf_coef" in line, line


def test_a_failed_collective_in_a_trainer_step_is_named():
    """A peer that dies inside the update's all-reduce surfaced as gloo's own text (found by
    fault injection); now a ControlError naming the rank and what it means -- other errors
    pass unchanged."""
    from types import SimpleNamespace

    from colo_rollout.rl.trainer import Trainer
    from colo_rollout.runtime.control import ControlError

    def failing(e):
        def _step(trajs):
            raise e
        return SimpleNamespace(_step=_step)

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:1234: "
                        "Connection reset by peer")
    with pytest.raises(ControlError) as info:
        Trainer.step(failing(gloo), [])
    assert str(info.value).startswith("trainer step, rank 0: a collective of the update "
                                      "failed: a process group of the trainer is broken (a "
                                      "peer exited")
    assert info.value.__cause__ is gloo
    other = RuntimeError("something else")
    with pytest.raises(RuntimeError) as info:
        Trainer.step(failing(other), [])
    assert info.value is other


def test_the_trainers_groups_wait_no_longer_than_the_configs_timeout(worker_groups):
    """(found by fault injection: a rank that failed in a training step left its peers in the
    update's all-reduce for gloo's 30 minutes, past parallel.timeout_s)"""
    res = worker_groups(2).run("tests.cases_rl:trainer_groups_time_out")
    assert res[0]["raised"] == "RuntimeError" and res[0]["after_s"] < 5.0, res[0]
