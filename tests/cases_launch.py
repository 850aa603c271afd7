"""Targets for the launcher tests (tests/test_wedged_exit.py): run under ``launch._launch`` in a
subprocess that looks like one torchrun rank."""

from __future__ import annotations

import threading

from colo_rollout.runtime import parallel
from colo_rollout.runtime.device import DeviceStall


def stall(rank: int, world: int, **_) -> None:
    """A step's bounded wait gave up: the device is wedged."""
    raise DeviceStall(f"rank {rank}, step 12: D tokens: the GPU work was not done within 1 s")


def peer_died_device_wedged(rank: int, world: int, **_) -> None:
    """Another error (a peer's death, seen by the control exchange) while this rank's device
    holds a collective that will never complete: the teardown's drain never returns."""
    never = threading.Event()
    parallel._device_sync = never.wait  # a synchronize that blocks forever
    raise RuntimeError("control exchange: rank 1 sent nothing within 1 s")


def fine(rank: int, world: int, **_) -> dict:
    return {"rank": rank}
