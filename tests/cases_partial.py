"""Partial rollout's cases on CPU ranks (run by tests/test_partial_rollout.py through one
WorkerGroup): finish_groups pauses the unfinished groups, the next call resumes them under a
new weight version; engine.pause() aborts what is in flight and refuses submits."""

from __future__ import annotations

import dataclasses

import torch

from colo_rollout.engine.engine import Engine
from colo_rollout.model.weights import random_state_dict
from colo_rollout.rl.rollout import Carry, rollout
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.sched.request import Request, RequestError, SamplingParams
from tests.cases_engine import tiny_config

# prompts of 4..16 tokens under a 24-token cap: budgets 16, 12, 8, 4 -> groups finish apart
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(16 - 4 * i)] for i in range(4)]
CAP = 24


def partial_round_trip(rank: int, world: int, adp: int, ep: int, mode: str) -> dict:
    cfg = tiny_config(world, adp, ep, mode=mode, record_routing=True)
    groups = init_parallel(cfg.parallel)
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    whole = rollout(engine, PROMPTS, params=params, n=2, max_total_tokens=CAP, tag="w")
    carry = Carry()
    first = rollout(engine, PROMPTS, params=params, n=2, max_total_tokens=CAP, tag="a",
                    finish_groups=1, carry=carry)
    paused = [t for t in carry.trajectories if t.status == "paused"]
    # (tokens generated so far, the budget) of each paused trajectory
    paused_lens = [(len(t.tokens) - len(PROMPTS[t.group]),
                    min(16, CAP - len(PROMPTS[t.group]))) for t in paused]
    second = rollout(engine, [], params=params, n=2, max_total_tokens=CAP, tag="b",
                     weight_version=1, carry=carry)
    # groups keep their prompt's index across the calls: greedy, same weights -> the
    # uninterrupted rollout's tokens, logprobs to the P-vs-D recompute's rounding
    ref = {(t.group, t.sample): t for t in whole}
    joined = first + second
    same_tokens = all(t.tokens == ref[(t.group, t.sample)].tokens for t in joined)
    gap = max(max(abs(a - b) for a, b in zip(t.logprobs, ref[(t.group, t.sample)].logprobs))
              for t in joined)
    masks_ok = all(t.loss_mask == ref[(t.group, t.sample)].loss_mask for t in joined)
    errors = {}
    # a trajectory resumed under version 1 (as the second call returned it), carried again
    # and resumed under version 0
    resumed = [t for t in second if (t.group, t.sample) == (paused[0].group, paused[0].sample)]
    try:
        rollout(engine, [], params=params, carry=Carry(resumed, {paused[0].group: PROMPTS[0]}),
                weight_version=0)
    except ValueError as e:
        errors["stale"] = str(e)
    try:
        rollout(engine, PROMPTS, params=params, finish_groups=1)
    except ValueError as e:
        errors["no_carry"] = str(e)
    # weights written after the carry was filled (a sync; here the same weights loaded
    # again): resuming under the carry's own version would label new-weight tokens old
    carry2 = Carry()
    rollout(engine, PROMPTS, params=params, n=2, max_total_tokens=CAP, tag="c",
            finish_groups=1, carry=carry2, weight_version=3)
    engine.model.load_full_state_dict(random_state_dict(cfg.model))
    try:
        rollout(engine, [], params=params, max_total_tokens=CAP, tag="d", carry=carry2,
                weight_version=3)
    except ValueError as e:
        errors["synced"] = str(e)
    rollout(engine, [], params=params, max_total_tokens=CAP, tag="d", carry=carry2,
            weight_version=4)  # a newer version: resumed
    # engine.pause(): in-flight requests come back with their tokens so far
    if rank == 0:
        for i, p in enumerate(PROMPTS):
            engine.submit(Request(f"p{i}", tuple(p), SamplingParams(max_tokens=6,
                                                                     ignore_eos=True)))
    for _ in range(3):
        engine.step()
    outs = engine.pause()
    errors["remembered_after_pause"] = sorted(engine.scheduler.by_id)
    try:
        engine.submit(Request("late", (1, 2), SamplingParams(max_tokens=2)))
    except RequestError as e:
        errors["paused_submit"] = str(e)
    try:
        rollout(engine, PROMPTS, params=params)
    except RuntimeError as e:
        errors["paused_rollout"] = str(e)
    engine.resume()
    after = rollout(engine, PROMPTS[:1], params=params, n=1, tag="z")
    engine.close()
    return {"first": [(t.group, t.sample, t.status) for t in first],
            "paused": len(paused), "paused_lens": paused_lens,
            "second": [(t.group, t.sample, t.status, t.segments) for t in second],
            "count": len(joined), "same_tokens": same_tokens, "logprob_gap": gap,
            "masks_ok": masks_ok,
            "routing_ok": all(t.routing is not None and t.routing.shape[0] == len(t.tokens) - 1
                              for t in joined),
            "errors": errors, "leftover": len(carry.trajectories),
            "pause_outs": sorted((rid, o.finish_reason.value, len(o.tokens))
                                 for rid, o in outs.items()),
            "after_resume": [t.status for t in after]}


class _Turns:
    """A deterministic multi-turn environment; it records every turn's output it is given
    (the test compares them with an uninterrupted run). Seed 0 ends after one turn, the
    others after three; first observations of 4, 60, 70 and 200 tokens: the longest does
    not fit the first P step (max_prefill_tokens 256), so its turns run a step behind the
    others' -- mid-turn when seed 0 ends, while seeds 1 and 2 are between turns."""

    LENGTHS = (4, 60, 70, 200)

    def __init__(self, seed: int) -> None:
        self.seed, self.turn, self.seen = seed, 0, []

    def reset(self) -> list[int]:
        return [(self.seed * 13 + j) % 250 + 1 for j in range(self.LENGTHS[self.seed])]

    def step(self, generated: list[int]) -> tuple[list[int], float, bool]:
        self.seen.append(list(generated))
        self.turn += 1
        return ([(self.seed + 7 * self.turn + j) % 250 + 1 for j in range(2)],
                float(len(generated)), self.turn >= (1 if self.seed == 0 else 3))


def partial_multi_turn(rank: int, world: int, adp: int, ep: int, mode: str) -> dict:
    """Multi-turn partial rollout: finish_groups stops mid-episode, the carry keeps the
    environments; the next call (envs=[]) resumes them under a new weight version; greedy,
    same weights -> the uninterrupted episodes' tokens and env inputs."""
    cfg = tiny_config(world, adp, ep, mode=mode)
    groups = init_parallel(cfg.parallel)
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    whole_envs = [_Turns(s) for s in range(4)]
    whole = rollout(engine, envs=whole_envs, params=params, max_turns=3, tag="w")
    carry = Carry()
    envs = [_Turns(s) for s in range(4)]
    first = rollout(engine, envs=envs, params=params, max_turns=3, tag="a", finish_groups=1,
                    carry=carry)
    paused = sum(t.status == "paused" for t in carry.trajectories)
    # mid-turn (some of the turn's tokens, < its budget) and between turns (none yet)
    where = sorted(len(t.tokens) - t.turn_start for t in carry.trajectories
                   if t.status == "paused")
    carried_envs = sorted(carry.envs)
    second = rollout(engine, envs=[], params=params, max_turns=3, tag="b", weight_version=1,
                     carry=carry)
    ref = {t.group: t for t in whole}
    joined = first + second
    engine.close()
    return {"first": sorted(t.group for t in first), "paused": paused, "where": where,
            "carried_envs": carried_envs, "count": len(joined),
            "same_tokens": all(t.tokens == ref[t.group].tokens for t in joined),
            "masks_ok": all(t.loss_mask == ref[t.group].loss_mask for t in joined),
            "same_env_inputs": [e.seen for e in envs] == [e.seen for e in whole_envs],
            "rewards_ok": all(t.reward == ref[t.group].reward for t in joined),
            "turns": sorted((t.group, t.turns, t.status) for t in joined),
            "ref_turns": sorted((t.group, t.turns, t.status) for t in whole),
            "versions": sorted({v for t in second for _, v in t.segments}),
            "leftover": len(carry.trajectories)}


def api_misuse(rank: int, world: int) -> dict:
    """What a caller of the in-process API gets wrong, on a replicated 2-rank engine: a second
    rollout() under the same tag and version (its ids were taken for good before), a carried
    trajectory paused just as its completion reached max_tokens, rollout()'s own arguments,
    generate()'s outputs and callbacks, and an engine used after close()."""
    from colo_rollout.rl.rollout import Trajectory

    cfg = tiny_config(world, 2, 2)
    groups = init_parallel(cfg.parallel)
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    once = rollout(engine, PROMPTS[:2], params=params, n=2)
    again = rollout(engine, PROMPTS[:2], params=params, n=2)  # same tag, same version
    res = {"again_same": [t.tokens for t in again] == [t.tokens for t in once],
           "again_status": sorted({t.status for t in again}),
           "remembered_after_rollouts": len(engine.scheduler.by_id)}
    # a paused single-turn trajectory whose completion already has max_tokens tokens
    full = Trajectory(0, 0, weight_version=0)
    full._append(list(PROMPTS[0]), None)
    full._append([5, 6, 7, 8], [-0.5] * 4)
    full.status, full.segments = "paused", [(len(PROMPTS[0]), 0)]
    resumed = rollout(engine, [], params=params, carry=Carry([full], {0: list(PROMPTS[0])}),
                      weight_version=1, reward_fn=lambda p, c: float(len(c)))
    res["resumed"] = [(t.status, t.error, len(t.tokens), t.reward, t.turns) for t in resumed]
    # the same for a multi-turn episode paused as its first turn reached max_tokens: the
    # environment steps on that turn, the next turn goes out with the whole context
    from tests.cases_rl import CountingEnv

    env = CountingEnv(0, turns=2)
    ep = Trajectory(0, 0, weight_version=0)
    ep._append(env.reset(), None)
    ep.turn_start = len(ep.tokens)
    ep._append([5, 6, 7, 8], [-0.5] * 4)
    ep.status, ep.segments = "paused", [(ep.turn_start, 0)]
    episode = rollout(engine, envs=[], params=params, carry=Carry([ep], {}, {0: env}),
                      weight_version=1)
    res["episode"] = [(t.status, t.error, t.turns, len(t.tokens), t.tokens[7:9])
                      for t in episode]
    errors = {}
    for name, kw in (("n0", {"n": 0}), ("n_float", {"n": 2.5}), ("params", {"params": None}),
                     ("cap0", {"max_total_tokens": 0}), ("carry_list", {"carry": []}),
                     ("carry_lost", {"carry": Carry([full], {})}),
                     # found by probing (session 31): an AttributeError, and a reward that
                     # failed every trajectory after the whole rollout
                     ("carry_junk", {"carry": Carry(["junk"], {})}),
                     ("reward_5", {"reward_fn": 5})):
        args = {"params": params, **kw}
        try:
            rollout(engine, PROMPTS[:1], **args)
        except ValueError as e:
            errors[name] = str(e)
    try:  # ranks calling with different arguments: refused on every rank, nothing submitted
        rollout(engine, PROMPTS[:1], params=params, n=2 if rank == 0 else 1)
    except ValueError as e:
        errors["diverged"] = str(e)
    try:
        rollout(engine, [PROMPTS[rank]], params=params)
    except ValueError as e:
        errors["diverged_prompts"] = str(e)
    try:
        rollout(engine, envs=[5], params=params)
    except ValueError as e:
        errors["env_5"] = str(e)
    for name, call in (("warmup", lambda: engine.warmup("a")),
                       ("take_routings", lambda: engine.take_routings(["a", "b"], [1]))):
        try:
            call()
        except ValueError as e:
            errors[name] = str(e)
    for name, args in (("engine_cfg", (None, groups)), ("engine_groups", (cfg, None)),
                       ("engine_sd", (cfg, groups, [("a", 1)]))):
        try:
            Engine(*args)
        except TypeError as e:
            errors[name] = str(e)
    res["errors"] = errors
    # generate(): this call's outputs (and an earlier submit's that finished in its first
    # step), every one through on_finish, then forgotten
    if rank == 0:
        engine.submit(Request("early", tuple(PROMPTS[1]), SamplingParams(max_tokens=1)))
    seen = []
    outs = engine.generate([Request("g1", tuple(PROMPTS[2]), params)] if rank == 0 else [],
                           on_finish=lambda o: seen.append(o.request_id))
    res["generate"] = sorted(outs)
    res["seen"] = sorted(seen)
    res["remembered_after_generate"] = sorted(engine.scheduler.by_id)
    # a callback that raises: every request still served and forgotten, the outputs on the
    # error (found by probing: neither returned nor forgotten)
    from colo_rollout.engine.engine import OnFinishError

    try:
        engine.generate([Request(f"cb{i}", tuple(PROMPTS[i]), params) for i in range(2)]
                        if rank == 0 else [], on_finish=lambda o: 1 / 0)
    except OnFinishError as e:
        res["on_finish_error"] = (str(e).split(":")[1].strip(), sorted(e.outputs))
    res["remembered_after_callback"] = sorted(engine.scheduler.by_id)
    # an id the engine still holds (finished by step(), not forgotten): refused, and the
    # refusal in the result (found by probing: the id was missing from it)
    if rank == 0:
        engine.submit(Request("held", tuple(PROMPTS[1]), SamplingParams(max_tokens=1)))
    while True:
        engine.step()
        if not engine.busy():
            break
    outs = engine.generate([Request("held", tuple(PROMPTS[2]), params),
                            Request("fresh", tuple(PROMPTS[2]), params)] if rank == 0 else [])
    res["held"] = {k: (o.finish_reason.value, (o.error or "")[:60]) for k, o in outs.items()}
    engine.forget(["held"])
    # rollout() beside a request it did not submit (it would take that output): refused on
    # every rank, the request untouched; served by generate(), then rollout() runs
    if rank == 0:
        engine.submit(Request("foreign", tuple(PROMPTS[1]), SamplingParams(max_tokens=2)))
    try:
        rollout(engine, PROMPTS[:1], params=params)
    except RuntimeError as e:
        res["rollout_beside_foreign"] = str(e)
    res["foreign_served"] = sorted(engine.generate([]))
    res["rollout_after"] = [t.status for t in rollout(engine, PROMPTS[:1], params=params)]
    # load_full_state_dict: a bad state dict on one rank is refused on every rank before
    # any rank writes; a meta tensor is refused before the first write; busy: refused
    before = [p.detach().clone() for p in engine.model.parameters()]
    sd = random_state_dict(cfg.model, seed=3)
    if rank == 1:
        sd.pop("embedding.word_embeddings.weight")
    loads = {}
    try:
        engine.model.load_full_state_dict(sd)
    except KeyError as e:
        loads["one_rank_bad"] = str(e)
    sd = random_state_dict(cfg.model, seed=3)
    sd["output_layer.weight"] = torch.empty_like(sd["output_layer.weight"], device="meta")
    try:
        engine.model.load_full_state_dict(sd)
    except ValueError as e:
        loads["meta"] = str(e)
    sd = random_state_dict(cfg.model, seed=3)  # a sparse one, last in order (found by
    sd["output_layer.weight"] = sd["output_layer.weight"].to_sparse()  # probing: half-loaded)
    try:
        engine.model.load_full_state_dict(sd)
    except ValueError as e:
        loads["sparse"] = str(e)
    if rank == 0:
        engine.submit(Request("busy", tuple(PROMPTS[1]), SamplingParams(max_tokens=3)))
    engine.step()  # in flight on every rank now
    try:
        engine.model.load_full_state_dict(random_state_dict(cfg.model, seed=3))
    except RuntimeError as e:
        loads["busy"] = str(e)
    while engine.busy():
        engine.step()
    res["loads"] = loads
    res["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))
    # different collective calls on the two ranks: named on both, and the ranks stay paired
    try:
        if rank == 0:
            engine.generate([])
        else:
            rollout(engine, PROMPTS[:1], params=params)
    except RuntimeError as e:
        res["crossed_calls"] = str(e).split(": ", 1)[1]
    res["after_crossed"] = [t.status for t in rollout(engine, PROMPTS[:1], params=params)]
    try:  # (found by probing: pause() against generate() read as a peer dead or diverged)
        if rank == 0:
            engine.pause()
        else:
            engine.generate([])
    except RuntimeError as e:
        res["crossed_pause"] = str(e).split(": ", 1)[1]
    engine.resume()
    res["after_pause"] = [t.status for t in rollout(engine, PROMPTS[:1], params=params)]
    # a weight load on one rank, weights_loaded() on the other: both refused, the weights
    # unchanged on both (they had agreed, and rank 0 loaded alone)
    before = [p.detach().clone() for p in engine.model.parameters()]
    try:
        if rank == 0:
            engine.model.load_full_state_dict(random_state_dict(cfg.model, seed=4))
        else:
            engine.weights_loaded()
    except RuntimeError as e:
        res["crossed_weights"] = str(e)
    res["unchanged_after_crossed"] = all(torch.equal(a, b) for a, b in
                                         zip(before, engine.model.parameters()))
    # found by probing (session 41): an interrupt in the second environment's reset() left
    # the first's request in the engine, and the retry continued its session (other tokens)
    import numpy as np

    class Interrupting(CountingEnv):
        def reset(self):
            raise KeyboardInterrupt

    class ArrayReset(CountingEnv):
        def reset(self):
            return np.array(super().reset())  # token ids as an array (a tensor, a numpy row)

    class NoneAtEnd(CountingEnv):
        def step(self, generated):
            obs, reward, done = super().step(generated)
            return (None if done else obs), reward, done

    def envs(cls=CountingEnv, k=2):
        return [cls(i, turns=2) for i in range(k)]

    clean = [t.tokens for t in rollout(engine, envs=envs(), params=params)]
    try:
        rollout(engine, envs=[CountingEnv(0, turns=2), Interrupting(1)], params=params)
    except KeyboardInterrupt:
        res["interrupted"] = True
    res["retry_same"] = [t.tokens for t in rollout(engine, envs=envs(), params=params)] == clean
    res["array_reset"] = [(t.status, t.tokens) for t in
                          rollout(engine, envs=envs(ArrayReset), params=params)] == \
        [("completed", tk) for tk in clean]
    res["none_at_end"] = sorted({t.status for t in rollout(engine, envs=envs(NoneAtEnd),
                                                           params=params)})

    class MetaReward:  # a number whose conversion raises something else than TypeError
        def __float__(self):
            raise RuntimeError("Tensor.item() cannot be called on meta tensors")

    scored = rollout(engine, PROMPTS[:2], params=params,
                     reward_fn=lambda p, c: MetaReward() if p == list(PROMPTS[0]) else 1.0)
    res["meta_reward"] = [(t.status, t.error) for t in scored]
    judged = rollout(engine, PROMPTS[:2], params=params, n=2,
                     reward_fn=lambda p, c: engine.generate([]) and 1.0)
    res["judge"] = sorted({(t.status, (t.error or "")[:60]) for t in judged})
    stepping = rollout(engine, PROMPTS[:2], params=params,
                       reward_fn=lambda p, c: engine.step() and 1.0)
    res["stepping"] = sorted({(t.status, (t.error or "")[:56]) for t in stepping})
    try:
        rollout(engine, PROMPTS[:1], params=dataclasses.replace(params, max_tokens=None))
    except ValueError as e:
        res["max_tokens_none"] = str(e)
    # requests close() leaves unserved end (found by probing: one in flight stayed unfinished
    # for good): in flight -> CANCELLED, a submit no step sent -> REJECTED, each naming it
    if rank == 0:
        engine.submit(Request("inflight", tuple(PROMPTS[0]),
                              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
    for _ in range(3):
        engine.step()
    if rank == 0:
        engine.submit(Request("unsent", tuple(PROMPTS[1]), params))
    engine.close()
    res["at_close"] = {rid: (engine.output(rid).finish_reason.value, engine.output(rid).error,
                             len(engine.output(rid).tokens))
                       for rid in ("inflight", "unsent") if rid in engine.scheduler.by_id}
    try:  # (found by probing: a closed engine was said to hold requests in flight)
        rollout(engine, PROMPTS[:1], params=params)
    except RuntimeError as e:
        res["rollout_closed"] = str(e)
    closed = {}
    for name, call in (("submit", lambda: engine.submit(Request("late", (1, 2), params))),
                       ("step", engine.step)):
        try:
            call()
        except RuntimeError as e:
            closed[name] = str(e)
    res["closed"] = closed
    engine.close()  # twice: a no-op
    return res


class _Boom(_Turns):
    """_Turns whose step raises KeyboardInterrupt once ``armed`` (an interrupted resume)."""

    armed = False

    def step(self, generated):
        if _Boom.armed:
            raise KeyboardInterrupt
        return super().step(generated)


def carry_after_an_interrupt(rank: int, world: int) -> dict:
    """A resume that raises leaves the carry as it was (single turn: the next call resumes
    and scores every carried trajectory in full); one that had stepped a carried
    environment marks those groups spoiled (refused, naming them); a carried episode whose
    next turn is past the resuming call's max_turns ends truncated without running it; a
    trajectory paused between turns keeps the routing of the positions it forwarded only."""
    cfg = tiny_config(world, world, world, record_routing=True, mtp=True,
                      model_kw={"mtp_num_layers": 1})
    groups = init_parallel(cfg.parallel)
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    res: dict = {}
    carry = Carry()
    rollout(engine, PROMPTS[:3], params=p, max_total_tokens=CAP, finish_groups=1, carry=carry,
            tag="a")
    before = [(t.group, t.status, list(t.tokens), list(t.segments)) for t in carry.trajectories]

    def boom(prompt, completion):
        raise KeyboardInterrupt

    try:
        rollout(engine, [], params=p, carry=carry, weight_version=1, reward_fn=boom, tag="b")
    except KeyboardInterrupt:
        res["interrupted"] = True
    res["carry_unchanged"] = before == [(t.group, t.status, list(t.tokens), list(t.segments))
                                        for t in carry.trajectories]
    res["paused_before"] = sum(1 for b in before if b[1] == "paused")
    again = rollout(engine, [], params=p, carry=carry, weight_version=1, tag="c",
                    max_total_tokens=CAP, reward_fn=lambda pr, c: float(len(c)))
    res["again"] = sorted((t.group, t.status, len(t.tokens) - len(PROMPTS[t.group]), t.reward,
                           t.routing.shape[0] == len(t.tokens) - 1) for t in again)
    # multi-turn: episodes paused between turns, resumed with max_turns 1
    carry = Carry()
    rollout(engine, envs=[_Turns(s) for s in range(3)], params=SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True), max_turns=6, finish_groups=1,
        carry=carry, tag="m")
    between = [t for t in carry.trajectories if t.status == "paused"
               and t.turn_start == len(t.tokens)]
    # forwarded: everything but the last observation (2 tokens) and the last output
    res["between_routing"] = [t.routing.shape[0] == len(t.tokens) - 3 for t in between]
    out = rollout(engine, envs=[], params=SamplingParams(temperature=0.0, max_tokens=4,
                                                         ignore_eos=True),
                  max_turns=1, carry=carry, weight_version=1, tag="n")
    res["max_turns_1"] = sorted((t.status, t.turns) for t in out)
    # an environment's step interrupted while resuming: its group is spoiled
    carry = Carry()
    envs = [_Boom(s) for s in range(3)]
    rollout(engine, envs=envs, params=SamplingParams(temperature=0.0, max_tokens=4,
                                                     ignore_eos=True),
            max_turns=6, finish_groups=1, carry=carry, tag="s")
    _Boom.armed = True
    try:
        rollout(engine, envs=[], params=SamplingParams(temperature=0.0, max_tokens=4,
                                                       ignore_eos=True),
                max_turns=6, carry=carry, weight_version=1, tag="t")
    except KeyboardInterrupt:
        pass
    _Boom.armed = False
    res["spoiled"] = list(carry.spoiled)
    try:
        rollout(engine, envs=[], params=p, carry=carry, weight_version=1, tag="u")
    except ValueError as e:
        res["spoiled_error"] = str(e)
    engine.close()
    return res
