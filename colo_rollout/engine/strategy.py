"""The scheduling mode as a typed strategy, built once from config (``strategy_for``), and the
round each strategy runs inside one engine step.

Owns what differs between the modes of the ordering ladder (DESIGN.md item 9), so that no other
module tests the mode's name:
  * ``Normal``: strict P priority, no multiplexing -- P and D run on the default stream one
    step each, with no turnstile and no rendezvous; P's MoE graphs are on by default.
  * ``Global(fence)``: PD mode with the whole P epoch as one segment (its span is every
    boundary), P first, then D. ``fence=True`` is Global-Complete (the host waits for P's GPU
    work before D may be enqueued); ``fence=False`` is Global-Enqueue (D goes once every rank
    host-enqueued P).
  * ``Fine(policy)``: the segment turnstile -- ready D goes first, and P advances by the
    policy's span of boundaries per round, its host enqueue hidden behind D's GPU time.
PD strategies keep P's MoE graphs off by default (docs/benchmarks.md: Fine with them stalled on
2 GPUs while P's AllReduce was unrouted).

A strategy holds no state of a serving session: ``run(plan, parts, d_ready)`` drives the
session's parts (``RoundParts``: runner, turnstile, rendezvous, route, scheduler, recorder),
which the engine owns. The round only enqueues work and records it; the step's host wait for
D's tokens is the engine's. Every rank takes the same branches (replicated state), so every
rank issues the same sequence of collectives -- ... P to p, D, p += K, P to p, D ... -- in one
global order.

Plain Python: no torch, no processes (tests/test_strategy.py drives the rounds on recording
fakes). Must not go in here: span policies (multiplex/segment_policy.py), streams
(multiplex/stream_route.py), the turnstile's rules (multiplex/turnstile.py).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from colo_rollout.config import EngineConfig
from colo_rollout.multiplex.segment_policy import (
    BalancedSpan,
    HeldClock,
    Load,
    policy_for,
    span_hint,
)


@dataclass
class RoundParts:
    """The serving session's parts a round drives (duck-typed: see worker/runner.py, multiplex/
    turnstile.py and rendezvous.py, engine/recorder.py)."""

    runner: Any  # run / run_decode / start_epoch / advance / epoch_active
    turnstile: Any  # TurnstileController
    rendezvous: Any  # PreD/PostD (None in Normal)
    route: Any  # StreamRoute: fence_p
    scheduler: Any  # seqs, waiting, epoch
    recorder: Any  # Recorder
    wait_s: float  # bound of every host wait on GPU work
    max_batch_size: int
    max_prefill_tokens: int
    boundaries: int  # one P epoch's boundaries
    epochs: itertools.count = field(default_factory=itertools.count)


@dataclass
class RoundOut:
    pending: list  # D's (or Normal's phase's) pending sampled tokens
    p_out: Any = None  # the P epoch's pending first tokens, when its enqueue completed
    epoch_plan: Any = None  # and that epoch's plan
    span_hint: tuple | None = None  # balanced policy: this rank's measurement of the round


@dataclass(frozen=True)
class Normal:
    """Strict P priority: one phase per step, no P/D machinery."""

    pd = False  # P/D multiplexing: P on its own stream, turnstile, rendezvous
    d_first = False  # ready D is enqueued before the P epoch's first segment
    fence = False  # whole-P GPU fence before D (Global-Complete)
    whole_epoch = True  # P's span is the whole epoch
    p_graphs_by_default = True  # engine.prefill_graphs "auto"
    # engine.overlap_prefill may read a P step's tokens one step late (the engine's
    # ``_collect``): P and D share one stream here, so the next step's work queues behind it
    overlaps_p = True
    policy = None  # the span policy (Fine only)
    balanced = False  # the span policy re-sizes K every round from rank-agreed hints

    def observe(self, hints: list) -> None:
        """Rank-agreed span hints of the last step (balanced Fine only)."""

    def run(self, plan, parts: RoundParts, d_ready: int) -> RoundOut:
        """The plan's one phase. A whole P step holds every ready D row back."""
        rec = parts.recorder
        if plan.has_prefill:
            with rec.phase("P") as t:
                out = parts.runner.run(plan)
            if d_ready:
                rec.held(t.end - t.start)
        elif plan.has_decode:
            with rec.phase("D"):
                out = parts.runner.run(plan)
            rec.d_ran(plan)
        else:
            out = parts.runner.run(plan)  # idle: matched no-op work
        return RoundOut([out])


class _PD:
    """The turnstile round of the PD strategies: PreD -> one D iteration on every rank ->
    PostD -> P gets K more boundaries, and P runs to its permitted endpoint. Where P goes
    relative to D (``d_first``) and whether D waits for P's GPU work (``fence``) is the
    strategy's; the rest is shared."""

    pd = True
    overlaps_p = False  # P epochs are committed asynchronously already
    p_graphs_by_default = False

    def observe(self, hints: list) -> None:
        if self.balanced:  # every rank applies the same agreed hints, in rank order
            self.policy.observe(hints)

    def span(self, plan, parts: RoundParts) -> int:
        """Boundaries P may cross before the first D of its epoch."""
        if self.whole_epoch:
            return parts.boundaries
        load = Load(d_rows=sum(len(w.decode) for w in plan.replicas),
                    d_capacity=parts.max_batch_size * len(plan.replicas),
                    p_tokens=sum(w.prefill_tokens for w in plan.replicas)
                    + sum(len(r.prompt) for r in parts.scheduler.waiting),
                    p_budget=parts.max_prefill_tokens * len(plan.replicas))
        return self.policy.choose(load)

    def run(self, plan, parts: RoundParts, d_ready: int) -> RoundOut:
        """With no D row anywhere there is nothing to protect: P runs on to the end of its
        epoch in this round. With no P anywhere only D collectives exist: the P/D machinery
        (rendezvous, controller) is off and D runs exactly as in Normal mode."""
        ctl, runner, rec = parts.turnstile, parts.runner, parts.recorder
        if not plan.has_prefill and not runner.epoch_active:
            if not plan.has_decode:
                return RoundOut([])
            with rec.phase("D"):
                out = runner.run_decode(plan)
            rec.d_ran(plan)
            return RoundOut([out])
        if plan.has_prefill:
            runner.start_epoch(plan)
            ctl.begin(next(parts.epochs), d_enqueued=False, span=self.span(plan, parts))
        res = RoundOut([])
        epoch_plan = parts.scheduler.epoch
        d_first = self.d_first and plan.has_decode
        done = None
        if not d_first and runner.epoch_active:
            done = self._advance_p(parts, res)
            if done is not None and self.fence:
                # whole-P completion fence before D may be enqueued (bounded, as every wait)
                parts.route.fence_p(parts.wait_s)
        if plan.has_decode:
            parts.rendezvous.pre_d(ctl.epoch, ctl.reached)
            with rec.phase("D", ctl.epoch):
                d_out = runner.run_decode(plan, ctl.epoch)
            res.pending.append(d_out)
            rec.d_ran(plan)
            parts.rendezvous.post_d(ctl.epoch, ctl.reached)
            if ctl.active:
                if self.balanced:
                    ctl.set_span(self.policy.span)  # agreed this step: the same K everywhere
                rec.span_set(ctl.span)
            ctl.post_d()
            if d_first and runner.epoch_active:
                done = self._advance_p(parts, res, behind=d_out)
        else:
            while runner.epoch_active:  # no D to protect: finish the epoch now
                ctl.post_d()
                done = self._advance_p(parts, res)
        if done is not None:
            res.p_out, res.epoch_plan = done, epoch_plan
        return res

    def _advance_p(self, parts: RoundParts, res: RoundOut, behind=None):
        """Run P to its permitted endpoint. Its host time counts as D wait when a D iteration
        was ready meanwhile: D rows with tokens (all of it), or -- for a segment enqueued
        ``behind`` this step's D iteration -- the part after that iteration's tokens came back
        (to boundary precision, rounded up: the boundary during which they came back counts
        whole). Before that, P's enqueue was hidden behind D's GPU time and held nothing back.

        Balanced policy: the round's measurement (P's enqueue per boundary against the time D
        was held, or the time the host then waited for D) becomes this rank's span hint."""
        ctl, rec = parts.turnstile, parts.recorder
        d_ready = (behind is None
                   and any(q.last_token is not None for q in parts.scheduler.seqs.values()))
        reached = ctl.reached
        with rec.phase("P", ctl.epoch) as t:
            clock = HeldClock(behind, t.start) if behind is not None else None
            done = parts.runner.advance(ctl, clock)
        held = (t.end - t.start if d_ready
                else (clock.held(t.end) if clock is not None else 0.0))
        rec.held(held)
        if self.balanced and behind is not None:
            waited = 0.0
            if done is None and held == 0.0:  # parked at the endpoint before D was back
                with rec.clock("resolve"):
                    behind.wait(parts.wait_s, "D tokens")
                waited = time.perf_counter() - t.end
            crossed = ctl.reached - reached + (1 if done is not None else 0)
            est = clock.held_estimate(t.end) if held > 0.0 else 0.0
            res.span_hint = span_hint(ctl.span, crossed, t.end - t.start, waited, est)
        return done


@dataclass(frozen=True)
class Global(_PD):
    """The whole P epoch as one segment, P first; ``fence``: wait for its GPU work before D."""

    fence: bool
    d_first = False
    whole_epoch = True
    policy = None
    balanced = False


@dataclass(frozen=True)
class Fine(_PD):
    """The segment turnstile with a span ``policy`` (fixed, load-selected or balanced), D
    first."""

    policy: object
    d_first = True
    fence = False
    whole_epoch = False

    @property
    def balanced(self) -> bool:
        return isinstance(self.policy, BalancedSpan)


Strategy = Normal | Global | Fine


def strategy_for(engine: EngineConfig, boundaries: int) -> Strategy:
    """The strategy of ``engine.mode`` (validated by the config); ``boundaries``: one P epoch's
    boundary count (the balanced span's ceiling)."""
    if engine.mode == "normal":
        return Normal()
    if engine.mode in ("global_complete", "global_enqueue"):
        return Global(fence=engine.mode == "global_complete")
    return Fine(policy_for(engine, boundaries))
