"""Trajectory sessions in the scheduler (pure): validation, retention, eviction, closing."""

from __future__ import annotations

import pytest

from colo_rollout.config import EngineConfig
from colo_rollout.sched.plan import Phase
from colo_rollout.sched.request import Request, RequestError, SamplingParams
from colo_rollout.sched.scheduler import Sampled, Scheduler


def make(blocks: int = 32) -> Scheduler:
    cfg = EngineConfig(max_batch_size=4, max_prefill_tokens=64, kv_block_size=4,
                       num_kv_blocks=blocks, max_seq_len=64, decode_buckets=[1, 2, 4])
    return Scheduler(cfg, num_replicas=1, atp=1, vocab_size=50)


def run_turn(s: Scheduler, req: Request, token: int = 7) -> None:
    s.add(req)
    while req.request_id in s.live:
        plan = s.plan()
        items = plan.replicas[0].prefill if plan.phase is Phase.PREFILL else plan.replicas[0].decode
        s.commit(plan, [Sampled(i.lifetime, token, -0.5) for i in items])


def test_continuation_prefills_only_new_tokens_on_retained_context():
    s = make()
    run_turn(s, Request("t0", (1, 2, 3), SamplingParams(max_tokens=2), session="a"))
    sess = s.sessions["a"]
    assert sess.context == [1, 2, 3, 7, 7] and sess.cached == 4 and not sess.busy
    lt = sess.lifetime
    s.add(Request("t1", (9, 9), SamplingParams(max_tokens=1), session="a"))
    plan = s.plan()
    item = plan.replicas[0].prefill[0]
    assert item.lifetime == lt and item.start == 4 and item.tokens == (7, 9, 9)
    s.check_integrity()


def test_busy_session_and_context_budget_are_validated():
    s = make()
    s.add(Request("t0", (1, 2, 3), SamplingParams(max_tokens=2), session="a"))
    with pytest.raises(RequestError, match="session 'a' already has a turn"):
        s.add(Request("t1", (4,), session="a"))
    s2 = make()
    run_turn(s2, Request("t0", tuple(range(1, 31)), SamplingParams(max_tokens=30), session="b"))
    with pytest.raises(RequestError, match=r"context \(60\) \+ prompt \(1\) \+ max_tokens"):
        s2.add(Request("t1", (1,), SamplingParams(max_tokens=4), session="b"))

    # a close pending for the next step (applied before its submits): a turn of that
    # session is a new conversation (found by probing: checked against the closed context)
    s2.validate(Request("t1", tuple(range(1, 31)), SamplingParams(max_tokens=30),
                        session="b"), closing=["b"])


def test_eviction_frees_lru_context_and_forces_reprefill():
    s = make(blocks=6)  # 24 tokens of KV
    run_turn(s, Request("a0", (1, 2, 3, 4, 5), SamplingParams(max_tokens=3), session="a"))
    run_turn(s, Request("b0", (6, 7, 8, 9, 10), SamplingParams(max_tokens=3), session="b"))
    assert s.evictions == 0
    s.add(Request("c0", tuple(range(1, 13)), SamplingParams(max_tokens=4)))  # needs 4 blocks
    plan = s.plan()
    assert s.evictions >= 1 and s.sessions["a"].lifetime is None  # LRU: a went first
    assert plan.phase is Phase.PREFILL
    s.commit(plan, [Sampled(i.lifetime, 7, 0.0) for i in plan.replicas[0].prefill])
    s.check_integrity()
    s.add(Request("a1", (11,), SamplingParams(max_tokens=1), session="a"))
    while s.seqs:
        p = s.plan()
        items = p.replicas[0].prefill if p.phase is Phase.PREFILL else p.replicas[0].decode
        if p.phase is Phase.PREFILL and any(i.tokens[-1] == 11 for i in items):
            item = next(i for i in items if i.tokens[-1] == 11)
            assert item.start == 0 and item.tokens == (1, 2, 3, 4, 5, 7, 7, 7, 11)  # re-prefill
            assert item.ids is None  # (converted in the P step: see PrefillItem.ids)
        s.commit(p, [Sampled(i.lifetime, 7, 0.0) for i in items])
    s.check_integrity()


def test_close_session_frees_and_rejects_bad_closes():
    s = make()
    run_turn(s, Request("t0", (1, 2), SamplingParams(max_tokens=1), session="a"))
    with pytest.raises(RequestError, match="unknown session 'zz'"):
        s.close_session("zz")
    s.close_session("a")
    assert "a" not in s.sessions
    s.kv[0].assert_empty()
    s.add(Request("t1", (1,), SamplingParams(max_tokens=1), session="x"))
    with pytest.raises(RequestError, match="while a turn is in flight"):
        s.close_session("x")


def test_cancelled_turn_ends_its_trajectory():
    s = make()
    run_turn(s, Request("t0", (1, 2), SamplingParams(max_tokens=1), session="a"))
    s.add(Request("t1", (3,), SamplingParams(max_tokens=5), session="a"))
    plan = s.plan()
    s.commit(plan, [Sampled(i.lifetime, 7, 0.0) for i in plan.replicas[0].prefill])
    s.cancel("t1")
    assert "a" not in s.sessions
    s.kv[0].assert_empty()


def test_cancelled_waiting_continuation_frees_the_retained_context():
    s = make()
    run_turn(s, Request("t0", (1, 2), SamplingParams(max_tokens=1), session="a"))
    s.add(Request("t1", (3,), SamplingParams(max_tokens=5), session="a"))  # waiting
    s.cancel("t1")
    assert "a" not in s.sessions
    s.kv[0].assert_empty()


def test_fresh_prompts_carry_their_ids_and_continuations_their_tokens_only():
    """PrefillItem.ids: a fresh prompt's int64 array, converted at submit (the P step reads
    it instead of converting Python ints), a retained continuation's (its context tail + the
    prompt); a re-prefill of an evicted context carries none. The scheduler keeps no array
    once a request is admitted or cancelled."""
    import numpy as np

    s = make()
    s.add(Request("t0", (1, 2, 3, 4), SamplingParams(max_tokens=2), session="a"))
    s.add(Request("x", (9, 8), SamplingParams(max_tokens=2)))
    s.add(Request("gone", (5, 5, 5), SamplingParams(max_tokens=2)))
    s.cancel("gone")
    plan = s.plan()
    assert plan.phase is Phase.PREFILL
    fresh = plan.replicas[0].prefill
    assert [i.tokens for i in fresh] == [(1, 2, 3, 4), (9, 8)]
    for item in fresh:
        assert item.ids.dtype == np.int64 and item.ids.tolist() == list(item.tokens)
    assert s._prompt_ids == {}  # admitted or cancelled: nothing kept
    s.commit(plan, [Sampled(i.lifetime, 7, 0.0) for i in fresh])
    while s.seqs:
        p = s.plan()
        rows = p.replicas[0].prefill if p.phase is Phase.PREFILL else p.replicas[0].decode
        s.commit(p, [Sampled(i.lifetime, 7, 0.0) for i in rows])
    s.add(Request("t1", (11, 12), SamplingParams(max_tokens=1), session="a"))
    cont = s.plan().replicas[0].prefill
    assert len(cont) == 1 and cont[0].start > 0 and cont[0].tokens[-2:] == (11, 12)
    assert cont[0].ids.dtype == np.int64 and cont[0].ids.tolist() == list(cont[0].tokens)
    assert s._prompt_ids == {}
