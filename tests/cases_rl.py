"""Per-rank bodies of the rollout() tests."""

from __future__ import annotations

import math

import torch

from colo_rollout.model.megatron_gpt import (
    build_reference,
    reference_logprobs,
    singleton_pg_collection,
)
from colo_rollout.sched.request import SamplingParams
from colo_rollout.rl.rollout import rollout
from tests.cases_engine import LOGPROB_TOL, _engine


class CountingEnv:
    """Deterministic toy environment: observation = [turn, len(generated) % 7 + 20]; reward 1 per
    turn whose generation contains an even token; done after ``turns`` turns. Optional faults."""

    def __init__(self, seed: int, turns: int = 3, fail_at: int | None = None,
                 nan_at: int | None = None, empty_at: int | None = None) -> None:
        self.seed, self.turns, self.fail_at, self.nan_at = seed, turns, fail_at, nan_at
        self.empty_at = empty_at  # the turn whose observation is no tokens
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
        obs = [] if self.empty_at == self.t else [self.t, len(generated) % 7 + 20]
        return obs, reward, self.t >= self.turns


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
                                                 CountingEnv(11, nan_at=1),
                                                 CountingEnv(15, empty_at=1)]
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


def rollout_misuse(rank: int, world: int) -> dict:
    """rollout() under what users get wrong, on EP2/ADP2: a group whose prompt is not token
    ids fails alone; a prompt that fills the budget fails naming itself; a budget past
    engine.max_seq_len is capped; a reward that is not a number fails its trajectory; an
    interrupt out of a reward function leaves nothing behind (the same call again succeeds,
    the KV is empty); an engine.pause() from a reward function ends the call (the rest
    aborted) instead of looping for ever; a reward that differs by rank raises on every rank;
    released memory is refused before anything is submitted."""
    cfg, groups, sd, engine = _engine(world, 2, 2)
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    res: dict = {}

    def kv_empty() -> bool:
        engine.check_integrity()
        for kv in engine.scheduler.kv:
            kv.assert_empty()
        return not engine.scheduler.live and not engine.scheduler.sessions

    trajs = rollout(engine, [[5, 6], None, "text", [7, 8.5], [1] * 300, [3, 4]], params=p,
                    reward_fn=lambda pr, c: "0.5" if pr == [3, 4] else 1.0)
    res["mixed"] = [(t.group, t.status, t.error, len(t.tokens)) for t in trajs]
    res["capped"] = [len(t.tokens) for t in rollout(
        engine, [[9] * 250], params=SamplingParams(max_tokens=10, ignore_eos=True),
        max_total_tokens=10 ** 6, tag="capped")]

    def interrupt(pr, c):
        raise KeyboardInterrupt

    try:
        rollout(engine, [[5, 6], [7, 8]], n=2, params=p, reward_fn=interrupt)
        res["interrupt"] = "returned"
    except KeyboardInterrupt:
        res["interrupt"] = "raised"
    res["after_interrupt"] = [t.status for t in rollout(engine, [[5, 6], [7, 8]], n=2,
                                                        params=p)]
    res["kv_empty_after_interrupt"] = kv_empty()

    calls = []

    def pause_once(pr, c):
        if not calls:
            calls.append(1)
            engine.pause()
            engine.resume()
        return 1.0

    # the long prompt ends first (2 tokens of room), its reward pauses the engine while the
    # short one still generates (8 tokens)
    got = rollout(engine, [[1] * 16, [2, 3, 4, 5]],
                  params=SamplingParams(max_tokens=8, ignore_eos=True), reward_fn=pause_once,
                  max_total_tokens=18, tag="paused")
    res["paused"] = sorted((t.status, t.error or "") for t in got)
    res["kv_empty_after_pause"] = kv_empty()
    try:
        rollout(engine, [[5, 6]], params=p, reward_fn=lambda pr, c: float(rank), tag="rank")
        res["by_rank"] = "returned"
    except ValueError as e:
        res["by_rank"] = str(e)

    def raises_on_one(prompt, completion):
        if rank == 1:
            raise RuntimeError("reward exploded on rank 1")
        return 0.5

    try:  # the rank where the reward raised says so (its exception was lost)
        rollout(engine, [[5, 7]], params=p, reward_fn=raises_on_one, tag="raises")
        res["raised_by_rank"] = "returned"
    except ValueError as e:
        res["raised_by_rank"] = str(e)
    class StrDone:  # done as a str: "False" is truthy, and used to end the episode
        def reset(self):
            return [1, 2]

        def step(self, generated):
            return [3], 0.0, "False"

    res["str_done"] = [(t.status, t.error) for t in rollout(engine, envs=[StrDone()],
                                                            params=p, tag="env")]

    class EndsOnRankOne:  # the last live episode: rank 1's environment ends it, rank 0's not
        def reset(self):
            return [1, 2]

        def step(self, generated):
            return [3], 0.0, rank == 1

    import time
    t0 = time.perf_counter()
    try:
        rollout(engine, envs=[EndsOnRankOne()], params=p, max_turns=4, tag="diverge")
        res["env_by_rank"] = "returned"
    except ValueError as e:
        res["env_by_rank"] = str(e)
    res["env_by_rank_s"] = time.perf_counter() - t0
    res["after_diverge"] = [t.status for t in rollout(engine, [[5, 6]], params=p, tag="after")]
    res["kv_empty_after_diverge"] = kv_empty()
    engine.release_memory("keep")
    try:
        rollout(engine, [[5, 6]], params=p, tag="released")
        res["released"] = "returned"
    except RuntimeError as e:
        res["released"] = str(e)
    engine.resume_memory()
    res["after_release"] = [t.status for t in rollout(engine, [[5, 6]], params=p,
                                                      tag="released")]
    res["kv_empty"] = kv_empty()
    engine.close()
    return res


__all__ = ["CountingEnv", "grpo_groups", "env_multi_turn", "rollout_misuse", "LOGPROB_TOL",
           "math"]


def _trainer_pgc(world: int, tp: int):
    """A TP-`tp` x DP-`world/tp` megatron layout (experts TP-sharded over TP, EP1)."""
    import torch.distributed as dist

    me = dist.get_rank()
    tp_groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]
    dp_groups = [dist.new_group(list(range(j, world, tp))) for j in range(tp)]
    pgc = singleton_pg_collection()
    mine_tp = tp_groups[me // tp]
    mine_dp = dp_groups[me % tp]
    for f in ("tp", "mp", "tp_cp", "expt_tp", "tp_ep", "tp_ep_pp", "tp_dp_cp"):
        setattr(pgc, f, mine_tp)
    for f in ("dp", "dp_cp", "expt_dp"):
        setattr(pgc, f, mine_dp)
    return pgc


def weight_sync_closed(rank: int, world: int) -> dict:
    """A WeightSync per step, closed after it (``with``): the process groups they make are
    freed -- one built per step without close() grew ~5 open files a call until the run died
    (found by probing); a closed sync refuses to run. The syncs stay exact."""
    import dataclasses
    import os

    from colo_rollout.model.weights import random_state_dict
    from colo_rollout.rl.weight_sync import WeightSync

    cfg, groups, sd, engine = _engine(world, world, world)
    trained = random_state_dict(dataclasses.replace(cfg.model, seed=99))
    trainer = build_reference(cfg.model, trained, _trainer_pgc(world, 1), torch.device("cpu"))
    fds = []
    for _ in range(30):
        with WeightSync() as sync:
            stats = sync(trainer, engine.model)
        fds.append(len(os.listdir("/proc/self/fd")))
    try:
        sync(trainer, engine.model)
        after_close = None
    except RuntimeError as e:
        after_close = str(e)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    exact = bool(torch.equal(dict(engine.model.named_parameters())[name].detach().cpu(),
                             trained[name]))
    engine.close()
    return {"fds": fds, "after_close": after_close, "exact": exact,
            "version": stats.version}


def weight_sync_exact(rank: int, world: int, adp: int, ep: int, trainer_tp: int,
                      model_kw: dict | None = None, trainer_ep: int = 1,
                      rl_trainer: bool = False, perturb: float = 0.0) -> dict:
    """After the sync hook, every inference weight equals the trainer's bit for bit, and the
    engine generates what megatron computes with the trainer's weights. ``rl_trainer``: the
    RL ``Trainer``'s own model (at TP > 1 sequence-parallel) instead of a bare megatron TP
    model; with ``trainer_ep`` > 1 the trainer's EP layout."""
    import dataclasses

    from colo_rollout.model.weights import loadable_tensors, random_state_dict, shard_for
    from colo_rollout.rl.weight_sync import WeightSync
    from tests.cases_engine import compare_with_reference, mixed_requests

    cfg, groups, sd, engine = _engine(world, adp, ep, model_kw=model_kw)
    trained_sd = random_state_dict(dataclasses.replace(cfg.model, seed=99))  # "after a step"
    sp_params, trainer_groups = 0, {}
    if rl_trainer:
        from colo_rollout.config import RLConfig
        from colo_rollout.rl.trainer import Trainer

        rl = RLConfig(trainer_tp=trainer_tp, trainer_ep=trainer_ep)
        rl_trainer = Trainer(dataclasses.replace(cfg, rl=rl), trained_sd, groups.device)
        trainer = rl_trainer.module
        sp_params = sum(bool(getattr(p, "sequence_parallel", False))
                        for p in trainer.parameters())
        pgc = rl_trainer.pgc
        trainer_groups = {k: getattr(pgc, k).size() for k in ("tp", "dp", "ep", "expt_tp",
                                                                "tp_ep", "expt_dp")}
    elif trainer_ep > 1:  # the RL trainer's own layout: experts split over EP groups
        from colo_rollout.rl.trainer import trainer_pg_collection

        pgc = trainer_pg_collection(world, trainer_tp, trainer_ep)
        trainer = build_reference(cfg.model, trained_sd, pgc, torch.device("cpu"))
    else:
        trainer = build_reference(cfg.model, trained_sd, _trainer_pgc(world, trainer_tp),
                                  torch.device("cpu"))
    sync = WeightSync()
    stats = [sync(trainer, engine.model) for _ in range(2)]  # second call: cached plan
    replayed = bool(sync._replays)  # the plan was same-rank and direct: a LocalReplay
    if perturb:  # "another step": every trainer parameter moves; the next sync must follow
        with torch.no_grad():
            for q in trainer.parameters():
                q.add_(perturb)
        stats.append(sync(trainer, engine.model))
        # (the router's expert bias is a buffer, synced apart and not moved here)
        trained_sd = {k: v if k.endswith("expert_bias") else v + perturb
                      for k, v in trained_sd.items()}
    params = loadable_tensors(engine.model)  # parameters and the router's expert bias
    n_local = cfg.model.num_experts // groups.layout.ep
    mismatched, checked = [], 0
    for name, full in trained_sd.items():
        mapped = shard_for(name, full, groups.layout, rank, n_local, params)
        if mapped is None:
            continue
        local, shard = mapped
        checked += 1
        if not torch.equal(params[local].data, shard):
            mismatched.append(local)
    requests = mixed_requests(6, 1, cfg.model.vocab_size)
    outs = engine.generate(requests)
    res = {"mismatched": mismatched, "checked": checked, "version": sync.version,
           "seconds": [s.seconds for s in stats], "bytes_remote": stats[0].bytes_remote,
           "bytes_local": stats[0].bytes_local, "sp_params": sp_params,
           "trainer_groups": trainer_groups,
           # the trainer's experts megatron marks expert-parallel (what the planner reads)
           "ep_params": sum(not getattr(q, "allreduce", True) for q in trainer.parameters()),
           "replayed": replayed, "replays_left": len(sync._replays)}
    if rank == 0:
        ref = build_reference(cfg.model, trained_sd, singleton_pg_collection(),
                              torch.device("cpu"))
        res.update(compare_with_reference(ref, requests, outs))
    else:
        singleton_pg_collection()
    return res


def replicas_sample_independently(rank: int, world: int) -> dict:
    """Two replicas sampling a near-uniform model with temperature 1 must not draw the same
    tokens (their random streams differ)."""
    cfg, groups, sd, engine = _engine(world, 2, 2)
    from colo_rollout.sched.request import Request

    reqs = [Request(f"r{i}", (5, 6, 7), SamplingParams(temperature=1.0, max_tokens=16))
            for i in range(2)]
    outs = engine.generate(reqs)
    return {"replicas": [outs[r.request_id].replica for r in reqs],
            "tokens": [outs[r.request_id].tokens for r in reqs]}


def weight_sync_two_model_pairs(rank: int, world: int, adp: int, ep: int,
                                trainer_tp: int) -> dict:
    """Two WeightSyncs for two model pairs of one layout, called in turn: each refits its own
    pair exactly (megatron's plan cache is keyed by layout, not by model)."""
    import dataclasses

    from colo_rollout.model.weights import loadable_tensors, random_state_dict, shard_for
    from colo_rollout.rl.weight_sync import WeightSync

    from colo_rollout.runtime.cpu_compat import install_cpu_compat
    from colo_rollout.engine.engine import Engine
    from colo_rollout.runtime.parallel import init_parallel
    from tests.cases_engine import tiny_config

    pairs = []
    groups = None  # one layout, one set of groups for both engines
    for kw in ({}, {"qkv_bias": True, "shared_expert_ffn_hidden_size": 32, "num_layers": 3}):
        cfg = tiny_config(world, adp, ep, model_kw=kw)
        if groups is None:
            groups = init_parallel(cfg.parallel)
            install_cpu_compat()
        engine = Engine(cfg, groups, random_state_dict(cfg.model))
        trained = random_state_dict(dataclasses.replace(cfg.model, seed=99))
        trainer = build_reference(cfg.model, trained, _trainer_pgc(world, trainer_tp),
                                  torch.device("cpu"))
        pairs.append((cfg, groups, engine, trainer, trained, WeightSync()))
    mismatched = []
    for which in (0, 1, 0, 1):
        cfg, groups, engine, trainer, trained, sync = pairs[which]
        sync(trainer, engine.model)
        params = loadable_tensors(engine.model)
        n_local = cfg.model.num_experts // groups.layout.ep
        for name, full in trained.items():
            mapped = shard_for(name, full, groups.layout, rank, n_local, params)
            if mapped is not None and not torch.equal(params[mapped[0]], mapped[1]):
                mismatched.append((which, mapped[0]))
    return {"mismatched": mismatched}


def expert_parallel_trainer_grads(rank: int, world: int) -> dict:
    """One GRPO step of an EP2 trainer (experts split over the 2 ranks) and of a TP1 x DP2
    trainer (every expert on every rank) on the same trajectories -- an odd count of uneven
    lengths, so the EP ranks pad to one shape: the gradients agree parameter by parameter
    (expert ones mapped to their global index)."""
    import dataclasses
    import random
    import re

    from colo_rollout.config import RLConfig
    from colo_rollout.model.weights import random_state_dict
    from colo_rollout.rl.rollout import Trajectory
    from colo_rollout.rl.trainer import Trainer
    from colo_rollout.runtime.parallel import init_parallel
    from tests.cases_engine import tiny_config

    base = tiny_config(world, world, world)
    groups = init_parallel(base.parallel)
    sd = random_state_dict(base.model)
    rng = random.Random(5)
    trajs = []
    for i in range(5):  # 3 on rank 0, 2 on rank 1; lengths 5..14
        n_prompt, n_gen = rng.randint(2, 8), rng.randint(3, 6)
        t = Trajectory(i // 2, i % 2)
        t._append([rng.randrange(1, 256) for _ in range(n_prompt)], None)
        t._append([rng.randrange(1, 256) for _ in range(n_gen)],
                  [-rng.uniform(1, 5) for _ in range(n_gen)])
        t.reward = rng.random()
        trajs.append(t)
    grads, stats = {}, {}
    for ep in (1, world):
        cfg = dataclasses.replace(base, rl=RLConfig(trainer_ep=ep, lr=1e-3))
        trainer = Trainer(cfg, sd, groups.device)
        stats[ep] = trainer.step(trajs)
        n_local = base.model.num_experts // ep
        out = {}
        for name, p in trainer.module.named_parameters():
            m = re.match(r"(.*local_experts\.)(\d+)(\..*)", name)
            if m and ep > 1:  # local expert j of EP rank r is global expert r * n_local + j
                name = f"{m[1]}{trainer.pgc.ep.rank() * n_local + int(m[2])}{m[3]}"
            out[name] = p.grad.clone()
        grads[ep] = out
    worst = max((grads[1][k] - g).abs().max().item() / (grads[1][k].abs().max().item() + 1e-12)
                for k, g in grads[world].items())
    return {"worst_rel": worst, "compared": len(grads[world]),
            "experts": sum(1 for k in grads[world] if "local_experts" in k),
            "loss": [stats[1]["loss"], stats[world]["loss"]]}


def _random_trajectories(n: int, vocab: int, seed: int,
                         routing: tuple[int, int, int] | None = None) -> list:
    """``n`` trajectories in GRPO groups of two, of uneven lengths (prompts of 2..8 tokens,
    2..6 generated: odd and even totals, so a TP2 trainer pads some forwards). ``routing``
    (MoE layers, k, experts): a random recorded routing per input position, to replay."""
    import random

    import numpy as np

    from colo_rollout.rl.rollout import Trajectory

    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = Trajectory(i // 2, i % 2)
        t._append([rng.randrange(1, vocab) for _ in range(rng.randint(2, 8))], None)
        n_gen = rng.randint(2, 6)
        t._append([rng.randrange(1, vocab) for _ in range(n_gen)],
                  [-rng.uniform(1, 5) for _ in range(n_gen)])
        t.reward = rng.random()
        if routing is not None:
            layers, k, experts = routing
            t.routing = np.array([[rng.sample(range(experts), k) for _ in range(layers)]
                                  for _ in range(len(t.tokens) - 1)], dtype=np.uint8)
        out.append(t)
    return out


def tensor_parallel_trainer_grads(rank: int, world: int, tp: int = 2,
                                  model_kw: dict | None = None, replay: bool = False,
                                  algorithm: str = "grpo", is_level: str = "none",
                                  ep: int = 1) -> dict:
    """One update of a TP-``tp`` trainer (sequence parallel, DP world/tp; with ``ep`` > 1 its
    experts whole over EP groups) and of a TP1 x DP-world trainer: the loss, the step's
    metrics and every gradient agree -- the TP gradients against the TP1 ones cut to this
    rank's shard (``shard_layout``: column/row/SwiGLU/vocab splits over TP, this EP rank's
    experts; replicated ones whole). ``replay``: both replay one recorded routing.

    The TP1 trainer gets every trajectory ``tp`` times in a row: its DP rank r then takes
    exactly the share the TP trainer's replica r // tp takes (the duplicates of a GRPO group
    leave its mean and population std as they are), so the two optimise the same objective
    -- PPO's batch-whitened advantages included -- and report the same per-rank metrics."""
    import dataclasses

    from colo_rollout.config import RLConfig
    from colo_rollout.model.megatron_gpt import shard_layout
    from colo_rollout.model.weights import random_state_dict, shard_for
    from colo_rollout.rl.trainer import Trainer
    from colo_rollout.runtime.parallel import init_parallel
    from tests.cases_engine import tiny_config

    base = tiny_config(world, world, world, model_kw=model_kw, record_routing=replay)
    groups = init_parallel(base.parallel)
    sd = random_state_dict(base.model)
    layers = sum(1 for i in range(base.model.num_layers) if base.model.is_moe_layer(i))
    trajs = _random_trajectories(
        5 * world // tp, base.model.vocab_size, seed=11,
        routing=(layers, base.model.moe_router_topk, base.model.num_experts) if replay else None)
    grads, stats = {}, {}
    for t, batch in ((1, [x for x in trajs for _ in range(tp)]), (tp, trajs)):
        rl = RLConfig(trainer_tp=t, trainer_ep=ep if t == tp else 1, lr=1e-3,
                      routing_replay=replay, algorithm=algorithm, is_level=is_level)
        trainer = Trainer(dataclasses.replace(base, rl=rl), sd, groups.device)
        layout, shard_rank = shard_layout(trainer.pgc)  # the last: the TP trainer's
        if trainer.value_head is not None:
            # a value head that is not zero (its start): the value loss then reaches the
            # trunk through the gathered hidden states
            with torch.no_grad():
                trainer.value_head.weight.copy_(torch.randn(
                    trainer.value_head.weight.shape, generator=torch.Generator().manual_seed(3)))
        stats[t] = trainer.step(batch)
        grads[t] = {n: p.grad.clone() for n, p in trainer.module.named_parameters()}
        if trainer.value_head is not None:
            grads[t].update({f"value_head.{n}": p.grad.clone()
                             for n, p in trainer.value_head.named_parameters()})
    n_local = base.model.num_experts // ep
    worst, worst_name, compared, sharded, experts = 0.0, "", 0, 0, 0
    for name, full in grads[1].items():  # the TP1 names: every tensor whole, every expert
        if name.startswith("value_head."):
            local, want = name, full  # replicated on every rank
        else:
            mapped = shard_for(name, full, layout, shard_rank, n_local)
            if mapped is None:  # an expert of another EP rank
                continue
            local, want = mapped
        g = grads[tp][local]
        assert want.shape == g.shape, (name, local, tuple(want.shape), g.shape)
        rel = (want - g).abs().max().item() / (want.abs().max().item() + 1e-12)
        if rel > worst:
            worst, worst_name = rel, name
        compared += 1
        sharded += want.shape != full.shape
        experts += ".local_experts." in name
    assert compared == len(grads[tp]), (compared, len(grads[tp]))  # every local one
    # relative past 1 (a random value head's loss is large)
    worst_stat = max(abs(v - stats[1][k]) / max(1.0, abs(stats[1][k]))
                     for k, v in stats[tp].items())
    return {"worst_rel": worst, "worst_name": worst_name, "compared": compared,
            "sharded": sharded, "experts": experts, "keys": sorted(stats[tp]),
            "worst_stat": worst_stat,
            "stats": [stats[1], stats[tp]]}


def data_parallel_split_is_one_batch(rank: int, world: int, algorithm: str,
                                     is_level: str, is_mode: str) -> dict:
    """One update of a TP1 x DP-``world`` trainer on trajectories split over its ranks (the
    usual case: rank r takes every world-th) against the same trainer on every trajectory
    repeated ``world`` times in a row, so each rank holds the whole batch -- one replica's
    math. Loss, metrics and gradients must agree: every mean is the whole batch's. Some
    trajectories' rollout logprobs are far off, so masked IS drops most of their tokens and
    the ranks keep unequal token counts (found by probing: the loss was a per-rank token
    mean, and every metric rank 0's half)."""
    import dataclasses

    from colo_rollout.config import RLConfig
    from colo_rollout.model.weights import random_state_dict
    from colo_rollout.rl.trainer import Trainer
    from colo_rollout.runtime.parallel import init_parallel
    from tests.cases_engine import tiny_config

    base = tiny_config(world, world, world)
    groups = init_parallel(base.parallel)
    sd = random_state_dict(base.model)
    trajs = _random_trajectories(3 * world, base.model.vocab_size, seed=23)
    for t in trajs[0: 2 * world: 2]:  # rank 0's share: most generated tokens off by far
        k = sum(1 for m in t.loss_mask if m)
        for j in range(len(t.tokens) - k, len(t.tokens) - 1):
            t.logprobs[j] = -30.0
    grads, stats = {}, {}
    for name, batch in (("one", [x for x in trajs for _ in range(world)]), ("split", trajs)):
        rl = RLConfig(lr=1e-3, algorithm=algorithm, is_level=is_level, is_mode=is_mode,
                      is_cap=2.0)
        trainer = Trainer(dataclasses.replace(base, rl=rl), sd, groups.device)
        if trainer.value_head is not None:  # not zero (its start): the value loss moves
            with torch.no_grad():
                trainer.value_head.weight.copy_(torch.randn(
                    trainer.value_head.weight.shape, generator=torch.Generator().manual_seed(3)))
        stats[name] = trainer.step(batch)
        grads[name] = {n: p.grad.clone() for n, p in trainer.module.named_parameters()
                       if p.grad is not None}
        if trainer.value_head is not None:
            grads[name].update({f"value_head.{n}": p.grad.clone()
                                for n, p in trainer.value_head.named_parameters()})
    # a rollout logprob that is not finite where the loss trains: refused on every rank (the
    # trajectories are replicated), naming it, before any collective
    import copy

    bad = copy.deepcopy(trajs)
    bad[1].logprobs[len(bad[1].tokens) - 2] = float("nan")
    try:
        trainer.step(bad)
        refused = None
    except ValueError as e:
        refused = str(e)
    worst = max((grads["one"][k] - g).abs().max().item()
                / (grads["one"][k].abs().max().item() + 1e-12) for k, g in grads["split"].items())
    worst_stat = max(abs(v - stats["one"][k]) / max(1.0, abs(stats["one"][k]))
                     for k, v in stats["split"].items())
    return {"worst_rel": worst, "worst_stat": worst_stat, "compared": len(grads["split"]),
            "stats": stats, "refused": refused}


def export_failure_is_collective(rank: int, world: int, directory: str) -> dict:
    """The trainer's export into a folder that cannot be made (under a file): the writer's
    OSError reaches every rank as one RuntimeError (the others used to wait in a barrier for
    ever)."""
    from colo_rollout.model.weights import random_state_dict
    from colo_rollout.rl.trainer import Trainer
    from colo_rollout.runtime.parallel import init_parallel
    from tests.cases_engine import tiny_config

    cfg = tiny_config(world, world, world)
    groups = init_parallel(cfg.parallel)
    trainer = Trainer(cfg, random_state_dict(cfg.model), groups.device)
    try:
        trainer.export(directory)
    except RuntimeError as e:
        return {"error": str(e)}
    return {"error": None}


def weight_sync_misuse(rank: int, world: int) -> dict:
    """WeightSync handed the wrong things: a clear error before any tensor moves."""
    import dataclasses

    from colo_rollout.engine.engine import Engine
    from colo_rollout.model.weights import random_state_dict
    from colo_rollout.rl.weight_sync import WeightSync
    from colo_rollout.runtime.cpu_compat import install_cpu_compat
    from colo_rollout.runtime.parallel import init_parallel
    from tests.cases_engine import tiny_config

    cfg = tiny_config(world, world, world)
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    trainer = build_reference(cfg.model, random_state_dict(cfg.model), _trainer_pgc(world, 1),
                              torch.device("cpu"))
    deeper = dataclasses.replace(cfg.model, num_layers=cfg.model.num_layers + 1)
    other = build_reference(deeper, random_state_dict(deeper), _trainer_pgc(world, 1),
                            torch.device("cpu"))
    # the same widths with multi-head latent attention: another attention, not another shape
    mla_cfg = dataclasses.replace(cfg.model, attention="mla", num_query_groups=4,
                                  qk_layernorm=True, kv_lora_rank=16, qk_nope_head_dim=8,
                                  qk_rope_head_dim=8, v_head_dim=16, head_dim=None)
    mla = build_reference(mla_cfg, random_state_dict(mla_cfg), _trainer_pgc(world, 1),
                          torch.device("cpu"))
    # two MLA models of one layout but another latent width (engine and trainer)
    wide = dataclasses.replace(mla_cfg, kv_lora_rank=24)
    mla_engine = Engine(dataclasses.replace(cfg, model=wide), groups, random_state_dict(wide))
    # one shape, another function of the weights (found by probing: synced without a word)
    def variant(**kw):
        c = dataclasses.replace(cfg.model, **kw)
        return build_reference(c, random_state_dict(c), _trainer_pgc(world, 1),
                               torch.device("cpu"))

    errors = {}
    for name, args in (("swapped", (engine.model, trainer)), ("none", (None, engine.model)),
                       ("layers", (other, engine.model)), ("mla", (mla, engine.model)),
                       ("mla_rank", (mla, mla_engine.model)),
                       ("topk", (variant(moe_router_topk=1, router_norm_topk=False),
                                 engine.model)),
                       ("eps", (variant(norm_epsilon=0.1), engine.model)),
                       ("rope", (variant(rotary_base=5e5), engine.model))):
        try:
            WeightSync()(*args)
        except (TypeError, ValueError) as e:
            errors[name] = str(e)
    mla_engine.close()
    engine.release_memory("discard")
    try:
        WeightSync()(trainer, engine.model)
    except RuntimeError as e:
        errors["released"] = str(e)
    engine.resume_memory()
    # nothing written since the discard: named, not served (the storage is NaN until written)
    try:
        engine.weights_loaded()
    except RuntimeError as e:
        errors["unwritten"] = str(e)
    stats = WeightSync()(trainer, engine.model)  # and the right call still works
    engine.weights_loaded()
    # a trainer with a tensor kind the engine lacks (q/k norms): its weights would be dropped
    normed = dataclasses.replace(cfg.model, qk_layernorm=True)
    try:
        WeightSync()(build_reference(normed, random_state_dict(normed), _trainer_pgc(world, 1),
                                     torch.device("cpu")), engine.model)
    except ValueError as e:
        errors["kinds"] = str(e)
    # requests in flight: their tokens would mix the two models
    from colo_rollout.sched.request import Request

    sync = WeightSync(check_finite=True)
    engine.submit(Request("busy", (1, 2, 3), SamplingParams(max_tokens=6, ignore_eos=True)))
    engine.step()
    try:
        sync(trainer, engine.model)
    except RuntimeError as e:
        errors["busy"] = str(e)
    while engine.busy():
        engine.step()
    engine.forget(["busy"])
    first = next(trainer.parameters())
    kept = first.detach().clone()
    with torch.no_grad():
        first.fill_(float("nan"))
    try:
        sync(trainer, engine.model)
    except ValueError as e:
        errors["nan"] = str(e)
    # without the check the NaN weights reach the engine: its requests end with an error
    # naming the non-finite logits instead of serving tokens of them; good weights again
    # and it serves
    WeightSync()(trainer, engine.model)
    got = engine.generate([Request("nan", (1, 2), SamplingParams(max_tokens=3))])["nan"]
    nan_out = (got.finish_reason.value, len(got.tokens), got.error)
    with torch.no_grad():
        first.copy_(kept)
    WeightSync()(trainer, engine.model)
    got = engine.generate([Request("ok", (1, 2), SamplingParams(max_tokens=3,
                                                               ignore_eos=True))])["ok"]
    after_nan = (got.finish_reason.value, len(got.tokens))
    # pause(): an output that ends on its own in the pause's steps, and a submission not yet
    # sent (cancelled before it starts), both come back
    engine.submit(Request("ends", (1, 2), SamplingParams(max_tokens=2, ignore_eos=True)))
    engine.step()  # P: its first token
    engine.step()  # D: its last token, committed by the pause's first step
    engine.submit(Request("unsent", (3, 4), SamplingParams(max_tokens=5, ignore_eos=True)))
    paused = {k: (o.finish_reason.value, len(o.tokens)) for k, o in engine.pause().items()}
    engine.resume()
    engine.close()
    for name, call in (("closed_cancel", lambda: engine.cancel("x")),
                       ("closed_release", lambda: engine.release_memory("keep")),
                       ("closed_loaded", engine.weights_loaded)):
        try:
            call()
        except RuntimeError as e:
            errors[name] = str(e)
    return {"errors": errors, "path": stats.path, "paused": paused, "nan_out": nan_out,
            "after_nan": after_nan}


def one_rank_released(rank: int, world: int) -> dict:
    """Memory released on rank 0 alone: generate() and rollout() raise on every rank (their
    agreement), instead of rank 0 refusing alone and the next call pairing across ranks."""
    cfg, groups, sd, engine = _engine(world, 2, 2)
    from colo_rollout.sched.request import Request

    if rank == 0:
        engine.release_memory("keep")
    out = {}
    for name, call in (("generate", lambda: engine.generate([Request("a", (1, 2))])),
                       ("rollout", lambda: rollout(engine, [[1, 2]],
                                                   params=SamplingParams(max_tokens=2)))):
        try:
            call()
            out[name] = "returned"
        except RuntimeError as e:
            out[name] = str(e)
    if rank == 0:
        engine.resume_memory()
    out["after"] = sorted(engine.generate([Request("b", (1, 2), SamplingParams(
        max_tokens=2, ignore_eos=True))]))
    engine.close()
    return out


def trainer_groups_time_out(rank: int, world: int) -> dict:
    """Rank 0 enters an all-reduce on the trainer's data-parallel group that rank 1 never
    joins: with the config's timeout the wait ends in a RuntimeError within it (the groups
    had gloo's 30 minutes: a rank that failed in a training step left its peers waiting)."""
    import time

    import torch.distributed as dist

    from colo_rollout.rl.trainer import trainer_pg_collection

    pgc = trainer_pg_collection(world, 1, 1, timeout_s=2.0)
    start = time.monotonic()
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(1), group=pgc.dp)
        except RuntimeError as e:
            return {"raised": type(e).__name__, "after_s": time.monotonic() - start}
        return {"raised": None, "after_s": time.monotonic() - start}
    time.sleep(6.0)  # never joins
    return {"raised": None, "after_s": None}
