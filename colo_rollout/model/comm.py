"""Gather-backend communication of the MoE model, one method per (phase, collective).

Owns every collective the model issues, so the routing of P and D traffic (and, later, the
turnstile's registered boundaries and stream routes) is decided in one place.

Paths (DESIGN.md item 4, "gather backend"):
  * P (variable length, eager) -- ``p_gather`` and ``p_allreduce``: every rank writes its partial
    rows into a zero-filled buffer holding the tokens of *all* replicas (sum-len), then one
    AllReduce over ``full_p``. Zero rows contribute nothing, so a single collective both reduces
    the ATP partial sums and gathers across replicas. ``p_collectives`` counts them: they are
    the registered boundaries the turnstile will cut P at.
  * D (padded to a bucket of B rows per replica, B % ATP == 0) -- the residual stream is kept in
    ATP-scattered form ([B/ATP, H] per rank): ``d_reduce_scatter_atp`` reduces an ATP-partial
    tensor into this rank's chunk, ``d_all_gather_full`` gathers the chunks of every rank in rank
    order -- which is replica-major, chunk-minor, i.e. the global padded token order -- for the
    MoE (the AllGather across the ADP peers with the same ATP index, fused with the ATP gather
    into one collective over ``full_d``); ``d_reduce_scatter_full`` returns the MoE partial sums
    of this rank's chunk; ``d_all_gather_atp`` rebuilds a replica's rows for attention.

With d > 1 and ATP > 1 the P AllReduce and D's ATP/full collectives intersect: issuing them in
different orders on different ranks deadlocks. This module does not order them: the turnstile
orders the host enqueue and ``route`` (a StreamRoute, set by the runner) the device order.

On gloo, reduce-scatter is emulated by AllReduce + slice (same result, more bytes): gloo has no
reduce_scatter_tensor. NCCL uses the native collectives.

``ordered_sums`` (engine.batch_invariant): D's reduce-scatters become an all-to-all of the
partial chunks and a sum in rank order on each rank -- the same bytes moved, but a row's sum
no longer follows the message size (NCCL's ring starts each chunk's sum at a rank that depends
on where the chunk falls in the message, so a row's rounding depended on the batch). P's
AllReduce is unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from colo_rollout.runtime.parallel import ParallelGroups


class GatherComm:
    """Collectives of the gather backend for one rank."""

    def __init__(self, groups: ParallelGroups, ordered_sums: bool = False) -> None:
        self.groups = groups
        self.ordered_sums = ordered_sums
        self.atp_size = groups.layout.atp
        self.world = groups.layout.world_size
        self._native_rs = dist.get_backend(groups.full_d) == "nccl"
        self.p_collectives = 0  # P full-group AllReduces issued so far (monotone)
        self.d_collectives = 0
        self.route = None  # StreamRoute: places P's AllReduce on D's stream where paths cross

    # ---- P: sum-len, zero-filled global buffer + full-group AllReduce -------------------------
    def p_gather(self, partial: torch.Tensor, row_offset: int, total_rows: int) -> torch.Tensor:
        """Sum over ranks of ``partial`` placed at rows [row_offset, row_offset+len) of a
        zero [total_rows, ...] buffer. Every rank of the world must call it with the same total.
        One rank: ``partial`` itself (counted as a collective all the same)."""
        if self.world == 1:
            self.p_collectives += 1
            return partial
        buf = partial.new_zeros((total_rows, *partial.shape[1:]))
        buf[row_offset : row_offset + partial.shape[0]] = partial
        return self.p_allreduce(buf)

    def p_allreduce(self, x: torch.Tensor) -> torch.Tensor:
        """In place over ``full_p``; one rank: the identity, launching nothing (a one-rank
        NCCL AllReduce still costs c10d's host path and cross-stream event waits on the GPU:
        docs/benchmarks.md, session 15)."""
        self.p_collectives += 1
        if self.world == 1:
            return x
        if self.route is None:
            dist.all_reduce(x, group=self.groups.full_p)
        else:
            self.route.p_collective(lambda t: dist.all_reduce(t, group=self.groups.full_p), x)
        return x

    # ---- D: max-len, ATP ReduceScatter + full AllGather ---------------------------------------
    def d_reduce_scatter_atp(self, x: torch.Tensor) -> torch.Tensor:
        """[B, ...] ATP-partial -> this rank's reduced chunk [B/ATP, ...]."""
        if self.atp_size == 1:
            return x
        return self._reduce_scatter(x, self.groups.atp, self.groups.atp_rank, self.atp_size)

    def d_all_gather_atp(self, chunk: torch.Tensor) -> torch.Tensor:
        """[B/ATP, ...] -> [B, ...] (the replica's rows, in ATP-rank order)."""
        if self.atp_size == 1:
            return chunk
        return self._all_gather(chunk, self.groups.atp, self.atp_size)

    def d_all_gather_full(self, chunk: torch.Tensor) -> torch.Tensor:
        """[B/ATP, ...] -> [d*B, ...] in global (replica-major) row order."""
        if self.world == 1:
            return chunk
        return self._all_gather(chunk, self.groups.full_d, self.world)

    def d_reduce_scatter_full(self, x: torch.Tensor) -> torch.Tensor:
        """[d*B, ...] partial over all ranks -> this rank's reduced chunk [B/ATP, ...]."""
        if self.world == 1:
            return x
        return self._reduce_scatter(x, self.groups.full_d, self.groups.rank, self.world)

    def d_all_gather_vocab(self, shard: torch.Tensor) -> torch.Tensor:
        """[B, V/ATP] vocab shard -> [B, V] (output layer is column-parallel over ATP)."""
        if self.atp_size == 1:
            return shard
        parts = self._all_gather(shard.t().contiguous(), self.groups.atp, self.atp_size)
        return parts.t().contiguous()

    # ---- helpers ------------------------------------------------------------------------------
    def _all_gather(self, chunk: torch.Tensor, group, size: int) -> torch.Tensor:
        self.d_collectives += 1
        chunk = chunk.contiguous()
        out = chunk.new_empty((chunk.shape[0] * size, *chunk.shape[1:]))
        dist.all_gather_into_tensor(out, chunk, group=group)
        return out

    def _reduce_scatter(self, x: torch.Tensor, group, group_rank: int, size: int) -> torch.Tensor:
        self.d_collectives += 1
        rows = x.shape[0]
        if rows % size:
            raise ValueError(f"reduce-scatter of {rows} rows over {size} ranks: not divisible")
        n = rows // size
        if self.ordered_sums:  # every rank's chunk for this rank, added in rank order
            x = x.contiguous()
            recv = torch.empty_like(x)
            dist.all_to_all_single(recv, x, group=group)
            parts = recv.view(size, n, *x.shape[1:])
            out = parts[0].clone()
            for j in range(1, size):
                out += parts[j]
            return out
        if self._native_rs:
            out = x.new_empty((n, *x.shape[1:]))
            dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
            return out
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x[group_rank * n : (group_rank + 1) * n].contiguous()
