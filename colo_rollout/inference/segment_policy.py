"""Segment policy: how many boundary intervals (span K) a P epoch may advance per turnstile round.

Pure Python. Small K lets D in sooner (less D wait) but costs a rendezvous pair per K boundaries
and more P wait-for-permit; large K amortises control overhead but holds D back longer.

  * ``FixedSpan(K)``: always K.
  * ``LoadSelectedSpan``: picks among validated spans from current D occupancy (running D rows /
    D capacity) and P pressure (pending P tokens / P token budget). Heavy D and light P -> the
    smallest span (protect decode); light D and heavy P -> the largest (finish prefill, nobody is
    waiting); otherwise the middle candidate. Every rank must feed it the same (rank-shared)
    numbers, so every rank picks the same K.
"""

from __future__ import annotations

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
