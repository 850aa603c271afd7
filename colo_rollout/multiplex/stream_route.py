"""Stream routes of P/D multiplexing on a GPU (DESIGN.md item 8; the paper's selective route).

Owns, for one rank: D's stream, P's background stream, the routing of P's registered
full-group AllReduce onto D's stream on crossed paths, device->host result transfers that do
not stall the other phase, and optional CUDA-event timing of P segments and D iterations.

Why: the turnstile makes every rank *host-enqueue* D iteration i before P's collective at
boundary r. Host order is not device order across two streams, so on a crossed path (ADP > 1
and ATP > 1: P's full-group AllReduce shares ranks with D's ATP ReduceScatter and full
AllGather) the kernels could still meet in different orders on different ranks and stall. The
route puts that one collective on D's stream, where stream FIFO orders it after D iteration i
on every rank; every other P kernel stays on P's stream and overlaps D.

Invariants:
  * D work (inputs, forward, sampling) is enqueued under ``d()``, P work under ``p()``; nothing
    in either waits on the host for the other phase's stream.
  * A routed collective = event on P's stream -> D's stream waits -> collective enqueued on D's
    stream -> event on D's stream -> P's stream waits. P's next kernel sees the result; D's
    next iteration runs after the collective (its inputs never depend on it).
  * Host transfers go through runtime/device.py (pinned memory and events), never a
    synchronous copy that would wait for the other phase's queued work.
  * On CPU every context is a no-op and nothing is routed: host order is device order.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass

import torch

from colo_rollout.runtime.device import wait_event


def routes_p_collective(route: str, adp: int, atp: int, p_graphs: bool = False) -> bool:
    """Whether P's full-group AllReduce goes on D's stream (engine.stream_route):

      * ``auto``: on a crossed path (ADP > 1 and ATP > 1), where the turnstile's host order
        alone is known to be insufficient; and wherever P's MoE blocks are graphs and there is
        more than one rank (ADP x ATP). Without the route, P's and D's collectives then run on two
        communicators over the same GPUs at once, which NCCL gives no forward-progress
        guarantee for; with graphed P (its GPU work no longer paced by its host enqueue) Fine
        stalled 24-100 s on EP2/ADP2 (9 of 14 Fine cells over sessions 6-7), and not with the
        route. NCCL's watchdog caught P's AllReduce itself hung on both ranks, the same
        sequence number launched by both, beside D's graphed collectives (docs/benchmarks.md).
        Eager P keeps full stream concurrency there (no stall seen).
      * ``always``: on any layout; ``off``: never (the unsafe control)."""
    if route == "always":
        return True
    if route == "off":
        return False
    return (adp > 1 and atp > 1) or (p_graphs and adp * atp > 1)


HIGH_PRIORITY = -1  # a CUDA stream priority above the default 0 (lower number = higher)


def stream_priorities(favour: str) -> tuple[int, int]:
    """(D stream, P stream) CUDA priorities for engine.stream_priority ``favour``: the favoured
    phase's blocks get freed SMs first when both phases have kernels queued."""
    table = {"decode": (HIGH_PRIORITY, 0), "prefill": (0, HIGH_PRIORITY), "equal": (0, 0)}
    if favour not in table:
        raise ValueError(f"stream priority {favour!r}: expected one of {sorted(table)}")
    return table[favour]


@dataclass(frozen=True)
class Span:
    """A P segment or D iteration, in seconds: as the host enqueued it (the engine's timeline,
    ``perf_counter``) or as the GPU ran it (``StreamRoute.gpu_spans``, since the route's first
    event). ``epoch``: the P epoch it belongs to or ran inside (-1: none)."""

    kind: str
    start: float
    end: float
    epoch: int = -1


class StreamRoute:
    """P and D streams of one rank. ``active`` only in PD modes on CUDA."""

    def __init__(self, device: torch.device, active: bool, route_p_collective: bool,
                 timing: bool = False, favour: str = "prefill") -> None:
        self.active = active and device.type == "cuda"
        self.route_p_collective = self.active and route_p_collective
        self.timing = device.type == "cuda" and timing  # inactive: marks the current stream
        # The favoured phase's stream has the higher priority: when both phases have kernels
        # queued, the block scheduler hands it freed SMs first. Favouring P is the default: on
        # the bench (P host-bound, D graph-replayed) it gave Fine a lower makespan, p99 TTFT
        # and D wait than favouring D, on 1 and 2 H200 (docs/benchmarks.md).
        d_prio, p_prio = stream_priorities(favour)
        self.d_stream = torch.cuda.Stream(device, priority=d_prio) if self.active else None
        self.p_stream = torch.cuda.Stream(device, priority=p_prio) if self.active else None
        self.routed = 0  # P collectives placed on D's stream so far
        self._in_p = False
        # the latest marked intervals (bounded as the recorder's timeline: a long run)
        self._marks: collections.deque[tuple[str, int, object, object]] = collections.deque(
            maxlen=131072)
        self._base = None
        if self.active:
            torch.cuda.synchronize(device)  # weights, KV and tables were made on the default stream

    @classmethod
    def for_layout(cls, device: torch.device, pd: bool, adp: int, atp: int, route: str,
                   timing: bool, favour: str = "prefill", p_graphs: bool = False) -> StreamRoute:
        """A route per ``routes_p_collective``; ``route="off"`` keeps the streams but drops the
        route (the unsafe control of the crossed-path experiment)."""
        return cls(device, pd, routes_p_collective(route, adp, atp, p_graphs), timing, favour)

    # ------------------------------------------------------------------ phase contexts
    @contextlib.contextmanager
    def p(self):
        if not self.active:
            yield
            return
        self._in_p = True
        try:
            with torch.cuda.stream(self.p_stream):
                yield
        finally:
            self._in_p = False

    def d(self):
        return torch.cuda.stream(self.d_stream) if self.active else contextlib.nullcontext()

    # ------------------------------------------------------------------ the selective route
    def p_collective(self, fn, x: torch.Tensor) -> None:
        """Run P's registered full-group collective ``fn(x)`` (in place on ``x``)."""
        if not (self.route_p_collective and self._in_p):
            fn(x)
            return
        ready = torch.cuda.Event()
        ready.record(self.p_stream)
        self.d_stream.wait_event(ready)
        with torch.cuda.stream(self.d_stream):
            x.record_stream(self.d_stream)  # allocated on P's stream, used on D's
            fn(x)
            done = torch.cuda.Event()
            done.record(self.d_stream)
        self.p_stream.wait_event(done)
        self.routed += 1

    # ------------------------------------------------------------------ fences and timing
    def fence_p(self, timeout_s: float | None) -> None:
        """Global-Complete's whole-P GPU fence: the host waits until P's stream drained, at most
        ``timeout_s`` seconds (DeviceStall after), like every host wait on GPU work."""
        if self.active:
            done = torch.cuda.Event()
            done.record(self.p_stream)
            wait_event(done, timeout_s, "P epoch (the Global-Complete fence)")

    def mark(self, kind: str, epoch: int = -1):
        """Context: record CUDA events around work enqueued on ``kind``'s stream."""
        if not self.timing:
            return contextlib.nullcontext()
        return self._mark(kind, epoch)

    @contextlib.contextmanager
    def _mark(self, kind: str, epoch: int):
        if not self.active:
            stream = torch.cuda.current_stream()
        else:
            stream = self.p_stream if kind == "P" else self.d_stream
        if self._base is None:
            self._base = torch.cuda.Event(enable_timing=True)
            self._base.record(stream)
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._marks.append((kind, epoch, start, end))

    def clear_marks(self) -> None:
        """Forget the marked intervals so far (a measurement's own spans start here)."""
        self._marks.clear()

    def gpu_spans(self) -> list[Span]:
        """Every marked interval as the GPU ran it, seconds since the route's first event
        (synchronizes the device)."""
        if not self._marks:
            return []
        torch.cuda.synchronize()
        base = self._base
        return [Span(kind, base.elapsed_time(s) / 1e3, base.elapsed_time(e) / 1e3, epoch)
                for kind, epoch, s, e in self._marks]

    def synchronize(self) -> None:
        """Both phases drained (before weights change or groups are torn down)."""
        if self.active:
            torch.cuda.synchronize(self.d_stream.device)
