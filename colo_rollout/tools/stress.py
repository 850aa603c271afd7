"""Model-free turnstile stress: real rendezvous and controllers, random rank skew, no model.

Owns ``colo-rollout stress-turnstile`` (run on every rank) and ``bench-rendezvous``.

Each cycle is one turnstile round on every rank:
  P advances (publishing boundaries, with random per-rank host delays) until it is parked at its
  permitted endpoint or its epoch completes -> random per-rank skew up to ``max_skew_ms`` ->
  PreD rendezvous -> "enqueue" one D iteration (logged) -> PostD rendezvous -> post_d().
A completed epoch is followed by the next one (p = K: D was just enqueued). Epoch lengths come
from a seed shared by all ranks (P epochs are rank-shared plans); delays from per-rank seeds.
At the end every rank's event log (epoch, boundary ids) is hashed and compared across ranks.

Delayed-P control: P's submitted segments "execute" on a per-rank device thread that takes
random time; at each PostD acknowledgement we record whether the P work enqueued so far has
finished. D being acknowledged while P is still incomplete shows that the turnstile orders host
enqueue, not completion (it is not a fence).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import random
import time

import torch
import torch.distributed as dist

from colo_rollout.multiplex.rendezvous import make_rendezvous
from colo_rollout.testing.streams import Stream
from colo_rollout.multiplex.turnstile import TurnstileController

PRODUCER = "model-free"


class _Device:
    """P segments "executing" in FIFO order on one emulated stream (streams.Stream)."""

    def __init__(self) -> None:
        self.stream = Stream("device")
        self.events = []

    def submit(self, seconds: float) -> None:
        self.events.append(self.stream.submit(lambda: time.sleep(seconds)))

    @property
    def submitted(self) -> int:
        return len(self.events)

    @property
    def done(self) -> int:
        return sum(ev.query() for ev in self.events)

    def stop(self) -> None:
        self.stream.close()


def _run_seed(rank: int, rdv, seed: int, cycles: int, max_skew_ms: float,
              span: int, delayed_p: bool) -> dict:
    shared = random.Random(seed)  # same on every rank: epoch sizes
    local = random.Random(seed * 7919 + rank)  # per-rank skew
    ctl = TurnstileController(rank=rank, record=True)
    ctl.register_producer(PRODUCER)
    device = _Device() if delayed_p else None
    epoch, boundaries = 0, shared.randint(1, 12)
    ctl.begin(epoch, d_enqueued=False, span=span)
    completed, p_incomplete_at_ack = 0, 0
    d_ids = []
    for cycle in range(cycles):
        # P runs until parked at its endpoint or its epoch is complete
        while ctl.active and not ctl.at_endpoint:
            nxt = ctl.reached + 1
            if nxt == boundaries:
                ctl.complete(epoch)
                break
            time.sleep(local.uniform(0, max_skew_ms / 20) / 1000)  # host enqueue cost
            ctl.publish(epoch, nxt, PRODUCER)
            if device is not None:  # the segment before this boundary now runs on "device"
                device.submit(local.uniform(0, max_skew_ms) / 1000)
        time.sleep(local.uniform(0, max_skew_ms) / 1000)  # rank skew before the round
        rdv.pre_d(epoch, ctl.reached)
        d_ids.append(cycle)  # every rank enqueues D iteration `cycle` here, in the same order
        rdv.post_d(epoch, ctl.reached)
        if device is not None and ctl.active and device.done < device.submitted:
            p_incomplete_at_ack += 1
        ctl.post_d()
        completed += 1
        if not ctl.active:
            epoch += 1
            boundaries = shared.randint(1, 12)
            ctl.begin(epoch, d_enqueued=True, span=span)  # D was just enqueued: p = K
    if device is not None:
        device.stop()
    log = [(e.kind, e.epoch, e.boundary) for e in ctl.log] + [("d", -1, i) for i in d_ids]
    return {"completed": completed, "epochs": epoch + 1, "log": log,
            "p_incomplete_at_ack": p_incomplete_at_ack}


def _digest(obj) -> torch.Tensor:
    h = hashlib.sha256(json.dumps(obj).encode()).digest()
    return torch.frombuffer(bytearray(h), dtype=torch.uint8)


def stress_turnstile(rank: int, world: int, seeds: int = 5, cycles: int = 512,
                     max_skew_ms: float = 20.0, span: int = 2, control_cycles: int = 64,
                     timeout_s: float = 30.0, rendezvous: str = "auto") -> dict:
    """Per-rank body (run under WorkerGroup or torchrun)."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rdv = make_rendezvous(group, rank, world, timeout_s, rendezvous)
    total, logs = 0, []
    t0 = time.perf_counter()
    for seed in range(seeds):
        r = _run_seed(rank, rdv, seed, cycles, max_skew_ms, span, delayed_p=False)
        total += r["completed"]
        logs.append(r["log"])
    wall = time.perf_counter() - t0
    control = _run_seed(rank, rdv, 10_000, control_cycles, max_skew_ms, span, delayed_p=True)
    # compare event logs across ranks by digest (bytes only: nothing is unpickled)
    mine = _digest(logs)
    allg = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(allg, mine, group=group)
    identical = all(torch.equal(d, allg[0]) for d in allg)
    _close(rdv)
    return {"rendezvous_kind": type(rdv).__name__, "completed": total, "expected": seeds * cycles, "identical_logs": identical,
            "events": sum(len(x) for x in logs), "wall_s": wall,
            "rendezvous": rdv.count, "rendezvous_mean_us": 1e6 * rdv.seconds / max(rdv.count, 1),
            "control_cycles": control_cycles,
            "control_d_acked_while_p_incomplete": control["p_incomplete_at_ack"]}


def _close(rdv) -> None:
    if hasattr(rdv, "close"):
        rdv.close()


def bench_rendezvous(rank: int, world: int, rounds: int = 2000, timeout_s: float = 30.0,
                     kind: str = "auto") -> dict:
    """Cost of one rendezvous (no skew): mean and percentiles over ``rounds`` PreD/PostD pairs."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rdv = make_rendezvous(group, rank, world, timeout_s, kind)
    for _ in range(50):  # warm-up (connection set-up)
        rdv.pre_d(0, 0)
    times = []
    for i in range(rounds):
        t = time.perf_counter()
        rdv.pre_d(0, i)
        rdv.post_d(0, i)
        times.append((time.perf_counter() - t) / 2)
    times.sort()
    dist.barrier(group=group)  # nobody detaches while a peer still spins on the segment
    _close(rdv)
    return {"world": world, "kind": type(rdv).__name__, "mean_us": 1e6 * sum(times) / len(times),
            "p50_us": 1e6 * times[len(times) // 2], "p99_us": 1e6 * times[int(len(times) * 0.99)]}
