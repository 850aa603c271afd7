"""A watch on one thread's armed intervals: when one outlasts its limit, that thread's Python
stack is printed once (diagnosis of stalled rounds: where each rank's host waits).

Why not ``faulthandler.dump_traceback_later``: it dumps every thread from a C watchdog without
the GIL, and it crashed a CPU test worker (SIGSEGV) while torch's threads were running. This
watch reads the armed thread's frame with the GIL held (``sys._current_frames``), which it can
take whenever the watched thread waits in a call that released it -- a CUDA synchronize, a
collective, a sleep-poll -- the waits a stall is made of.

Invariants: one daemon thread per watch, idle (blocked on a condition, no GIL) while disarmed
or before the deadline; at most one print per armed interval; ``close`` stops the thread.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback


class StallWatch:
    def __init__(self, seconds: float, file=None) -> None:
        if not seconds > 0:
            raise ValueError(f"stall watch needs a limit > 0 seconds, got {seconds}")
        self.seconds = seconds
        self._file = file  # None: sys.stderr at print time
        self._cv = threading.Condition()
        self._deadline: float | None = None
        self._label = ""
        self._ident = 0
        self._stop = False
        self.printed = 0
        self._thread = threading.Thread(target=self._run, name="colo-stall-watch", daemon=True)
        self._thread.start()

    def arm(self, label: str) -> None:
        """Start an interval on the calling thread, named ``label`` in the print."""
        with self._cv:
            self._label = label
            self._ident = threading.get_ident()
            self._deadline = time.monotonic() + self.seconds
            self._cv.notify()

    def disarm(self) -> None:
        with self._cv:
            self._deadline = None

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join()

    def _run(self) -> None:
        with self._cv:
            while not self._stop:
                if self._deadline is None:
                    self._cv.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                frame = sys._current_frames().get(self._ident)
                stack = "".join(traceback.format_stack(frame)) if frame else "(thread gone)\n"
                out = self._file or sys.stderr
                out.write(f"[stall watch] {self._label}: still running after "
                          f"{self.seconds:g} s, at\n{stack}")
                out.flush()
                self.printed += 1
                self._deadline = None  # once per interval
