"""PreD / PostD rendezvous: the two all-rank CPU phases of a turnstile round.

Owns the host-side synchronisation only. Neither implementation enqueues a GPU collective,
waits on a CUDA event or stream, or carries an endpoint value -- only a phase tag, so ranks that
disagree about which phase they are in (a diverged protocol) are detected instead of silently
pairing a PreD with a PostD. Waits are bounded: a dead or diverged peer makes every rank raise
``RendezvousError`` (naming its rank, epoch and boundary) within ``timeout_s``.

  * ``Rendezvous``: one all-reduce of a two-element int tensor on the gloo control group; works
    across hosts.
  * ``ShmRendezvous``: all ranks on one host; a shared-memory arrival counter per rank, spun on
    with ``sched_yield`` -- no sockets, no kernel round trip per peer. ``make_rendezvous`` picks
    it when every rank of the group runs on the same host.
"""

from __future__ import annotations

import datetime
import time

import numpy as np
import torch
import torch.distributed as dist

from colo_rollout.runtime.shm import arrive_and_wait, open_shared, same_host

PRE_D, POST_D = 0, 1
_NAMES = {PRE_D: "PreD", POST_D: "PostD"}


class RendezvousError(RuntimeError):
    """A rendezvous did not complete in time, or ranks disagreed on the phase."""


class _Phases:
    """PreD/PostD entry points and cost accounting; subclasses implement ``_wait``."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0  # total host time spent inside rendezvous (cost accounting)

    def pre_d(self, epoch: int, boundary: int) -> None:
        self._meet(PRE_D, epoch, boundary)

    def post_d(self, epoch: int, boundary: int) -> None:
        self._meet(POST_D, epoch, boundary)

    def _meet(self, phase: int, epoch: int, boundary: int) -> None:
        t0 = time.perf_counter()
        self.count += 1
        self._wait(phase, epoch, boundary)
        self.seconds += time.perf_counter() - t0

    def _wait(self, phase: int, epoch: int, boundary: int) -> None:
        raise NotImplementedError


class Rendezvous(_Phases):
    def __init__(self, group: dist.ProcessGroup, rank: int, world: int,
                 timeout_s: float) -> None:
        super().__init__()
        self.group = group
        self.rank = rank
        self.world = world
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._buf = torch.zeros(2, dtype=torch.int32)

    def _wait(self, phase: int, epoch: int, boundary: int) -> None:
        if self.world > 1:
            self._buf.zero_()
            self._buf[phase] = 1
            work = dist.all_reduce(self._buf, group=self.group, async_op=True)
            try:
                work.wait(timeout=self.timeout)
            except Exception as e:  # gloo raises RuntimeError on timeout / peer loss
                raise RendezvousError(
                    f"rank {self.rank}, epoch {epoch}, boundary {boundary}: "
                    f"{_NAMES[phase]} rendezvous did not complete within "
                    f"{self.timeout.total_seconds():g} s (a peer is dead or diverged): {e}"
                ) from e
            if int(self._buf[phase]) != self.world:
                raise RendezvousError(
                    f"rank {self.rank}, epoch {epoch}, boundary {boundary}: ranks disagree on "
                    f"the rendezvous phase ({int(self._buf[PRE_D])} in PreD, "
                    f"{int(self._buf[POST_D])} in PostD)")


class ShmRendezvous(_Phases):
    """Same-host rendezvous over shared memory.

    Layout: int64 ``arrive[world]`` (rank r's count of rendezvous entered) and int64
    ``phase[world, 2]`` (the phase of r's rendezvous number n, at slot n % 2). A rank writes its
    phase, then its count, then spins until every count reaches its own. A peer can be at most
    one rendezvous ahead (it cannot pass the next one without us), so slot n % 2 still holds
    every peer's phase for rendezvous n when we check it. Store order is relied on (x86-TSO;
    numpy element stores), which holds on the GPU hosts this targets.
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, world: int, timeout_s: float) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        self.timeout_s = timeout_s
        self._mm = open_shared(group, rank, 8 * world * 3)
        arr = np.ndarray((world * 3,), dtype=np.int64, buffer=self._mm)  # plain view: fast
        self._arrive = arr[:world]
        self._phase = arr[world:].reshape(world, 2)
        self._n = 0

    def _wait(self, phase: int, epoch: int, boundary: int) -> None:
        self._n += 1
        n, slot = self._n, self._n % 2
        self._phase[self.rank, slot] = phase
        gone, late = arrive_and_wait(self._arrive, self.rank, n, self.timeout_s)
        if gone:
            raise RendezvousError(
                f"rank {self.rank}, epoch {epoch}, boundary {boundary}: ranks {gone} gave up "
                f"on a {_NAMES[phase]} rendezvous (their timeout passed before every rank "
                "arrived): the ranks are out of step")
        if late:
            raise RendezvousError(
                f"rank {self.rank}, epoch {epoch}, boundary {boundary}: {_NAMES[phase]} "
                f"rendezvous did not complete within {self.timeout_s:g} s; ranks {late} "
                "never arrived (dead or diverged)")
        phases = self._phase[:, slot]
        if (phases != phase).any():
            raise RendezvousError(
                f"rank {self.rank}, epoch {epoch}, boundary {boundary}: ranks disagree on the "
                f"rendezvous phase ({int((phases == PRE_D).sum())} in PreD, "
                f"{int((phases == POST_D).sum())} in PostD)")

    def close(self) -> None:
        self._arrive = self._phase = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def make_rendezvous(group: dist.ProcessGroup, rank: int, world: int, timeout_s: float,
                    kind: str = "auto"):
    """``kind``: "auto" (shared memory when all ranks share a host, else gloo), "shm", "gloo".
    Collective over ``group``."""
    if kind == "gloo" or world == 1:
        return Rendezvous(group, rank, world, timeout_s)
    if kind == "shm" or (kind == "auto" and same_host(group, world)):
        return ShmRendezvous(group, rank, world, timeout_s)
    return Rendezvous(group, rank, world, timeout_s)
