"""Unit tests for colo_rollout.sched.planner (pure Python: no processes, no torch)."""

from __future__ import annotations

import copy
import math
import random

import pytest

from colo_rollout.sched.plan import DecodeRow, Phase, PrefillItem, ReplicaWork, StepPlan
from colo_rollout.sched.planner import (
    Admission,
    PlannerLimits,
    ReplicaView,
    WaitingView,
    admission_window,
    pick_bucket,
    plan_normal,
    plan_round,
)

BS = 4  # KV block size used throughout


def limits(max_batch_size: int = 4, max_prefill_tokens: int = 64,
           buckets: tuple[int, ...] = (1, 2, 4), atp: int = 1) -> PlannerLimits:
    return PlannerLimits(max_batch_size, max_prefill_tokens, buckets, atp)


def rows(first_lifetime: int, n: int, position: int = 10) -> list[DecodeRow]:
    return [DecodeRow(first_lifetime + i, token=7 + i, position=position + i) for i in range(n)]


def replica(running: list[DecodeRow] | None = None, free_blocks: int = 100,
            prefill_ready: list[PrefillItem] | None = None) -> ReplicaView:
    return ReplicaView(running=list(running or []), free_blocks=free_blocks, block_size=BS,
                       prefill_ready=list(prefill_ready or []))


def waiting(rid: str, prompt_len: int, max_tokens: int = 1) -> WaitingView:
    prompt = tuple(range(1, prompt_len + 1))
    return WaitingView(rid, prompt, prompt_len + max_tokens)


def admitted_to(admissions: list[Admission]) -> dict[str, int]:
    return {a.request_id: a.replica for a in admissions}


# --------------------------------------------------------------------------- phases


def test_admitted_prefill_makes_whole_step_prefill_and_drops_decode_rows() -> None:
    reps = [replica(running=rows(100, 3)), replica(running=rows(200, 1))]
    w = [waiting("a", 5)]
    plan, adm = plan_normal(7, w, reps, limits(), next_lifetime=300)
    assert plan.phase is Phase.PREFILL
    assert plan.step == 7
    assert plan.bucket == 0
    # Admission goes to replica 1 (fewer sequences); replica 0 has running D rows but they
    # are NOT part of a PREFILL plan (strict P priority, no multiplexing).
    assert adm == [Admission("a", 1, 300)]
    assert plan.replicas[0] == ReplicaWork()
    assert plan.replicas[1].decode == ()
    assert plan.replicas[1].prefill == (PrefillItem(300, w[0].prompt, 0),)
    assert all(r.decode == () for r in plan.replicas)


def test_pending_prefill_on_one_replica_makes_step_prefill() -> None:
    pending = PrefillItem(lifetime=5, tokens=(1, 2, 3), start=0)
    reps = [replica(running=rows(10, 2)), replica(prefill_ready=[pending]),
            replica(running=rows(20, 4))]
    plan, adm = plan_normal(0, [], reps, limits(), next_lifetime=50)
    assert adm == []
    assert plan.phase is Phase.PREFILL
    assert [r.prefill for r in plan.replicas] == [(), (pending,), ()]
    assert all(r.decode == () for r in plan.replicas)
    assert plan.replicas[1].prefill_tokens == 3


def test_decode_when_nothing_waiting() -> None:
    r0, r1 = rows(0, 3), rows(10, 1)
    reps = [replica(running=r0), replica(running=r1), replica()]
    plan, adm = plan_normal(3, [], reps, limits(), next_lifetime=20)
    assert adm == []
    assert plan.phase is Phase.DECODE
    assert [r.decode for r in plan.replicas] == [tuple(r0), tuple(r1), ()]
    assert all(r.prefill == () for r in plan.replicas)
    assert plan.bucket == 4  # largest replica has 3 rows -> bucket 4 of (1, 2, 4)


def test_decode_when_waiting_head_fits_nowhere() -> None:
    # The head needs 3 blocks; no replica has them. Running rows still decode.
    r0 = rows(0, 1)
    reps = [replica(running=r0, free_blocks=2), replica(free_blocks=2)]
    plan, adm = plan_normal(0, [waiting("big", 8, 4)], reps, limits(), next_lifetime=1)
    assert adm == []
    assert plan.phase is Phase.DECODE
    assert plan.replicas[0].decode == tuple(r0)
    assert plan.bucket == 1


def test_idle_when_nothing_to_do() -> None:
    reps = [replica(), replica()]
    plan, adm = plan_normal(4, [], reps, limits(), next_lifetime=0)
    assert adm == []
    assert plan.phase is Phase.IDLE
    assert plan.bucket == 0
    assert plan.replicas == (ReplicaWork(), ReplicaWork())


def test_idle_when_head_fits_nowhere_and_nothing_runs() -> None:
    reps = [replica(free_blocks=1), replica(free_blocks=0)]
    plan, adm = plan_normal(0, [waiting("x", 4, 4)], reps, limits(), next_lifetime=0)
    assert adm == []
    assert plan.phase is Phase.IDLE
    assert len(plan.replicas) == 2


# --------------------------------------------------------------------------- admission


def test_admission_to_fewest_sequences_ties_to_lowest_index() -> None:
    # loads 2, 1, 1: r1 (tie with r2, lower index) -> [2,2,1] -> r2 -> [2,2,2] -> r0 -> r1
    reps = [replica(running=rows(0, 2)), replica(running=rows(10, 1)), replica(running=rows(20, 1))]
    w = [waiting(f"q{i}", 2) for i in range(4)]
    _, adm = plan_normal(0, w, reps, limits(), next_lifetime=0)
    assert [a.replica for a in adm] == [1, 2, 0, 1]


def test_admission_all_empty_goes_round_robin_from_zero() -> None:
    reps = [replica() for _ in range(3)]
    w = [waiting(f"q{i}", 1) for i in range(6)]
    _, adm = plan_normal(0, w, reps, limits(), next_lifetime=0)
    assert [a.replica for a in adm] == [0, 1, 2, 0, 1, 2]


def test_prefill_ready_counts_as_sequences_for_balancing() -> None:
    pending = [PrefillItem(1, (1,), 0), PrefillItem(2, (1,), 0)]
    reps = [replica(prefill_ready=pending), replica(running=rows(10, 1))]
    _, adm = plan_normal(0, [waiting("a", 1)], reps, limits(), next_lifetime=3)
    assert adm == [Admission("a", 1, 3)]


def test_respects_max_batch_size() -> None:
    # max 2 rows per replica: r0 full, r1 has one free row -> only the first is admitted.
    reps = [replica(running=rows(0, 2)), replica(running=rows(10, 1))]
    w = [waiting(f"q{i}", 1) for i in range(3)]
    plan, adm = plan_normal(0, w, reps, limits(max_batch_size=2, buckets=(1, 2)), next_lifetime=0)
    assert [(a.request_id, a.replica) for a in adm] == [("q0", 1)]
    assert plan.phase is Phase.PREFILL
    per_replica = [len(r.running) + sum(1 for a in adm if a.replica == i)
                   for i, r in enumerate(reps)]
    assert max(per_replica) <= 2


def test_full_replica_is_skipped_for_the_next_least_loaded() -> None:
    # r0 has 0 rows but no KV; r1 has 1 row; r2 has 1 row -> r1 (lowest index among the rest)
    reps = [replica(free_blocks=0), replica(running=rows(0, 1)), replica(running=rows(5, 1))]
    _, adm = plan_normal(0, [waiting("a", 3)], reps, limits(), next_lifetime=0)
    assert adm == [Admission("a", 1, 0)]


def test_respects_max_prefill_tokens_per_replica_per_step() -> None:
    lim = limits(max_prefill_tokens=10)
    # one replica: 4 + 4 = 8 fits, + 4 = 12 does not
    _, adm = plan_normal(0, [waiting(f"q{i}", 4) for i in range(3)], [replica()], lim, 0)
    assert [a.request_id for a in adm] == ["q0", "q1"]
    # exact fit (<=) is allowed
    _, adm = plan_normal(0, [waiting("a", 6), waiting("b", 4)], [replica()], lim, 0)
    assert [a.request_id for a in adm] == ["a", "b"]
    # two replicas: 6 -> r0, 6 -> r1, third 6 fits on neither (12 > 10)
    _, adm = plan_normal(0, [waiting(f"q{i}", 6) for i in range(3)], [replica(), replica()], lim, 0)
    assert [(a.request_id, a.replica) for a in adm] == [("q0", 0), ("q1", 1)]


def test_max_prefill_tokens_counts_pending_prefill() -> None:
    pending = PrefillItem(1, tuple(range(8)), 0)
    reps = [replica(prefill_ready=[pending]), replica(running=rows(10, 2))]
    # r0 has fewer sequences (1 < 2) but 8 + 3 > 10 P tokens, so r1 takes it
    _, adm = plan_normal(0, [waiting("a", 3)], reps, limits(max_prefill_tokens=10), 2)
    assert adm == [Admission("a", 1, 2)]


@pytest.mark.parametrize("prompt_len,max_tokens,free,fits", [
    (5, 7, 3, True),    # 12 tokens = 3 blocks of 4
    (5, 8, 3, False),   # 13 tokens = 4 blocks (ceil)
    (1, 1, 1, True),    # 2 tokens = 1 block
    (4, 4, 1, False),   # budget includes max_tokens, not only the prompt
    (3, 1, 0, False),
])
def test_kv_budget_is_prompt_plus_max_tokens_ceil_blocks(prompt_len: int, max_tokens: int,
                                                          free: int, fits: bool) -> None:
    assert (math.ceil((prompt_len + max_tokens) / BS) <= free) is fits  # the table itself
    reps = [replica(free_blocks=free), replica(free_blocks=free)]
    plan, adm = plan_normal(0, [waiting("a", prompt_len, max_tokens)], reps, limits(), 0)
    assert (len(adm) == 1) is fits
    assert plan.phase is (Phase.PREFILL if fits else Phase.IDLE)


def test_kv_free_blocks_are_consumed_across_admissions() -> None:
    # one replica with 5 free blocks; each request needs ceil(8/4) = 2 blocks: 2 fit, 3rd doesn't
    _, adm = plan_normal(0, [waiting(f"q{i}", 4, 4) for i in range(3)],
                         [replica(free_blocks=5)], limits(), 0)
    assert [a.request_id for a in adm] == ["q0", "q1"]
    # two replicas with 3 free blocks each: 2 + 2 blocks cannot share one replica
    _, adm = plan_normal(0, [waiting(f"q{i}", 4, 4) for i in range(3)],
                         [replica(free_blocks=3), replica(free_blocks=3)], limits(), 0)
    assert [(a.request_id, a.replica) for a in adm] == [("q0", 0), ("q1", 1)]


def test_fifo_head_blocks_smaller_requests_behind_it() -> None:
    reps = [replica(free_blocks=2, running=rows(0, 1)), replica(free_blocks=2)]
    w = [waiting("big", 10, 10), waiting("small", 1, 1)]  # big needs 5 blocks, small 1
    plan, adm = plan_normal(0, w, reps, limits(), next_lifetime=9)
    assert adm == []
    assert plan.phase is Phase.DECODE  # no overtaking: the small one is not admitted


def test_fifo_admits_prefix_then_stops_at_first_misfit() -> None:
    reps = [replica(free_blocks=4)]
    w = [waiting("a", 2, 2), waiting("b", 20, 4), waiting("c", 1, 1)]
    _, adm = plan_normal(0, w, reps, limits(), next_lifetime=0)
    assert [a.request_id for a in adm] == ["a"]


@pytest.mark.parametrize("seed", range(40))
def test_a_plan_reads_no_waiting_request_past_the_admission_window(seed: int) -> None:
    """The scheduler views only the queue's first ``admission_window`` requests (a queue of a
    million made every step rebuild a million views): the plan and admissions on that prefix
    are the plan on the whole queue, in both modes -- random replicas (rows, pending P,
    awaiting, free blocks) and queues of every shape."""
    rng = random.Random(seed)
    lim = limits(max_batch_size=rng.randint(1, 5), max_prefill_tokens=rng.randint(4, 40))
    reps = []
    for r in range(rng.randint(1, 3)):
        reps.append(ReplicaView(running=rows(100 * r, rng.randint(0, 4)),
                                free_blocks=rng.randint(0, 30), block_size=BS,
                                prefill_ready=[PrefillItem(lifetime=900 + 10 * r + i,
                                                           tokens=(1, 2), start=0)
                                               for i in range(rng.randint(0, 2))],
                                awaiting=rng.randint(0, 1)))
    w = [waiting(f"w{i}", rng.randint(1, 12), rng.randint(1, 8))
         for i in range(rng.randint(0, 30))]
    window = admission_window(reps, lim)
    assert window >= 1
    for plan_fn in (lambda q: plan_normal(3, q, copy.deepcopy(reps), lim, next_lifetime=50),
                    lambda q: plan_round(3, q, copy.deepcopy(reps), lim, next_lifetime=50,
                                         admit=True)):
        whole, adm_whole = plan_fn(w)
        prefix, adm_prefix = plan_fn(w[:window])
        assert (prefix, adm_prefix) == (whole, adm_whole)
        assert len(adm_whole) < window  # the window holds every admission and one more


def test_lifetimes_consecutive_from_next_lifetime_and_items_match() -> None:
    pending = PrefillItem(3, (9, 9), 0)
    reps = [replica(prefill_ready=[pending]), replica()]
    w = [waiting(f"q{i}", i + 1) for i in range(5)]
    plan, adm = plan_normal(11, w, reps, limits(), next_lifetime=17)
    assert [a.lifetime for a in adm] == [17, 18, 19, 20, 21]
    assert [a.request_id for a in adm] == [x.request_id for x in w]
    prompt_of = {x.request_id: x.prompt for x in w}
    for r, work in enumerate(plan.replicas):
        mine = [a for a in adm if a.replica == r]
        new_items = [p for p in work.prefill if p != pending]
        # already-admitted P first, then this step's admissions in FIFO order
        if r == 0:
            assert work.prefill[0] == pending
        assert new_items == [PrefillItem(a.lifetime, prompt_of[a.request_id], 0) for a in mine]


def test_plan_normal_does_not_mutate_its_inputs() -> None:
    pending = PrefillItem(3, (9, 9), 0)
    reps = [replica(prefill_ready=[pending], running=rows(0, 1)), replica(running=rows(5, 2))]
    w = [waiting(f"q{i}", 3) for i in range(3)]
    before = copy.deepcopy((w, reps))
    plan_normal(0, w, reps, limits(), next_lifetime=10)
    assert (w, reps) == before


# --------------------------------------------------------------------------- buckets


@pytest.mark.parametrize("n,buckets,atp,expected", [
    (1, (1, 2, 4, 8), 1, 1),
    (2, (1, 2, 4, 8), 1, 2),
    (3, (1, 2, 4, 8), 1, 4),
    (5, (1, 2, 4, 8), 1, 8),
    (8, (1, 2, 4, 8), 1, 8),
    (1, (1, 2, 4, 8), 2, 2),
    (3, (1, 3, 6), 2, 4),   # bucket 3 -> next multiple of 2
    (4, (1, 3, 6), 2, 6),
    (1, (1, 2, 4, 8), 4, 4),
    (5, (1, 2, 4, 8), 4, 8),
    (2, (1, 3, 6), 4, 4),   # bucket 3 -> 4
    (4, (1, 3, 6), 4, 8),   # bucket 6 -> 8
])
def test_pick_bucket_table(n: int, buckets: tuple[int, ...], atp: int, expected: int) -> None:
    assert pick_bucket(n, buckets, atp) == expected


@pytest.mark.parametrize("atp", [1, 2, 4])
def test_pick_bucket_beyond_largest_bucket(atp: int) -> None:
    # Not reachable through the engine (largest bucket >= max_batch_size), but the result must
    # still hold every row and divide evenly across ATP ranks, with minimal padding.
    buckets = (1, 2, 4)
    for n in (5, 7, 9, 13):
        b = pick_bucket(n, buckets, atp)
        assert b >= n and b % atp == 0
        assert b - n < atp


@pytest.mark.parametrize("atp", [1, 2, 4])
def test_pick_bucket_matches_brute_force(atp: int) -> None:
    rng = random.Random(atp)
    for _ in range(200):
        buckets = tuple(sorted(rng.sample(range(1, 40), rng.randint(1, 6))))
        n = rng.randint(1, buckets[-1])
        # smallest candidate that is >= n, where candidates are the buckets padded to ATP
        brute = min(-(-b // atp) * atp for b in buckets if b >= n)
        assert pick_bucket(n, buckets, atp) == brute


@pytest.mark.parametrize("atp,counts,expected", [
    (1, (3, 1), 4),
    (2, (1, 1), 2),
    (4, (1, 0), 4),
    (2, (2, 3), 4),
])
def test_decode_plan_bucket_uses_largest_replica_and_atp(atp: int, counts: tuple[int, int],
                                                         expected: int) -> None:
    reps = [replica(running=rows(100 * i, c)) for i, c in enumerate(counts)]
    plan, _ = plan_normal(0, [], reps, limits(buckets=(1, 2, 4), atp=atp), 0)
    assert plan.phase is Phase.DECODE
    assert plan.bucket == expected
    assert plan.bucket >= max(counts) and plan.bucket % atp == 0


# --------------------------------------------------------------------------- determinism


def _scenario() -> tuple[list[WaitingView], list[ReplicaView]]:
    rng = random.Random(42)
    reps = [replica(running=rows(100 * i, rng.randint(0, 3)), free_blocks=rng.randint(2, 12))
            for i in range(3)]
    w = [waiting(f"r{i}", rng.randint(1, 12), rng.randint(1, 6)) for i in range(8)]
    return w, reps


def test_same_inputs_give_equal_plans_and_digests() -> None:
    w1, r1 = _scenario()
    w2, r2 = _scenario()
    p1, a1 = plan_normal(5, w1, r1, limits(), next_lifetime=40)
    p2, a2 = plan_normal(5, w2, r2, limits(), next_lifetime=40)
    assert p1 == p2 and a1 == a2
    assert p1.digest() == p2.digest()
    # and the digest distinguishes different plans
    p3, _ = plan_normal(6, w1, r1, limits(), next_lifetime=40)
    assert p3.digest() != p1.digest()
    p4, _ = plan_normal(5, w1, r1, limits(), next_lifetime=41)
    assert p4 != p1 and p4.digest() != p1.digest()


def test_digest_is_stable_for_equal_plans_built_separately() -> None:
    a = StepPlan(1, Phase.DECODE, (ReplicaWork(decode=(DecodeRow(1, 2, 3),)), ReplicaWork()), 1)
    b = StepPlan(1, Phase.DECODE, (ReplicaWork(decode=(DecodeRow(1, 2, 3),)), ReplicaWork()), 1)
    c = StepPlan(1, Phase.DECODE, (ReplicaWork(decode=(DecodeRow(1, 2, 4),)), ReplicaWork()), 1)
    assert a.digest() == b.digest()
    assert a.digest() != c.digest()
