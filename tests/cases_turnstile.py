"""Per-rank bodies of the rendezvous / stress tests (gloo CPU ranks)."""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from colo_rollout.inference.rendezvous import RendezvousError, make_rendezvous


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
        return {"raised": None, "stalled": True}
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
    from colo_rollout.inference.control import all_gather_json

    return all_gather_json({"rank": rank, "xs": list(range(rank))},
                           dist.new_group(backend="gloo"))
