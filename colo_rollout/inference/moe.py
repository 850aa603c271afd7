"""MoE block of the gather backend: megatron's router and experts, computed on gathered tokens.

Owns the local part of one MoE layer: every rank sees the tokens of all replicas (the comm
layer gathered them), routes them with megatron's ``TopKRouter`` (replicated weights, so every
rank computes the same routing) and runs its *local* experts (megatron ``SequentialMLP``: EP
shards experts, ETP shards each expert's FFN). The result is this rank's partial sum of the MoE
output for every token; the phase's combine collective (P: full AllReduce, D: full
ReduceScatter) completes it. Parameter names match megatron's MoELayer
(``router.weight``, ``experts.local_experts.{j}.linear_fc{1,2}.weight``).

Must not go in here: collectives (the expert fc2 skips its reduction by megatron's
``explicit_expert_comm`` whenever EP > 1 or ETP > 1; with EP = ETP = 1 its group has one rank).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig


class GatherMoE(torch.nn.Module):
    def __init__(self, config: TransformerConfig, pg_collection, ep_rank: int, ep_size: int,
                 layer_number: int, experts_builder=None) -> None:
        super().__init__()
        self.num_experts = config.num_moe_experts
        self.num_local = self.num_experts // ep_size
        self.first_expert = ep_rank * self.num_local
        self.router = TopKRouter(config=config, pg_collection=pg_collection)
        self.router.set_layer_number(layer_number)
        # experts_builder comes from megatron's backend provider: SequentialMLP (local) or
        # TEGroupedMLP (TE grouped GEMM, FP8-capable); both take (permuted tokens, counts, probs).
        if experts_builder is None:
            self.experts = SequentialMLP(
                self.num_local, config,
                MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                pg_collection=pg_collection,
            )
        else:
            self.experts = experts_builder(self.num_local, config, pg_collection=pg_collection)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] (all replicas' tokens) -> this rank's partial MoE output [N, H]."""
        probs, routing_map = self.router(x.unsqueeze(1))  # [N, E] each
        local_map = routing_map[:, self.first_expert : self.first_expert + self.num_local]
        local_probs = probs[:, self.first_expert : self.first_expert + self.num_local]
        # Permute: tokens grouped by local expert (expert-major, token order within an expert).
        expert_idx, token_idx = local_map.t().nonzero(as_tuple=True)
        counts = torch.bincount(expert_idx, minlength=self.num_local)
        out = torch.zeros_like(x)
        if token_idx.numel() == 0:
            return out
        permuted = x[token_idx]
        permuted_probs = local_probs[token_idx, expert_idx]
        y, _ = self.experts(permuted, counts.cpu(), permuted_probs)
        out.index_add_(0, token_idx, y.to(out.dtype))
        return out
