"""CUDA-graph timing shared by the GPU kernel scripts (gpu_attention.py, gpu_prefill_attention.py,
gpu_fused_moe.py): a list of calls warmed on a side stream, captured in one graph, replayed;
and the one-line print of a result row (``print_row``).

Imports only torch, so each script still runs on a bare CUDA host with torch and triton."""

from __future__ import annotations

import statistics

import torch


def print_row(row: dict) -> None:
    """One result row on a line: ``key=value`` pairs, floats to 4 significant digits."""
    print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in row.items()), flush=True)


def capture(fns) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph of the calls ``fns`` in order, the last call's output as captured). The first
    two calls run once on a side stream first (allocator, lazy inits, Triton compiles)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(g):
        for fn in fns:
            out = fn()
    return g, out


def graph_time(fns, reps: int = 20, warm: int = 3) -> float:
    """Median seconds of one call: ``fns``' calls captured in one CUDA graph, replayed
    ``warm`` times untimed, then ``reps`` times timed by CUDA events."""
    g, _ = capture(fns)
    for _ in range(warm):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(fns))
    del g
    return statistics.median(times)
