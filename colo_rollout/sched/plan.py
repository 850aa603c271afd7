"""The typed hand-off from scheduler to runner: one ``StepPlan`` per engine iteration.

Every rank computes the same plan from the same replicated scheduler state (the control plane
makes the inputs identical), so the plan itself never travels; ``digest()`` lets tests and the
debug check compare plans across ranks cheaply.

Self-contained: the scheduler fills in each item's KV block table and sampling parameters
(``Scheduler.plan``), so the runner needs nothing else -- it never reads the scheduler, and it
can be driven by hand-built plans. The planner leaves them empty (it decides who runs, not
where their blocks are); they do not take part in equality.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


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
    table: tuple[int, ...] = field(default=(), compare=False)  # its KV blocks (reserved)
    params: Any = field(default=None, compare=False)  # its SamplingParams
    # ``tokens`` as an int64 numpy array where the scheduler has them (a fresh prompt's,
    # converted at submit; a retained continuation's context tail + prompt), else None (a
    # re-prefill of an evicted context): the P step's index arrays take it as it is instead
    # of converting Python ints on the step's critical path (worker/runner.prefill_index).
    # Equal to tokens.
    ids: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class DecodeRow:
    lifetime: int
    token: int  # input token (the last sampled one)
    position: int  # its absolute position
    table: tuple[int, ...] = field(default=(), compare=False)  # its KV blocks
    params: Any = field(default=None, compare=False)  # its SamplingParams
    # engine.mtp: the MTP layer's draft of the token after ``token`` (verified at position + 1
    # in this iteration; the KV reservation covers it: prompt + max_tokens); -1 without MTP
    draft: int = -1


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
    # the longest D block table over every replica (the same on every rank: it picks the D
    # graph, and graph choice must agree)
    table_blocks: int = 1

    @property
    def has_decode(self) -> bool:
        return any(w.decode for w in self.replicas)

    @property
    def has_prefill(self) -> bool:
        return any(w.prefill for w in self.replicas)

    def digest(self) -> str:
        return hashlib.sha1(repr(self).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Sampled:
    """The tokens one lifetime got from one forward (from the replica leader, agreed by all
    ranks): ``token`` and, with MTP, the accepted draft's bonus tokens ``more`` ((token,
    logprob) in order) and the next ``draft`` (-1: none)."""

    lifetime: int
    token: int
    logprob: float
    more: tuple[tuple[int, float], ...] = ()
    draft: int = -1
