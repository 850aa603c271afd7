"""Unit tests for colo_rollout.multiplex.segment_policy (pure Python: no processes, no torch).

Expectations come from the module docstring: FixedSpan(K) always picks K; LoadSelectedSpan picks
among validated ascending spans from D occupancy (d_rows / d_capacity) and P pressure
(p_tokens / p_budget): no D rows -> largest; heavy D & light P -> smallest; light D & heavy P ->
largest; otherwise the middle candidate (candidates[len // 2]). "Heavy" is at-or-above the
threshold (busy_decode for D, heavy_prefill for P). The choice must be a pure function of the
rank-shared Load so every rank picks the same K.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from colo_rollout.multiplex.segment_policy import (
    BalancedSpan,
    FixedSpan,
    Load,
    LoadSelectedSpan,
    span_hint,
)


def load(occ: tuple[int, int], pres: tuple[int, int]) -> Load:
    return Load(d_rows=occ[0], d_capacity=occ[1], p_tokens=pres[0], p_budget=pres[1])


# Reference loads for the default thresholds (busy_decode 0.5, heavy_prefill 1.0).
HEAVY_D = (6, 8)  # 0.75
LIGHT_D = (1, 8)  # 0.125
HEAVY_P = (300, 100)  # 3.0
LIGHT_P = (10, 100)  # 0.1


# ---------------------------------------------------------------------------- Load
def test_load_ratios():
    ld = Load(d_rows=3, d_capacity=12, p_tokens=96, p_budget=64)
    assert ld.d_occupancy == pytest.approx(0.25)
    assert ld.p_pressure == pytest.approx(1.5)


def test_load_zero_capacity_and_budget_give_zero():
    ld = Load(d_rows=5, d_capacity=0, p_tokens=7, p_budget=0)
    assert ld.d_occupancy == 0.0 and isinstance(ld.d_occupancy, float)
    assert ld.p_pressure == 0.0 and isinstance(ld.p_pressure, float)
    z = Load(0, 0, 0, 0)
    assert (z.d_occupancy, z.p_pressure) == (0.0, 0.0)


def test_load_is_frozen_value():
    ld = Load(1, 2, 3, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ld.d_rows = 9  # type: ignore[misc]
    assert ld == Load(1, 2, 3, 4) and hash(ld) == hash(Load(1, 2, 3, 4))


# ---------------------------------------------------------------------------- FixedSpan
@pytest.mark.parametrize("bad", [0, -1, -100])
def test_fixed_span_rejects_below_one(bad):
    with pytest.raises(ValueError, match=str(bad)):
        FixedSpan(bad)


@pytest.mark.parametrize("k", [1, 2, 7])
def test_fixed_span_always_returns_k(k):
    pol = FixedSpan(k)
    loads = [load(d, p) for d in (HEAVY_D, LIGHT_D, (0, 8), (0, 0), (3, 0))
             for p in (HEAVY_P, LIGHT_P, (0, 0), (5, 0))]
    assert [pol.choose(ld) for ld in loads] == [k] * len(loads)


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize("bad", [
    pytest.param((), id="empty"),
    pytest.param((2, 1), id="descending"),
    pytest.param((1, 4, 2), id="non-ascending"),
    pytest.param((1, 2, 2, 4), id="duplicate"),
    pytest.param((3, 3), id="all-duplicate"),
    pytest.param((0, 1, 2), id="zero"),
    pytest.param((-2, 1), id="negative"),
    pytest.param((0,), id="single-zero"),
])
def test_load_selected_rejects_bad_candidates(bad):
    with pytest.raises(ValueError, match="candidates must be distinct ascending spans >= 1"):
        LoadSelectedSpan(candidates=bad)


@pytest.mark.parametrize("good", [(1,), (1, 2), (1, 2, 4), (2, 3, 5, 8, 13)])
def test_load_selected_accepts_valid_candidates(good):
    assert LoadSelectedSpan(candidates=good).candidates == good


def test_load_selected_defaults():
    pol = LoadSelectedSpan()
    assert pol.candidates == (1, 2, 4)
    assert (pol.busy_decode, pol.heavy_prefill) == (0.5, 1.0)


# ---------------------------------------------------------------------------- choose table
@pytest.mark.parametrize("d,p,expected", [
    (HEAVY_D, LIGHT_P, 1),  # protect decode: smallest
    (LIGHT_D, HEAVY_P, 4),  # finish prefill: largest
    (HEAVY_D, HEAVY_P, 2),  # both heavy: middle
    (LIGHT_D, LIGHT_P, 2),  # both light: middle
    ((0, 8), LIGHT_P, 4),   # no D rows: largest
    ((0, 8), HEAVY_P, 4),
    ((0, 8), (0, 100), 4),
    ((0, 0), (0, 0), 4),
], ids=["heavyD-lightP", "lightD-heavyP", "both-heavy", "both-light",
        "noD-lightP", "noD-heavyP", "noD-noP", "all-zero"])
def test_choose_table_default(d, p, expected):
    assert LoadSelectedSpan().choose(load(d, p)) == expected


@pytest.mark.parametrize("cands,middle", [
    ((3,), 3), ((1, 8), 8), ((1, 2, 4), 2), ((1, 2, 4, 8), 4), ((1, 2, 3, 5, 8), 3),
    ((2, 4, 6, 8, 10, 12), 8),
])
def test_choose_extremes_and_middle_for_any_candidate_count(cands, middle):
    pol = LoadSelectedSpan(candidates=cands)
    assert pol.choose(load(HEAVY_D, LIGHT_P)) == cands[0]
    assert pol.choose(load(LIGHT_D, HEAVY_P)) == cands[-1]
    assert pol.choose(load((0, 8), LIGHT_P)) == cands[-1]
    assert pol.choose(load(HEAVY_D, HEAVY_P)) == middle
    assert pol.choose(load(LIGHT_D, LIGHT_P)) == middle


def test_thresholds_are_inclusive_decode():
    pol = LoadSelectedSpan()  # busy_decode 0.5
    assert pol.choose(load((4, 8), LIGHT_P)) == 1  # exactly 0.5 is heavy
    assert pol.choose(load((49, 100), LIGHT_P)) == 2  # just below: light, both light -> middle
    assert pol.choose(load((4, 8), HEAVY_P)) == 2  # exactly 0.5 + heavy P: both heavy
    assert pol.choose(load((49, 100), HEAVY_P)) == 4


def test_thresholds_are_inclusive_prefill():
    pol = LoadSelectedSpan()  # heavy_prefill 1.0
    assert pol.choose(load(LIGHT_D, (64, 64))) == 4  # exactly 1.0 is heavy
    assert pol.choose(load(LIGHT_D, (63, 64))) == 2  # just below: light
    assert pol.choose(load(HEAVY_D, (64, 64))) == 2  # both heavy
    assert pol.choose(load(HEAVY_D, (63, 64))) == 1


def test_custom_thresholds():
    pol = LoadSelectedSpan(candidates=(2, 4, 8), busy_decode=0.25, heavy_prefill=2.0)
    assert pol.choose(load((1, 4), (1, 1))) == 2  # occ 0.25 heavy, pressure 1.0 light
    assert pol.choose(load((1, 5), (2, 1))) == 8  # occ 0.2 light, pressure 2.0 heavy
    assert pol.choose(load((1, 5), (1, 1))) == 4  # both light
    assert pol.choose(load((1, 4), (2, 1))) == 4  # both heavy


def test_zero_capacity_with_d_rows_counts_as_light_decode():
    pol = LoadSelectedSpan()
    # occupancy 0.0 (zero capacity) < 0.5 -> light D; but d_rows > 0 so not the "no D" rule
    assert pol.choose(Load(d_rows=3, d_capacity=0, p_tokens=0, p_budget=100)) == 2
    assert pol.choose(Load(d_rows=3, d_capacity=0, p_tokens=100, p_budget=100)) == 4
    # zero budget -> pressure 0.0 -> light P
    assert pol.choose(Load(d_rows=6, d_capacity=8, p_tokens=999, p_budget=0)) == 1


def test_no_d_rows_beats_every_other_rule():
    # even with a threshold of 0.0 (every occupancy "heavy"), no D rows means largest
    pol = LoadSelectedSpan(candidates=(1, 2, 4), busy_decode=0.0, heavy_prefill=1.0)
    assert pol.choose(load((0, 8), LIGHT_P)) == 4
    assert pol.choose(load((1, 8), LIGHT_P)) == 1


def test_choice_always_a_candidate_and_matches_table_randomized():
    rng = random.Random(1234)
    for _ in range(2000):
        cands = tuple(sorted(rng.sample(range(1, 33), rng.randint(1, 6))))
        busy = rng.choice([0.25, 0.5, 0.75])
        heavy = rng.choice([0.5, 1.0, 2.0])
        pol = LoadSelectedSpan(candidates=cands, busy_decode=busy, heavy_prefill=heavy)
        cap = rng.randint(0, 16)
        ld = Load(rng.randint(0, 16), cap, rng.randint(0, 400), rng.randint(0, 200))
        occ = ld.d_rows / ld.d_capacity if ld.d_capacity else 0.0
        pres = ld.p_tokens / ld.p_budget if ld.p_budget else 0.0
        hd, hp = occ >= busy, pres >= heavy
        if ld.d_rows == 0:
            want = cands[-1]
        elif hd and not hp:
            want = cands[0]
        elif hp and not hd:
            want = cands[-1]
        else:
            want = cands[len(cands) // 2]
        got = pol.choose(ld)
        assert got in cands
        assert got == want, (cands, busy, heavy, ld)


# ---------------------------------------------------------------------------- determinism
def test_choose_is_deterministic_and_stateless():
    """Every rank feeds the same rank-shared Load and must get the same K: choose is a pure
    function of (policy config, Load), independent of call history and of the instance."""
    loads = [Load(r, c, t, b) for r, c, t, b in
             itertools.product((0, 1, 4, 8), (0, 8), (0, 50, 100, 300), (0, 100))]
    ranks = [LoadSelectedSpan(candidates=(1, 2, 4, 8)) for _ in range(4)]
    reference = [ranks[0].choose(ld) for ld in loads]
    rng = random.Random(5)
    for pol in ranks:
        order = list(range(len(loads)))
        rng.shuffle(order)
        got = {i: pol.choose(loads[i]) for i in order}
        assert [got[i] for i in range(len(loads))] == reference
        # equal-but-distinct Load objects give the same answer; repeated calls too
        for i, ld in enumerate(loads):
            twin = Load(ld.d_rows, ld.d_capacity, ld.p_tokens, ld.p_budget)
            assert pol.choose(twin) == pol.choose(ld) == reference[i]
    assert LoadSelectedSpan(candidates=(1, 2, 4, 8)) == ranks[0]


# ---------------------------------------------------------------------------- BalancedSpan
# span_hint: P enqueued ``boundaries`` in ``p_seconds`` behind a D iteration. Held time means P
# went on that long after D's tokens were back (too many boundaries); wait time means the host
# then idled that long for D (too few). The balanced span converts either into boundaries.
def test_span_hint_shrinks_by_the_held_boundaries():
    # 4 boundaries in 8 ms = 2 ms each; D held for the last 3 ms = 1.5 boundaries too many
    assert span_hint(4, 4, 0.008, 0.0, 0.003) == pytest.approx(2.5)


def test_span_hint_grows_by_the_waited_boundaries():
    # 2 boundaries in 1 ms = 0.5 ms each; then 3 ms idle for D = room for 6 more
    assert span_hint(2, 2, 0.001, 0.003, 0.0) == pytest.approx(8.0)


@pytest.mark.parametrize("args", [(2, 0, 0.001, 0.0, 0.001), (2, 3, 0.0, 0.002, 0.0),
                                  (2, 3, 0.003, 0.0, 0.0)])
def test_span_hint_none_when_the_round_measured_nothing(args):
    # no boundaries / no P time / neither held nor waited (the epoch ended inside the segment)
    assert span_hint(*args) is None


def test_balanced_span_takes_the_smallest_hint_and_carries_its_fraction():
    pol = BalancedSpan(span=2, max_span=18)
    assert pol.choose(load(HEAVY_D, LIGHT_P)) == 2
    assert pol.observe([7.9, 5.6, None]) == 5  # min over ranks protects the slowest rank's D
    assert pol.choose(load(LIGHT_D, HEAVY_P)) == 5  # the load does not matter, measurements do
    assert pol.observe([5.6]) == 6  # 0.6 carried + 5.6 owed
    spans = [pol.observe([5.6, 9.0]) for _ in range(98)]
    assert set(spans) == {5, 6}
    assert sum(spans + [5, 6]) / 100 == pytest.approx(5.6)  # the mean tracks the target


def test_balanced_span_mean_tracks_a_fractional_balance():
    # P costs 1.2 ms per boundary, D's iteration 2.1 ms: 1.75 boundaries balance a round.
    # Rounding down every round would run K = 1 for ever (the host idles 0.9 ms a round).
    per, d = 0.0012, 0.0021
    pol = BalancedSpan(span=1, max_span=18)
    spans = []
    for _ in range(400):
        k = pol.span
        spans.append(k)
        p = k * per
        pol.observe([span_hint(k, k, p, max(0.0, d - p), max(0.0, p - d))])
    assert set(spans[10:]) == {1, 2}
    assert sum(spans[10:]) / len(spans[10:]) == pytest.approx(1.75, abs=0.05)


def test_balanced_span_clamps_and_keeps_without_hints():
    pol = BalancedSpan(span=3, max_span=10)
    assert pol.observe([None, None]) == 3  # nothing measured: keep K
    assert pol.observe([]) == 3
    assert pol.observe([-4.0, 2.0]) == 1  # never below one boundary per round
    assert pol.observe([0.4]) == 1
    assert pol.observe([250.0, 99.0]) == 10  # never past one epoch's boundaries


@pytest.mark.parametrize("span,max_span", [(0, 4), (5, 4), (-1, 1)])
def test_balanced_span_rejects_bad_bounds(span, max_span):
    with pytest.raises(ValueError, match="span"):
        BalancedSpan(span=span, max_span=max_span)


def test_balanced_span_is_identical_on_ranks_fed_the_same_hints():
    rng = random.Random(3)
    ranks = [BalancedSpan(span=2, max_span=18) for _ in range(4)]
    for _ in range(200):
        hints = [rng.choice([None, rng.uniform(-3, 25)]) for _ in range(4)]
        assert len({p.observe(list(hints)) for p in ranks}) == 1
    assert all(p == ranks[0] for p in ranks)


def test_balanced_span_settles_where_p_matches_d():
    # a simulated rank: P costs 0.5 ms per boundary, D's iteration 3 ms -> K = 6 balances
    per, d = 0.0005, 0.003
    pol = BalancedSpan(span=1, max_span=18)
    for _ in range(6):
        k = pol.span
        p = k * per
        hint = span_hint(k, k, p, max(0.0, d - p), max(0.0, p - d))
        pol.observe([hint])
    assert pol.span == 6


# ---------------------------------------------------------------------------- the held clock
class _FakePending:
    """D's tokens: pending until ``back`` is set."""

    def __init__(self) -> None:
        self.back = False

    def done(self) -> bool:
        return self.back


def test_held_clock_brackets_d_return_and_estimates_the_midpoint(monkeypatch):
    from colo_rollout.multiplex import segment_policy as sp

    now = [0.0]
    monkeypatch.setattr(sp.time, "perf_counter", lambda: now[0])
    pending = _FakePending()
    clock = sp.HeldClock(pending, 0.0)
    for t in (1.0, 2.0):  # two boundaries enqueued while D was still running
        now[0] = t
        clock()
    pending.back = True  # D's tokens came back somewhere in (2, 3]
    for t in (3.0, 4.0):
        now[0] = t
        clock()
    # the D-wait metric counts from the last check D was pending (conservative: 5 - 2 = 3);
    # the span hint uses the midpoint of the bracketing checks (5 - 2.5 = 2.5)
    assert clock.held(5.0) == pytest.approx(3.0)
    assert clock.held_estimate(5.0) == pytest.approx(2.5)


def test_held_clock_is_zero_while_d_never_came_back(monkeypatch):
    from colo_rollout.multiplex import segment_policy as sp

    now = [0.0]
    monkeypatch.setattr(sp.time, "perf_counter", lambda: now[0])
    clock = sp.HeldClock(_FakePending(), 0.0)
    for t in (1.0, 2.0):
        now[0] = t
        clock()
    assert clock.held(3.0) == 0.0 and clock.held_estimate(3.0) == 0.0
