"""`colo-rollout` command line: demo, train, bench, generate, stress-turnstile, bench-rendezvous,
bench-decode-overhead, bench-speed, bench-sync, bench-mtp.

Launch modes: under torchrun (WORLD_SIZE set) every process runs the job itself; otherwise the
CLI spawns ``parallel.world_size`` CPU processes joined with gloo.

Every command checks its config and inputs at the door (colo_rollout/door.py) before it spawns
or initialises a rank: a user mistake is one ``error: FILE[:LINE]: KEY: problem`` line on
stderr and exit code 2, no traceback. Known-harmless third-party notices are filtered once,
here and in each launched rank (colo_rollout/quiet.py).
"""

from __future__ import annotations

import argparse
import os
import sys

from colo_rollout.launch import _config_at_the_door, _door, _launch, _overrides
from colo_rollout.quiet import quiet_known_warnings


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one ``error:`` line and exit code 2, as every other user
    mistake at the door (argparse prints its usage block first): ``error: --iters: invalid
    int value: 'x'``; ``colo-rollout CMD --help`` shows the usage."""

    def error(self, message: str):
        if message.startswith("argument "):  # "argument --iters: invalid ..." -> "--iters: ..."
            message = message[len("argument "):]
        print(f"error: {' '.join(message.split())} ({self.prog} --help: the usage)",
              file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    """The command line: ``_main`` with SIGTERM taken as an interrupt -- the spawned ranks are
    torn down on the way out (found by fault injection: a SIGTERM left them training) -- and an
    interrupt reported as one line, exit code 130."""
    import signal
    import threading

    def terminate(signum, frame):
        raise KeyboardInterrupt

    # (not under torchrun: a rank there is one process of its group, and torchrun's own
    # SIGTERM must stop it even inside a blocking collective, as the default action does)
    main_thread = (threading.current_thread() is threading.main_thread()
                   and "WORLD_SIZE" not in os.environ)
    previous = signal.signal(signal.SIGTERM, terminate) if main_thread else None
    from colo_rollout.config.files import OutputError
    from colo_rollout.runtime.spawn import WorkerTimeout

    try:
        return _main(argv)
    except OutputError as e:  # a report written here after the run (the disk full, say)
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nerror: interrupted", file=sys.stderr)  # (after a progress bar's line)
        return 130
    except WorkerTimeout as e:  # spawned ranks past the run's limit, or killed (out of
        # memory, say): the group is torn down; one line, no traceback (found by probing)
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None = None) -> int:
    quiet_known_warnings()
    ap = _Parser(prog="colo-rollout",  # the docstring's first paragraph: every command
                 description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="serve a synthetic workload and print throughput/latency")
    d.add_argument("config", help="YAML config, e.g. configs/demo_cpu.yaml")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set workload.num_requests=8")
    d.add_argument("--report", default=None, help="write the report as JSON to this path")
    st = sub.add_parser("stress-turnstile",
                        help="model-free turnstile stress with random rank skew (CPU ranks)")
    st.add_argument("--ranks", type=int, default=4)
    st.add_argument("--seeds", type=int, default=5)
    st.add_argument("--cycles", type=int, default=512)
    st.add_argument("--max-skew-ms", type=float, default=20.0)
    st.add_argument("--span", type=int, default=2, help="segment span K")
    st.add_argument("--control-cycles", type=int, default=64,
                    help="cycles of the delayed-P control")
    st.add_argument("--rendezvous", choices=["auto", "shm", "gloo"], default="auto")
    br = sub.add_parser("bench-rendezvous", help="cost of one PreD/PostD rendezvous")
    br.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    br.add_argument("--rounds", type=int, default=2000)
    br.add_argument("--kinds", nargs="+", choices=["shm", "gloo"], default=["shm", "gloo"])
    bd = sub.add_parser("bench-decode-overhead",
                        help="decode-only step time of PD mode vs Normal (same run)")
    bd.add_argument("config")
    bd.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    bd.add_argument("--reps", type=int, default=3)
    bd.add_argument("--mode", default="fine", help="PD mode to compare with normal")
    bn = sub.add_parser("bench", help="replay a multi-turn trace under every mode of the "
                        "ordering ladder; table, JSON and plots")
    bn.add_argument("config", help="YAML config and its bench: section (absent: the "
                    "defaults -- the synthetic trace, every mode, 3 reps, into runs/bench), "
                    "e.g. configs/bench_cpu.yaml")
    bn.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    bs = sub.add_parser("bench-speed", help="decode/prefill speed on one rank against the "
                        "roofline, a kernel-time breakdown and the Hugging Face peer")
    bs.add_argument("config", help="YAML config and its bench_speed: section (absent: the "
                    "defaults, into runs/bench_speed), e.g. configs/bench_speed_cpu.yaml")
    bs.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    bs.add_argument("--versus", action="append", default=[], metavar="'KEY=VALUE ...'",
                    help="a variant measured in the same process after the base, on the same "
                         "rows (model.* and engine.* keys, space-separated): step times and "
                         "their ratios to the base's; repeatable")
    bw = sub.add_parser("bench-sync", help="the weight sync (trainer -> inference layout) "
                        "against the device's copy bandwidth")
    bw.add_argument("config", help="YAML config (its model, parallel layout and rl.trainer_tp "
                    "/ rl.trainer_ep), e.g. configs/bench_speed_gpu.yaml")
    bw.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    bw.add_argument("--iters", type=int, default=5, help="timed syncs after the first")
    bw.add_argument("--out", default="runs/bench_sync", help="directory of bench_sync.json")
    bm = sub.add_parser("bench-mtp", help="decode tokens/s with MTP drafting against without "
                        "(random, oracle-drafting and distilled-head weights), same run")
    bm.add_argument("config", help="YAML config (model, layout, engine limits), e.g. "
                    "configs/bench_speed_gpu.yaml")
    bm.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    bm.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    bm.add_argument("--prompt-len", type=int, default=128)
    bm.add_argument("--new-tokens", type=int, default=128)
    bm.add_argument("--reps", type=int, default=2)
    bm.add_argument("--distill-steps", type=int, default=300,
                    help="training steps of the distilled MTP head (0: no distilled row)")
    bm.add_argument("--distill-seqs", type=int, default=128,
                    help="greedy continuations the distilled head is fit to")
    bm.add_argument("--distill-batch", type=int, default=8,
                    help="sequences per training step of the distilled head")
    bm.add_argument("--out", default="runs/bench_mtp", help="directory of bench_mtp.json")
    tr = sub.add_parser("train", help="colocated GRPO: rollout, train, reshard (YAML config)")
    tr.add_argument("config", help="e.g. configs/grpo_cpu.yaml")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ge = sub.add_parser("generate", help="text in, text out: serve prompts on a Hugging Face "
                        "checkpoint (its tokenizer and chat template)")
    ge.add_argument("prompts", nargs="+", metavar="PROMPT")
    ge.add_argument("--model", required=True, metavar="DIR",
                    help="checkpoint directory: config.json, safetensors, tokenizer.json")
    ge.add_argument("--config", default=None, metavar="YAML", help="run config (default: one "
                    "rank, fp32 on CPU / bf16 on CUDA, engine limits sized to the prompts)")
    ge.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ge.add_argument("--max-tokens", type=int, default=None, help="default: the checkpoint's "
                    "generation_config.json max_new_tokens, else 64")
    ge.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: "
                    "the checkpoint's generation_config.json, as transformers' generate)")
    ge.add_argument("--top-p", type=float, default=None, help="1 = off (default: as "
                    "--temperature)")
    ge.add_argument("--top-k", type=int, default=None, help="0 = off (default: as "
                    "--temperature)")
    ge.add_argument("--no-chat", action="store_true", help="encode prompts as plain text, "
                    "without the chat template")
    args = ap.parse_args(argv)
    if args.cmd == "generate":
        from colo_rollout.tools.generate import main as generate

        return generate(args)
    if args.cmd == "bench-speed":
        from colo_rollout.tools.bench_speed import versus_overrides

        overrides = _door(_overrides, args.set)
        cfg = _config_at_the_door(args.config, overrides, args.cmd)
        versus = [_door(versus_overrides, v) for v in args.versus]
        for text, v in zip(args.versus, versus):  # each variant's config checked at the door
            _door(_versus_config, args.config, overrides, v, text)
        res = _launch("colo_rollout.tools.bench_speed:run_bench_speed", args.config, overrides,
                      cfg=cfg, versus=versus)[0]
        from colo_rollout.tools.bench_speed import report

        report(res, cfg, args.config)
        return 0
    if args.cmd == "bench-sync":
        from colo_rollout.config.schema import MAX_BENCH_REPEATS

        if not 1 <= args.iters <= MAX_BENCH_REPEATS:  # (found by probing: 10^23 ran on)
            print(f"error: --iters: must be in [1, {MAX_BENCH_REPEATS}], got {args.iters}",
                  file=sys.stderr)
            return 2
        overrides = _door(_overrides, args.set)
        cfg = _config_at_the_door(args.config, overrides, args.cmd)
        from colo_rollout.door import OUTPUT_FILES, check_output, run_inputs

        _door(check_output, "--out", args.out, files=OUTPUT_FILES["bench-sync --out"],
              inputs=run_inputs(cfg, args.config, args.cmd))
        res = _launch("colo_rollout.tools.bench_sync:run_bench_sync", args.config, overrides,
                      cfg=cfg, iters=args.iters)[0]
        if int(os.environ.get("RANK", "0")) == 0:
            from colo_rollout.tools.bench_sync import report

            report(res, args.out)
        return 0
    if args.cmd == "bench-mtp":
        from colo_rollout.config.schema import MAX_BENCH_REPEATS

        bad = ([f"--batches: every batch must be >= 1, got {args.batches}"]
               if min(args.batches) < 1 else [])
        bad += [f"--{k.replace('_', '-')}: must be >= {lo}, got {getattr(args, k)}"
                for k, lo in (("prompt_len", 1), ("new_tokens", 2), ("reps", 1),
                              ("distill_steps", 0), ("distill_seqs", 1),
                              ("distill_batch", 1))
                if getattr(args, k) < lo]
        # (found by probing: 10^14 repetitions or 10^11 sequences ran until killed, a batch of
        # 10^6 until the host's memory ran out)
        bad += [f"--{k.replace('_', '-')}: must be at most {MAX_BENCH_REPEATS}, got "
                f"{getattr(args, k)}" for k in ("reps", "distill_steps", "distill_seqs")
                if getattr(args, k) > MAX_BENCH_REPEATS]
        if args.distill_batch > args.distill_seqs:
            bad.append(f"--distill-batch: {args.distill_batch} sequences a step, more than "
                       f"the {args.distill_seqs} --distill-seqs there are")
        if bad:
            print(f"error: {bad[0]}", file=sys.stderr)
            return 2
        overrides = _door(_overrides, args.set)
        layers = overrides.get("model.mtp_num_layers", 1)
        if isinstance(layers, bool) or layers != 1:  # (True == 1 in Python)
            print(f"error: --set model.mtp_num_layers={overrides['model.mtp_num_layers']}: "
                  "bench-mtp measures the model with its one MTP layer (1)", file=sys.stderr)
            return 2
        user_set = "model.mtp_num_layers" in overrides
        overrides["model.mtp_num_layers"] = 1
        cfg = _door(_bench_mtp_config, args, overrides, user_set)
        from colo_rollout.door import OUTPUT_FILES, check_output, run_inputs

        _door(check_output, "--out", args.out, files=OUTPUT_FILES["bench-mtp --out"],
              inputs=run_inputs(cfg, args.config, args.cmd))
        res = _launch("colo_rollout.tools.bench_mtp:run_bench_mtp", args.config, overrides,
                      cfg=cfg, batches=tuple(args.batches), prompt_len=args.prompt_len,
                      new_tokens=args.new_tokens, reps=args.reps,
                      distill_steps=args.distill_steps, distill_seqs=args.distill_seqs,
                      distill_batch=args.distill_batch)[0]
        if int(os.environ.get("RANK", "0")) == 0:
            from colo_rollout.tools.bench_mtp import report

            report(res, args.out)
        return 0
    if args.cmd in ("demo", "train", "bench", "bench-decode-overhead"):
        overrides = _door(_overrides, args.set)
        extra = ({"reps": args.reps, "mode": args.mode} if args.cmd == "bench-decode-overhead"
                 else {})
        cfg = _config_at_the_door(args.config, overrides, args.cmd, **extra)
    if args.cmd == "train":
        res = _launch("colo_rollout.rl.train:run_train", args.config, overrides, cfg=cfg)
        h = res[0]["history"]
        if h and ("WORLD_SIZE" not in os.environ or os.environ.get("RANK") == "0"):
            gaps = [x["logprob_gap_max"] for x in h]
            worst = float("nan") if any(g != g for g in gaps) else max(gaps)  # NaN-aware
            print(f"reward {h[0]['reward']:.3f} -> {h[-1]['reward']:.3f} over {len(h)} steps; "
                  f"max logprob gap {worst:.2e}")
        return 0
    if args.cmd == "bench":
        results = _launch("colo_rollout.tools.bench:run_bench", args.config, overrides, gather=True,
                          cfg=cfg)
        from colo_rollout.tools.bench import report

        if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 reports
            return 0
        report(results, cfg, cfg.bench.out_dir)
        print(f"JSON and plots in {cfg.bench.out_dir}/")
        return 0
    if args.cmd == "bench-decode-overhead":
        res = _launch("colo_rollout.tools.bench_decode:decode_overhead", args.config, overrides,
                      cfg=cfg, reps=args.reps, modes=("normal", args.mode))[0]
        import statistics

        if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 prints
            return 0
        med = {m: statistics.median(v) for m, v in res.items()}
        print(f"{'mode':>16s} {'median ms/D step':>17s}   per repetition")
        for m, v in res.items():
            print(f"{m:>16s} {1e3 * med[m]:17.3f}   " + " ".join(f"{1e3 * x:.3f}" for x in v))
        print(f"{args.mode}/normal = {med[args.mode] / med['normal']:.4f}")
        return 0
    if args.cmd == "stress-turnstile":
        return _stress(args)
    if args.cmd == "bench-rendezvous":
        return _bench_rendezvous(args)
    from colo_rollout.door import check_output, run_inputs

    _door(check_output, "--report", args.report, file=True,
          inputs=run_inputs(cfg, args.config, args.cmd))
    _launch("colo_rollout.tools.demo:run_demo", args.config, overrides, cfg=cfg, report=args.report)
    return 0


def _versus_config(config: str, overrides: dict, variant: dict, text: str):
    """A bench-speed --versus variant's config at the door, its errors naming the variant
    (found by probing: a variant's refusal read as the file's own)."""
    from colo_rollout import door
    from colo_rollout.config import ConfigError

    try:
        return door.load("bench-speed", config, {**overrides, **variant})
    except ConfigError as err:
        raise ConfigError(f"--versus {text!r}: {err}", key=err.key, source=err.source) from None


def _bench_mtp_config(args, overrides: dict, user_set: bool):
    """bench-mtp's config at the door: the command sets model.mtp_num_layers 1 itself, so a
    checkpoint without an MTP layer is named as such (found by probing: the error named
    model.mtp_num_layers, which the user never set, and said to drop it)."""
    from colo_rollout import door
    from colo_rollout.config import ConfigError

    try:
        return door.load("bench-mtp", args.config, overrides, batches=tuple(args.batches),
                         prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    except ConfigError as err:
        # (only the checkpoint without one: another count is the contradiction it says)
        if err.key != "model.mtp_num_layers" or user_set or ", which has 0 (" not in str(err):
            raise
        raise ConfigError(f"{args.config}: model.checkpoint: bench-mtp measures the model's MTP "
                          "layer, and the checkpoint has none (its config.json gives no "
                          "num_nextn_predict_layers / mtp layers)", key="model.checkpoint",
                          source=args.config) from None


def _stress(args) -> int:
    from colo_rollout.door import check_stress_args
    from colo_rollout.runtime.spawn import WorkerGroup

    _door(check_stress_args, ranks=args.ranks, seeds=args.seeds, cycles=args.cycles,
          max_skew_ms=args.max_skew_ms, span=args.span, control_cycles=args.control_cycles)
    with WorkerGroup(args.ranks) as group:
        res = group.run("colo_rollout.quiet:run_quietly", timeout=3600,
                        fn="colo_rollout.tools.stress:stress_turnstile", seeds=args.seeds,
                        cycles=args.cycles, max_skew_ms=args.max_skew_ms, span=args.span,
                        control_cycles=args.control_cycles, rendezvous=args.rendezvous)
    done = min(r["completed"] for r in res)
    total = res[0]["expected"]
    same = all(r["identical_logs"] for r in res)
    print(f"turnstile stress: {args.ranks} ranks, {args.seeds} seeds x {args.cycles} cycles, "
          f"max skew {args.max_skew_ms:g} ms, span K={args.span}, "
          f"rendezvous {res[0]['rendezvous_kind']}")
    print(f"  completed cycles        : {done}/{total}")
    print(f"  epoch/boundary logs     : {'identical on all ranks' if same else 'DIFFER'} "
          f"({res[0]['events']} events per rank)")
    # (the seeds' skewed cycles and the delayed-P control's, two rendezvous a cycle)
    print(f"  rendezvous              : {res[0]['rendezvous']} per rank (seeds and control), "
          f"mean wait {res[0]['rendezvous_mean_us'] / 1000:.2f} ms (includes peers' injected "
          "skew)")
    print(f"  delayed-P control       : D acknowledged while P incomplete in "
          f"{res[0]['control_d_acked_while_p_incomplete']}/{res[0]['control_cycles']} cycles "
          "(enqueue order is not a completion fence)")
    return 0 if done == total and same else 1


def _bench_rendezvous(args) -> int:
    from colo_rollout.door import check_rendezvous_args
    from colo_rollout.runtime.spawn import WorkerGroup

    _door(check_rendezvous_args, ranks=args.ranks, rounds=args.rounds)
    print(f"{'ranks':>5s} {'kind':>14s} {'mean us':>9s} {'p50 us':>9s} {'p99 us':>9s}"
          "   (CPU processes on this host)")
    for n in args.ranks:
        with WorkerGroup(n) as group:
            for kind in args.kinds:
                r = group.run("colo_rollout.quiet:run_quietly", timeout=600,
                              fn="colo_rollout.tools.stress:bench_rendezvous",
                              rounds=args.rounds, kind=kind)[0]
                print(f"{n:5d} {r['kind']:>14s} {r['mean_us']:9.1f} {r['p50_us']:9.1f} "
                      f"{r['p99_us']:9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
