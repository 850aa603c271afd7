"""Segment policy: how many boundary intervals (span K) a P epoch may advance per turnstile round.

Pure Python. Small K lets D in sooner (less D wait) but costs a rendezvous pair per K boundaries
and more P wait-for-permit; large K amortises control overhead but holds D back longer.

  * ``FixedSpan(K)``: always K.
  * ``LoadSelectedSpan``: picks among validated spans from current D occupancy (running D rows /
    D capacity) and P pressure (pending P tokens / P token budget). Heavy D and light P -> the
    smallest span (protect decode); light D and heavy P -> the largest (finish prefill, nobody is
    waiting); otherwise the middle candidate. Every rank must feed it the same (rank-shared)
    numbers, so every rank picks the same K.
  * ``BalancedSpan``: K re-sized every round so that P's host enqueue of one segment lasts as
    long as the D iteration it runs behind (D first). Each rank reports what its last round
    measured -- P's enqueue time per boundary, and either how long it then waited for D's
    tokens (P could have done more) or how long P kept enqueuing after D's tokens were back
    (D was held) -- as the span that would have balanced it (``span_hint``); the hints travel
    in the control exchange, and every rank applies the same ``observe(min(hints))``. The
    minimum protects D on the slowest rank. Why: with graph-replayed D, a D iteration takes a
    few ms of GPU time while P's eager enqueue costs ~0.5-1 ms of host time per boundary, so a
    fixed K is either too small (P's epoch spreads over many rounds: TTFT) or too large (a
    ready D waits for P's Python: D wait); the right K depends on the model, the batch and
    the host, and moves during a run. The balancing span is fractional (1.8 boundaries of P
    per D iteration, say) while a round's K is whole: the rounds' spans carry the remainder,
    so their running mean tracks it (1, 2, 2, 2, 2, 1, ...) instead of rounding down every
    round -- which left P a boundary short of D's iteration and idled the host.
  * ``policy_for(engine config, boundaries)``: the policy ``engine.segment_policy`` names.
  * ``HeldClock``: the round's measurement behind the balanced span and the D-wait metric.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    d_rows: int  # ready D rows over all replicas
    d_capacity: int  # max D rows over all replicas (max_batch_size * ADP)
    p_tokens: int  # P tokens admitted or waiting over all replicas
    p_budget: int  # P token budget per step over all replicas

    @property
    def d_occupancy(self) -> float:
        return self.d_rows / self.d_capacity if self.d_capacity else 0.0

    @property
    def p_pressure(self) -> float:
        return self.p_tokens / self.p_budget if self.p_budget else 0.0


@dataclass(frozen=True)
class FixedSpan:
    span: int

    def __post_init__(self) -> None:
        if self.span < 1:
            raise ValueError(f"segment span must be >= 1, got {self.span}")

    def choose(self, load: Load) -> int:
        return self.span


@dataclass(frozen=True)
class LoadSelectedSpan:
    candidates: tuple[int, ...] = (1, 2, 4)  # validated spans, ascending
    busy_decode: float = 0.5  # D occupancy at or above which decode is "heavy"
    heavy_prefill: float = 1.0  # P pressure at or above which prefill is "heavy"

    def __post_init__(self) -> None:
        c = self.candidates
        if not c or any(k < 1 for k in c) or list(c) != sorted(set(c)):
            raise ValueError(f"candidates must be distinct ascending spans >= 1, got {c}")

    def choose(self, load: Load) -> int:
        c = self.candidates
        heavy_d = load.d_occupancy >= self.busy_decode
        heavy_p = load.p_pressure >= self.heavy_prefill
        if load.d_rows == 0:
            return c[-1]  # nobody to protect: let P run
        if heavy_d and not heavy_p:
            return c[0]
        if heavy_p and not heavy_d:
            return c[-1]
        return c[len(c) // 2]


def span_hint(span: int, boundaries: int, p_seconds: float, d_wait_s: float,
              d_held_s: float) -> float | None:
    """The span that would have balanced the last round on this rank, or None when the round
    says nothing about it. ``span``: the K it ran with; ``boundaries``/``p_seconds``: what P
    enqueued behind D and how long that took; ``d_wait_s``: host time then spent waiting for
    D's tokens (P stopped too early); ``d_held_s``: P time after D's tokens were back (P
    stopped too late). At most one of the two is non-zero."""
    if boundaries <= 0 or p_seconds <= 0.0:
        return None
    per = p_seconds / boundaries
    if d_held_s > 0.0:
        return span - d_held_s / per
    if d_wait_s > 0.0:
        return span + d_wait_s / per
    return None


@dataclass
class BalancedSpan:
    """Rank-agreed K from measured round outcomes (see the module docstring). Mutable state,
    identical on every rank as long as every rank observes the same agreed hints."""

    span: int = 2  # K of the next round
    max_span: int = 64  # no use beyond one epoch's boundaries
    target: float = 0.0  # the balancing span last agreed (fractional; 0 = none yet)
    carry: float = 0.0  # fraction of a boundary owed to the next round, in [0, 1)

    def __post_init__(self) -> None:
        if self.span < 1 or self.max_span < self.span:
            raise ValueError(f"need 1 <= span <= max_span, got span {self.span}, "
                             f"max_span {self.max_span}")

    def choose(self, load: Load) -> int:
        return self.span

    def observe(self, hints: list[float]) -> int:
        """Apply the round's agreed hints (every rank's, None where a rank had none): the
        target becomes the smallest hint within [1, max_span], and K the whole part of target
        plus the carried remainder (so successive Ks average the target); no hint keeps K."""
        got = [h for h in hints if h is not None]
        if got:
            self.target = max(1.0, min(float(self.max_span), min(got)))
            owed = self.carry + self.target
            k = int(owed + 1e-9)  # a float hair below a whole number is that number
            self.carry = max(0.0, owed - k)
            self.span = max(1, min(self.max_span, k))
        return self.span


class HeldClock:
    """Called after each P boundary enqueued behind a D iteration (``pending``: D's tokens, with
    ``done()``): ``since`` is the last check at which D's tokens were still pending, so P time
    after it held a ready D back."""

    def __init__(self, pending, t0: float) -> None:
        self.pending, self.since, self.seen = pending, t0, False
        self.seen_at = t0  # the first check at which D's tokens were back

    def __call__(self) -> None:
        if not self.seen:
            now = time.perf_counter()
            if self.pending.done():
                self.seen, self.seen_at = True, now
            else:
                self.since = now

    def held(self, end: float) -> float:
        """The D-wait metric: from the last check D was pending (rounded up: conservative)."""
        self()
        return end - self.since if self.seen else 0.0

    def held_estimate(self, end: float) -> float:
        """For the balanced span: D came back somewhere between the two checks that bracket
        it; the midpoint is unbiased, where ``held`` over-counts by half a boundary on average
        and would pull K down every round."""
        self()
        return end - (self.since + self.seen_at) / 2 if self.seen else 0.0


def policy_for(engine, boundaries: int):
    """The segment policy ``engine.segment_policy`` names (``engine``: an EngineConfig);
    ``boundaries``: one P epoch's boundary count (the balanced span's ceiling)."""
    if engine.segment_policy == "load":
        return LoadSelectedSpan(tuple(engine.segment_spans))
    if engine.segment_policy == "balanced":
        return BalancedSpan(span=min(engine.segment_span, boundaries), max_span=boundaries)
    return FixedSpan(engine.segment_span)
