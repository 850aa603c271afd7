"""Shared memory between the ranks of one host: the segment the host-agreement paths use.

Owns making one mapped segment visible to every rank of a group (rank 0 creates a file in
/dev/shm, broadcasts its name, every rank maps it, rank 0 unlinks it once all have), the
same-host check that decides whether it can be used, and the bounded spin that waits on it.
Users lay out their own arrays on top (the rendezvous' arrival counters, the control plane's
mailboxes).

Plain mmap instead of multiprocessing.shared_memory: that registers every attach with a
resource tracker, which either unlinks the segment when a rank exits or, when spawned ranks
share the parent's tracker, double-unregisters it.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist

# Waits spin with sched_yield for SPIN_S (host agreement on a GPU host takes microseconds),
# then sleep between checks, doubling from 50 us to 200 us (a longer nap would add its own
# latency to every wait past the spin): a long wait -- a peer busy with a
# CPU P step, 8 ranks on 2 cores -- must not take the CPU from the rank that is working.
SPIN_S = 0.002
SLEEP_S = (50e-6, 2e-4)


def same_host(group: dist.ProcessGroup, world: int) -> bool:
    """True when every rank of ``group`` runs on this host (hostname digest all-gather)."""
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    h = torch.tensor([int.from_bytes(digest[:8], "little") & 0x7FFFFFFFFFFFFFFF],
                     dtype=torch.int64)
    allh = [torch.zeros_like(h) for _ in range(world)]
    dist.all_gather(allh, h, group=group)
    return all(int(x) == int(h) for x in allh)


def open_shared(group: dist.ProcessGroup, rank: int, nbytes: int) -> mmap.mmap:
    """Collective over ``group``: one zeroed segment of ``nbytes`` mapped by every rank. The
    file is unlinked before returning; the memory lives until the last rank unmaps it."""
    path = torch.zeros(256, dtype=torch.uint8)
    if rank == 0:
        d = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, name = tempfile.mkstemp(prefix="colo_shm_", dir=d)
        os.ftruncate(fd, nbytes)  # a new file reads as zeros
        os.close(fd)
        raw = name.encode()
        path[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(path, src=dist.get_global_rank(group, 0), group=group)
    name = bytes(path.tolist()).rstrip(b"\0").decode()
    fd = os.open(name, os.O_RDWR)
    mm = mmap.mmap(fd, nbytes)
    os.close(fd)
    dist.barrier(group=group)  # every rank has it mapped
    if rank == 0:
        os.unlink(name)
    return mm


def wait_until(ready, timeout_s: float) -> bool:
    """Spin on ``ready()`` (sched_yield, then short sleeps); False if ``timeout_s`` passed."""
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    nap = SLEEP_S[0]
    while not ready():
        now = time.perf_counter()
        if now > deadline:
            return False
        if now - t0 < SPIN_S:
            os.sched_yield()
        else:
            time.sleep(nap)
            nap = min(2 * nap, SLEEP_S[1])
    return True


def arrive_and_wait(arrive, rank: int, n: int, timeout_s: float) -> tuple[list[int], list[int]]:
    """Mark ``rank`` as entered into round ``n`` of a shared arrival-counter array and wait
    until every rank has. Returns (ranks that gave up, ranks that had not arrived after
    ``timeout_s``); both empty: all did. A rank that times out marks its entry -n, so a peer
    arriving later finds the round abandoned (the first list) instead of taking it as
    complete (found by fault injection: a late rank applied an exchange its peer had given up
    on); every later round then finds it too. The caller writes its round's data before
    calling (stores are ordered)."""
    arrive[rank] = n
    wait_until(lambda: int(arrive.min()) >= n or int(arrive.min()) < 0, timeout_s)
    # (a peer that gave up ends the wait early: the ranks it waited for are named, and this
    # rank gives up too)
    late = [r for r in range(len(arrive)) if 0 <= arrive[r] < n]
    if late:
        arrive[rank] = -n
        return [], late
    return [r for r in range(len(arrive)) if arrive[r] < 0], []
