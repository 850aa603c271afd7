"""Unit tests for colo_rollout.multiplex.turnstile (pure Python: no processes, no torch).

Expectations come from the module docstring, DESIGN.md item 7 and paper section 4 ("The
controller stores the largest reached boundary r (initially -1), permitted endpoint p, positive
span K, and task state. P stops at i=p; after the post-D phase, active ranks set p <- p+K, while
completed ranks follow the matched control path. Initially, p=0 orders ready D before P enters
CUDA; if D is already enqueued, P starts with p=K. ... rejects stale or duplicate epochs, missing
producers, nonmonotone boundary publication, and endpoints beyond the current permit.")
"""

from __future__ import annotations

import random
import re

import pytest

from colo_rollout.multiplex.turnstile import Event, TaskState, TurnstileController, TurnstileError

PROD = "gather"
RANK = 3  # a non-zero rank so the message must really come from the controller


# ---------------------------------------------------------------------------- helpers
def ctl(rank: int = RANK, *, span: int = 1, record: bool = True,
        producer: str | None = PROD) -> TurnstileController:
    c = TurnstileController(rank=rank, record=record)
    if producer is not None:
        c.register_producer(producer)
    c.set_span(span)
    return c


def snap(c: TurnstileController) -> tuple:
    return (c.epoch, c.reached, c.permit, c.span, c.state, c.producer, tuple(c.log),
            c.active, c.at_endpoint)


HEADER = re.compile(r"^rank (-?\d+), epoch (-?\d+), boundary (-?\d+): ")


def check_rejected(c: TurnstileController, fn, *args, epoch: int, boundary: int, match: str,
           **kwargs) -> str:
    """Call ``fn`` expecting a TurnstileError whose message starts with
    ``rank R, epoch E, boundary B:`` for this controller; the controller must be unchanged."""
    before = snap(c)
    with pytest.raises(TurnstileError) as ei:
        fn(*args, **kwargs)
    msg = str(ei.value)
    m = HEADER.match(msg)
    assert m, f"message lacks the 'rank R, epoch E, boundary B:' header: {msg!r}"
    assert (int(m.group(1)), int(m.group(2)), int(m.group(3))) == (c.rank, epoch, boundary), msg
    assert re.search(match, msg), f"{match!r} not in {msg!r}"
    assert snap(c) == before, "a rejected call changed the controller state"
    return msg


def drive_to(c: TurnstileController, epoch: int, upto: int, *, d_enqueued: bool = True) -> None:
    """Begin ``epoch`` and publish boundaries 0..upto, running a D round at every endpoint."""
    c.begin(epoch, d_enqueued=d_enqueued)
    for i in range(upto + 1):
        while i > c.permit:
            c.post_d()
        c.publish(epoch, i, PROD)


def test_turnstile_error_is_runtime_error():
    assert issubclass(TurnstileError, RuntimeError)


# ---------------------------------------------------------------------------- initial permit
def test_fresh_controller_is_idle():
    c = TurnstileController(rank=5)
    assert c.state is TaskState.IDLE and not c.active and not c.at_endpoint
    assert (c.epoch, c.reached) == (-1, -1)
    assert c.log == []


@pytest.mark.parametrize("span", [1, 2, 5])
def test_begin_without_d_gives_permit_zero_so_d_goes_first(span):
    c = ctl(span=span)
    assert c.begin(0, d_enqueued=False) == 0
    assert (c.epoch, c.reached, c.permit, c.state) == (0, -1, 0, TaskState.ACTIVE)
    assert c.active and not c.at_endpoint
    assert not c.may_cross(0)  # P may not pass boundary 0 before D had its turn
    # P's first boundary is its endpoint: publish says stop
    assert c.publish(0, 0, PROD) is True
    assert c.at_endpoint and c.reached == 0 and c.permit == 0
    # boundary 1 is beyond the permit until a D round ran
    check_rejected(c, c.publish, 0, 1, PROD, epoch=0, boundary=1, match="beyond the permit 0")
    assert c.post_d() == span
    assert not c.at_endpoint and c.may_cross(0)


@pytest.mark.parametrize("span", [1, 2, 5])
def test_begin_with_d_enqueued_gives_permit_k(span):
    c = ctl(span=span)
    assert c.begin(0, d_enqueued=True) == span
    assert (c.reached, c.permit) == (-1, span)
    for i in range(span):
        assert c.may_cross(i)
        assert c.publish(0, i, PROD) is False
    assert not c.may_cross(span)
    assert c.publish(0, span, PROD) is True
    assert c.at_endpoint


def test_begin_span_argument_sets_span_before_permit():
    c = ctl(span=1)
    assert c.begin(0, d_enqueued=True, span=4) == 4
    assert c.span == 4
    assert c.post_d() == 8
    c2 = ctl(span=1)
    assert c2.begin(0, d_enqueued=False, span=3) == 0
    assert c2.post_d() == 3


def test_begin_logs_begin_event_at_minus_one():
    c = ctl()
    c.begin(4, d_enqueued=False)
    assert c.log == [Event("begin", 4, -1)]


# ---------------------------------------------------------------------------- post_d
@pytest.mark.parametrize("span", [1, 2, 3])
def test_post_d_extends_permit_by_k_on_active_rank(span):
    c = ctl(span=span)
    c.begin(0, d_enqueued=False)
    for n in range(1, 5):
        assert c.post_d() == n * span
        assert c.permit == n * span
        assert c.log[-1] == Event("post_d", 0, n * span)
    # rounds do not move the reached boundary
    assert c.reached == -1


def test_post_d_is_noop_before_any_epoch():
    c = ctl(span=3)
    before = snap(c)
    for _ in range(3):
        assert c.post_d() == before[2]  # returns the permit unchanged
    assert snap(c) == before
    assert c.log == []


def test_post_d_is_noop_after_completion():
    c = ctl(span=2)
    c.begin(0, d_enqueued=True)
    c.publish(0, 0, PROD)
    c.publish(0, 1, PROD)
    c.complete(0)
    before = snap(c)
    assert c.permit == 2
    for _ in range(3):
        assert c.post_d() == 2
    assert snap(c) == before  # no log entry, nothing moved


def test_post_d_noop_without_record_too():
    c = ctl(record=False)
    assert c.post_d() == 0
    assert c.log == []


# ---------------------------------------------------------------------------- may_cross
def test_may_cross_only_below_permit_and_only_while_active():
    c = ctl(span=3)
    assert not any(c.may_cross(i) for i in range(-1, 6))  # idle
    c.begin(0, d_enqueued=True)  # p = 3
    assert [c.may_cross(i) for i in range(6)] == [True, True, True, False, False, False]
    c.post_d()  # p = 6
    assert [c.may_cross(i) for i in range(8)] == [True] * 6 + [False] * 2
    for i in range(4):
        c.publish(0, i, PROD)
    c.complete(0)
    assert not any(c.may_cross(i) for i in range(-1, 8))  # idle again, permit 6 kept


# ---------------------------------------------------------------------------- full epochs
# Hand-derived traces: (operation, returned value, reached, permit, at_endpoint).
# K=1, D not enqueued, boundaries 0..3.
TRACE_K1 = [
    ("begin", 0, -1, 0, False),
    ("pub0", True, 0, 0, True),
    ("post_d", 1, 0, 1, False),
    ("pub1", True, 1, 1, True),
    ("post_d", 2, 1, 2, False),
    ("pub2", True, 2, 2, True),
    ("post_d", 3, 2, 3, False),
    ("pub3", True, 3, 3, True),
    ("post_d", 4, 3, 4, False),
]
# K=2, D not enqueued, boundaries 0..4.
TRACE_K2 = [
    ("begin", 0, -1, 0, False),
    ("pub0", True, 0, 0, True),
    ("post_d", 2, 0, 2, False),
    ("pub1", False, 1, 2, False),
    ("pub2", True, 2, 2, True),
    ("post_d", 4, 2, 4, False),
    ("pub3", False, 3, 4, False),
    ("pub4", True, 4, 4, True),
    ("post_d", 6, 4, 6, False),
]
# K=3, D enqueued (p starts at K), boundaries 0..7; one extra D round while P is mid-segment.
TRACE_K3 = [
    ("begin", 3, -1, 3, False),
    ("pub0", False, 0, 3, False),
    ("pub1", False, 1, 3, False),
    ("pub2", False, 2, 3, False),
    ("pub3", True, 3, 3, True),
    ("post_d", 6, 3, 6, False),
    ("pub4", False, 4, 6, False),
    ("post_d", 9, 4, 9, False),
    ("pub5", False, 5, 9, False),
    ("pub6", False, 6, 9, False),
    ("pub7", False, 7, 9, False),
]


@pytest.mark.parametrize("span,d_enqueued,trace", [
    (1, False, TRACE_K1), (2, False, TRACE_K2), (3, True, TRACE_K3)], ids=["K1", "K2", "K3"])
def test_full_epoch_trace(span, d_enqueued, trace):
    c = ctl(span=span)
    epoch = 7
    for op, ret, reached, permit, endpoint in trace:
        if op == "begin":
            got = c.begin(epoch, d_enqueued=d_enqueued)
        elif op == "post_d":
            got = c.post_d()
        else:
            got = c.publish(epoch, int(op[3:]), PROD)
        assert got == ret and type(got) is type(ret), (op, got)
        assert (c.reached, c.permit, c.at_endpoint) == (reached, permit, endpoint), op
        assert c.active and c.epoch == epoch
    last = trace[-1]
    c.complete(epoch)
    assert c.state is TaskState.IDLE and not c.active and not c.at_endpoint
    assert (c.epoch, c.reached, c.permit) == (epoch, last[2], last[3])
    # event log mirrors the trace
    expected = []
    for op, ret, reached, permit, _ in trace:
        if op == "begin":
            expected.append(Event("begin", epoch, -1))
        elif op == "post_d":
            expected.append(Event("post_d", epoch, permit))
        else:
            expected.append(Event("publish", epoch, reached))
    expected.append(Event("complete", epoch, last[2]))
    assert c.log == expected


def test_completion_then_new_larger_epoch():
    c = ctl(span=2)
    c.begin(0, d_enqueued=True)
    c.publish(0, 0, PROD)
    c.publish(0, 1, PROD)
    assert c.publish(0, 2, PROD) is True
    c.complete(0)
    assert c.log[-1] == Event("complete", 0, 2)
    # a new, larger epoch (gaps allowed) restarts r and p
    assert c.begin(5, d_enqueued=False) == 0
    assert (c.epoch, c.reached, c.permit, c.state) == (5, -1, 0, TaskState.ACTIVE)
    assert c.publish(5, 0, PROD) is True  # boundary ids restart at 0
    assert c.post_d() == 2
    c.complete(5)
    assert c.begin(6, d_enqueued=True) == 2
    assert c.log[-1] == Event("begin", 6, -1)


def test_complete_without_any_boundary_is_allowed():
    c = ctl()
    c.begin(0, d_enqueued=False)
    c.complete(0)
    assert c.state is TaskState.IDLE
    assert c.log == [Event("begin", 0, -1), Event("complete", 0, -1)]


def test_producer_reregistration_same_name_allowed():
    c = ctl()
    c.register_producer(PROD)
    assert c.producer == PROD
    c.begin(0, d_enqueued=True)
    c.register_producer(PROD)  # also while active
    assert c.publish(0, 0, PROD) is False


def test_set_span_valid_values():
    c = ctl()
    for k in (1, 2, 64):
        c.set_span(k)
        assert c.span == k


def test_no_log_without_record():
    c = ctl(record=False)
    drive_to(c, 0, 3)
    c.complete(0)
    assert c.log == []


# ---------------------------------------------------------------------------- rejections
def test_reject_begin_without_producer():
    c = TurnstileController(rank=RANK, record=True)
    msg = check_rejected(c, c.begin, 0, d_enqueued=False, epoch=0, boundary=-1,
                         match="epoch 0 begun with no registered boundary producer")
    assert "producer" in msg
    check_rejected(c, c.begin, 9, d_enqueued=True, epoch=9, boundary=-1, match="epoch 9 begun")
    assert c.state is TaskState.IDLE


def test_reject_publish_with_no_producer_registered():
    c = TurnstileController(rank=RANK, record=True)
    check_rejected(c, c.publish, 0, 0, PROD, epoch=0, boundary=0, match="no producer is registered")
    check_rejected(c, c.publish, 2, 4, "dispatch", epoch=2, boundary=4,
                   match="published by 'dispatch'.*no producer is registered")


def test_reject_publish_with_foreign_producer():
    c = ctl()
    c.begin(1, d_enqueued=True)
    check_rejected(c, c.publish, 1, 0, "dispatch", epoch=1, boundary=0,
                   match="published by 'dispatch'.*registered producer is 'gather'")
    # the real producer still works afterwards
    assert c.publish(1, 0, PROD) is False


def test_reject_second_different_producer():
    c = ctl()
    check_rejected(c, c.register_producer, "dispatch", epoch=-1, boundary=-1,
                   match="'dispatch' registered while 'gather'")
    drive_to(c, 2, 1)
    check_rejected(c, c.register_producer, "dispatch", epoch=2, boundary=1,
                   match="exactly one producer")
    assert c.producer == PROD


def test_reject_stale_epoch():
    c = ctl()
    drive_to(c, 5, 0)
    c.complete(5)
    check_rejected(c, c.begin, 4, d_enqueued=False, epoch=4, boundary=0,
                   match=r"stale epoch 4 \(last epoch was 5\)")
    check_rejected(c, c.begin, 0, d_enqueued=True, epoch=0, boundary=0, match="stale epoch 0")


def test_reject_duplicate_epoch():
    c = ctl()
    drive_to(c, 5, 1)
    c.complete(5)
    check_rejected(c, c.begin, 5, d_enqueued=False, epoch=5, boundary=1,
                   match=r"duplicate epoch 5 \(last epoch was 5\)")


def test_reject_begin_while_active():
    c = ctl()
    drive_to(c, 2, 0)
    check_rejected(c, c.begin, 3, d_enqueued=False, epoch=3, boundary=0,
                   match="epoch 3 begun while epoch 2 is still active")
    # also for the active epoch's own id, and with a span argument
    check_rejected(c, c.begin, 2, d_enqueued=True, epoch=2, boundary=0, match="still active")
    check_rejected(c, c.begin, 9, d_enqueued=True, span=4, epoch=9, boundary=0, match="still active")
    assert c.span == 1


def test_reject_publish_stale_epoch_while_active():
    c = ctl()
    drive_to(c, 1, 0)
    c.complete(1)
    drive_to(c, 2, 0)
    check_rejected(c, c.publish, 1, 1, PROD, epoch=1, boundary=1,
                   match=r"boundary 1 of stale epoch 1 \(active: 2\)")
    check_rejected(c, c.publish, 3, 1, PROD, epoch=3, boundary=1, match="epoch 3")  # future epoch too


def test_reject_publish_when_idle():
    c = ctl()
    check_rejected(c, c.publish, 0, 0, PROD, epoch=0, boundary=0, match=r"\(active: none\)")
    drive_to(c, 0, 2)
    c.complete(0)
    check_rejected(c, c.publish, 0, 3, PROD, epoch=0, boundary=3,
                   match=r"boundary 3 of stale epoch 0 \(active: none\)")


@pytest.mark.parametrize("bad", [
    pytest.param(2, id="repeat"),
    pytest.param(1, id="back-one"),
    pytest.param(0, id="back-to-zero"),
    pytest.param(-1, id="negative"),
    pytest.param(4, id="skip-one"),
    pytest.param(9, id="skip-many"),
])
def test_reject_non_monotone_boundary(bad):
    c = ctl(span=10)
    c.begin(0, d_enqueued=True)  # p = 10, so nothing here is beyond the permit
    for i in range(3):
        c.publish(0, i, PROD)
    check_rejected(c, c.publish, 0, bad, PROD, epoch=0, boundary=bad,
                   match=rf"non-monotone boundary {bad} after 2")
    assert c.publish(0, 3, PROD) is False


def test_reject_first_boundary_not_zero():
    c = ctl(span=4)
    c.begin(0, d_enqueued=True)
    check_rejected(c, c.publish, 0, 1, PROD, epoch=0, boundary=1,
                   match="non-monotone boundary 1 after -1")


@pytest.mark.parametrize("span,d_enqueued", [(1, False), (1, True), (3, False), (3, True)])
def test_reject_boundary_beyond_permit(span, d_enqueued):
    c = ctl(span=span)
    c.begin(0, d_enqueued=d_enqueued)
    p = c.permit
    for i in range(p + 1):
        c.publish(0, i, PROD)
    assert c.at_endpoint
    check_rejected(c, c.publish, 0, p + 1, PROD, epoch=0, boundary=p + 1,
                   match=rf"boundary {p + 1} is beyond the permit {p}")
    c.post_d()
    assert c.publish(0, p + 1, PROD) is (span == 1)


def test_reject_complete_when_idle():
    c = ctl()
    check_rejected(c, c.complete, 0, epoch=0, boundary=-1, match="completion of epoch 0, which is not active")
    drive_to(c, 0, 2)
    c.complete(0)
    check_rejected(c, c.complete, 0, epoch=0, boundary=2, match="completion of epoch 0, which is not active")


def test_reject_complete_wrong_epoch():
    c = ctl()
    drive_to(c, 4, 1)
    check_rejected(c, c.complete, 3, epoch=3, boundary=1, match="completion of epoch 3, which is not active")
    check_rejected(c, c.complete, 5, epoch=5, boundary=1, match="completion of epoch 5")
    c.complete(4)


@pytest.mark.parametrize("bad", [0, -1, True, False, 2.0, 1.5, "2", None],
                         ids=["zero", "neg", "true", "false", "float-int", "float", "str", "none"])
def test_reject_set_span(bad):
    c = ctl(span=2)
    check_rejected(c, c.set_span, bad, epoch=-1, boundary=-1, match=rf"span must be an int >= 1, got {re.escape(repr(bad))}")
    drive_to(c, 1, 1)
    check_rejected(c, c.set_span, bad, epoch=1, boundary=1, match="span must be an int >= 1")


@pytest.mark.parametrize("bad", [0, -1, True])
def test_reject_begin_with_bad_span_leaves_state(bad):
    c = ctl(span=2)
    check_rejected(c, c.begin, 0, d_enqueued=True, span=bad, epoch=-1, boundary=-1, match="span must be")
    assert c.begin(0, d_enqueued=True) == 2  # epoch 0 was not consumed


def test_rejections_leave_controller_usable_mid_epoch():
    """A batch of rejections on a parked rank changes nothing; the epoch then goes on."""
    c = ctl(span=2)
    c.begin(3, d_enqueued=False)
    c.publish(3, 0, PROD)
    before = snap(c)
    bad_calls = [
        lambda: c.begin(4, d_enqueued=True),
        lambda: c.publish(3, 1, PROD),  # beyond permit 0
        lambda: c.publish(3, 0, PROD),  # repeat
        lambda: c.publish(2, 1, PROD),  # stale epoch
        lambda: c.publish(3, 1, "dispatch"),
        lambda: c.register_producer("dispatch"),
        lambda: c.complete(2),
        lambda: c.set_span(0),
    ]
    for call in bad_calls:
        with pytest.raises(TurnstileError, match=rf"^rank {RANK}, "):
            call()
        assert snap(c) == before
    assert c.post_d() == 2
    assert c.publish(3, 1, PROD) is False


# ---------------------------------------------------------------------------- property tests
def random_run(seed: int, ranks: tuple[int, ...] = (0, 1)):
    """Drive controllers for ``ranks`` through one seeded random sequence of valid operations,
    checking the documented rules against an independent model after every step. Also tries
    a few invalid operations on every rank (same op) and returns their messages."""
    rng = random.Random(seed)
    cs = [TurnstileController(rank=r, record=True) for r in ranks]
    for c in cs:
        c.register_producer(PROD)
    errors: list[list[str]] = []
    meta: dict[int, tuple[int, int]] = {}  # epoch -> (span K, initial permit)

    def all_(fn):
        return [fn(c) for c in cs]

    def try_bad(fn):
        msgs = []
        for c in cs:
            before = snap(c)
            with pytest.raises(TurnstileError) as ei:
                fn(c)
            assert snap(c) == before
            msgs.append(str(ei.value))
        errors.append(msgs)

    epoch = -1
    for _ in range(rng.randint(1, 6)):
        # idle D rounds between epochs take the matched no-op path
        for _ in range(rng.randint(0, 2)):
            pre = [c.permit for c in cs]
            assert all_(lambda c: c.post_d()) == pre
        epoch += rng.randint(1, 3)
        span = rng.randint(1, 4)
        d_enq = rng.random() < 0.5
        nb = rng.randint(0, 12)
        initial = span if d_enq else 0
        meta[epoch] = (span, initial)
        assert all_(lambda c: c.begin(epoch, d_enqueued=d_enq, span=span)) == [initial] * len(cs)
        permit, rounds = initial, 0
        for i in range(nb):
            # a D round whenever the rank is parked (or needs one to reach i), plus random extras
            while i > permit or (rng.random() < 0.15):
                if i > permit:
                    assert all(c.at_endpoint for c in cs)
                    try_bad(lambda c: c.publish(epoch, i, PROD))  # beyond permit
                rounds += 1
                permit = initial + rounds * span
                assert all_(lambda c: c.post_d()) == [permit] * len(cs)
            for c in cs:
                assert c.may_cross(i - 1) if i > 0 else True
                assert c.may_cross(i) == (i < permit)
            stops = all_(lambda c: c.publish(epoch, i, PROD))
            assert stops == [i == permit] * len(cs)
            for c in cs:
                assert (c.reached, c.permit, c.at_endpoint) == (i, permit, i == permit)
                assert c.permit % span == 0
                assert c.permit == initial + rounds * span
            if rng.random() < 0.1:
                try_bad(lambda c: c.publish(epoch, i, PROD))  # repeat
        if nb and cs[0].at_endpoint:
            rounds += 1
            permit = initial + rounds * span
            assert all_(lambda c: c.post_d()) == [permit] * len(cs)
        if rng.random() < 0.2:
            try_bad(lambda c: c.begin(epoch + 1, d_enqueued=False))  # while active
        all_(lambda c: c.complete(epoch))
        for c in cs:
            assert not c.active and c.permit == permit and c.reached == nb - 1
        if rng.random() < 0.2:
            try_bad(lambda c: c.begin(epoch, d_enqueued=True))  # duplicate
    return cs, errors, meta


@pytest.mark.parametrize("seed", range(40))
def test_two_ranks_same_ops_same_log(seed):
    (c0, c1), errors, _ = random_run(seed)
    assert c0.log, "run recorded nothing"
    assert c0.log == c1.log
    assert (c0.epoch, c0.reached, c0.permit, c0.span, c0.state) == \
        (c1.epoch, c1.reached, c1.permit, c1.span, c1.state)
    for m0, m1 in errors:
        assert m0.startswith("rank 0, ") and m1.startswith("rank 1, ")
        assert m0[len("rank 0"):] == m1[len("rank 1"):]  # identical except for the rank


def test_model_check_publish_and_permit_progression():
    """Over many random valid runs: publish returns True only at boundary == permit (never below
    it), and within an epoch the permit runs initial, initial+K, initial+2K, ... with initial
    in {0, K}, as read back from the event log."""
    for seed in range(1000, 1300):
        (c,), _, meta = random_run(seed, ranks=(0,))
        permit = k = None
        for ev in c.log:
            if ev.kind == "begin":
                k, permit = meta[ev.epoch]
                assert permit in (0, k)
            elif ev.kind == "post_d":
                assert ev.boundary == permit + k  # p <- p + K, nothing else
                permit = ev.boundary
            elif ev.kind == "publish":
                assert ev.boundary <= permit  # never beyond the permit
            elif ev.kind == "complete":
                assert ev.boundary <= permit
    rng = random.Random(7)
    for _ in range(300):
        k = rng.randint(1, 5)
        c = ctl(span=k)
        c.begin(0, d_enqueued=rng.random() < 0.5)
        init = c.permit
        assert init in (0, k)
        rounds = 0
        for i in range(rng.randint(1, 20)):
            while i > c.permit:
                c.post_d()
                rounds += 1
            p = c.permit
            stop = c.publish(0, i, PROD)
            assert stop == (i == p)
            if i < p:
                assert stop is False
            assert c.permit == init + rounds * k
            assert (c.permit - init) % k == 0
