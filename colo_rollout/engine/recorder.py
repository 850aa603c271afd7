"""What one engine's steps did and where their host time went, recorded beside the loop.

Owns ``StepStats`` (one per step), the P/D timeline (``Span`` per P segment and D iteration,
perf_counter seconds), host seconds by part of the step, and the D-wait account (P time that
held back D rows that were ready). The step and the strategies' rounds call it at the points
they pass; they compute nothing for it.

Each timed part is also a ``torch.profiler`` range (``colo.P``, ``colo.D``, ``colo.exchange``,
...), so a profiler trace of a run shows the engine's phases over the kernels they launch.
Ranges are entered only while a profiler runs (otherwise nothing is dispatched per step).

Invariants: ``history`` gets exactly one entry per ``end_step``; a D iteration's ``d_wait_s``
is the P time held since the previous D iteration (``held`` adds, ``d_ran`` takes and resets).
``history`` and ``timeline`` keep the latest HISTORY_KEPT steps / TIMELINE_KEPT spans (a
days-long RL run's memory stays bounded; found by probing: they grew by ~20 entries per
rollout step); ``host_seconds`` keeps running totals, so it covers every step since the
engine was made at O(1) cost.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch.autograd.profiler as autograd_profiler
from torch.profiler import record_function

from colo_rollout.multiplex.stream_route import Span
from colo_rollout.sched.plan import Phase, StepPlan


@dataclass
class StepStats:
    step: int
    phase: Phase
    rows: int  # P tokens or D rows of the whole world this step
    seconds: float
    p_in_flight: bool = False  # PD mode: a P epoch was in flight during this round
    d_rows: int = 0  # D rows of the D iteration run in this step (0: none ran)
    d_wait_s: float = 0.0  # P time that held this D iteration back while its rows were ready
    span: int = 0  # PD: boundaries P was permitted after this step's D iteration (0: none)
    d_ready: int = 0  # D rows with a token when the step planned, whole world (d_rows <= it)
    # Normal, engine.overlap_prefill: this step's P tokens are read in the next step (its
    # GPU work left running under that step's enqueue)
    read_late: bool = False


@dataclass
class Timed:
    start: float
    end: float = 0.0


HISTORY_KEPT = 65536  # steps (a bench replay's few thousand fit whole)
TIMELINE_KEPT = 131072  # P segments and D iterations


class Recorder:
    def __init__(self) -> None:
        self.history: collections.deque[StepStats] = collections.deque(maxlen=HISTORY_KEPT)
        self.timeline: collections.deque[Span] = collections.deque(maxlen=TIMELINE_KEPT)
        self.host_s: dict[str, float] = {}
        self._totals = {"steps": 0.0, "P_enqueue": 0.0, "D_enqueue": 0.0}
        self._d_wait = 0.0  # P time accumulated while D rows were ready, since the last D
        self._step_t0 = 0.0
        self._d_rows = 0  # this step's D iteration (set by d_ran)
        self._d_wait_run = 0.0
        self._span = 0

    def begin_step(self) -> None:
        self._step_t0 = time.perf_counter()
        self._d_rows, self._d_wait_run, self._span = 0, 0.0, 0

    @contextmanager
    def clock(self, what: str) -> Iterator[None]:
        """Host time of one part of the step (exchange, plan, resolve), summed by name."""
        t = time.perf_counter()
        with _range(f"colo.{what}"):
            yield
        self.add_host(what, time.perf_counter() - t)

    def add_host(self, what: str, seconds: float) -> None:
        self.host_s[what] = self.host_s.get(what, 0.0) + seconds

    @contextmanager
    def phase(self, kind: str, epoch: int = -1) -> Iterator[Timed]:
        """One P segment or D iteration's host enqueue, appended to the timeline; the yielded
        ``Timed`` has its ``start``, and its ``end`` once the block exits."""
        timed = Timed(time.perf_counter())
        with _range(f"colo.{kind}"):
            yield timed
        timed.end = time.perf_counter()
        self.timeline.append(Span(kind, timed.start, timed.end, epoch))
        if kind in ("P", "D"):
            self._totals[f"{kind}_enqueue"] += timed.end - timed.start

    def held(self, seconds: float) -> None:
        """P host time during which ready D rows waited."""
        self._d_wait += seconds

    def d_ran(self, plan: StepPlan) -> None:
        """A D iteration ran: it waited for the P time accumulated since the previous one."""
        self._d_rows = sum(len(w.decode) for w in plan.replicas)
        self._d_wait_run, self._d_wait = self._d_wait, 0.0

    def span_set(self, span: int) -> None:
        self._span = span

    def end_step(self, plan: StepPlan, *, p_in_flight: bool, d_ready: int,
                 read_late: bool = False) -> None:
        rows = sum(w.prefill_tokens if plan.phase is Phase.PREFILL else len(w.decode)
                   for w in plan.replicas)
        seconds = time.perf_counter() - self._step_t0
        self._totals["steps"] += seconds
        self.history.append(StepStats(plan.step, plan.phase, rows, seconds,
                                      p_in_flight=p_in_flight, d_rows=self._d_rows,
                                      d_wait_s=self._d_wait_run, span=self._span,
                                      d_ready=d_ready, read_late=read_late))

    def host_seconds(self, rendezvous_s: float = 0.0) -> dict[str, float]:
        """Host time since the engine was made: the whole steps, their control exchange,
        planning, token resolve (waits for D's GPU work), the P and D enqueues, and the
        PreD/PostD rendezvous."""
        out = dict(self.host_s)
        out.update(self._totals)
        out["rendezvous"] = rendezvous_s
        return out


def _range(name: str):
    """A profiler range while a profiler runs, else nothing (the step's hot path)."""
    return (record_function(name) if autograd_profiler._is_profiler_enabled
            else nullcontext())
