"""Rank-shared planner (Normal mode): decides each iteration's phase, D rows and P admissions.

Pure function of the replicated scheduler state -- no clocks, no randomness, no torch -- so
every rank derives the same ``StepPlan`` from the same state.

Policy (Normal = strict P priority, no multiplexing):
  1. Admission: the global FIFO of waiting requests is offered, head first, to the replica with
     the fewest sequences (ties -> lowest index) that has a free batch row, P token budget left
     this step and KV blocks for the request's whole budget (prompt + max_tokens: admitted work
     is never preempted). The head blocks the queue when no replica can take it (no overtaking,
     so no starvation).
  2. If any replica has P (newly admitted or pending continuation), the step is PREFILL on every
     rank; replicas without P contribute zero rows to the collectives.
  3. Otherwise, if any replica has running rows, the step is DECODE with one bucket for all
     replicas (the smallest configured bucket >= the largest replica's rows, rounded up to a
     multiple of ATP so the ATP ReduceScatter divides evenly); otherwise IDLE.

PD mode (``plan_round``): D rows are committed first, every round; a new P epoch is admitted
into the remaining rows/budget/KV only when no epoch is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from colo_rollout.sched.plan import DecodeRow, Phase, PrefillItem, ReplicaWork, StepPlan


@dataclass
class WaitingView:
    request_id: str
    prompt: tuple[int, ...]  # the tokens this P must prefill
    budget_tokens: int  # start + prompt + max_tokens: what its reservation must hold in total
    start: int = 0  # tokens already in this sequence's KV (a retained trajectory context)
    replica: int | None = None  # a retained context pins the continuation to its replica
    lifetime: int | None = None  # the retained context's KV owner (kept across turns)
    held_blocks: int = 0  # blocks that owner already holds
    ids: Any = None  # ``prompt`` as an int64 array, when converted at submit (PrefillItem.ids)


@dataclass
class ReplicaView:
    running: list[DecodeRow]  # D rows ready this step, in admission order
    free_blocks: int
    block_size: int
    prefill_ready: list[PrefillItem] = field(default_factory=list)  # already admitted P
    # admitted sequences whose P ran but whose first token is not committed yet (a P step
    # read one step late: engine.overlap_prefill): batch rows they hold, not yet D rows
    awaiting: int = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


@dataclass(frozen=True)
class Admission:
    request_id: str
    replica: int
    lifetime: int
    new: bool = True  # False: a continuation growing its retained reservation


@dataclass(frozen=True)
class PlannerLimits:
    max_batch_size: int  # D rows per replica
    max_prefill_tokens: int  # P tokens per replica per step
    decode_buckets: tuple[int, ...]
    atp: int


def pick_bucket(rows: int, buckets: tuple[int, ...], atp: int) -> int:
    b = next((x for x in buckets if x >= rows), rows)
    return -(-b // atp) * atp


def _admit(waiting: list[WaitingView], replicas: list[ReplicaView], limits: PlannerLimits,
           next_lifetime: int) -> tuple[list[list[PrefillItem]], list[Admission]]:
    """FIFO admission into the batch rows, P budget and KV blocks left after D (D goes first:
    running rows already count against ``max_batch_size``)."""
    n = len(replicas)
    rows = [len(r.running) + len(r.prefill_ready) + r.awaiting for r in replicas]
    p_tokens = [sum(len(p.tokens) for p in r.prefill_ready) for r in replicas]
    free = [r.free_blocks for r in replicas]
    prefill: list[list[PrefillItem]] = [list(r.prefill_ready) for r in replicas]
    admissions: list[Admission] = []
    fresh = 0
    for w in waiting:
        choice = None
        candidates = [w.replica] if w.replica is not None else sorted(
            range(n), key=lambda i: (rows[i], i))
        for i in candidates:
            r = replicas[i]
            if (rows[i] < limits.max_batch_size
                    and p_tokens[i] + len(w.prompt) <= limits.max_prefill_tokens
                    and r.blocks_for(w.budget_tokens) - w.held_blocks <= free[i]):
                choice = i
                break
        if choice is None:
            break  # FIFO head blocks: no overtaking
        if w.lifetime is None:
            lifetime, new = next_lifetime + fresh, True
            fresh += 1
        else:
            lifetime, new = w.lifetime, False
        admissions.append(Admission(w.request_id, choice, lifetime, new))
        prefill[choice].append(PrefillItem(lifetime=lifetime, tokens=w.prompt, start=w.start,
                                           ids=w.ids))
        rows[choice] += 1
        p_tokens[choice] += len(w.prompt)
        free[choice] -= replicas[choice].blocks_for(w.budget_tokens) - w.held_blocks
    return prefill, admissions


def admission_window(replicas: list[ReplicaView], limits: PlannerLimits) -> int:
    """How many of the waiting queue's first requests a plan can look at: each admission
    takes a free batch row and FIFO admission stops at the first that fits nowhere, so past
    the free rows (and the one that would stop it) no request is read. A plan built on the
    queue's first ``admission_window`` views is the plan built on all of them -- the
    scheduler need not view a queue of millions every step."""
    rows = (len(r.running) + len(r.prefill_ready) + r.awaiting for r in replicas)
    return sum(max(0, limits.max_batch_size - n) for n in rows) + 1


def admits(head: WaitingView, replicas: list[ReplicaView], limits: PlannerLimits) -> bool:
    """Whether a plan on these replicas would admit ``head`` (the FIFO's head): the
    admission rule itself, on a head alone."""
    return bool(_admit([head], replicas, limits, 0)[1])


def _decode_bucket(replicas: list[ReplicaView], limits: PlannerLimits) -> int:
    most = max(len(r.running) for r in replicas)
    return pick_bucket(most, limits.decode_buckets, limits.atp) if most else 0


def plan_normal(step: int, waiting: list[WaitingView], replicas: list[ReplicaView],
                limits: PlannerLimits, next_lifetime: int) -> tuple[StepPlan, list[Admission]]:
    prefill, admissions = _admit(waiting, replicas, limits, next_lifetime)
    if any(prefill):
        work = tuple(ReplicaWork(prefill=tuple(p)) for p in prefill)
        return StepPlan(step=step, phase=Phase.PREFILL, replicas=work), admissions
    if any(r.running for r in replicas):
        work = tuple(ReplicaWork(decode=tuple(r.running)) for r in replicas)
        return StepPlan(step=step, phase=Phase.DECODE, replicas=work,
                        bucket=_decode_bucket(replicas, limits)), admissions
    return StepPlan(step=step, phase=Phase.IDLE, replicas=tuple(ReplicaWork() for _ in replicas)), admissions


def plan_round(step: int, waiting: list[WaitingView], replicas: list[ReplicaView],
               limits: PlannerLimits, next_lifetime: int,
               admit: bool) -> tuple[StepPlan, list[Admission]]:
    """PD mode, one turnstile round: every ready D row (D first), plus -- when no P epoch is in
    flight (``admit``) -- a new P epoch admitted into what is left. ROUND plans carry both; the
    P items start an epoch that later rounds advance segment by segment."""
    if admit:
        prefill, admissions = _admit(waiting, replicas, limits, next_lifetime)
    else:
        prefill, admissions = [[] for _ in replicas], []
    if not any(prefill) and not any(r.running for r in replicas):
        return StepPlan(step=step, phase=Phase.IDLE,
                        replicas=tuple(ReplicaWork() for _ in replicas)), admissions
    work = tuple(ReplicaWork(prefill=tuple(p), decode=tuple(r.running))
                 for p, r in zip(prefill, replicas))
    return StepPlan(step=step, phase=Phase.ROUND, replicas=work,
                    bucket=_decode_bucket(replicas, limits)), admissions
