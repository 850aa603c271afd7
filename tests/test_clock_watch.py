"""The SM clock / power watch bench-speed reads beside its prefill rows
(colo_rollout/tools/clock_watch.py): samples from enter to exit through an injected reader,
the summary's statistics, a reading failing midway, no NVML off CUDA; and the rows' table
line (tools/bench_speed.py: ``_clock_lines``)."""

from __future__ import annotations

import itertools
import time

import torch

from colo_rollout.tools.bench_speed import _clock_lines
from colo_rollout.tools.clock_watch import ClockWatch, nvml_reader

CPU = torch.device("cpu")


def test_samples_from_enter_to_exit_and_summarises_them():
    values = itertools.cycle([(1980.0, 300.0), (1725.0, 700.0), (1440.0, 711.0)])
    with ClockWatch(CPU, period_s=0.005, read=lambda: next(values)) as w:
        deadline = time.monotonic() + 5.0  # (a loaded machine may schedule the thread late)
        while w.summary()["samples"] < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
    s = w.summary()
    assert w.reason is None and s["samples"] >= 4  # one at each end and the thread's
    assert s["sm_mhz_min"] == 1440.0 and s["power_w_max"] == 711.0
    assert 1440.0 <= s["sm_mhz_median"] <= 1980.0
    # nothing more is sampled after exit (the thread was stopped and joined)
    n = s["samples"]
    time.sleep(0.03)
    assert w.summary()["samples"] == n
    # a short block still has both ends' samples
    with ClockWatch(CPU, period_s=10.0, read=lambda: (1900.0, 650.0)) as w:
        pass
    assert w.summary() == {"samples": 2, "sm_mhz_median": 1900.0, "sm_mhz_min": 1900.0,
                           "power_w_median": 650.0, "power_w_max": 650.0}


def test_a_failing_reading_keeps_the_samples_before_it():
    calls = itertools.count()

    def read():
        if next(calls) >= 2:
            raise RuntimeError("NVML gone")
        return (1800.0, 500.0)

    with ClockWatch(CPU, period_s=0.005, read=read) as w:
        deadline = time.monotonic() + 5.0
        while w.reason is None and time.monotonic() < deadline:
            time.sleep(0.005)
    assert w.summary()["samples"] == 2 and "RuntimeError" in w.reason


def test_no_reading_off_cuda():
    read, why = nvml_reader(CPU)
    assert read is None and "not a CUDA device" in why
    with ClockWatch(CPU) as w:
        pass
    assert w.summary() is None and w.reason == why


def test_the_rows_clock_line():
    clock = {"samples": 9, "sm_mhz_median": 1725.4, "sm_mhz_min": 1440.0,
             "power_w_median": 690.2, "power_w_max": 711.6}
    rows = [{"shape": "1 x 4096", "clock": clock, "burst_clock": None},
            {"shape": "8 x 1024", "clock": None, "burst_clock": clock}]
    (line,) = _clock_lines(rows)
    assert "1 x 4096 single 1725 MHz (min 1440), 690 W (max 712)" in line
    assert "8 x 1024 b2b 1725 MHz" in line and "8 x 1024 single" not in line
    assert _clock_lines([{"shape": "x", "clock": None, "clock_note": "no NVML reading"}]) == [
        "  (no SM clock read: no NVML reading)"]
    assert _clock_lines([{"shape": "x", "clock": None}]) == []
