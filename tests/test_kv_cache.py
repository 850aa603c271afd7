"""Unit tests for colo_rollout.sched.kv_cache (pure Python, no processes)."""

from __future__ import annotations


import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from colo_rollout.sched.kv_cache import KVCacheError, KVCacheManager, KVCacheStats


def test_constructor_validates_args() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(8, 0)


@pytest.mark.parametrize(
    "tokens,blocks", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)]
)
def test_blocks_needed_is_ceil(tokens: int, blocks: int) -> None:
    kv = KVCacheManager(8, 16)
    assert kv.blocks_needed(tokens) == blocks
    with pytest.raises(KVCacheError):
        kv.blocks_needed(-1)


def test_reserve_sizes_and_lowest_id_first() -> None:
    kv = KVCacheManager(10, 4)
    assert kv.reserve(1, 5) == [0, 1]
    assert kv.reserve(2, 4) == [2]
    assert kv.reserve(3, 9) == [3, 4, 5]
    assert kv.num_free_blocks() == 4
    assert kv.num_tokens(3) == 9
    assert kv.owners() == [1, 2, 3]
    # Reuse after free: the lowest freed ids come back first, in order.
    kv.free(1)
    kv.free(2)
    assert kv.reserve(4, 12) == [0, 1, 2]
    assert kv.owner_of(0) == 4 and kv.owner_of(9) is None
    kv.check_integrity()
    for lt in (3, 4):
        kv.free(lt)
    kv.assert_empty()


def test_two_managers_agree_deterministically() -> None:
    a, b = KVCacheManager(32, 4), KVCacheManager(32, 4)
    for kv in (a, b):
        kv.reserve(1, 10)
        kv.reserve(2, 3)
        kv.free(1)
        kv.reserve(3, 20)
        kv.grow(2, 9)
    # Freed ids 0-2 are refilled first, then the untouched tail.
    assert a.block_table(3) == b.block_table(3) == [0, 1, 2, 4, 5]
    assert a.block_table(2) == b.block_table(2) == [3, 6, 7]


def test_reserve_rejects_zero_tokens_and_duplicate() -> None:
    kv = KVCacheManager(4, 4)
    with pytest.raises(KVCacheError, match="lifetime 7"):
        kv.reserve(7, 0)
    kv.reserve(7, 1)
    with pytest.raises(KVCacheError, match="lifetime 7"):
        kv.reserve(7, 1)
    assert kv.block_table(7) == [0]
    kv.free(7)
    kv.assert_empty()


def test_grow_returns_only_new_blocks_and_never_shrinks() -> None:
    kv = KVCacheManager(6, 4)
    kv.reserve(1, 3)
    kv.reserve(2, 1)
    assert kv.grow(1, 4) == []  # still fits in block 0
    assert kv.grow(1, 9) == [2, 3]
    assert kv.block_table(1) == [0, 2, 3]
    assert kv.grow(1, 2) == []  # never shrinks
    assert kv.num_tokens(1) == 9
    assert kv.block_table(1) == [0, 2, 3]
    kv.check_integrity()
    kv.free(1)
    kv.free(2)
    kv.assert_empty()


def test_grow_respects_capacity_and_leaves_state_unchanged() -> None:
    kv = KVCacheManager(4, 4)
    kv.reserve(1, 4)
    kv.reserve(2, 8)
    assert kv.can_grow(1, 8)
    assert not kv.can_grow(1, 13)
    with pytest.raises(KVCacheError, match="lifetime 1"):
        kv.grow(1, 13)
    assert kv.block_table(1) == [0] and kv.num_tokens(1) == 4
    assert kv.num_free_blocks() == 1
    kv.check_integrity()
    assert kv.grow(1, 8) == [3]
    assert kv.num_free_blocks() == 0
    kv.free(1)
    kv.free(2)
    kv.assert_empty()


def test_reserve_beyond_capacity_rejected_state_unchanged() -> None:
    kv = KVCacheManager(4, 8)
    kv.reserve(1, 16)
    before = kv.stats()
    assert not kv.can_allocate(17)
    with pytest.raises(KVCacheError, match="lifetime 2"):
        kv.reserve(2, 17)
    assert kv.stats() == before
    assert kv.owners() == [1]
    kv.check_integrity()
    assert kv.can_allocate(16)
    assert kv.reserve(2, 16) == [2, 3]
    assert not kv.can_allocate(1)
    kv.free(1)
    kv.free(2)
    kv.assert_empty()


@pytest.mark.parametrize(
    "call",
    [
        lambda kv: kv.grow(99, 4),
        lambda kv: kv.can_grow(99, 4),
        lambda kv: kv.num_tokens(99),
        lambda kv: kv.block_table(99),
        lambda kv: kv.free(99),
        lambda kv: kv.retire(99),
        lambda kv: kv.release_drained(99),
    ],
)
def test_unknown_lifetime_rejected(call) -> None:  # type: ignore[no-untyped-def]
    kv = KVCacheManager(4, 4)
    kv.reserve(1, 4)
    with pytest.raises(KVCacheError, match="99"):
        call(kv)
    kv.check_integrity()
    # owns() is the stale check: it answers False instead of raising.
    assert not kv.owns(99, [0])


def test_double_free_and_release_of_live_lifetime_rejected() -> None:
    kv = KVCacheManager(4, 4)
    kv.reserve(1, 4)
    with pytest.raises(KVCacheError):
        kv.release_drained(1)  # live, not draining
    kv.free(1)
    with pytest.raises(KVCacheError):
        kv.free(1)
    with pytest.raises(KVCacheError):
        kv.owner_of(4)
    kv.assert_empty()


def test_retire_keeps_blocks_out_until_release() -> None:
    kv = KVCacheManager(4, 4)
    kv.reserve(1, 12)
    kv.reserve(2, 4)
    kv.retire(1)
    assert kv.owners() == [2] and kv.draining() == [1]
    assert kv.num_free_blocks() == 0
    assert not kv.can_allocate(1)
    s = kv.stats()
    assert (s.free_blocks, s.used_blocks, s.draining_blocks, s.num_owners) == (0, 1, 3, 1)
    with pytest.raises(KVCacheError):
        kv.grow(1, 16)
    with pytest.raises(KVCacheError):
        kv.reserve(1, 4)  # id still in use while draining
    assert kv.owner_of(0) is None
    kv.check_integrity()
    with pytest.raises(KVCacheError, match="1"):
        kv.assert_empty()
    kv.release_drained(1)
    assert kv.draining() == [] and kv.num_free_blocks() == 3
    assert kv.reserve(3, 4) == [0]
    kv.free(2)
    kv.free(3)
    kv.assert_empty()


def test_owns_detects_stale_lifetime() -> None:
    kv = KVCacheManager(4, 4)
    table = kv.reserve(1, 8)
    assert kv.owns(1, table)
    assert not kv.owns(1, table + [2])
    kv.retire(1)
    assert not kv.owns(1, table)
    kv.release_drained(1)
    # Resubmitted request: new lifetime gets the very same block ids.
    assert kv.reserve(2, 8) == table
    assert kv.owns(2, table)
    assert not kv.owns(1, table)
    kv.free(2)
    assert not kv.owns(2, table)
    kv.assert_empty()


def test_stats_fields() -> None:
    kv = KVCacheManager(8, 2)
    kv.reserve(1, 3)
    assert kv.stats() == KVCacheStats(8, 2, 6, 2, 0, 1)
    kv.free(1)
    kv.assert_empty()


def _corruptions():  # type: ignore[no-untyped-def]
    def dup_free(kv: KVCacheManager) -> None:
        kv._free.append(kv._free[0])

    def drop_free(kv: KVCacheManager) -> None:
        kv._free.remove(max(kv._free))

    def free_and_owned(kv: KVCacheManager) -> None:
        kv._free.append(kv._tables[1][0])

    def wrong_reverse(kv: KVCacheManager) -> None:
        kv._owner[kv._tables[1][0]] = 2

    def stray_reverse(kv: KVCacheManager) -> None:
        kv._owner[max(kv._free)] = 1

    def wrong_size(kv: KVCacheManager) -> None:
        kv._declared[1] = 100

    def out_of_range(kv: KVCacheManager) -> None:
        kv._draining[5] = [999]

    def shared_between_owners(kv: KVCacheManager) -> None:
        kv._tables[2].append(kv._tables[1][0])
        kv._declared[2] = 8

    def bad_heap(kv: KVCacheManager) -> None:
        kv._free.reverse()

    return [
        (dup_free, "both free pool and free pool"),
        (drop_free, "leaked"),
        (free_and_owned, "both free pool and lifetime 1"),
        (wrong_reverse, "owner_of says 2"),
        (stray_reverse, "non-owned"),
        (wrong_size, "lifetime 1 holds 2 blocks"),
        (out_of_range, "out of range"),
        (shared_between_owners, "both lifetime 1 and lifetime 2"),
        (bad_heap, "heap order"),
    ]


@pytest.mark.parametrize("corrupt,expected", _corruptions())
def test_check_integrity_catches_corruption(corrupt, expected) -> None:  # type: ignore[no-untyped-def]
    kv = KVCacheManager(8, 4)
    kv.reserve(1, 8)
    kv.reserve(2, 4)
    kv.check_integrity()
    corrupt(kv)
    with pytest.raises(KVCacheError, match=expected):
        kv.check_integrity()


def test_assert_empty_lists_leaks() -> None:
    kv = KVCacheManager(8, 4)
    kv.reserve(11, 4)
    kv.reserve(12, 4)
    kv.retire(12)
    with pytest.raises(KVCacheError) as exc:
        kv.assert_empty()
    assert "11" in str(exc.value) and "12" in str(exc.value)
    kv.free(11)
    kv.release_drained(12)
    kv.assert_empty()


class KVAgainstModel(RuleBasedStateMachine):
    """The manager against a dictionary model of who holds how many blocks, driven by
    hypothesis (random op sequences, shrunk to the shortest failing one)."""

    NB, BS = 48, 8

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.NB, self.BS)
        self.live: dict[int, int] = {}  # lifetime -> declared tokens
        self.blocks: dict[int, int] = {}  # lifetime -> blocks held (live or draining)
        self.draining: set[int] = set()
        self.next_lt = 0

    def need(self, t: int) -> int:
        return -(-t // self.BS)

    def model_free(self) -> int:
        return self.NB - sum(self.blocks.values())

    @rule(t=st.integers(1, 80))
    def reserve(self, t):
        ok = self.need(t) <= self.model_free()
        assert self.kv.can_allocate(t) == ok
        if ok:
            table = self.kv.reserve(self.next_lt, t)
            assert len(table) == self.need(t)
            self.live[self.next_lt], self.blocks[self.next_lt] = t, self.need(t)
        else:
            with pytest.raises(KVCacheError):
                self.kv.reserve(self.next_lt, t)
        self.next_lt += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), delta=st.integers(-8, 40))
    def grow(self, data, delta):
        lt = data.draw(st.sampled_from(sorted(self.live)))
        t = max(0, self.live[lt] + delta)
        extra = max(0, self.need(t) - self.blocks[lt])
        ok = extra <= self.model_free()
        assert self.kv.can_grow(lt, t) == ok
        if ok:
            before = self.kv.block_table(lt)
            added = self.kv.grow(lt, t)
            assert len(added) == extra
            assert self.kv.block_table(lt) == before + added
            self.live[lt] = max(self.live[lt], t)
            self.blocks[lt] += extra
        else:
            with pytest.raises(KVCacheError):
                self.kv.grow(lt, t)
        assert self.kv.num_tokens(lt) == self.live[lt]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        lt = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(lt)
        del self.live[lt], self.blocks[lt]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def retire(self, data):
        lt = data.draw(st.sampled_from(sorted(self.live)))
        table = self.kv.block_table(lt)
        self.kv.retire(lt)
        assert not self.kv.owns(lt, table)
        del self.live[lt]
        self.draining.add(lt)

    @precondition(lambda self: self.draining)
    @rule(data=st.data())
    def release(self, data):
        lt = data.draw(st.sampled_from(sorted(self.draining)))
        self.kv.release_drained(lt)
        self.draining.discard(lt)
        del self.blocks[lt]

    @invariant()
    def agrees_with_the_model(self):
        self.kv.check_integrity()
        assert self.kv.num_free_blocks() == self.model_free()
        assert self.kv.owners() == sorted(self.live)
        assert self.kv.draining() == sorted(self.draining)

    def teardown(self):  # everything returned: nothing leaks
        for lt in sorted(self.live):
            self.kv.free(lt)
        for lt in sorted(self.draining):
            self.kv.release_drained(lt)
        self.kv.assert_empty()
        assert self.kv.num_free_blocks() == self.NB


KVAgainstModel.TestCase.settings = settings(max_examples=60, stateful_step_count=60,
                                            deadline=None, derandomize=True)
test_randomized_against_model = KVAgainstModel.TestCase
