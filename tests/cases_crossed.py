"""Crossed-path safety on 4 CPU ranks (ADP2/ATP2): per-rank bodies.

Each rank has a D stream and a P stream (host-emulated, colo_rollout.testing.streams) and a
device residency of one collective. D issues its ATP ReduceScatter then its full-group AllGather
(max-len path); P issues its full-group AllReduce (sum-len path). P and D use separate
communicators, as on a GPU.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from colo_rollout.config import ParallelConfig
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.multiplex.rendezvous import make_rendezvous
from colo_rollout.testing.streams import Residency, Stream, StreamError
from colo_rollout.multiplex.turnstile import TurnstileController

H = 8  # hidden size of the toy tensors


def _setup(timeout_s: float):
    groups = init_parallel(ParallelConfig(world_size=4, adp=2, ep=4, backend="gloo",
                                          timeout_s=timeout_s))
    return groups, Residency(1), Stream("D"), Stream("P")


def _d_iteration(groups, res: Residency, out: list) -> None:
    """D: ReduceScatter over ATP, then AllGather over the full D group (max-len path)."""
    x = torch.full((2, H), float(groups.rank + 1))
    chunk = torch.empty(1, H)
    with res:  # gloo has no reduce_scatter_tensor: all-reduce + slice, same group and order
        dist.all_reduce(x, group=groups.atp)
        chunk.copy_(x[groups.atp_rank : groups.atp_rank + 1])
    gathered = torch.empty(4, H)
    with res:
        dist.all_gather_into_tensor(gathered, chunk, group=groups.full_d)
    out.append(float(gathered.sum()))


def _p_allreduce(groups, res: Residency, out: list) -> None:
    y = torch.full((3, H), float(groups.rank))
    with res:
        dist.all_reduce(y, group=groups.full_p)
    out.append(float(y[0, 0]))


def independent_replicas(rank: int, world: int, timeout_s: float = 3.0) -> dict:
    """No turnstile: each replica orders P and D by its own ready queue. Replica 0 enqueues D
    then P, replica 1 P then D (a skew of 0.2 s makes the interleaving deterministic)."""
    groups, res, d_stream, p_stream = _setup(timeout_s)
    d_out, p_out = [], []
    first, second = ((d_stream, lambda: _d_iteration(groups, res, d_out)),
                     (p_stream, lambda: _p_allreduce(groups, res, p_out)))
    if groups.replica == 1:
        first, second = second, first
    t0 = time.perf_counter()
    first[0].submit(first[1])
    time.sleep(0.2)
    second[0].submit(second[1])
    errors = []
    for s in (d_stream, p_stream):
        try:
            s.synchronize(timeout=4 * timeout_s)
        except StreamError as e:
            errors.append(str(e))
    return {"hung": bool(errors), "errors": errors, "seconds": time.perf_counter() - t0,
            "d_out": d_out, "p_out": p_out}


def with_turnstile(rank: int, world: int, rounds: int = 6, span: int = 1,
                   timeout_s: float = 10.0) -> dict:
    """Turnstile + selective route: every round is PreD -> D enqueued -> PostD -> permit K more
    P boundaries; P's registered full-group AllReduce is enqueued on D's stream (FIFO after D),
    with event edges both ways; P's other work stays on the P stream."""
    groups, res, d_stream, p_stream = _setup(timeout_s)
    rdv = make_rendezvous(groups.control, rank, world, timeout_s)
    ctl = TurnstileController(rank=rank, record=True)
    ctl.register_producer("gather")
    d_out, p_out = [], []
    boundaries = rounds  # P epoch: one registered AllReduce per boundary
    ctl.begin(0, d_enqueued=False, span=span)
    crossed = 0  # boundaries whose registered collective has been issued
    t0 = time.perf_counter()
    for _ in range(rounds + 1):
        # P issues every permitted collective, then advances to its next boundary, until it is
        # parked at its endpoint (or done). Boundary i = just before P's i-th AllReduce.
        while ctl.active:
            while crossed <= ctl.reached and ctl.may_cross(crossed):
                pre = p_stream.submit(lambda: time.sleep(0.01))  # P compute before the AR
                d_stream.wait_event(pre)  # edge P -> D stream
                ar = d_stream.submit(lambda: _p_allreduce(groups, res, p_out))  # routed to D
                p_stream.wait_event(ar)  # edge D stream -> P (P continues after its AR)
                crossed += 1
            if crossed == boundaries:
                ctl.complete(0)
                break
            if ctl.at_endpoint:
                break
            ctl.publish(0, ctl.reached + 1, "gather")
        rdv.pre_d(0, ctl.reached)
        d_stream.submit(lambda: _d_iteration(groups, res, d_out))
        rdv.post_d(0, ctl.reached)
        ctl.post_d()
    d_stream.synchronize(timeout=4 * timeout_s)
    p_stream.synchronize(timeout=4 * timeout_s)
    return {"hung": False, "seconds": time.perf_counter() - t0, "d_out": d_out, "p_out": p_out,
            "p_allreduces": crossed, "log": [(e.kind, e.epoch, e.boundary) for e in ctl.log]}
