"""Unit tests for colo_rollout.sched.scheduler (pure Python: no processes, no torch)."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque

import pytest

from colo_rollout.config import EngineConfig
from colo_rollout.sched.plan import DecodeRow, Phase, PrefillItem, StepPlan
from colo_rollout.sched.request import FinishReason, Request, RequestError, SamplingParams
from colo_rollout.sched.plan import Sampled
from colo_rollout.sched.scheduler import Scheduler

VOCAB = 50
EOS = 3
BS = 4
NUM_BLOCKS = 32


def engine_cfg(**overrides) -> EngineConfig:
    # full reservations: these tests count prompt + max_tokens blocks per admission
    # (engine.kv_reservation on_demand: tests/test_kv_on_demand.py)
    kw = dict(max_batch_size=4, max_prefill_tokens=64, kv_block_size=BS, num_kv_blocks=NUM_BLOCKS,
              max_seq_len=64, decode_buckets=[1, 2, 4], eos_token_id=EOS, kv_reservation="full")
    kw.update(overrides)
    return EngineConfig(**kw)


def make(cfg: EngineConfig | None = None, replicas: int = 2, atp: int = 1) -> Scheduler:
    return Scheduler(cfg or engine_cfg(), replicas, atp, VOCAB)


def req(rid: str, prompt_len: int = 5, max_tokens: int = 4, *, first: int = 10,
        **params) -> Request:
    prompt = tuple((first + i) % VOCAB for i in range(prompt_len))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params))


def blocks(tokens: int) -> int:
    return math.ceil(tokens / BS)


def items(plan: StepPlan) -> list:
    out = []
    for work in plan.replicas:
        out.extend(work.prefill if plan.phase is Phase.PREFILL else work.decode)
    return out


def assert_all_empty(s: Scheduler) -> None:
    s.check_integrity()
    for kv in s.kv:
        kv.assert_empty()


# --------------------------------------------------------------------------- validation


def _bad_requests():
    p = (1, 2, 3)
    return [
        ("empty prompt", Request("r-empty", ()), ["empty prompt"]),
        ("token >= vocab", Request("r-oov", (1, VOCAB, 2)), [str(VOCAB), "vocabulary"]),
        ("negative token", Request("r-neg", (1, -1)), ["-1", "vocabulary"]),
        ("bool token", Request("r-bool", (1, True)), ["True", "is a bool, not an integer id"]),
        ("float token", Request("r-float", (1, 2.0)), ["2.0", "is a float, not an integer id"]),
        ("too long", Request("r-long", tuple(range(1, 41)), SamplingParams(max_tokens=25)),
         ["40", "25", "65", "max_seq_len"]),
        ("temperature<0", Request("r-t", p, SamplingParams(temperature=-0.5)), ["temperature"]),
        ("temperature nan", Request("r-tn", p, SamplingParams(temperature=float("nan"))),
         ["temperature"]),
        ("temperature inf", Request("r-ti", p, SamplingParams(temperature=float("inf"))),
         ["temperature"]),
        ("top_k<0", Request("r-k", p, SamplingParams(top_k=-1)), ["top_k"]),
        ("top_k>vocab", Request("r-kv", p, SamplingParams(top_k=VOCAB + 1)), ["top_k", str(VOCAB)]),
        ("top_p 0", Request("r-p0", p, SamplingParams(top_p=0.0)), ["top_p"]),
        ("top_p 1.5", Request("r-p15", p, SamplingParams(top_p=1.5)), ["top_p"]),
        ("top_p nan", Request("r-pn", p, SamplingParams(top_p=float("nan"))), ["top_p"]),
        ("max_tokens 0", Request("r-m0", p, SamplingParams(max_tokens=0)), ["max_tokens"]),
        ("max_tokens bool", Request("r-mb", p, SamplingParams(max_tokens=True)), ["max_tokens"]),
        ("max_tokens float", Request("r-mf", p, SamplingParams(max_tokens=2.0)), ["max_tokens"]),
    ]


@pytest.mark.parametrize("label,request_,fragments", _bad_requests(), ids=lambda x: x
                         if isinstance(x, str) else "")
def test_invalid_request_is_rejected_naming_id_and_problem(label: str, request_: Request,
                                                           fragments: list[str]) -> None:
    s = make()
    with pytest.raises(RequestError) as ei:
        s.add(request_)
    msg = str(ei.value)
    assert repr(request_.request_id) in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)
    # a rejected request leaves no trace: the id is reusable, nothing is queued
    assert not s.has_work()
    s.add(Request(request_.request_id, (1, 2), SamplingParams(max_tokens=1)))
    assert s.has_work()


@pytest.mark.parametrize("rid", ["", 7, None])
def test_bad_request_id_is_rejected(rid) -> None:
    s = make()
    with pytest.raises(RequestError, match=r"request id must be a non-empty string, got " + repr(rid)):
        s.add(Request(rid, (1, 2)))
    assert not s.has_work()


def test_valid_boundaries_are_accepted() -> None:
    s = make()
    s.add(Request("max-seq", tuple(1 + i % 40 for i in range(60)), SamplingParams(max_tokens=4)))  # 64 == cap
    s.add(Request("top-k-vocab", (1,), SamplingParams(top_k=VOCAB, top_p=1.0, temperature=0.0)))
    s.add(Request("tok-range", (0, VOCAB - 1)))
    s.add(Request("top-p-tiny", (1,), SamplingParams(top_p=1e-6, temperature=2.0)))
    assert list(s.live) == ["max-seq", "top-k-vocab", "tok-range", "top-p-tiny"]


def test_prompt_longer_than_max_prefill_tokens_is_rejected() -> None:
    s = make(engine_cfg(max_prefill_tokens=16, max_seq_len=128, num_kv_blocks=64))
    with pytest.raises(RequestError, match=r"'p17'.*17 tokens.*max_prefill_tokens 16"):
        s.add(Request("p17", tuple(range(1, 18)), SamplingParams(max_tokens=1)))
    s.add(Request("p16", tuple(range(1, 17)), SamplingParams(max_tokens=40)))  # exactly 16 ok


def test_budget_needing_more_kv_blocks_than_a_replica_has_is_rejected() -> None:
    # max_seq_len allows 20 tokens, but a replica only has 4 blocks * 4 = 16 tokens
    s = make(engine_cfg(num_kv_blocks=4))
    with pytest.raises(RequestError, match=r"'kv-big'.*needs 5 KV blocks.*has 4"):
        s.add(Request("kv-big", tuple(range(1, 11)), SamplingParams(max_tokens=10)))
    s.add(Request("kv-fit", tuple(range(1, 11)), SamplingParams(max_tokens=6)))  # 16 -> 4 blocks
    plan = s.plan()
    assert plan.phase is Phase.PREFILL
    assert s.kv[0].num_free_blocks() == 0


def test_duplicate_id_rejected_while_live_and_after_finish() -> None:
    s = make()
    s.add(req("dup", max_tokens=1))
    with pytest.raises(RequestError, match=r"'dup'.*duplicate"):
        s.add(req("dup"))
    plan = s.plan()
    (item,) = items(plan)
    done = s.commit(plan, [Sampled(item.lifetime, 20, -1.0)])
    assert [o.request_id for o in done] == ["dup"]
    assert s.by_id["dup"].finished
    with pytest.raises(RequestError, match=r"'dup'.*duplicate"):
        s.add(req("dup"))
    # ... and after a cancel
    s.add(req("dup2"))
    s.cancel("dup2")
    with pytest.raises(RequestError, match=r"'dup2'.*duplicate"):
        s.add(req("dup2"))


def test_cancel_unknown_and_finished_ids_raise_distinct_errors() -> None:
    s = make()
    with pytest.raises(RequestError) as unknown:
        s.cancel("nope")
    s.add(req("done", max_tokens=1))
    plan = s.plan()
    s.commit(plan, [Sampled(items(plan)[0].lifetime, 20, 0.0)])
    with pytest.raises(RequestError) as finished:
        s.cancel("done")
    s.add(req("cx"))
    s.cancel("cx")
    with pytest.raises(RequestError) as cancelled_twice:
        s.cancel("cx")
    assert "'nope'" in str(unknown.value) and "unknown" in str(unknown.value)
    assert "'done'" in str(finished.value) and "finished" in str(finished.value)
    assert "'cx'" in str(cancelled_twice.value) and "finished" in str(cancelled_twice.value)
    assert str(unknown.value).replace("nope", "X") != str(finished.value).replace("done", "X")
    assert s.by_id["done"].finish_reason is FinishReason.LENGTH  # unchanged by the failed cancel


# --------------------------------------------------------------------------- lifecycle


def test_full_lifecycle_by_hand_to_length() -> None:
    s = make()
    r = req("a", prompt_len=5, max_tokens=4)
    s.add(r, now=1.0)
    assert s.has_work()

    plan = s.plan()
    assert plan.phase is Phase.PREFILL and plan.step == 0
    assert plan.replicas[0].prefill == (PrefillItem(lifetime=0, tokens=r.prompt, start=0),)
    assert plan.replicas[1].prefill == ()
    # admission reserved the whole budget: ceil((5 + 4) / 4) = 3 blocks, lowest ids first
    assert s.block_table(0, 0) == [0, 1, 2]
    assert s.kv[0].num_free_blocks() == NUM_BLOCKS - blocks(5 + 4)
    assert s.kv[1].num_free_blocks() == NUM_BLOCKS
    s.check_integrity()

    generated = [21, 22, 23, 24]
    logprobs = [-0.1, -0.2, -0.3, -0.4]
    assert s.commit(plan, [Sampled(0, generated[0], logprobs[0])], now=2.0) == []
    out = s.by_id["a"]
    assert out.tokens == generated[:1] and out.first_token_time == 2.0 and out.replica == 0
    for k in range(1, 4):
        plan = s.plan()
        assert plan.phase is Phase.DECODE and plan.step == k
        # input = the last sampled token at its absolute position (prompt length + k - 1)
        assert plan.replicas[0].decode == (DecodeRow(0, generated[k - 1], 5 + k - 1),)
        assert plan.replicas[1].decode == ()
        assert plan.bucket == 1
        assert s.block_table(0, 0) == [0, 1, 2]  # no growth: everything reserved up front
        done = s.commit(plan, [Sampled(0, generated[k], logprobs[k])], now=2.0 + k)
        s.check_integrity()
        assert done == ([] if k < 3 else [out])
    assert out.tokens == generated and out.logprobs == logprobs
    assert out.finish_reason is FinishReason.LENGTH and out.finish_time == 5.0
    assert out.prompt_len == 5 and out.submit_time == 1.0
    assert_all_empty(s)
    assert not s.has_work()
    assert s.plan().phase is Phase.IDLE


def test_two_requests_spread_over_replicas_and_decode_together() -> None:
    s = make()
    s.add(req("a", 3, 2))
    s.add(req("b", 6, 3))
    plan = s.plan()
    assert plan.phase is Phase.PREFILL
    assert [len(w.prefill) for w in plan.replicas] == [1, 1]
    assert (s.by_id["a"].replica, s.by_id["b"].replica) == (0, 1)  # fewest sequences
    assert s.block_table(0, 0) == list(range(blocks(5)))
    assert s.block_table(1, 1) == list(range(blocks(9)))
    s.commit(plan, [Sampled(0, 30, 0.0), Sampled(1, 31, 0.0)])
    plan = s.plan()
    assert plan.phase is Phase.DECODE
    assert plan.replicas[0].decode == (DecodeRow(0, 30, 3),)
    assert plan.replicas[1].decode == (DecodeRow(1, 31, 6),)
    done = s.commit(plan, [Sampled(0, 32, 0.0), Sampled(1, 33, 0.0)])
    assert [o.request_id for o in done] == ["a"]
    assert s.kv[0].num_free_blocks() == NUM_BLOCKS
    plan = s.plan()
    assert plan.replicas[0].decode == () and plan.replicas[1].decode == (DecodeRow(1, 33, 7),)
    done = s.commit(plan, [Sampled(1, 34, 0.0)])
    assert [o.request_id for o in done] == ["b"]
    assert s.by_id["b"].tokens == [31, 33, 34]
    assert_all_empty(s)


def test_waiting_request_admitted_as_prefill_preempts_decode_step() -> None:
    s = make()
    s.add(req("a", 3, 5))
    p = s.plan()
    s.commit(p, [Sampled(0, 20, 0.0)])
    s.add(req("b", 2, 5))
    p = s.plan()
    assert p.phase is Phase.PREFILL  # strict P priority: a's D row waits this step
    assert all(w.decode == () for w in p.replicas)
    assert p.replicas[1].prefill == (PrefillItem(1, req("b", 2, 5).prompt, 0),)
    s.commit(p, [Sampled(1, 21, 0.0)])
    assert s.by_id["a"].tokens == [20]  # untouched by the P step
    p = s.plan()
    assert p.phase is Phase.DECODE
    assert p.replicas[0].decode == (DecodeRow(0, 20, 3),)
    assert p.replicas[1].decode == (DecodeRow(1, 21, 2),)


@pytest.mark.parametrize("at", [0, 2])
def test_eos_stops_with_stop(at: int) -> None:
    s = make()
    s.add(req("a", 4, 6))
    toks = [20, 21, 22, 23, 24, 25]
    toks[at] = EOS
    for k in range(at + 1):
        plan = s.plan()
        assert plan.phase is (Phase.PREFILL if k == 0 else Phase.DECODE)
        done = s.commit(plan, [Sampled(0, toks[k], -1.0)])
    assert [o.request_id for o in done] == ["a"]
    out = s.by_id["a"]
    assert out.finish_reason is FinishReason.STOP
    assert out.tokens == toks[: at + 1] and out.tokens[-1] == EOS
    assert_all_empty(s)


def test_ignore_eos_generates_exactly_max_tokens() -> None:
    s = make()
    s.add(req("a", 4, 3, ignore_eos=True))
    for k in range(3):
        plan = s.plan()
        done = s.commit(plan, [Sampled(0, EOS, -1.0)])
        assert (done != []) is (k == 2)
    out = s.by_id["a"]
    assert out.finish_reason is FinishReason.LENGTH and out.tokens == [EOS] * 3
    assert_all_empty(s)


def test_no_eos_configured_never_stops_on_token() -> None:
    s = make(engine_cfg(eos_token_id=None))
    s.add(req("a", 4, 2))
    for _ in range(2):
        s.commit(s.plan(), [Sampled(0, EOS, -1.0)])
    assert s.by_id["a"].finish_reason is FinishReason.LENGTH


# --------------------------------------------------------------------------- cancel


def test_cancel_waiting_request() -> None:
    s = make()
    s.add(req("a"))
    s.add(req("b", 3, 2))
    out = s.cancel("a", now=4.0)
    assert out.finish_reason is FinishReason.CANCELLED and out.finish_time == 4.0
    assert out.tokens == []
    plan = s.plan()
    # only b is admitted, with the first lifetime
    assert [it.lifetime for it in items(plan)] == [0]
    assert plan.replicas[0].prefill[0].tokens == req("b", 3, 2).prompt
    s.check_integrity()
    s.cancel("b")
    assert_all_empty(s)
    assert not s.has_work()


def test_cancel_running_frees_kv_and_later_result_is_stale() -> None:
    s = make()
    s.add(req("a", 5, 8))
    s.add(req("b", 5, 8))
    s.commit(s.plan(), [Sampled(0, 20, 0.0), Sampled(1, 21, 0.0)])
    plan = s.plan()
    assert plan.phase is Phase.DECODE
    out = s.cancel("a")  # cancelled while its D step "runs"
    assert out.finish_reason is FinishReason.CANCELLED
    assert s.kv[0].num_free_blocks() == NUM_BLOCKS  # freed at once
    s.check_integrity()
    done = s.commit(plan, [Sampled(0, 30, -0.5), Sampled(1, 31, -0.5)])
    assert done == []
    assert s.by_id["a"].tokens == [20] and s.by_id["a"].finish_reason is FinishReason.CANCELLED
    assert s.by_id["b"].tokens == [21, 31]
    nxt = s.plan()
    assert [it.lifetime for it in items(nxt)] == [1]
    s.check_integrity()


def test_abandon_ends_every_request_in_flight_naming_the_reason() -> None:
    """What Engine.close() leaves: running and waiting requests alike end CANCELLED with the
    reason as their error, their KV freed, their sessions ended; finished ones untouched."""
    s = make(replicas=1)
    s.add(req("done", 3, 1))
    s.commit(s.plan(), [Sampled(0, 20, 0.0)])
    assert s.by_id["done"].finish_reason is FinishReason.LENGTH
    s.add(req("run", 5, 8))
    s.add(dataclasses.replace(req("turn", 4, 8), session="chat"))
    s.commit(s.plan(), [Sampled(1, 21, 0.0), Sampled(2, 22, 0.0)])
    s.add(req("wait", 5, 8))
    outs = s.abandon("closed", now=7.0)
    assert sorted(o.request_id for o in outs) == ["run", "turn", "wait"]
    for o in outs:
        assert (o.finish_reason, o.error, o.finish_time) == (FinishReason.CANCELLED, "closed",
                                                             7.0)
    assert s.by_id["run"].tokens == [21] and s.by_id["wait"].tokens == []
    assert s.by_id["done"].error is None and s.by_id["done"].tokens == [20]
    assert "chat" not in s.sessions and "chat" in s.ended
    assert_all_empty(s)
    assert not s.has_work() and s.abandon("again") == []


def test_cancel_between_prefill_plan_and_commit_ignores_result_and_missing_token() -> None:
    s = make()
    s.add(req("a", 5, 3))
    s.add(req("b", 5, 3))
    plan = s.plan()
    s.cancel("a")
    assert s.kv[0].num_free_blocks() == NUM_BLOCKS
    # the cancelled lifetime's token may or may not arrive: both are fine
    s.commit(plan, [Sampled(1, 20, 0.0)])
    assert s.by_id["a"].tokens == []
    assert s.by_id["b"].tokens == [20]
    s.check_integrity()


def test_stale_result_not_applied_to_new_lifetime_on_same_blocks() -> None:
    s = make(replicas=1)
    s.add(req("a", 4, 4))
    plan_a = s.plan()
    s.cancel("a")
    s.add(req("b", 4, 4))
    plan_b = s.plan()
    (item_b,) = items(plan_b)
    assert item_b.lifetime == 1
    assert s.block_table(0, 1) == [0, 1]  # same blocks as a had, new owner
    s.commit(plan_a, [Sampled(0, 40, 0.0)])  # late result of the cancelled lifetime
    assert s.by_id["b"].tokens == [] and s.by_id["a"].tokens == []
    s.commit(plan_b, [Sampled(1, 41, 0.0)])
    assert s.by_id["b"].tokens == [41]


def test_commit_with_missing_sampled_token_raises() -> None:
    s = make()
    s.add(req("a"))
    s.add(req("b"))
    plan = s.plan()
    with pytest.raises(RuntimeError, match="lifetime 1"):
        s.commit(plan, [Sampled(0, 20, 0.0)])
    s2 = make()
    s2.add(req("a"))
    plan = s2.plan()
    with pytest.raises(RuntimeError, match="lifetime 0"):
        s2.commit(plan, [Sampled(7, 20, 0.0)])  # token for some other lifetime only


# --------------------------------------------------------------------------- replication


def _drive(schedulers: list[Scheduler], rng: random.Random, steps: int) -> None:
    """Feed the same calls to every scheduler; compare plans and block tables every step."""
    n = 0
    for _ in range(steps):
        if rng.random() < 0.5:
            r = req(f"q{n}", rng.randint(1, 20), rng.randint(1, 12), first=rng.randint(4, 40))
            n += 1
            for s in schedulers:
                s.add(r)
        if rng.random() < 0.1:
            live = sorted(schedulers[0].live)
            if live:
                rid = rng.choice(live)
                for s in schedulers:
                    s.cancel(rid)
        plans = [s.plan() for s in schedulers]
        assert all(p == plans[0] for p in plans) and len({p.digest() for p in plans}) == 1
        samples = [Sampled(it.lifetime, rng.randrange(VOCAB), -rng.random())
                   for it in items(plans[0])]
        finished = [[o.request_id for o in s.commit(p, samples)] for s, p in zip(schedulers, plans)]
        assert all(f == finished[0] for f in finished)
        ref = schedulers[0]
        for s in schedulers[1:]:
            for r in range(len(ref.kv)):
                assert s.kv[r].owners() == ref.kv[r].owners()
                for lt in ref.kv[r].owners():
                    assert s.block_table(r, lt) == ref.block_table(r, lt)
            assert {k: (v.tokens, v.finish_reason, v.replica) for k, v in s.by_id.items()} == \
                {k: (v.tokens, v.finish_reason, v.replica) for k, v in ref.by_id.items()}


def test_two_schedulers_fed_same_calls_stay_identical() -> None:
    a, b = make(), make()
    _drive([a, b], random.Random(7), 120)
    assert a.step_no == b.step_no and a.next_lifetime == b.next_lifetime


# --------------------------------------------------------------------------- randomized


def test_randomized_driver_keeps_integrity_and_drains() -> None:
    cfg = engine_cfg()
    nrep = 2
    s = make(cfg, replicas=nrep)
    rng = random.Random(20240531)
    requests: dict[str, Request] = {}
    fifo: deque[str] = deque()           # shadow waiting queue (add order)
    lt_to_rid: dict[int, str] = {}
    rid_to_rep: dict[str, int] = {}
    live: set[str] = set()              # shadow: not finished
    expected_next_lifetime = 0
    n_added = 0
    counts = {"prefill": 0, "decode": 0, "stale": 0, "cancel": 0, "stop": 0, "length": 0}

    def check_plan(plan: StepPlan) -> None:
        nonlocal expected_next_lifetime
        assert len(plan.replicas) == nrep
        if plan.phase is Phase.PREFILL:
            counts["prefill"] += 1
            assert all(w.decode == () for w in plan.replicas)
            assert plan.bucket == 0
            new = sorted(items(plan), key=lambda it: it.lifetime)
            assert [it.lifetime for it in new] == list(
                range(expected_next_lifetime, expected_next_lifetime + len(new)))
            for it in new:  # FIFO: admitted in add order
                rid = fifo.popleft()
                assert it.tokens == requests[rid].prompt and it.start == 0
                lt_to_rid[it.lifetime] = rid
            expected_next_lifetime += len(new)
            for r, w in enumerate(plan.replicas):
                assert w.prefill_tokens <= cfg.max_prefill_tokens
                for it in w.prefill:
                    rid_to_rep[lt_to_rid[it.lifetime]] = r
                    budget = len(requests[lt_to_rid[it.lifetime]].prompt) + \
                        requests[lt_to_rid[it.lifetime]].params.max_tokens
                    assert len(s.block_table(r, it.lifetime)) == blocks(budget)
        elif plan.phase is Phase.DECODE:
            counts["decode"] += 1
            running = {lt for lt, rid in lt_to_rid.items()
                       if rid in live and s.by_id[rid].tokens}
            seen = [row.lifetime for w in plan.replicas for row in w.decode]
            assert sorted(seen) == sorted(running)
            most = max(len(w.decode) for w in plan.replicas)
            assert plan.bucket == min(b for b in cfg.decode_buckets if b >= most)
            for r, w in enumerate(plan.replicas):
                for row in w.decode:
                    rid = lt_to_rid[row.lifetime]
                    out = s.by_id[rid]
                    assert rid_to_rep[rid] == r
                    assert row.token == out.tokens[-1]
                    assert row.position == len(requests[rid].prompt) + len(out.tokens) - 1
        else:
            assert not live, "IDLE while requests are unfinished"
        for r in range(nrep):
            on_r = [lt for lt, rid in lt_to_rid.items() if rid in live and rid_to_rep[rid] == r]
            assert len(on_r) <= cfg.max_batch_size
            used = sum(blocks(len(requests[lt_to_rid[lt]].prompt)
                              + requests[lt_to_rid[lt]].params.max_tokens) for lt in on_r)
            assert s.kv[r].num_free_blocks() == cfg.num_kv_blocks - used

    def cancel_random() -> None:
        if live:
            rid = rng.choice(sorted(live))
            s.cancel(rid)
            live.discard(rid)
            if rid in fifo:
                fifo.remove(rid)
            counts["cancel"] += 1
            assert s.by_id[rid].finish_reason is FinishReason.CANCELLED

    step = 0
    while step < 300 or s.has_work():
        assert step < 3000, "did not drain"
        if step < 300:
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                r = Request(f"r{n_added}",
                            tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))),
                            SamplingParams(max_tokens=rng.randint(1, 20),
                                           ignore_eos=rng.random() < 0.3))
                n_added += 1
                s.add(r)
                requests[r.request_id] = r
                fifo.append(r.request_id)
                live.add(r.request_id)
            if rng.random() < 0.08:
                cancel_random()
        plan = s.plan()
        check_plan(plan)
        if step < 300 and rng.random() < 0.05:
            cancel_random()  # while the step "runs": its result must be discarded
        before = {rid: list(s.by_id[rid].tokens) for rid in requests}
        sampled = []
        for it in items(plan):
            tok = EOS if rng.random() < 0.05 else rng.randrange(VOCAB)
            sampled.append(Sampled(it.lifetime, tok, -rng.random()))
        done = s.commit(plan, sampled)
        tok_of = {x.lifetime: x.token for x in sampled}
        for it in items(plan):
            rid = lt_to_rid[it.lifetime]
            if s.by_id[rid].finish_reason is FinishReason.CANCELLED:
                counts["stale"] += rid not in live and before[rid] == s.by_id[rid].tokens
                assert s.by_id[rid].tokens == before[rid]
            else:
                assert s.by_id[rid].tokens == before[rid] + [tok_of[it.lifetime]]
        for out in done:
            rid = out.request_id
            p = requests[rid].params
            if out.tokens[-1] == EOS and not p.ignore_eos:
                assert out.finish_reason is FinishReason.STOP
                counts["stop"] += 1
            else:
                assert out.finish_reason is FinishReason.LENGTH
                assert len(out.tokens) == p.max_tokens
                counts["length"] += 1
            live.discard(rid)
        s.check_integrity()
        step += 1

    assert not live and not fifo
    assert all(o.finished for o in s.by_id.values())
    for o in s.by_id.values():
        assert len(o.tokens) <= requests[o.request_id].params.max_tokens
    for kv in s.kv:
        kv.assert_empty()
    # the driver really exercised every path
    assert all(v > 0 for v in counts.values()), counts


# ------------------------------------------------------- a P step committed one step late
# (engine.overlap_prefill: the next step is planned before the previous P step's tokens are
# committed; the engine commits both plans at the exchange after, in plan order)


def test_next_prefill_planned_before_the_last_ones_commit_holds_its_batch_rows() -> None:
    s = make(engine_cfg(max_batch_size=2, max_prefill_tokens=8), replicas=1)
    for rid in "abcd":
        s.add(req(rid, prompt_len=4, max_tokens=3))
    p0 = s.plan()  # a and b (8 tokens), their tokens not yet committed
    assert [it.lifetime for it in items(p0)] == [0, 1]
    # a and b hold both batch rows while awaiting their first tokens: c may not be admitted
    # (it was, past max_batch_size, before awaiting sequences counted as rows)
    p1 = s.plan()
    assert p1.phase is Phase.IDLE and len(s.waiting) == 2
    assert s.commit(p0, [Sampled(0, 20, -0.1), Sampled(1, 21, -0.2)]) == []
    assert s.commit(p1, []) == []
    p2 = s.plan()  # strict P priority, but no rows are free: a and b decode
    assert p2.phase is Phase.DECODE and len(items(p2)) == 2
    assert_drains(s, [p2])


def test_two_prefill_steps_in_flight_commit_in_plan_order() -> None:
    s = make(engine_cfg(max_batch_size=4, max_prefill_tokens=5), replicas=1)
    for rid in "abc":
        s.add(req(rid, prompt_len=5, max_tokens=2))
    p0 = s.plan()
    p1 = s.plan()  # planned before p0's tokens: b, on new blocks
    assert p0.phase is p1.phase is Phase.PREFILL
    assert [it.lifetime for it in items(p0)] == [0] and [it.lifetime for it in items(p1)] == [1]
    assert not set(s.block_table(0, 0)) & set(s.block_table(0, 1))
    # a is cancelled while its P's tokens are in flight: freed now, its token later ignored
    s.cancel("a")
    p2 = s.plan()  # c takes a's freed blocks (the engine's one stream orders the writes)
    assert [it.lifetime for it in items(p2)] == [2]
    sampled = [Sampled(0, 30, -0.5), Sampled(1, 31, -0.6)]
    done = s.commit(p0, sampled) + s.commit(p1, sampled)
    assert done == [] and s.by_id["a"].tokens == [] and s.by_id["b"].tokens == [31]
    assert s.by_id["a"].finish_reason is FinishReason.CANCELLED
    s.commit(p2, [Sampled(2, 32, -0.7)])
    p3 = s.plan()
    assert p3.phase is Phase.DECODE and [d.lifetime for d in items(p3)] == [1, 2]
    assert_drains(s, [p3])


def test_head_admissible_says_whether_the_next_plan_can_take_the_queues_head() -> None:
    # rows: a and b hold both batch rows while awaiting their tokens and while decoding
    s = make(engine_cfg(max_batch_size=2, max_prefill_tokens=8), replicas=1)
    assert not s.head_admissible()  # nothing waits
    for rid in "abc":
        s.add(req(rid, prompt_len=4, max_tokens=2))
    assert s.head_admissible()
    p0 = s.plan()
    assert not s.head_admissible()  # c waits for a row
    s.commit(p0, [Sampled(0, 20, 0.0), Sampled(1, 21, 0.0)])
    assert not s.head_admissible()
    p1 = s.plan()
    assert p1.phase is Phase.DECODE
    s.commit(p1, [Sampled(0, 22, 0.0), Sampled(1, 23, 0.0)])  # both done: rows free
    assert s.head_admissible() and s.plan().phase is Phase.PREFILL
    # KV: the head's blocks are not free -- unless a retained context no one uses holds them
    # (the plan evicts it)
    s = make(engine_cfg(num_kv_blocks=4, max_seq_len=16), replicas=1)
    s.add(dataclasses.replace(req("t1", prompt_len=8, max_tokens=4), session="x"))  # 3 blocks
    p = s.plan()
    s.add(req("d", prompt_len=4, max_tokens=4))  # 2 blocks: 1 free
    assert not s.head_admissible()
    s.commit(p, [Sampled(0, 5, 0.0)])
    for _ in range(3):  # x's turn ends: its context stays cached
        p = s.plan()
        s.commit(p, [Sampled(0, 5, 0.0)])
    assert s.sessions["x"].lifetime is not None and not s.seqs
    assert s.head_admissible()
    p = s.plan()
    assert p.phase is Phase.PREFILL and s.evictions == 1


def assert_drains(s: Scheduler, plans: list[StepPlan]) -> None:
    """Commit ``plans`` with one token each, then step D to the end: empty and consistent."""
    tok = 40
    while plans:
        for plan in plans:
            s.commit(plan, [Sampled(it.lifetime, tok, 0.0) for it in items(plan)])
            tok += 1
        s.check_integrity()
        nxt = s.plan()
        plans = [] if nxt.phase is Phase.IDLE else [nxt]
    assert_all_empty(s)
