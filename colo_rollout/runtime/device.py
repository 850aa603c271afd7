"""The device layer: host <-> device transfers, pending results and bounded host waits.

Owns ``h2d`` (host lists to device tensors without a host wait), ``Pending`` (device results
whose D2H copy is enqueued now and awaited later), ``wait_event`` (every host wait on GPU work
goes through it, bounded) and ``DeviceStall`` (a bounded wait that ran out).

Invariants:
  * Host transfers use pinned memory and events: a synchronous copy would block the host until
    the *current* stream drained, i.e. until the other phase's queued work finished, and P/D
    overlap would be gone.
  * A wait is bounded unless its caller passes None; a bounded wait polls, so a wedged GPU
    becomes a DeviceStall instead of a silent hang.
  * On CPU every transfer is a plain tensor and every wait returns at once.

Must not go in here: streams and routing (stream_route.py), collectives (comm.py).
"""

from __future__ import annotations

import time

import numpy as np
import torch


def h2d(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, enqueued on the current stream without a host wait."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def h2d_packed(arrays, device: torch.device) -> list[torch.Tensor]:
    """Host int64 arrays (numpy, 1-D or 2-D) as device tensors through ONE pinned buffer and
    ONE copy, enqueued on the current stream without a host wait; the results are views of
    that one device tensor, in order and in the arrays' shapes. (A P step's index tensors:
    one pinned allocation and copy instead of one per list -- each ``h2d`` of a 4k-entry
    list costs ~0.15 ms of host time.)"""
    flat = np.concatenate([np.asarray(a, dtype=np.int64).ravel() for a in arrays]
                          or [np.zeros(0, np.int64)])
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        dev = torch.empty(host.shape, dtype=torch.int64, pin_memory=True).copy_(host)
        dev = dev.to(device, non_blocking=True)
    else:
        dev = host.to(device, copy=True)
    out, at = [], 0
    for a in arrays:
        n = int(np.prod(np.shape(a)))
        out.append(dev[at : at + n].view(np.shape(a)))
        at += n
    return out


class DeviceStall(RuntimeError):
    """A host wait for GPU work outlasted its bound: a collective inside it did not complete
    (a peer stalled, died or diverged). Graph-captured collectives (D's) are not watched by
    NCCL's own watchdog, so this bound is what turns their hang into an error."""


def wait_event(event, timeout_s: float | None, what: str) -> None:
    """Wait on the host for ``event`` (a CUDA event, or anything with ``query``/``synchronize``),
    at most ``timeout_s`` seconds (None: unbounded). Bounded waits poll ``query`` -- a spin, as
    cudaEventSynchronize's default is -- so the wait can be cut short; raises DeviceStall."""
    if timeout_s is None:
        event.synchronize()
        return
    if event.query():
        return
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise DeviceStall(f"{what}: the GPU work was not done within {timeout_s:g} s (a "
                              "collective in it did not complete: a peer stalled, died or "
                              "diverged)")


class Pending:
    """Device tensors whose host values are needed later: the D2H copy is enqueued now on the
    producing stream; ``get`` waits for that copy only."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._event = None
        if tensors and tensors[0].is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self._host, tensors):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = list(tensors)

    def done(self) -> bool:
        """The values are on the host already (get would not wait)."""
        return self._event is None or self._event.query()

    def wait(self, timeout_s: float | None = None, what: str = "device->host copy") -> None:
        if self._event is not None:
            wait_event(self._event, timeout_s, what)

    def get(self, timeout_s: float | None = None, what: str = "device->host copy") -> list[list]:
        self.wait(timeout_s, what)
        return [h.tolist() for h in self._host]

    def tensors(self, timeout_s: float | None = None,
                what: str = "device->host copy") -> list[torch.Tensor]:
        """The host copies as tensors (no Python lists: large copies stay cheap to read)."""
        self.wait(timeout_s, what)
        return list(self._host)
