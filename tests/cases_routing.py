"""Routing replay's cases on CPU ranks (run by tests/test_routing_replay.py through one
WorkerGroup): the engine records every input token's experts in P and D, rollout() returns
them per trajectory, and the trainer (its own layout) replays them."""

from __future__ import annotations

import dataclasses
import random

import torch

from colo_rollout.config import RLConfig
from colo_rollout.engine.engine import Engine
from colo_rollout.model.weights import random_state_dict
from colo_rollout.rl.rollout import rollout
from colo_rollout.rl.trainer import Trainer
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.sched.request import SamplingParams
from tests.cases_engine import tiny_config


class _Echo:
    """Two turns: the first observation, then two more tokens; deterministic."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.turn = 0

    def reset(self) -> list[int]:
        return [self.rng.randrange(1, 256) for _ in range(5)]

    def step(self, generated: list[int]) -> tuple[list[int], float, bool]:
        self.turn += 1
        return [self.rng.randrange(1, 256) for _ in range(2)], 0.0, self.turn >= 2


def _trainer_maps(trainer: Trainer, batch, replay: bool):
    """(logp, per-layer [S*B, E] routing maps of the trainer's forward)."""
    maps: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, o: maps.append(o[1].detach().clone()))
             for r in trainer.routers()]
    try:
        with torch.no_grad():
            logp, _ = trainer.token_logprobs(batch, replay=replay)
    finally:
        for h in hooks:
            h.remove()
    return logp, maps


def _disagree(maps, batch, routing_of) -> tuple[int, int]:
    """(rows whose expert set differs from ``routing_of(b)``, rows compared)."""
    B = len(batch)
    bad = total = 0
    for j, m in enumerate(maps):
        for b, t in enumerate(batch):
            rec = routing_of(b)
            for s in range(rec.shape[0]):
                want = set(int(e) for e in rec[s, j])
                got = set(m[s * B + b].nonzero().flatten().tolist())
                bad += want != got
                total += 1
    return bad, total


def routing_round_trip(rank: int, world: int, adp: int, ep: int, mode: str,
                       moe_compute: str = "auto", model_kw: dict | None = None,
                       mtp: bool = False, engine_kw: dict | None = None) -> dict:
    cfg = tiny_config(world, adp, ep, record_routing=True, mode=mode, mtp=mtp,
                      **(engine_kw or {}),
                      model_kw={"moe_compute": moe_compute, **(model_kw or {}),
                                **({"mtp_num_layers": 1} if mtp else {})})
    cfg = dataclasses.replace(cfg, rl=RLConfig(routing_replay=True))
    groups = init_parallel(cfg.parallel)
    sd = random_state_dict(cfg.model)
    engine = Engine(cfg, groups, sd)
    trainer = Trainer(cfg, sd, groups.device)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    trajs = rollout(engine, prompts, params=params, n=2, tag="rr")
    multi = rollout(engine, envs=[_Echo(s) for s in range(3)], params=params, tag="mt")
    layers = sum(1 for i in range(cfg.model.num_layers) if cfg.model.is_moe_layer(i))
    k = cfg.model.moe_router_topk
    shapes_ok = all(t.routing is not None and t.routing.shape == (len(t.tokens) - 1, layers, k)
                    for t in trajs + multi)
    leftover = len(engine.routes)
    # a plain request (no session): its routing comes with its output
    from colo_rollout.sched.request import Request

    out = engine.generate([Request("g0", (1, 2, 3, 4), SamplingParams(max_tokens=3,
                                                                      ignore_eos=True))])["g0"]
    plain_ok = (out.routing is not None and out.routing.shape == (4 + 3 - 1, layers, k)
                and len(engine.routes) == 0)
    leftover += len(engine.routes)
    batch = trajs + multi
    # the trainer's own routing (fp32: the same numbers up to summation order) and the
    # replayed one, against what the engine recorded
    free_logp, free_maps = _trainer_maps(trainer, batch, replay=False)
    rep_logp, rep_maps = _trainer_maps(trainer, batch, replay=True)
    own_bad, compared = _disagree(free_maps, batch, lambda b: batch[b].routing)
    rep_bad, _ = _disagree(rep_maps, batch, lambda b: batch[b].routing)
    # a different routing replayed (every expert id shifted by one): the forward follows it
    shifted = [dataclasses.replace(t, routing=(t.routing.astype("int64") + 1)
                                   % cfg.model.num_experts) for t in batch]
    sh_logp, sh_maps = _trainer_maps(trainer, shifted, replay=True)
    sh_bad, _ = _disagree(sh_maps, shifted, lambda b: shifted[b].routing)
    L = free_logp.shape[1]
    valid = torch.zeros_like(free_logp, dtype=torch.bool)
    for b, t in enumerate(batch):
        valid[b, : len(t.tokens) - 1] = True
    rollout_gap = max(
        max(abs(a - b) for a, b, m in zip(t.logprobs[1:], rep_logp[i, : len(t.tokens) - 1]
                                          .tolist(), t.loss_mask[1:]) if m)
        for i, t in enumerate(batch))
    # bad input: a trajectory without routing, and one with another expert count
    errors = []
    for bad in (dataclasses.replace(batch[0], routing=None),
                dataclasses.replace(batch[0], routing=batch[0].routing[:, :, :1]),
                # found by probing: torch's index error, an AttributeError
                dataclasses.replace(batch[0], routing=batch[0].routing.astype("int64") - 99),
                dataclasses.replace(batch[0], routing=batch[0].routing.tolist())):
        try:
            trainer.token_logprobs([bad], replay=True)
        except ValueError as e:
            errors.append(str(e))
    engine.close()
    return {"shapes_ok": shapes_ok, "leftover": leftover, "plain_ok": plain_ok, "compared": compared,
            "own_disagree": own_bad, "replay_disagree": rep_bad, "shift_disagree": sh_bad,
            "replay_vs_free_logp": float((rep_logp - free_logp)[valid].abs().max()),
            "shift_vs_free_logp": float((sh_logp - free_logp)[valid].abs().max()),
            "rollout_vs_replay_logp": rollout_gap, "errors": errors, "L": L,
            "routing": [t.routing.tolist() for t in batch]}


def session_routing_with_mtp(rank: int, world: int) -> dict:
    """A session's routing with MTP drafting (random weights: drafts rejected) is one row per
    input, as without MTP -- a D iteration also routes the draft's position, which outruns the
    sequence when it ends on a rejected draft (found by probing: one row too many, a draft
    that never entered the sequence). Taken while the session is open and after its close."""
    from colo_rollout.sched.request import Request

    out = {}
    for mtp in (False, True):
        cfg = tiny_config(world, world, world, record_routing=True, mtp=mtp,
                          model_kw={"mtp_num_layers": 1})
        groups = init_parallel(cfg.parallel)
        engine = Engine(cfg, groups, random_state_dict(cfg.model))
        for key, close in (("open", False), ("closed", True)):
            n = 0
            for t in range(3):
                got = engine.generate([Request(f"{key}#{t}", (3 + t,) * (1 + t),
                                               SamplingParams(max_tokens=2 + 3 * t,
                                                              ignore_eos=True), session=key)])
                n += 1 + t + len(got[f"{key}#{t}"].tokens)
            if close:
                engine.close_session(key)
                engine.generate([])  # the close applied; its routing kept for this call
            rows = engine.take_routing(key)
            out[f"{key}_{mtp}"] = (rows.shape[0], n - 1)
            out[f"{key}_{mtp}_ids"] = rows.tolist()
        engine.close()
    return out


def routing_store_stays_bounded(rank: int, world: int) -> dict:
    """The routing store over many calls (found by probing): a session id used again for a
    new conversation starts from no routing (it returned the old conversation's positions),
    and the routing of closed sessions nobody took -- generate() with sessions, rollout()
    calls a reward interrupted -- is forgotten when the next collective call begins (the
    store grew by every one)."""
    from colo_rollout.sched.request import Request

    cfg = tiny_config(world, world, world, record_routing=True)
    groups = init_parallel(cfg.parallel)
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    out = {}
    for i in range(12):  # sessions served and closed, their routing never taken
        sid = f"conv{i}"
        engine.generate([Request(f"{sid}#0", (1, 2, 3, 4 + i), p, session=sid)])
        engine.close_session(sid)
    engine.generate([])  # applies the last close
    out["after_closed"] = len(engine.routes)  # the last close's, kept for one more call
    # a closed session's routing can still be taken in the call after the close
    engine.generate([Request("keep#0", (5, 6, 7), p, session="keep")])
    engine.close_session("keep")
    engine.generate([])
    out["kept_rows"] = engine.take_routing("keep").shape[0]
    # the id of a long closed conversation, used again for a short new one
    engine.generate([Request("x#0", tuple(range(1, 41)),
                             SamplingParams(max_tokens=20, ignore_eos=True), session="x")])
    engine.close_session("x")
    engine.generate([Request("x#0", (9, 9, 9), p, session="x")])
    out["reused_rows"] = engine.take_routing("x").shape[0]  # 3 + 4 tokens: 6 inputs
    engine.close_session("x")
    calls = [0]

    def interrupt(prompt, completion):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return 0.0

    for k in range(6):
        calls[0] = 0
        try:
            rollout(engine, [[1, 2, 3], [4, 5]], params=SamplingParams(temperature=1.0,
                                                                       max_tokens=5),
                    n=3, reward_fn=interrupt, tag=f"cut{k}")
        except KeyboardInterrupt:
            pass
    out["after_interrupts"] = len(engine.routes)  # the last call's 6 at most
    engine.generate([])
    out["at_rest"] = len(engine.routes)
    engine.close()
    return out
