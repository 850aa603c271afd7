"""PreD / PostD rendezvous: the two all-rank CPU phases of a turnstile round.

Owns the host-side synchronisation only. A rendezvous is one all-reduce of a two-element int
tensor on the gloo control group: it enqueues no GPU collective, waits on no CUDA event or
stream, and carries no endpoint value -- only a one-hot phase tag, so ranks that disagree about
which phase they are in (a diverged protocol) are detected instead of silently pairing a PreD
with a PostD. The wait is bounded: a dead or diverged peer makes every rank raise
``RendezvousError`` (naming its rank, epoch and boundary) within ``timeout_s``.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

PRE_D, POST_D = 0, 1
_NAMES = {PRE_D: "PreD", POST_D: "PostD"}


class RendezvousError(RuntimeError):
    """A rendezvous did not complete in time, or ranks disagreed on the phase."""


class Rendezvous:
    def __init__(self, group: dist.ProcessGroup, rank: int, world: int,
                 timeout_s: float) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._buf = torch.zeros(2, dtype=torch.int32)
        self.count = 0
        self.seconds = 0.0  # total host time spent inside rendezvous (cost accounting)

    def pre_d(self, epoch: int, boundary: int) -> None:
        self._meet(PRE_D, epoch, boundary)

    def post_d(self, epoch: int, boundary: int) -> None:
        self._meet(POST_D, epoch, boundary)

    def _meet(self, phase: int, epoch: int, boundary: int) -> None:
        t0 = time.perf_counter()
        self.count += 1
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
        self.seconds += time.perf_counter() - t0
