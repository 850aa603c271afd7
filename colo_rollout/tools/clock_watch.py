"""The GPU's SM clock and board power, sampled while a measurement runs.

Why: under sustained prefill the chip sits at its power cap and clocks down (issue 16; docs/
benchmarks.md sessions 21, 36 and 38: SM clock 1440-1965 MHz, median 1725, in a P burst on an
H100 against 1980 at rest), so a row's time says as much about the clock it ran at as about
the kernels. bench-speed reports the clock and power beside its prefill rows, so that single
steps and bursts -- and rows from different machines -- can be compared.

Reads NVML through ``torch.cuda.clock_rate`` / ``torch.cuda.power_draw``, which need
nvidia-ml-py (``pynvml``): an optional dependency. Without it, or on CPU, the watch samples
nothing and says why (``reason``). A daemon thread samples every ``period_s`` between enter
and exit, plus once at each end (so a short measurement has two samples); exit waits for the
thread at most ``2 * period_s + 1`` seconds. The reader is injectable (the CPU test).

Imports only the standard library and torch.
"""

from __future__ import annotations

import statistics
import threading
from typing import Callable

import torch

Reader = Callable[[], tuple[float, float]]  # -> (SM clock MHz, board power W)


def nvml_reader(device: torch.device) -> tuple[Reader | None, str | None]:
    """(a reader of ``device``'s SM clock and power, None) -- or (None, why not)."""
    if device.type != "cuda":
        return None, "not a CUDA device"

    def read() -> tuple[float, float]:
        return (float(torch.cuda.clock_rate(device)),
                torch.cuda.power_draw(device) / 1000.0)  # mW -> W

    try:
        read()
    except Exception as e:  # pynvml absent (ModuleNotFoundError) or NVML refusing the query
        return None, f"no NVML reading ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
    return read, None


class ClockWatch:
    """``with ClockWatch(device) as w: ...`` then ``w.summary()``: the SM clock (median, min,
    MHz) and board power (median, max, W) over the block, or None (``w.reason`` says why)."""

    def __init__(self, device: torch.device, period_s: float = 0.05,
                 read: Reader | None = None) -> None:
        if read is None:
            read, self.reason = nvml_reader(device)
        else:
            self.reason = None
        self._read = read
        self.period_s = period_s
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        try:
            self._samples.append(self._read())
        except Exception as e:  # a reading failing midway: keep what was read, say why
            self.reason = f"a reading failed ({type(e).__name__})"
            self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def __enter__(self) -> "ClockWatch":
        if self._read is not None:
            self._sample()
            self._thread = threading.Thread(target=self._run, name="clock-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2 * self.period_s + 1.0)
            self._thread = None
            if self.reason is None:
                self._sample()

    def summary(self) -> dict | None:
        if not self._samples:
            return None
        mhz = [m for m, _ in self._samples]
        watts = [w for _, w in self._samples]
        return {"samples": len(self._samples), "sm_mhz_median": statistics.median(mhz),
                "sm_mhz_min": min(mhz), "power_w_median": statistics.median(watts),
                "power_w_max": max(watts)}
