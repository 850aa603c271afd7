"""`colo-rollout` command line. Subcommands: demo (more arrive with later issues).

Launch modes: under torchrun (WORLD_SIZE set) every process runs the job itself; otherwise the
CLI spawns ``parallel.world_size`` CPU processes joined with gloo.
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for p in pairs:
        if "=" not in p:
            raise SystemExit(f"--set expects key=value, got {p!r}")
        k, v = p.split("=", 1)
        out[k] = yaml.safe_load(v)
    return out


def _launch(target: str, config: str, overrides: dict, **extra) -> list:
    from colo_rollout.config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    if "WORLD_SIZE" in os.environ:  # torchrun: this process is one rank
        import importlib

        mod, fn = target.split(":")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return [getattr(importlib.import_module(mod), fn)(rank=rank, world=world,
                                                          config_path=config,
                                                          overrides=overrides, **extra)]
    from colo_rollout.testing import WorkerGroup

    with WorkerGroup(cfg.parallel.world_size) as group:
        return group.run(target, timeout=3600, config_path=config, overrides=overrides,
                         **extra)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="colo-rollout", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="serve a synthetic workload and print throughput/latency")
    d.add_argument("config", help="YAML config, e.g. configs/demo_cpu.yaml")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set workload.num_requests=8")
    d.add_argument("--report", default=None, help="write the report as JSON to this path")
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        _launch("colo_rollout.demo:run_demo", args.config, _overrides(args.set),
                report=args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
