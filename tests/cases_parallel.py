"""Per-rank bodies of the layout tests."""

from __future__ import annotations

from colo_rollout.config import ParallelConfig
from colo_rollout.runtime.parallel import group_ranks, init_parallel


def layout_membership(rank: int, world: int, adp: int, ep: int) -> dict:
    groups = init_parallel(ParallelConfig(world_size=world, adp=adp, ep=ep, backend="gloo",
                                          timeout_s=60.0))
    from megatron.core import parallel_state as ps

    out = {name: group_ranks(getattr(groups, name))
           for name in ("atp", "adp", "ep", "etp", "full_p", "full_d", "control")}
    out["replica"] = groups.replica
    out["atp_rank"] = groups.atp_rank
    # megatron's own view must agree (modules built from pg_collection use these)
    out["mcore_tp"] = group_ranks(groups.pg_collection.tp)
    out["mcore_ep"] = group_ranks(groups.pg_collection.ep)
    out["mcore_tp_size"] = ps.get_tensor_model_parallel_world_size()
    out["distinct_p_d"] = groups.full_p is not groups.full_d
    return out


def default_group_is_bounded(rank: int, world: int, group: str = "default") -> dict:
    """A collective on the default group that a peer never joins (rank 0 alone) raises
    within parallel.timeout_s: the spawner's default group takes the config's timeout; and
    megatron's groups (attention TP, EP: ``group``) too, at EP2/ATP2."""
    import time

    import torch
    import torch.distributed as dist

    adp = world if group == "default" else 1
    groups = init_parallel(ParallelConfig(world_size=world, adp=adp, ep=world, backend="gloo",
                                          timeout_s=1.5))
    start = time.monotonic()
    error = None
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(1), group=None if group == "default"
                            else getattr(groups, group))
        except Exception as e:  # noqa: BLE001 - gloo's timeout error
            error = type(e).__name__
    seconds = time.monotonic() - start
    if rank != 0:
        time.sleep(3.5)  # until rank 0 gave up (its collective must not meet this rank's)
    return {"error": error, "seconds": seconds}


def layouts_that_differ(rank: int, world: int, key: str) -> dict:
    """Rank 1 given another parallel section (found by fault injection: ranks built megatron's
    groups apart and met in torch's store timeouts, 10-24 s, naming no key): a ConfigError on
    every rank naming the key, at once; the same section on every rank sets up again after."""
    import time

    from colo_rollout.config import ConfigError

    kw = {"world_size": world, "adp": world, "ep": world, "backend": "gloo", "timeout_s": 20.0}
    if rank == 1:
        kw[key] = {"adp": 1, "ep": 1, "timeout_s": 30.0}[key]
    start = time.monotonic()
    try:
        init_parallel(ParallelConfig(**kw))
        error = None
    except ConfigError as e:
        error = (str(e), e.key)
    seconds = time.monotonic() - start
    again = init_parallel(ParallelConfig(world_size=world, adp=world, ep=world, backend="gloo",
                                         timeout_s=20.0))
    return {"error": error, "seconds": seconds, "again": group_ranks(again.ep)}


def command_sections_that_differ(rank: int, world: int, key: str, value) -> dict:
    """Rank 1 given another value of a command's own key (``key``: "rl.lr", "bench.reps"):
    the command's check refuses on every rank naming it (found by probing: different rl.lr
    trained diverged replicas to exit 0; a rank's bench.reps was reported as engine.mode)."""
    from colo_rollout.config import ConfigError
    from colo_rollout.config.loader import config_from_dict
    from colo_rollout.engine.engine import SHARED_SECTIONS, check_same_config

    data = {"parallel": {"world_size": world, "adp": world, "ep": world, "backend": "gloo",
                         "timeout_s": 20.0}}
    section, name = key.split(".")
    if rank == 1:
        data[section] = {name: value}
    cfg = config_from_dict(data)
    groups = init_parallel(cfg.parallel)
    out = {}
    for sections in (SHARED_SECTIONS, (*SHARED_SECTIONS, section)):
        try:
            check_same_config(cfg, groups, sections, section)
            out[len(sections)] = None
        except ConfigError as e:
            out[len(sections)] = (str(e), e.key)
    return out


def sync_built_on_one_rank(rank: int, world: int) -> dict:
    """Rank 0 builds WeightSync() as the README does (no timeout given), rank 1 never does:
    rank 0's refusal comes within parallel.timeout_s (found by probing: after 300 s)."""
    import time

    from colo_rollout.rl.weight_sync import WeightSync
    from colo_rollout.runtime.parallel import default_timeout_s

    init_parallel(ParallelConfig(world_size=world, adp=world, ep=world, backend="gloo",
                                 timeout_s=3.0))
    out = {"timeout": default_timeout_s(), "error": None, "seconds": None}
    if rank == 0:
        start = time.monotonic()
        try:
            WeightSync()
        except RuntimeError as e:
            out["error"] = str(e)
        out["seconds"] = time.monotonic() - start
    return out
