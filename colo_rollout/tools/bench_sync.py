"""`colo-rollout bench-sync CONFIG`: the weight sync's speed against the device's copy bandwidth.

Owns one measurement (issue 18 item 2): a trainer (megatron GPTModel in ``rl.trainer_tp`` /
``rl.trainer_ep``) and the inference model (the config's ADP/ATP/EP layout) built side by side
with random weights made on the device, then ``WeightSync`` (rl/weight_sync.py) called
``--iters`` times after a first call that also builds megatron's transfer plan. The
bytes are the inference parameters the sync writes (every rank's, summed); GB/s is bytes over
the steady call's median seconds; the yardstick is a device-to-device ``copy_`` of the same
bytes per rank (on one GPU the sync's copies are that). After the last call, with a TP1 x EP1
trainer (whose ranks hold every tensor whole), every inference parameter is checked against
the trainer's (``torch.equal`` per tensor, through the same sharding rules the loader uses);
other trainer layouts are checked by tests/test_weight_sync.py, and the table says so.

Table on stdout, ``bench_sync.json`` in ``--out``.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from colo_rollout.config import load_config
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.config.files import strict_json, write_output


def _fill(model: torch.nn.Module, seed: int) -> None:
    """Random weights in place, on the model's device (no host copy of a large model)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)


def _copy_rate(nbytes: int, device: torch.device, iters: int) -> float:
    """Seconds of one device copy of ``nbytes`` (median of ``iters``)."""
    n = max(1, nbytes // 2)
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def run_bench_sync(rank: int, world: int, config_path: str, overrides: dict | None = None,
                   iters: int = 5) -> dict:
    from colo_rollout.model.megatron_gpt import build_reference
    from colo_rollout.model.model import InferenceGPT
    from colo_rollout.model.weights import DTYPES, loadable_tensors, shard_for
    from colo_rollout.rl.trainer import trainer_pg_collection
    from colo_rollout.rl.weight_sync import WeightSync, _unwrapped

    cfg = load_config(config_path, overrides)
    groups = init_parallel(cfg.parallel)
    dev = groups.device
    dtype = DTYPES[cfg.model.params_dtype]
    e = cfg.engine
    engine_model = InferenceGPT(cfg.model, groups, dtype, e.decode_attention,
                                e.prefill_attention, moe_kernel=e.moe_kernel).to(dev).eval()
    _fill(engine_model, seed=1)
    pgc = trainer_pg_collection(world, cfg.rl.trainer_tp, cfg.rl.trainer_ep,
                                cfg.parallel.timeout_s)
    # one seed on every rank: the trainer's data-parallel replicas hold the same weights
    trainer = build_reference(cfg.model, lambda m: _fill(m, seed=2), pgc, dev)
    sync = WeightSync()
    first = sync(trainer, engine_model).seconds
    runs = [sync(trainer, engine_model) for _ in range(iters)]
    steady = [r.seconds for r in runs]
    params = loadable_tensors(engine_model)
    mine = sum(t.numel() * t.element_size() for t in params.values())
    # every inference tensor equals the trainer's shard of it (a TP1 x EP1 trainer rank holds
    # every tensor whole; other trainer layouts are not checked here: tests/test_weight_sync.py)
    core = getattr(trainer, "module", trainer)
    full = {_unwrapped(name): p.detach() for name, p in core.named_parameters()}
    checked = equal = 0
    if pgc.tp.size() == 1 and pgc.ep.size() == 1:
        n_local = cfg.model.num_experts // groups.layout.ep
        for name, t in full.items():
            mapped = shard_for(name, t, groups.layout, groups.rank, n_local, params)
            if mapped is None or mapped[0] not in params:
                continue
            checked += 1
            equal += torch.equal(params[mapped[0]].data, mapped[1].to(params[mapped[0]].dtype))
    copy_s = _copy_rate(mine, dev, iters)
    total = torch.tensor([mine], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(total)
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
            "world": world, "layout": groups.layout.name,
            "trainer": f"TP{cfg.rl.trainer_tp} x EP{cfg.rl.trainer_ep}",
            "bytes_per_rank": mine, "bytes_total": float(total[0]),
            "first_s": first, "steady_s": statistics.median(steady), "all_s": steady,
            "paths": [r.path for r in runs],
            "copy_s": copy_s, "checked": checked, "equal": equal}


def report(res: dict, out_dir: str) -> None:
    gbs = res["bytes_per_rank"] / res["steady_s"] / 1e9
    copy = res["bytes_per_rank"] / res["copy_s"] / 1e9
    print(f"bench-sync on {res['device']}: {res['world']} rank(s), inference {res['layout']}, "
          f"trainer {res['trainer']}")
    print(f"{'bytes/rank':>12} {'first s':>9} {'steady s':>9} {'GB/s':>8} {'copy GB/s':>10} "
          f"{'of copy':>8} {'exact':>9}")
    exact = (f"{res['equal']:>4}/{res['checked']:<4}" if res["checked"] else
             f"{'not checked':>11}")
    print(f"{res['bytes_per_rank'] / 1e9:>10.3f}GB {res['first_s']:>9.3f} {res['steady_s']:>9.4f} "
          f"{gbs:>8.1f} {copy:>10.1f} {100 * gbs / copy:>7.1f}% {exact}")
    if not res["checked"]:
        print(f"(trainer {res['trainer']}: its ranks hold shards; tests/test_weight_sync.py "
              "checks the sync from such layouts bit for bit)")
    paths = sorted(set(res["paths"]))
    print(f"steady path: {', '.join(paths)} ("
          "replay: the recorded same-rank copies, batched; plan: megatron's refit)")
    path = os.path.join(out_dir, "bench_sync.json")
    write_output(path, strict_json({**res, "gb_per_s": gbs, "copy_gb_per_s": copy}, indent=1),
                 "the report")
    print(f"JSON: {path}")
