"""Launching a job's ranks: the door's checks, then torchrun's ranks or spawned CPU ranks.

Owns how a command's target function runs on every rank: under torchrun (WORLD_SIZE set) each
process runs it itself (teardown bounded; a wedged GPU exits with its error), otherwise
``parallel.world_size`` CPU processes are spawned and joined with gloo. Before either, the
config and inputs are checked at the door (colo_rollout/door.py): a user mistake is one
``error:`` line on stderr and exit code 2. The command line (cli.py) and the text commands
(tools/generate.py) both launch through here.
"""

from __future__ import annotations

import os
import sys


def _overrides(pairs: list[str]) -> dict:
    """``--set KEY=VALUE`` pairs as {dotted key: value read as YAML}; a ConfigError naming the
    key (``--set KEY: ...``) for a pair without '=' or a value that is not valid YAML."""
    from colo_rollout.config.loader import parse_override

    return dict(parse_override(p) for p in pairs)


def _door(check, *args, **kwargs):
    """``check(*args, **kwargs)``, before any rank starts: a user mistake (door.is_user_error)
    is one ``error:`` line on stderr and exit code 2, no traceback."""
    from colo_rollout.door import is_user_error

    try:
        return check(*args, **kwargs)
    except Exception as e:
        if not is_user_error(e):
            raise
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        raise SystemExit(2) from None


def _check_torchrun_env() -> None:
    """WORLD_SIZE set means torchrun launched this process: the rest of its environment must be
    there too (a stray WORLD_SIZE in a shell used to end in a KeyError on RANK)."""
    from colo_rollout.door import DoorError

    bad = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
           if k in os.environ and not os.environ[k].isdigit()]
    needed = ("RANK", "LOCAL_RANK") + (("MASTER_ADDR", "MASTER_PORT")
                                       if os.environ["WORLD_SIZE"] not in ("0", "1") else ())
    missing = [k for k in needed if k not in os.environ]
    if not missing and not bad and os.environ["WORLD_SIZE"] == "1":
        # one rank needs no peer, but env:// still reads a rendezvous address: this host's
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if missing or bad:
        what = (f"{', '.join(missing)} not set" if missing else
                f"{', '.join(bad)} not a non-negative integer")
        raise DoorError(f"WORLD_SIZE is set ({os.environ['WORLD_SIZE']!r}), so this process "
                        f"would be a torchrun rank, but {what}: launch it with torchrun, or "
                        "unset WORLD_SIZE to run the CPU ranks")
    # what torchrun itself never sets (found by probing: RANK past WORLD_SIZE waited for its
    # peers for ever, WORLD_SIZE 0 was taken for a world, a MASTER_PORT of 'notaport' or
    # 99999 was a traceback and an unresolvable MASTER_ADDR a retry loop)
    env = os.environ
    world, rank, local = (int(env[k]) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
    why = None
    if world < 1:
        why = "WORLD_SIZE 0: a run has at least one rank"
    elif rank >= world:
        why = f"RANK {rank} is not below WORLD_SIZE {world}"
    elif local >= int(env.get("LOCAL_WORLD_SIZE", world)):
        why = (f"LOCAL_RANK {local} is not below LOCAL_WORLD_SIZE "
               f"{env.get('LOCAL_WORLD_SIZE', world)}")
    elif "MASTER_PORT" in env and not (env["MASTER_PORT"].isdigit()
                                       and 1 <= int(env["MASTER_PORT"]) <= 65535):
        why = f"MASTER_PORT {env['MASTER_PORT']!r} is not a port (1-65535)"
    elif world > 1:
        import socket

        try:
            socket.getaddrinfo(env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        except (OSError, UnicodeError) as e:
            why = f"MASTER_ADDR {env['MASTER_ADDR']!r} does not resolve ({e})"
    if why:
        raise DoorError(f"torchrun's environment: {why}; launch the command with torchrun, or "
                        "unset WORLD_SIZE to run the CPU ranks")


def _check_torchrun_world(cfg, config: str) -> None:
    """torchrun started as many processes as parallel.world_size says (found after the
    process group existed, it was a traceback on every rank)."""
    from colo_rollout.door import DoorError

    started = int(os.environ["WORLD_SIZE"])
    if started != cfg.parallel.world_size:
        raise DoorError(f"{config}: parallel.world_size: {cfg.parallel.world_size}, but "
                        f"torchrun started {started} processes (WORLD_SIZE): launch "
                        f"--nproc-per-node {cfg.parallel.world_size} or set "
                        f"parallel.world_size {started}")


def _exit_wedged(rank: int, err: BaseException) -> None:
    """A rank whose GPU cannot be drained (DeviceStall): print the error (with the one it
    arrived during), abort the communicators so spinning kernels return, and exit 1 at once --
    an interpreter exit would run teardowns that wait on the device and hang silently."""
    import traceback

    from colo_rollout.runtime.parallel import abort_parallel

    # the chain includes the error a failed teardown arrived during (its __context__)
    traceback.print_exception(err, file=sys.stderr)
    sys.stderr.write(f"rank {rank}: the GPU cannot be drained; aborting the communicators "
                     "and exiting\n")
    sys.stderr.flush()
    sys.stdout.flush()
    abort_parallel()
    os._exit(1)


def _config_at_the_door(config: str, overrides: dict, command: str = "", **args):
    """The validated config of ``command`` (door.load: a named checkpoint's files, what the
    command asks of the engine), before any rank starts; a user mistake is one ``error:`` line
    and exit code 2."""
    from colo_rollout import door

    return _door(door.load, command, config, overrides, **args)


def _launch(target: str, config: str, overrides: dict, gather: bool = False, cfg=None,
            **extra) -> list:
    """Run ``target`` on every rank; returns the ranks' results (under torchrun: this rank's
    only, or every rank's when ``gather`` -- all-gathered as JSON over gloo, never pickle).
    ``cfg``: the config already checked at the door (else it is checked here). Spawned ranks
    run ``target`` through quiet.run_quietly (the filters before its module's imports)."""
    if cfg is None:
        cfg = _config_at_the_door(config, overrides)
    if "WORLD_SIZE" in os.environ:  # torchrun: this process is one rank
        _door(_check_torchrun_env)
        _door(_check_torchrun_world, cfg, config)
        import importlib

        from colo_rollout.runtime.parallel import destroy_parallel
        from colo_rollout.runtime.device import DeviceStall

        mod, fn = target.split(":")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        try:
            out = getattr(importlib.import_module(mod), fn)(rank=rank, world=world,
                                                            config_path=config,
                                                            overrides=overrides, **extra)
            if not gather:
                return [out]
            import torch.distributed as dist

            from colo_rollout.runtime.control import all_gather_json

            import datetime

            return all_gather_json(out, dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s)))
        except DeviceStall as e:  # the device is wedged: a teardown would wait on it forever
            _exit_wedged(rank, e)
        except Exception as e:
            if not getattr(type(e), "user_facing", False):
                raise
            _rank_error(" ".join(str(e).split()))
        finally:
            # an explicit teardown (groups left to interpreter exit can hang there), bounded:
            # after another error (a peer's death seen by the control exchange, say) this
            # rank's device may be wedged too
            try:
                destroy_parallel(drain_timeout_s=cfg.parallel.timeout_s)
            except DeviceStall as e:
                _exit_wedged(rank, e)
    from colo_rollout.door import SPAWNED_RUN_S  # (the bench's schedules are held to it)
    from colo_rollout.runtime.spawn import WorkerError, WorkerGroup

    try:
        with WorkerGroup(cfg.parallel.world_size) as group:
            # once a rank fails the others fail within their collectives' timeouts (and
            # their bounded teardown): past that one is stuck, and the run is over
            return group.run("colo_rollout.quiet:run_quietly", timeout=SPAWNED_RUN_S,
                             grace=2 * cfg.parallel.timeout_s + 30, fn=target,
                             config_path=config, overrides=overrides, **extra)
    except WorkerError as e:
        if e.user_line is None:
            raise
        _rank_error(e.user_line)


def _rank_error(line: str):
    """A checkpoint, config or request error a rank raised after the door (a weight that is
    not finite, say): one ``error:`` line, exit code 1 (the run had started)."""
    print(f"error: {line}", file=sys.stderr)
    raise SystemExit(1) from None
