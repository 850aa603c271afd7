"""Spawned CPU process groups for tests, the demo and benchmarks.

Owns ``WorkerGroup``: N spawned processes joined into one gloo world through a FileStore in a
private temporary directory (no ports, so parallel runs never collide). The group stays alive
across many calls -- tests reuse one group per module -- and each call runs a named function
``"package.module:function"`` on every rank with JSON-serialisable keyword arguments. A call that
does not finish within its timeout tears the whole group down and raises ``WorkerTimeout``; an
exception on any rank is re-raised here with that rank's traceback.

Only our own processes talk over the multiprocessing queues (results are pickled by the
multiprocessing module between a parent and the children it spawned).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any


class WorkerError(RuntimeError):
    """A function raised on one or more ranks. ``user_line``: the message of the first
    failing rank's exception where its class is ``user_facing`` (a config, checkpoint or
    request error meant to be read as one line), else None."""

    def __init__(self, message: str, user_line: str | None = None) -> None:
        super().__init__(message)
        self.user_line = user_line


def _signals(codes: dict[int, int | None]) -> str:
    """The signals that killed ranks (negative exit codes), named: SIGKILL is most often the
    kernel's out-of-memory killer."""
    import signal

    named = sorted({signal.Signals(-c).name for c in codes.values()
                    if c is not None and c < 0 and -c in signal.valid_signals()})
    if not named:
        return ""
    oom = " -- the kernel's out-of-memory killer, most often" if "SIGKILL" in named else ""
    return f": killed by {', '.join(named)}{oom}"


class WorkerTimeout(TimeoutError):
    """A call did not finish in time; the group has been torn down."""


# what a rank's error says when it only saw a peer fail (its last line): the timeouts of
# gloo, the control exchange and the rendezvous, a peer's closed connection or broken group
PEER_FAILURE_MARKS = ("Timed out", "never arrived", "a peer exited", "did not complete within",
                      "Connection closed by peer", "Connection reset by peer", "is broken")

# NVLink multicast stays off on shared GPU hosts (it can take the host's GPUs out of service).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


def _die_with(parent: int) -> None:
    """Exit this rank once ``parent`` (the process that spawned the group) is gone: a parent
    killed outright (SIGKILL, an unhandled SIGTERM) runs no teardown, and its ranks -- children
    of the forkserver, not of it -- trained on and then waited for ever on their task queue
    (found by fault injection)."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:  # (a pid reused by another user's process: gone too)
            os._exit(1)


def _worker_main(rank: int, world: int, store_path: str, tasks, results, env: dict,
                 backend: str, parent: int | None = None) -> None:
    os.environ.update(env)
    if parent is not None:
        import threading

        threading.Thread(target=_die_with, args=(parent,), name="colo-parent-watch",
                         daemon=True).start()
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)  # one process per GPU, rank i on device i
    else:
        torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    while True:
        task = tasks.get()
        if task is None:
            break
        target, kwargs = task
        try:
            mod_name, fn_name = target.split(":")
            fn = getattr(importlib.import_module(mod_name), fn_name)
            results.put((rank, True, fn(rank=rank, world=world, **kwargs)))
        except BaseException as e:  # report, keep serving: the next call may still work
            line = " ".join(str(e).split()) if getattr(type(e), "user_facing", False) else None
            results.put((rank, False, (traceback.format_exc(), line)))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _cpu_context():
    """CPU ranks fork from a forkserver that imported torch and megatron once
    (colo_rollout/preload.py): a rank then starts in well under a second instead of ~6 s of
    imports, which on a 2-core machine is most of what spawning a group costs. The server is
    one per parent process; children get a fresh copy of its memory, never the parent's."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["colo_rollout.preload"])
    return ctx


class WorkerGroup:
    def __init__(self, world_size: int, env: dict[str, str] | None = None,
                 backend: str = "gloo", *, fresh: bool = False) -> None:
        """``fresh``: spawned interpreters even for gloo -- ranks that use CUDA themselves
        (e.g. several on one GPU over a gloo group) cannot fork from the preloaded server,
        whose imports touched CUDA."""
        self.world = world_size
        self._dir = tempfile.mkdtemp(prefix="colo_rollout_pg_")
        ctx = (_cpu_context() if backend == "gloo" and not fresh
               else mp.get_context("spawn"))
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        child_env = {"OMP_NUM_THREADS": "1", **MULTICAST_OFF, **(env or {})}
        if backend == "nccl":  # set before the ranks' first communicator (runtime/nccl_env.py)
            from colo_rollout.runtime.nccl_env import nccl_env, nccl_version

            child_env.update(nccl_env(nccl_version(), {**os.environ, **child_env}))
        self._procs = [
            ctx.Process(target=_worker_main, daemon=True,
                        args=(r, world_size, os.path.join(self._dir, "store"), self._tasks[r],
                              self._results, child_env, backend, os.getpid()))
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.alive = True

    def run(self, target: str, timeout: float = 300.0, grace: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``target(rank=, world=, **kwargs)`` on every rank; results in rank order.
        ``grace``: once a rank has raised, how long the others may still take (they are
        expected to fail or finish within their collectives' timeout) before the group is torn
        down and the first rank's error raised (found by fault injection: a rank stuck in a
        user's reward function held a failed run for the whole ``timeout``, silent); None:
        ``timeout`` alone bounds the call."""
        if not self.alive:
            raise WorkerError("worker group is closed")
        for q in self._tasks:
            q.put((target, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}  # (in the order they arrived)
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world:
            left = deadline - time.monotonic()
            try:
                rank, ok, value = self._results.get(timeout=min(max(left, 0.01), 1.0))
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self._procs)
                        if not p.is_alive() and r not in out and r not in errors}
                if errors and grace is not None and left <= 0 and not dead:
                    # the grace after a failure ran out
                    self.close(force=True)
                    late = sorted(set(range(self.world)) - set(out) - set(errors))
                    raise self._failure(target, errors, f"; rank(s) {late} still running "
                                        f"{grace:g} s after it, group torn down")
                if dead or left <= 0:
                    # a dead rank never answers and its peers may be stuck in a collective
                    # with it: fail now, with whatever the other ranks reported
                    self.close(force=True)
                    why = (f"rank(s) {sorted(dead)} died (exit codes {dead}{_signals(dead)})"
                           if dead else
                           f"{self.world - len(out) - len(errors)} rank(s) did not finish "
                           f"within {timeout:.0f}s")
                    detail = "".join(f"\n--- rank {r} ---\n{e[0]}"
                                     for r, e in sorted(errors.items()))
                    raise WorkerTimeout(f"{target}: {why}; group torn down{detail}") from None
                continue
            (out if ok else errors)[rank] = value
            if not ok and grace is not None:
                deadline = min(deadline, time.monotonic() + grace)
        if errors:
            raise self._failure(target, errors)
        return [out[r] for r in range(self.world)]

    @staticmethod
    def _failure(target: str, errors: dict, more: str = "") -> WorkerError:
        """The call's WorkerError, reporting the rank whose error caused the others: the
        first to arrive whose message is not a peer's absence (a collective or control
        exchange timing out, a peer gone) -- found by fault injection: rank 0's "ranks [1]
        never arrived" was reported and rank 1's own exception nowhere."""
        def consequence(r: int) -> bool:
            last = errors[r][0].strip().splitlines()[-1:] or [""]
            return any(m in last[0] for m in PEER_FAILURE_MARKS)

        arrival = list(errors)
        first = min(errors, key=lambda r: (consequence(r), arrival.index(r)))
        tb, line = errors[first]
        return WorkerError(f"{target} failed on ranks {sorted(errors)}{more}; rank {first}:"
                           f"\n{tb}", line)

    def close(self, force: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # leaving on an error (a KeyboardInterrupt, say): the ranks may be mid-task, and a
        # polite shutdown waits 10 s for each (found by fault injection: Ctrl-C took 20 s)
        self.close(force=exc_type is not None)
