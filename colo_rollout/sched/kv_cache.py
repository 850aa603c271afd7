"""Paged KV-cache block bookkeeping for ONE attention replica.

This module owns the host-side mapping from integer block ids
(0..num_blocks-1) to the *lifetime* that holds them: which blocks are free,
which are owned (and by whom, in which order), and which are draining after a
cancel. A lifetime id is an int the engine assigns on every admission of a
request or trajectory turn; a resubmitted request gets a new one, so results
tagged with a stale lifetime can be detected with ``owns()``.

Every rank of a replica runs this bookkeeping with the same sequence of calls
and must reach the same block tables without communicating, so allocation is
deterministic (lowest free id first) and nothing here depends on time, hashing
order or randomness.

What must NOT go into this module: tensors, torch / torch.distributed, device
or stream handling, scheduling policy (who gets admitted), or any
communication. The KV tensors themselves are owned by the attention runtime;
callers decide when in-flight work has drained and tell us via
``release_drained``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


class KVCacheError(Exception):
    """Misuse of the block manager or a broken internal invariant."""


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    block_size: int
    free_blocks: int
    used_blocks: int
    draining_blocks: int
    num_owners: int


class KVCacheManager:
    """Hands out KV block ids to lifetimes; see the module docstring."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks: int = num_blocks
        self.block_size: int = block_size
        # Min-heap of free block ids: popping gives the lowest id, which keeps
        # allocation identical on every rank. Draining blocks are NOT here.
        self._free: list[int] = list(range(num_blocks))
        heapq.heapify(self._free)
        # lifetime -> block table in allocation order (the order is the
        # logical page order of the sequence, so it is never reordered).
        self._tables: dict[int, list[int]] = {}
        # lifetime -> largest token count declared via reserve/grow.
        self._declared: dict[int, int] = {}
        # Reverse map block -> owning lifetime, for owned blocks only.
        self._owner: dict[int, int] = {}
        # Retired lifetime -> blocks still possibly written by in-flight work.
        self._draining: dict[int, list[int]] = {}

    # ----------------------------------------------------------- queries
    def blocks_needed(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise KVCacheError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, num_tokens: int) -> bool:
        # Mirrors reserve(): a new reservation needs at least one token.
        return num_tokens >= 1 and self.blocks_needed(num_tokens) <= len(self._free)

    def can_grow(self, lifetime: int, total_tokens: int) -> bool:
        table = self._table(lifetime)
        extra = self.blocks_needed(total_tokens) - len(table)
        return extra <= len(self._free)

    def capacity(self, lifetime: int) -> int:
        """The tokens ``lifetime``'s blocks hold."""
        return len(self._table(lifetime)) * self.block_size

    def num_tokens(self, lifetime: int) -> int:
        self._table(lifetime)
        return self._declared[lifetime]

    def block_table(self, lifetime: int) -> list[int]:
        return list(self._table(lifetime))

    def owner_of(self, block: int) -> int | None:
        if not 0 <= block < self.num_blocks:
            raise KVCacheError(f"block {block} out of range [0, {self.num_blocks})")
        return self._owner.get(block)

    def owns(self, lifetime: int, blocks: list[int]) -> bool:
        # Deliberately lenient (no error for unknown lifetimes): this is the
        # stale-lifetime check, and a retired/freed lifetime owns nothing.
        if lifetime not in self._tables:
            return False
        return all(self._owner.get(b) == lifetime for b in blocks)

    def draining(self) -> list[int]:
        return sorted(self._draining)

    def owners(self) -> list[int]:
        return sorted(self._tables)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            free_blocks=len(self._free),
            used_blocks=len(self._owner),
            draining_blocks=sum(len(b) for b in self._draining.values()),
            num_owners=len(self._tables),
        )

    # ----------------------------------------------------------- mutations
    def reserve(self, lifetime: int, num_tokens: int) -> list[int]:
        if lifetime in self._tables or lifetime in self._draining:
            # A draining lifetime id is still in use: reusing it would make
            # release_drained ambiguous and break stale detection.
            raise KVCacheError(f"lifetime {lifetime} already exists")
        if num_tokens < 1:
            raise KVCacheError(
                f"lifetime {lifetime}: reserve needs num_tokens >= 1, got {num_tokens}"
            )
        need = self.blocks_needed(num_tokens)
        # Check before mutating so a failed call leaves the state untouched.
        if need > len(self._free):
            raise KVCacheError(
                f"lifetime {lifetime}: needs {need} blocks, only {len(self._free)} free"
            )
        self._tables[lifetime] = self._take(lifetime, need)
        self._declared[lifetime] = num_tokens
        return list(self._tables[lifetime])

    def grow(self, lifetime: int, total_tokens: int) -> list[int]:
        table = self._table(lifetime)
        need = self.blocks_needed(total_tokens) - len(table)
        if need > len(self._free):
            raise KVCacheError(
                f"lifetime {lifetime}: grow to {total_tokens} tokens needs {need} "
                f"more blocks, only {len(self._free)} free"
            )
        # Never shrinks: the declared count is a high-water mark.
        self._declared[lifetime] = max(self._declared[lifetime], total_tokens)
        if need <= 0:
            return []
        added = self._take(lifetime, need)
        table.extend(added)
        return added

    def free(self, lifetime: int) -> None:
        for b in self._detach(lifetime):
            heapq.heappush(self._free, b)

    def retire(self, lifetime: int) -> None:
        # Owner disappears now (owns() turns False, no more growth), but the
        # blocks may still be written by queued device work, so they are
        # quarantined until the caller confirms the work has drained.
        self._draining[lifetime] = self._detach(lifetime)

    def release_drained(self, lifetime: int) -> None:
        if lifetime not in self._draining:
            raise KVCacheError(f"lifetime {lifetime} is not draining")
        for b in self._draining.pop(lifetime):
            heapq.heappush(self._free, b)

    # ----------------------------------------------------------- checks
    def check_integrity(self) -> None:
        where: dict[int, str] = {}

        def place(block: int, loc: str) -> None:
            if not 0 <= block < self.num_blocks:
                raise KVCacheError(f"block {block} in {loc} is out of range")
            if block in where:
                raise KVCacheError(f"block {block} is in both {where[block]} and {loc}")
            where[block] = loc

        for b in self._free:
            place(b, "free pool")
        if self._tables.keys() != self._declared.keys():
            raise KVCacheError("owner tables and declared token counts disagree")
        for lt, table in self._tables.items():
            for b in table:
                place(b, f"lifetime {lt}")
                if self._owner.get(b) != lt:
                    raise KVCacheError(
                        f"block {b} in lifetime {lt}'s table but owner_of says "
                        f"{self._owner.get(b)}"
                    )
            want = self.blocks_needed(self._declared[lt])
            if self._declared[lt] < 1 or len(table) != want:
                raise KVCacheError(
                    f"lifetime {lt} holds {len(table)} blocks for "
                    f"{self._declared[lt]} tokens (expected {want})"
                )
        for lt, blocks in self._draining.items():
            if lt in self._tables:
                raise KVCacheError(f"lifetime {lt} is both live and draining")
            for b in blocks:
                place(b, f"draining lifetime {lt}")
        if len(where) != self.num_blocks:
            missing = sorted(set(range(self.num_blocks)) - where.keys())
            raise KVCacheError(f"blocks leaked from every set: {missing[:16]}")
        stray = [b for b, lt in self._owner.items() if not where.get(b, "").startswith("lifetime")]
        if stray:
            raise KVCacheError(f"owner_of maps non-owned blocks {sorted(stray)[:16]}")
        # Checked last so misplacement errors above take precedence; a broken
        # heap would silently break lowest-id-first (cross-rank agreement).
        for i in range(1, len(self._free)):
            if self._free[(i - 1) // 2] > self._free[i]:
                raise KVCacheError("free pool lost its heap order")

    def assert_empty(self) -> None:
        self.check_integrity()
        if self._tables or self._draining:
            raise KVCacheError(
                f"KV cache not empty: live lifetimes {self.owners()}, "
                f"draining lifetimes {self.draining()}"
            )

    # ----------------------------------------------------------- private
    def _table(self, lifetime: int) -> list[int]:
        try:
            return self._tables[lifetime]
        except KeyError:
            raise KVCacheError(f"unknown lifetime {lifetime}") from None

    def _take(self, lifetime: int, n: int) -> list[int]:
        # Caller has already checked n <= len(self._free).
        blocks = [heapq.heappop(self._free) for _ in range(n)]
        for b in blocks:
            self._owner[b] = lifetime
        return blocks

    def _detach(self, lifetime: int) -> list[int]:
        table = self._table(lifetime)
        del self._tables[lifetime]
        del self._declared[lifetime]
        for b in table:
            del self._owner[b]
        return table
