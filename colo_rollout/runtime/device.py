"""The device layer: host <-> device transfers, pending results and bounded host waits.

Owns ``h2d`` (host lists to device tensors without a host wait), ``h2d_packed`` and its
``PinnedStage`` (many arrays in one copy), ``Pending`` (device results
whose D2H copy is enqueued now and awaited later), ``wait_event`` (every host wait on GPU work
goes through it, bounded), ``DeviceStall`` (a bounded wait that ran out) and ``fp32_norms``
(the finiteness checks' one pass over many tensors).

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


class PinnedStage:
    """A pinned host buffer that one caller's packed copies reuse (``h2d_packed``'s
    ``stage``): no pinned allocation and no second host copy per step -- the arrays are
    concatenated straight into it.

    Invariant: the buffer is rewritten only once the copy that last read it has completed
    (its event, queried: never a host wait); while that copy is still queued a new buffer is
    taken (the old one stays alive until its copy is done: torch's host allocator records
    the copy on it) and kept from then on."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    def take(self, n: int) -> torch.Tensor:
        """A pinned int64 buffer of ``n`` entries, free to write now."""
        have = 0 if self._host is None else self._host.numel()
        if have < n:  # grown geometrically: a few allocations over a run
            self._host = torch.empty(max(n, 2 * have, 1024), dtype=torch.int64,
                                     pin_memory=True)
        elif self._event is not None and not self._event.query():  # its copy still queued
            self._host = torch.empty(have, dtype=torch.int64, pin_memory=True)
        return self._host[:n]

    @property
    def capacity(self) -> int:
        """Entries of the current buffer (0 before the first take)."""
        return 0 if self._host is None else self._host.numel()

    def copied(self) -> None:
        """The buffer's copy has been enqueued on the current stream."""
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record()


def h2d_packed(arrays, device: torch.device, stage: PinnedStage | None = None
               ) -> list[torch.Tensor]:
    """Host int64 arrays (numpy or lists, 1-D or 2-D) as device tensors through ONE pinned
    buffer and ONE copy, enqueued on the current stream without a host wait; the results are
    views of that one device tensor, in order and in the arrays' shapes. (A P step's index
    tensors: one copy instead of one per list -- each ``h2d`` of a 4k-entry list costs
    ~0.15 ms of host time.) ``stage``: the caller's reused pinned buffer (CUDA), else a
    fresh one per call."""
    arrays = [np.asarray(a, dtype=np.int64) for a in arrays]
    sizes = [a.size for a in arrays]
    flat = [a.ravel() for a in arrays] or [np.zeros(0, np.int64)]
    if device.type == "cuda":
        n = sum(sizes)
        host = (stage.take(n) if stage is not None
                else torch.empty(n, dtype=torch.int64, pin_memory=True))
        np.concatenate(flat, out=host.numpy())
        dev = host.to(device, non_blocking=True)
        if stage is not None:
            stage.copied()
    else:
        dev = torch.from_numpy(np.concatenate(flat))  # a copy of the caller's arrays
    parts = torch.split(dev, sizes) if arrays else ()
    return [t.view(a.shape) if a.ndim != 1 else t for t, a in zip(parts, arrays)]


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


def fp32_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norms of ``tensors`` in fp32, stacked: NaN and inf carry through, fp16 values
    cannot overflow them. A few fused kernels for any number of tensors (torch's foreach
    norm); one per tensor where this torch's takes no dtype."""
    try:
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    except TypeError:
        return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32)
                            for t in tensors])
