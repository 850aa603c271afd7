"""Parallel layout of the inference side: which ranks form which group, and the groups themselves.

Owns
  * ``Layout``: the pure arithmetic of a deployment (world g, ADP d, EP e -> ATP = g/d,
    ETP = g/e) and the membership of every group, checked without processes;
  * ``ParallelGroups``: the live process groups, built on megatron-core's ``parallel_state``
    (so megatron modules get a ``ProcessGroupCollection`` with the same TP/EP groups), plus
    the groups megatron does not have: a full-world group per phase and a gloo control group.

Rank order is replica-major: rank = replica * ATP + atp_rank. This is megatron's default
"tp-cp-ep-dp-pp" order with TP = ATP, so megatron's TP groups are our ATP groups and megatron's
DP groups are the ADP peer groups (same ATP index across replicas).

P and D get separate communicators (``full_p`` vs ``full_d``/``atp_d``) so that the phases never
share a communicator's internal sequence state; separate communicators alone do NOT order P and D
collectives against each other -- that is the turnstile's job (DESIGN.md item 7).

Must not go in here: model code, scheduling, anything that asks for the global rank on its own
(layers receive the groups they use explicitly).
"""

from __future__ import annotations

import datetime
import os
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from colo_rollout.config import ParallelConfig
from colo_rollout.runtime.device import DeviceStall


class LayoutError(ValueError):
    """An impossible parallel layout."""


@dataclass(frozen=True)
class Layout:
    """Pure description of a deployment; every membership list is in ascending rank order."""

    world_size: int
    adp: int
    ep: int

    def __post_init__(self) -> None:
        for name in ("world_size", "adp", "ep"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.world_size % self.adp:
            raise LayoutError(
                f"world size {self.world_size} is not divisible by ADP {self.adp} "
                "(every attention replica needs the same ATP width)"
            )
        if self.world_size % self.ep:
            raise LayoutError(
                f"world size {self.world_size} is not divisible by EP {self.ep} "
                "(ETP = world/EP must be an integer)"
            )

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int | None = None) -> "Layout":
        g = cfg.world_size if world_size is None else world_size
        if g != cfg.world_size:
            raise LayoutError(
                f"parallel.world_size is {cfg.world_size} but {g} processes were started"
            )
        return cls(world_size=g, adp=cfg.adp, ep=cfg.ep)

    @property
    def atp(self) -> int:
        return self.world_size // self.adp

    @property
    def etp(self) -> int:
        return self.world_size // self.ep

    @property
    def name(self) -> str:
        parts = [f"EP{self.ep}"] if self.ep > 1 else []
        if self.adp > 1:
            parts.append(f"ADP{self.adp}")
        if self.atp > 1:
            parts.append(f"ATP{self.atp}")
        return "/".join(parts) or "single"

    @property
    def crossed(self) -> bool:
        """True when P's full-group AllReduce and D's ATP/ADP collectives intersect (d>1, ATP>1)."""
        return self.adp > 1 and self.atp > 1

    def replica_of(self, rank: int) -> int:
        return rank // self.atp

    def atp_rank_of(self, rank: int) -> int:
        return rank % self.atp

    def atp_groups(self) -> list[list[int]]:
        return [[r * self.atp + a for a in range(self.atp)] for r in range(self.adp)]

    def adp_groups(self) -> list[list[int]]:
        """ADP peers: the ranks holding the same ATP index in every replica."""
        return [[r * self.atp + a for r in range(self.adp)] for a in range(self.atp)]

    def etp_groups(self) -> list[list[int]]:
        # megatron's expert order is "tp-ep-dp-pp": expert TP is the fastest-varying axis.
        return [[k * self.etp + t for t in range(self.etp)] for k in range(self.ep)]

    def ep_groups(self) -> list[list[int]]:
        return [[k * self.etp + t for k in range(self.ep)] for t in range(self.etp)]

    def replica_leaders(self) -> list[int]:
        """ATP rank 0 of each replica: the rank whose sampled tokens are authoritative."""
        return [r * self.atp for r in range(self.adp)]


def _group_containing(groups: list[list[int]], rank: int) -> list[int]:
    return next(g for g in groups if rank in g)


@dataclass
class ParallelGroups:
    """The live groups of one rank. Built once by ``init_parallel``; passed explicitly to layers."""

    layout: Layout
    rank: int
    device: torch.device
    atp: dist.ProcessGroup  # attention TP (megatron TP group) -- D's ReduceScatter/AllGather
    adp: dist.ProcessGroup  # ADP peers (megatron DP group)
    ep: dist.ProcessGroup  # expert parallel (megatron EP group)
    etp: dist.ProcessGroup  # expert tensor parallel (megatron expert-TP group)
    full_p: dist.ProcessGroup  # all ranks, P's communicator (sum-len AllReduce)
    full_d: dist.ProcessGroup  # all ranks, D's communicator (max-len AllGather/ReduceScatter)
    control: dist.ProcessGroup  # gloo, host-side agreement (plans, intake, results)
    pg_collection: object = field(repr=False)  # megatron ProcessGroupCollection for its modules

    @property
    def replica(self) -> int:
        return self.layout.replica_of(self.rank)

    @property
    def atp_rank(self) -> int:
        return self.layout.atp_rank_of(self.rank)

    @property
    def is_replica_leader(self) -> bool:
        return self.atp_rank == 0


def _new_group(ranks: list[int], timeout: datetime.timedelta, backend: str | None = None):
    return dist.new_group(ranks=ranks, timeout=timeout, backend=backend)


def resolve_backend(cfg: ParallelConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def _free_port() -> int:
    """A TCP port of this host no one listens on now (a one-rank group's store)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(cfg: ParallelConfig) -> ParallelGroups:
    """Initialise torch.distributed (if needed), megatron parallel_state and our own groups.

    Must be called by every rank with the same ``cfg``. When torch.distributed is not yet
    initialised it uses the ``env://`` rendezvous that torchrun (or our spawner) sets up.
    One layout per process at a time: calling it again re-initialises megatron's state and,
    on gloo, frees the previous call's groups -- engines built on those must not step again
    (build every engine of a process on one ``ParallelGroups``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    backend = resolve_backend(cfg)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if backend == "nccl":  # before any communicator: NCCL orders P's and D's launches
        from colo_rollout.runtime.nccl_env import apply_nccl_env

        apply_nccl_env()
    if not dist.is_initialized() and "RANK" not in os.environ:
        # a plain `python script.py` (no torchrun): one rank runs on its own; more need a
        # launcher (found by probing: torch's "environment variable RANK expected")
        if cfg.world_size != 1:
            raise RuntimeError(f"parallel.world_size {cfg.world_size}: this process was not "
                               f"started by a launcher (RANK is not set); run it under "
                               f"torchrun --nproc-per-node {cfg.world_size}")
        dist.init_process_group(backend=backend, timeout=timeout, rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{_free_port()}")
    elif not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout)
    else:  # made by a spawner (runtime/spawn.py): its default group's timeout becomes ours,
        # so a collective on it (a weight sync's copies, a checkpoint export's verdict) that a
        # peer never joins raises within parallel.timeout_s instead of gloo's 30 minutes
        set_timeout = getattr(dist, "set_timeout", None)
        if set_timeout is None:  # torch < 2.12
            from torch.distributed.distributed_c10d import _set_pg_timeout as set_timeout
        set_timeout(timeout)
    world = dist.get_world_size()
    rank = dist.get_rank()
    all_ranks = list(range(world))
    # the control group first, and on it every rank's parallel section compared: ranks given
    # different layouts would build megatron's groups apart and meet in torch's store
    # timeouts (found by fault injection: 10-24 s, then DistStoreError naming no key)
    if backend == "gloo":  # the previous layout's own groups (see below)
        _destroy_groups(_OWN_GLOO_GROUPS)
        _OWN_GLOO_GROUPS.clear()
    control = _new_group(all_ranks, timeout, backend="gloo")
    _agree_on_layout(cfg, control)
    layout = Layout.from_config(cfg, world)

    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        # CPU ranks: megatron's forward needs the documented CPU patches (cpu_compat.py);
        # they are process-wide, so they go in here, at process set-up, not in a constructor
        from colo_rollout.runtime.cpu_compat import install_cpu_compat

        install_cpu_compat()

    if ps.model_parallel_is_initialized():
        _drop_stale_graphs()
        stale = _megatron_groups(ps) if backend == "gloo" else []
        ps.destroy_model_parallel()
        # gloo: free the previous layout's communicators (each holds threads; a process that
        # initialises many layouts -- a test module's workers -- otherwise accumulates
        # thousands, and their polling slows every rank). NCCL groups stay: a live engine's
        # captured graphs may still name them.
        _destroy_groups(stale)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.atp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        # (megatron makes timedelta(minutes=...) of it: parallel.timeout_s exactly, as every
        # other group -- whole minutes let a stalled attention-TP peer wait 60 s: probing)
        distributed_timeout_minutes=cfg.timeout_s / 60,
        # on gloo every group is already a gloo group: megatron's gloo copies would be twins
        create_gloo_process_groups=backend != "gloo",
    )
    pgc = ProcessGroupCollection.use_mpu_process_groups()

    # Order of creation is identical on every rank (new_group is collective).
    full_p = _new_group(all_ranks, timeout)
    full_d = _new_group(all_ranks, timeout)
    _OWN_GLOO_GROUPS[:] = [full_p, full_d, control] if backend == "gloo" else []

    groups = ParallelGroups(
        layout=layout,
        rank=rank,
        device=device,
        atp=ps.get_tensor_model_parallel_group(),
        adp=ps.get_data_parallel_group(),
        ep=ps.get_expert_model_parallel_group(),
        etp=ps.get_expert_tensor_parallel_group(),
        full_p=full_p,
        full_d=full_d,
        control=control,
        pg_collection=pgc,
    )
    verify_membership(groups)
    return groups


def _agree_on_layout(cfg: ParallelConfig, control: dist.ProcessGroup) -> None:
    """Every rank's parallel section is rank 0's, else a ConfigError on every rank naming the
    first key that differs (one tagged all-gather over ``control``)."""
    if dist.get_world_size(control) == 1:
        return
    import dataclasses

    from colo_rollout.config import ConfigError
    from colo_rollout.runtime.control import first_difference, gather_call

    mine = {k: repr(v) for k, v in dataclasses.asdict(cfg).items()}
    every = gather_call("init_parallel()", mine, control)
    differs = first_difference(every)
    if differs is not None:
        r, key = differs
        raise ConfigError(f"rank {r}'s parallel.{key} is {every[r].get(key)} where rank 0's is "
                          f"{every[0].get(key)} (every rank sets up one layout: give the ranks "
                          "one parallel section)", key=f"parallel.{key}")


# The groups the last init_parallel made itself on gloo, freed by the next one: process state,
# like megatron's parallel_state that init_parallel re-initialises.
_OWN_GLOO_GROUPS: list[dist.ProcessGroup] = []


def new_layout_group(ranks: list[int]) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` (collective over the world) that lives as long as the current
    layout: on gloo it is freed by the next ``init_parallel`` with the layout's own groups (each
    gloo group holds threads, and a test process builds many models)."""
    g = dist.new_group(ranks=ranks)
    if dist.get_backend(g) == "gloo":
        _OWN_GLOO_GROUPS.append(g)
    return g


def _megatron_groups(ps) -> list[dist.ProcessGroup]:
    """Every process group megatron's parallel_state holds (module globals, lists of them)."""
    out: list[dist.ProcessGroup] = []
    for value in vars(ps).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        out += [g for g in items if isinstance(g, dist.ProcessGroup)]
    return list({id(g): g for g in out}.values())


def _destroy_groups(groups: list[dist.ProcessGroup]) -> None:
    for g in groups:
        if g is dist.GroupMember.WORLD:
            continue
        try:
            dist.destroy_process_group(g)
        except (RuntimeError, ValueError):  # already destroyed, or not a group of this process
            pass


def default_timeout_s() -> float | None:
    """The timeout the default process group was made with -- ``parallel.timeout_s`` where
    ``init_parallel`` made or re-timed it -- or None: no default group, or a torch that does
    not say (its backend's options are not public API: read defensively)."""
    if not dist.is_initialized():
        return None
    try:
        pg = dist.distributed_c10d._get_default_group()
        for dev in ("cpu", "cuda"):
            try:
                t = pg._get_backend(torch.device(dev)).options._timeout
            except (RuntimeError, AttributeError, ValueError):
                continue
            if isinstance(t, datetime.timedelta) and t.total_seconds() > 0:
                return t.total_seconds()
    except Exception:  # noqa: BLE001 - a private API moved: no answer, not a failure
        return None
    return None


def group_ranks(group: dist.ProcessGroup) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def verify_membership(groups: ParallelGroups) -> None:
    """Check that the live groups are exactly the ones ``Layout`` predicts for this rank.

    Guards against a megatron rank-order change silently turning ATP into something else.
    """
    lay, r = groups.layout, groups.rank
    expected = {
        "atp": _group_containing(lay.atp_groups(), r),
        "adp": _group_containing(lay.adp_groups(), r),
        "ep": _group_containing(lay.ep_groups(), r),
        "etp": _group_containing(lay.etp_groups(), r),
        "full_p": list(range(lay.world_size)),
        "full_d": list(range(lay.world_size)),
        "control": list(range(lay.world_size)),
    }
    for name, want in expected.items():
        got = group_ranks(getattr(groups, name))
        if got != want:
            raise LayoutError(
                f"rank {r}: {name} group is {got}, layout {lay.name} expects {want}"
            )


def destroy_parallel(drain_timeout_s: float | None = None) -> None:
    """Tear down megatron's state and the default process group (drop CUDA graphs first).
    ``drain_timeout_s`` bounds the wait for this process's GPU work (None: unbounded); a
    device that does not drain in time raises DeviceStall and nothing is torn down -- the
    caller then aborts the communicators (``abort_parallel``) and exits."""
    from megatron.core import parallel_state as ps

    _drop_stale_graphs(drain_timeout_s)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _drop_stale_graphs(drain_timeout_s: float | None = None) -> None:
    """Unreferenced engines may still hold D graphs with NCCL collectives in them (reference
    cycles): collect them and drain the device before groups go away, or a destroy hangs."""
    import gc

    gc.collect()
    drain_device(drain_timeout_s)


def _cuda_sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# How drain_device waits for the device; a seam for tests (a CPU process has no device to wedge).
_device_sync = _cuda_sync


def _within(fn, timeout_s: float) -> tuple[bool, BaseException | None]:
    """Run ``fn`` on a daemon thread and wait at most ``timeout_s`` seconds: (finished, the
    error it raised). A call that never returns (a synchronize on a wedged device) is left
    behind on its thread; the caller goes on.

    Not ``concurrent.futures``: its worker threads are joined at interpreter exit, so a call
    wedged on the device would hang the very exit this bound exists to allow."""
    done = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            failed.append(e)
        done.set()

    threading.Thread(target=run, name="colo-bounded", daemon=True).start()
    finished = done.wait(timeout_s)
    return finished, (failed[0] if failed else None)


def drain_device(timeout_s: float | None) -> None:
    """Wait until this process's GPU work is done, at most ``timeout_s`` seconds (None:
    unbounded). Why bounded: a collective whose peer stalled or died never completes (graph-
    captured ones are not even watched by NCCL's watchdog), and an unbounded synchronize in a
    teardown then hangs the process silently instead of letting its error out. Raises
    DeviceStall (synchronize releases the GIL, so it can wait on another thread)."""
    if timeout_s is None:
        _device_sync()
        return
    finished, err = _within(_device_sync, timeout_s)
    if not finished:
        raise DeviceStall(f"the device did not drain within {timeout_s:g} s (a collective in "
                          "flight did not complete: a peer stalled, died or diverged)")
    if err is not None:
        raise err


def abort_parallel(timeout_s: float = 10.0) -> bool:
    """Abort every communicator of this process (NCCL: ncclCommAbort, which makes kernels
    spinning on a lost peer return) without waiting for the device -- the way out after a
    DeviceStall, where destroy_parallel would wait forever. Best effort, bounded by
    ``timeout_s``; afterwards no collective may be issued. Returns whether it completed (a
    backend without abort, gloo, raises inside: nothing of it spins on the device)."""
    if not dist.is_initialized():
        return True
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:  # an older torch: nothing to abort with
        return False
    return _within(abort, timeout_s)[0]
