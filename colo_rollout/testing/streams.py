"""Host-emulated device streams for CPU ranks: FIFO executors, events, and a residency limit.

On a GPU, P runs on a background stream and D on its graph stream; kernels of one stream run in
enqueue order, and a collective kernel occupies device resources until all its peers join. Two
collectives on different communicators can therefore wait on each other across ranks when they
were enqueued in different orders (the crossed-path stall of paper section 3).

On CPU ranks we model exactly that, so the protocol is exercised without a GPU:
  * ``Stream``: one thread executing submitted callables in FIFO order (a CUDA stream);
  * ``Event``: recorded on one stream, waited on by another (cross-stream edges);
  * ``Residency``: how many collectives may be in flight on this rank's "device" at once. With a
    limit of 1, a collective that waits for absent peers blocks every other collective of the
    rank -- the resource coupling that turns different enqueue orders into a global cycle.

Must not go in here: scheduling decisions (which phase runs when): that is the turnstile's.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class StreamError(RuntimeError):
    """Work submitted to a stream raised; re-raised on ``synchronize``."""


class Event:
    def __init__(self) -> None:
        self._done = threading.Event()

    def set(self) -> None:
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def query(self) -> bool:
        return self._done.is_set()


class Stream:
    def __init__(self, name: str) -> None:
        self.name = name
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"stream-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object]) -> Event:
        """Enqueue ``fn``; the returned event is set once it (and all before it) ran."""
        ev = Event()
        self._q.put((fn, ev))
        return ev

    def record(self) -> Event:
        return self.submit(lambda: None)

    def wait_event(self, ev: Event) -> None:
        """Later work of this stream starts only after ``ev`` (a cross-stream edge)."""
        self.submit(ev.wait)

    def synchronize(self, timeout: float | None = None) -> None:
        if not self.record().wait(timeout):
            raise StreamError(f"stream {self.name}: not drained within {timeout} s")
        if self._error is not None:
            err, self._error = self._error, None
            raise StreamError(f"stream {self.name}: {err}") from err

    def close(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, ev = item
            try:
                if self._error is None:  # after a failure, later work is skipped (poisoned)
                    fn()
            except BaseException as e:  # noqa: BLE001 - surfaced on synchronize()
                self._error = e
            finally:
                ev.set()


class Residency:
    """At most ``limit`` collectives in flight on this rank's emulated device."""

    def __init__(self, limit: int = 1) -> None:
        if limit < 1:
            raise ValueError(f"residency limit must be >= 1, got {limit}")
        self._sem = threading.Semaphore(limit)

    def __enter__(self) -> "Residency":
        self._sem.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._sem.release()
