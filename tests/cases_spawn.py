"""Per-rank bodies of the spawned group's failure tests (tests/test_spawn.py)."""

from __future__ import annotations

import time


def one_rank_stuck(rank: int, world: int) -> None:
    """Rank 1 fails at once; rank 0 is stuck (a user's reward function that never returns)."""
    if rank == 1:
        raise ZeroDivisionError("rank 1's own failure")
    time.sleep(60)


def the_cause_arrives_second(rank: int, world: int) -> None:
    """Rank 0 reports a peer's absence first; rank 1's own error, the cause, comes later."""
    if rank == 0:
        time.sleep(0.2)
        raise RuntimeError("rank 0, step 3: the control exchange did not complete within "
                           "5 s; ranks [1] never arrived (dead or diverged)")
    time.sleep(1.5)
    raise ZeroDivisionError("rank 1's own failure")
