"""Per-rank timeline of P segments and D iterations from a bench.json, in a time window.

    python scripts/plot_timeline.py runs/bench_gpu_large/bench.json --variants normal fine-bal \
        [--window 2.8 2.95] --out timeline.png

Reads ``timelines_by_rank`` (every rank, session 7 on) or ``timelines_rank0`` (older files).
Spans are clipped to the window; a span running past its right edge is drawn to the edge and
its full length printed on stdout, so a stall shows as a bar that leaves the plot."""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_json")
    ap.add_argument("--variants", nargs="+", required=True,
                    help="the bench's variant names (its table's rows, e.g. normal fine-bal)")
    ap.add_argument("--window", nargs=2, type=float, default=None, metavar=("START", "END"),
                    help="seconds since the run's first work (default: every span)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    try:
        with open(args.bench_json) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        ap.exit(2, f"error: {args.bench_json}: {e}\n")
    ranks = data.get("timelines_by_rank") or (
        [data["timelines_rank0"]] if "timelines_rank0" in data else None)
    if not ranks:
        ap.exit(2, f"error: {args.bench_json}: no timelines (timelines_by_rank): not a "
                   "bench.json of `colo-rollout bench`\n")
    have = sorted({name for tl in ranks for name in tl})
    missing = [v for v in args.variants if not any(tl.get(v) for tl in ranks)]
    if missing:
        ap.exit(2, f"error: {args.bench_json}: no timeline of variant {missing[0]!r} "
                   f"(it has {', '.join(have) or 'none'})\n")
    if args.window is not None and not args.window[0] < args.window[1]:
        ap.exit(2, f"error: --window: START must be below END, got {args.window[0]:g} "
                   f"{args.window[1]:g}\n")
    fig, axes = plt.subplots(len(args.variants), 1, squeeze=False,
                             figsize=(10, 1.0 + 0.7 * len(ranks) * len(args.variants)))
    for ax, name in zip(axes[:, 0], args.variants):
        lo, hi = args.window or (0.0, max(b for tl in ranks for _, _, b in tl.get(name, [])))
        for rank, tl in enumerate(ranks):
            for kind, a, b in tl.get(name, []):
                if b < lo or a > hi:
                    continue
                if b > hi and args.window:
                    print(f"{name} rank {rank}: {kind} span {a:.4f}-{b:.4f} s "
                          f"({b - a:.3f} s) runs past the window")
                a2, b2 = max(a, lo), min(b, hi)
                ax.barh(rank, b2 - a2, left=a2, height=0.35 if kind == "P" else 0.7,
                        color="tab:orange" if kind == "P" else "tab:blue")
        ax.set_xlim(lo, hi)
        ax.set_yticks(range(len(ranks)))
        ax.set_ylabel("rank")
        ax.set_title(f"{args.title}{name}: P segments (orange), D iterations (blue)",
                     fontsize=9)
    axes[-1, 0].set_xlabel("seconds since first work (the device's clock: CUDA events on a "
                           "GPU, the host's on CPU)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
