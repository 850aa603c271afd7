"""The typed hand-off from planner to runner: one ``StepPlan`` per engine iteration.

Every rank computes the same plan from the same replicated scheduler state (the control plane
makes the inputs identical), so the plan itself never travels; ``digest()`` lets tests and the
debug check compare plans across ranks cheaply.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum


class Phase(str, Enum):
    IDLE = "idle"  # nothing to run on any replica: no collective is issued
    PREFILL = "prefill"  # every rank runs P (replicas without P contribute zero rows)
    DECODE = "decode"  # every rank runs one D iteration (replicas without rows run padding)
    ROUND = "round"  # PD mode: one turnstile round -- D rows (if any) and, when ``prefill``
    #                  items are present, the start of a new P epoch advanced over later rounds


@dataclass(frozen=True)
class PrefillItem:
    lifetime: int  # KV owner id of this admission
    tokens: tuple[int, ...]  # new tokens to prefill
    start: int  # tokens already in the cache before this P (0 for a fresh prompt)


@dataclass(frozen=True)
class DecodeRow:
    lifetime: int
    token: int  # input token (the last sampled one)
    position: int  # its absolute position


@dataclass(frozen=True)
class ReplicaWork:
    prefill: tuple[PrefillItem, ...] = ()
    decode: tuple[DecodeRow, ...] = ()

    @property
    def prefill_tokens(self) -> int:
        return sum(len(p.tokens) for p in self.prefill)


@dataclass(frozen=True)
class StepPlan:
    step: int
    phase: Phase
    replicas: tuple[ReplicaWork, ...]
    bucket: int = 0  # D rows per replica after padding (multiple of ATP); 0 without D rows

    @property
    def has_decode(self) -> bool:
        return any(w.decode for w in self.replicas)

    @property
    def has_prefill(self) -> bool:
        return any(w.prefill for w in self.replicas)

    def digest(self) -> str:
        return hashlib.sha1(repr(self).encode()).hexdigest()[:16]
