"""Per-rank bodies of the rendezvous / stress tests (gloo CPU ranks)."""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from colo_rollout.multiplex.rendezvous import RendezvousError, make_rendezvous


def _rdv(rank: int, world: int, timeout_s: float, kind: str):
    g = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return make_rendezvous(g, rank, world, timeout_s, kind)


def phase_divergence(rank: int, world: int, kind: str) -> dict:
    """The last rank skips PreD and goes straight to PostD: every rank must raise at once."""
    rdv = _rdv(rank, world, 20.0, kind)
    t0 = time.perf_counter()
    try:
        if rank == world - 1:
            rdv.post_d(5, 3)
        else:
            rdv.pre_d(5, 3)
            rdv.post_d(5, 3)
        return {"raised": None}
    except RendezvousError as e:
        return {"raised": str(e), "seconds": time.perf_counter() - t0}


def stalled_peer(rank: int, world: int, timeout_s: float, kind: str) -> dict:
    """The last rank stalls past the timeout: every other rank raises within the timeout."""
    rdv = _rdv(rank, world, timeout_s, kind)
    rdv.pre_d(1, 0)  # everyone healthy once
    if rank == world - 1:
        time.sleep(3 * timeout_s)
        try:  # late: the others gave up on this rendezvous (shared memory: it says so)
            rdv.post_d(1, 0)
            late = None
        except RendezvousError as e:
            late = str(e)
        return {"raised": None, "stalled": True, "late": late}
    t0 = time.perf_counter()
    try:
        rdv.post_d(1, 0)
        return {"raised": None}
    except RendezvousError as e:
        return {"raised": str(e), "seconds": time.perf_counter() - t0}


def die(rank: int, world: int) -> None:
    if rank == world - 1:
        os._exit(3)
    time.sleep(60)  # the others would wait (e.g. in a collective with the dead rank)


def gather_json(rank: int, world: int) -> list:
    from colo_rollout.runtime.control import all_gather_json

    return all_gather_json({"rank": rank, "xs": list(range(rank))},
                           dist.new_group(backend="gloo"))


def control_exchanges(rank: int, world: int, shm: bool, slot_bytes: int = 4096) -> dict:
    """Exchange messages of every size class -- empty, small, larger than a shared-memory slot
    (falls back to gloo for every rank), different per rank -- for many steps; return what
    each rank received."""
    from colo_rollout.runtime.control import ControlPlane, Message, ShmMailbox

    g = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    cp = ControlPlane(g, rank, world, 30.0, shm=shm)
    if shm:  # a small slot so that the fallback is exercised
        cp.mailbox.close()
        cp.mailbox = ShmMailbox(g, rank, world, 30.0, slot_bytes=slot_bytes)
    got = []
    for step in range(40):
        big = step % 7 == 3 and rank == step % world  # one rank's message outgrows the slot
        msg = Message(rank=rank, step=step, cancels=[f"r{rank}s{step}"] * (1000 if big else 1),
                      sampled=[[step, rank, -0.5, -1, 0]] * rank, span_hint=None if rank else 1.5)
        got.append([(m.rank, m.step, len(m.cancels), m.cancels[0], len(m.sampled), m.span_hint)
                    for m in cp.exchange(msg)])
    used = cp.mailbox is not None
    cp.close()
    return {"got": got, "shm": used, "fallbacks": cp.fallbacks}


def control_stalled_peer(rank: int, world: int, timeout_s: float) -> dict:
    """The last rank stops exchanging: every other rank raises ControlError naming it."""
    from colo_rollout.runtime.control import ControlError, ControlPlane, Message

    g = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    cp = ControlPlane(g, rank, world, timeout_s, shm=True)
    cp.exchange(Message(rank=rank, step=0))
    if rank == world - 1:
        time.sleep(3 * timeout_s)
        try:  # late: the others gave up on this exchange -- never taken as complete
            cp.exchange(Message(rank=rank, step=1))
            late = None
        except ControlError as e:
            late = str(e)
        return {"raised": None, "stalled": True, "late": late}
    t0 = time.perf_counter()
    try:
        cp.exchange(Message(rank=rank, step=1))
        return {"raised": None}
    except ControlError as e:
        return {"raised": str(e), "seconds": time.perf_counter() - t0}
