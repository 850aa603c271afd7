"""MoE block of the gather backend: megatron's router and experts, computed on gathered tokens.

Owns the local part of one MoE layer: every rank sees the tokens of all replicas (the comm
layer gathered them), routes them with megatron's ``TopKRouter`` (replicated weights, so every
rank computes the same routing) and runs its *local* experts (megatron ``SequentialMLP`` or
``TEGroupedMLP``: EP shards experts, ETP shards each expert's FFN). The result is this rank's
partial sum of the MoE output for every token; the phase's combine collective (P: full
AllReduce, D: full ReduceScatter) completes it. Parameter names match megatron's MoELayer.

Two ways to compute the experts, same weights, same math (tested equal):
  * ``megatron``: the experts module's own forward. It needs the per-expert token counts on
    the host (``tokens_per_expert.tolist()`` / TE's ``m_splits``), i.e. one device->host sync
    per layer -- which stalls a P segment's host enqueue until P's GPU work has caught up, and
    so defeats P/D overlap on a GPU.
  * ``grouped``: host-sync-free. Every (token, top-k slot) pair gets a fixed-size slot; pairs
    routed to other ranks' experts sort to the end and are masked out; per-expert offsets are
    a device-side cumsum fed to ``torch._grouped_mm`` (CUTLASS grouped GEMM on sm90, a loop
    elsewhere) or to the Triton fused-MoE kernel (model/fused_moe.py; ``kernel``,
    ``engine.moe_kernel``). The experts' weights are stacked once into [E_local, out, in]
    tensors and the module's parameters are re-pointed at views of them, so there is one copy
    of the weights and in-place updates (load_state_dict, weight sync) reach both; a parameter
    that was replaced rather than updated in place is detected and the stack rebuilt.

The output is fp32 (COMBINE_DTYPE): the caller's combine collective runs in fp32. Or, on the
grouped path when the caller asks (``pairs``), the k slots of each token unsummed: where the
combine is the identity the caller sums them into the residual in one launch (model/residual.py).

Must not go in here: collectives (the expert fc2 skips its reduction by megatron's
``explicit_expert_comm`` whenever EP > 1 or ETP > 1; with EP = ETP = 1 its group has one rank).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.transformer_config import TransformerConfig

from colo_rollout.config import MOE_COMPUTE
from colo_rollout.model.batch_invariant import invariant_linear
from colo_rollout.model.fused_moe import (
    BACKENDS as MOE_KERNELS,
    KERNEL_DTYPES,
    moe_experts,
    stores_sorted,
    triton_available,
    triton_supports,
)
from colo_rollout.model.fp8 import Fp8Weight
from colo_rollout.model.fp8_linear import fp8_linear
from colo_rollout.model.moe_align import align
from colo_rollout.model.residual import SortedSlots
from colo_rollout.model import router_topk

# The partial MoE outputs are summed over experts and reduced across ranks in fp32 and rounded
# to the model dtype once, after the combine collective -- as megatron's token dispatchers do
# (they reduce in the router-probs dtype). Rounding each rank's partial to bf16 first loses
# ~1.5x more per MoE layer and compounds through later layers (measured on 2 GPUs, ATP2).
COMBINE_DTYPE = torch.float32
# torch.mm(a, b, out_dtype=...) (16-bit operands into fp32; CUDA kernels only)
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")



def mlp_partial(mlp: torch.nn.Module, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """A megatron (Shared-expert) MLP's output before its row-parallel reduction: fc1 (with
    TE's fused norm, if any) -> SwiGLU -> fc2's weight. Issues no collective (fc1 is column-
    parallel with gather_output off; fc2's reduction belongs to the comm path).
    ``invariant``: both GEMMs batch-invariant (engine.batch_invariant's D; local layers)."""
    if x.shape[0] == 0:  # TE's fused norm rejects empty input
        return x.new_zeros((0, mlp.linear_fc2.weight.shape[0]))
    if invariant:
        gate, up = torch.chunk(invariant_linear(x, mlp.linear_fc1.weight, mlp.linear_fc1.bias),
                               2, dim=-1)
        return invariant_linear(mlp.config.activation_func(gate) * up, mlp.linear_fc2.weight)
    fp8 = getattr(mlp, "colo_fp8", None)  # model.fp8: (fc1, fc2) as FP8 (model/fp8.py)
    if fp8 is not None:
        gate, up = torch.chunk(fp8_linear(x, fp8[0]), 2, dim=-1)
        return fp8_linear(mlp.config.activation_func(gate) * up, fp8[1])
    h, _ = mlp.linear_fc1(x)
    gate, up = torch.chunk(h, 2, dim=-1)
    return torch.nn.functional.linear(mlp.config.activation_func(gate) * up, mlp.linear_fc2.weight)


class GatherMoE(torch.nn.Module):
    def __init__(self, config: TransformerConfig, pg_collection, ep_rank: int, ep_size: int,
                 layer_number: int, experts_builder=None, compute: str = "auto",
                 shared_fc=ColumnParallelLinear, shared_proj=RowParallelLinear,
                 kernel: str = "auto") -> None:
        super().__init__()
        if compute not in MOE_COMPUTE:
            raise ValueError(f"moe compute {compute!r}: expected one of {MOE_COMPUTE}")
        if kernel not in MOE_KERNELS:
            raise ValueError(f"moe kernel {kernel!r}: expected one of {MOE_KERNELS}")
        if kernel == "triton" and not (triton_available()
                                       and triton_supports(config.activation_func)):
            raise ValueError(f"moe kernel 'triton': no Triton epilogue for "
                             f"{config.activation_func!r} (or triton does not import)")
        self.config = config
        self.compute = compute
        # the grouped path's expert GEMMs (engine.moe_kernel, resolved at model build):
        # "torch" (torch._grouped_mm), "triton" (model/fused_moe.py), "auto" (triton on CUDA
        # bf16/fp16 when it imports and computes the activation)
        self.kernel = kernel
        self.num_experts = config.num_moe_experts
        self.num_local = self.num_experts // ep_size
        self.first_expert = ep_rank * self.num_local
        self.topk = config.moe_router_topk
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
        # shared experts (megatron's SharedExpertMLP, ATP-sharded like a dense MLP, optional
        # sigmoid gate): every token goes through them. In the gather backend each replica
        # computes them for its own rows only (``add_shared``): the phase's combine collective
        # sums the ATP partials, and other replicas' rows get their share from their owners.
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(
                config, MLPSubmodules(linear_fc1=shared_fc, linear_fc2=shared_proj),
                gate=config.moe_shared_expert_gate, pg_collection=pg_collection)
        self._stack: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stack_ptrs: list[int] = []  # the expert parameters' addresses when stacked
        # the expert Parameter objects never change (moving or releasing the model swaps their
        # .data, not the objects), so they are listed once: P's host enqueue is on the
        # critical path, and walking the module tree per layer per forward cost ~0.1 ms
        self._weights: tuple[list, list] | None = None
        self._use_grouped: dict[tuple, bool] = {}  # (device, dtype) -> decision (constant)
        self._kernel: dict[tuple, str] = {}  # (device, dtype) -> expert GEMM backend
        self._ids: torch.Tensor | None = None
        self._use_fused_topk: dict[torch.device, bool] = {}  # device -> decision (constant)
        # model.fp8 (set by the model): the routed experts' GEMMs take FP8 copies of the
        # stacks (``fp8_weights``, re-quantised by ``refresh_fp8`` after every weight write)
        self.fp8 = False
        self.fp8_block = 0  # model.fp8_recipe's scale block (model/fp8.py): 0 rowwise
        # model.fp8_backend te: the experts' scales by TE's arithmetic for its recipe
        # (model/fp8.py: tensorwise per expert, blockwise in power-of-2 blocks)
        self.fp8_te = False
        self.fp8_weights: tuple[Fp8Weight, Fp8Weight] | None = None
        c = config
        # megatron's top-k routing in its dense form ([N, k] probabilities and expert ids, as
        # its InferenceTopKRouter computes them) where the router has nothing else to do: no
        # sinkhorn or quantile balancing, token dropping, fused TE kernel or forced/jittered
        # logits. The rest go through the router's own forward and its [N, E] maps.
        self._dense_routing = (
            self.router.routing_type not in ("sinkhorn", "quantile_balancing")
            and c.moe_expert_capacity_factor is None and not c.moe_router_fusion
            and not c.moe_router_force_load_balancing and c.moe_router_force_biased is None
            and c.moe_input_jitter_eps is None)

    def uses_grouped(self, x: torch.Tensor) -> bool:
        key = (x.device, x.dtype)
        got = self._use_grouped.get(key)
        if got is None:
            if self.fp8:  # the FP8 expert GEMMs are the grouped path's (model/fused_moe.py)
                if self.compute == "megatron":
                    raise ValueError("model.fp8 needs the grouped expert path; "
                                     "model.moe_compute is 'megatron'")
                got = True
            elif self.compute == "auto":
                # sm90 CUTLASS grouped GEMM (bf16)
                got = (x.is_cuda and x.dtype == torch.bfloat16
                       and torch.cuda.get_device_capability(x.device)[0] >= 9)
            else:
                got = self.compute == "grouped"
            self._use_grouped[key] = got
        return got

    def kernel_for(self, x: torch.Tensor) -> str:
        """The grouped path's expert GEMM backend for x's device and dtype: "torch" or
        "triton" (``kernel``; "auto" as ``moe_experts`` reads it, decided once)."""
        key = (x.device, x.dtype)
        got = self._kernel.get(key)
        if got is None:
            got = self.kernel
            if got == "auto":
                got = ("triton" if x.is_cuda and triton_available() and x.dtype in KERNEL_DTYPES
                       and triton_supports(self.config.activation_func) else "torch")
            self._kernel[key] = got
        return got

    def forward(self, x: torch.Tensor, n_valid: torch.Tensor | None = None,
                record: torch.Tensor | None = None, pairs: bool = False,
                invariant: bool = False) -> torch.Tensor:
        """x [N, H] (all replicas' tokens) -> this rank's partial MoE output [N, H], fp32.

        ``n_valid`` (grouped path; a 0-dim int64 tensor on x's device): only rows < n_valid are
        tokens, the rest padding -- a P graph's token bucket. Padding rows are routed (the
        router is per row) but given to no expert, and their output rows are zero.
        ``record`` [N, k] (routing replay): the rows' chosen expert ids are written into it.
        ``pairs`` (grouped path only, ``uses_grouped``): the k slots of each token unsummed,
        [N, k, H] in x's dtype (other ranks' experts' and padding rows' slots zero) -- or,
        where fc2 leaves its rows sorted (``fused_moe.stores_sorted``: prefill on the Triton
        kernel), a ``SortedSlots`` naming each slot's row -- for a caller that sums them into
        the residual itself (model/residual.py: ``add_rounded_slots``, one launch where the
        combine collective is the identity).
        ``invariant`` (engine.batch_invariant's D; the grouped path): the gate and the expert
        GEMMs batch-invariant (model/batch_invariant.py)."""
        if self.uses_grouped(x):
            weight, chosen = self.route(x, invariant)
            if record is not None:
                record.copy_(chosen)
            return self._grouped(x, weight, chosen, n_valid, pairs, invariant)
        if invariant:
            raise ValueError("engine.batch_invariant needs the grouped expert path")
        if n_valid is not None:
            raise ValueError("n_valid (padded rows) needs the grouped expert path")
        if pairs:
            raise ValueError("pairs (the unsummed slots) need the grouped expert path")
        probs, routing_map = self.router(x.unsqueeze(1))  # [N, E] each
        if record is not None:
            record.copy_(routing_map.to(torch.int8).topk(self.topk, dim=1).indices)
        return self._megatron(x, probs, routing_map)

    def route(self, x: torch.Tensor, invariant: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (router probabilities [N, k], chosen global expert ids [N, k]) by
        megatron's routing: ``topk_routing_with_score_function`` in its dense form on the
        router's own logits, else (the router configurations it does not cover, or training)
        the router's forward with the k ids read back from its routing map. ``invariant``:
        the gate's GEMM batch-invariant (the dense form only)."""
        r = self.router
        if not self._dense_routing or (r.training and torch.is_grad_enabled()):
            if invariant:
                raise ValueError("engine.batch_invariant: this router has no dense form")
            probs, routing_map = r(x.unsqueeze(1))  # [N, E] each
            # the k routed experts of each token (exactly k True per row of routing_map)
            chosen = routing_map.to(torch.int8).topk(self.topk, dim=1).indices
            return probs.gather(1, chosen), chosen
        r._maintain_float32_expert_bias()
        c = self.config
        if self._fused_topk(x):  # one launch for top-k + softmax (model/router_topk.py)
            return router_topk.softmax_topk(
                self._gate_logits(x, invariant), self.topk, pre_softmax=c.moe_router_pre_softmax,
                scaling_factor=c.moe_router_topk_scaling_factor)
        return topk_routing_with_score_function(
            self._gate_logits(x, invariant), self.topk, use_pre_softmax=c.moe_router_pre_softmax,
            num_groups=c.moe_router_num_groups, group_topk=c.moe_router_group_topk,
            scaling_factor=c.moe_router_topk_scaling_factor, score_function=r.score_function,
            expert_bias=r.expert_bias, fused=False, router_replay=r.router_replay,
            dense_output=True)

    def _fused_topk(self, x: torch.Tensor) -> bool:
        """Whether the dense routing's top-k and softmax run as router_topk's one kernel:
        the Triton expert path on CUDA, a router it computes (softmax, no groups, bias or
        replay), fp32 router logits (megatron's ``moe_router_dtype: fp32``)."""
        got = self._use_fused_topk.get(x.device)
        if got is None:
            r, c = self.router, self.config
            got = (x.is_cuda and self.kernel_for(x) == "triton"
                   and c.moe_router_dtype == "fp32"
                   and router_topk.supports(r.score_function, c.moe_router_num_groups,
                                            c.moe_router_group_topk, r.expert_bias,
                                            r.router_replay, self.topk, self.num_experts))
            self._use_fused_topk[x.device] = got
        return got

    def _gate_logits(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """The router's fp32 logits [N, E]. On CUDA, for a bias-free gate whose weight has
        x's 16-bit dtype: one GEMM of the 16-bit operands into fp32 (``torch.mm`` with
        ``out_dtype``), as megatron's gate computes it where Transformer Engine is installed
        (``te_general_gemm`` in ``RouterGatingLinearFunction``) -- a 16-bit product is exact
        in fp32, so it is megatron's fp32 GEMM of the upcast operands up to summation order,
        without casting x and the [E, H] weight to fp32 on every call (two copy kernels per
        layer, the weight's the larger). Else megatron's ``gating``. ``invariant``: the same
        product through the batch-invariant GEMM, in megatron's router dtype."""
        r = self.router
        if invariant:
            dt = {"fp32": torch.float32, "fp64": torch.float64}.get(
                self.config.moe_router_dtype, x.dtype)
            if dt == torch.float32 and r.weight.dtype == x.dtype:  # 16-bit products: exact
                return invariant_linear(x, r.weight, r.bias, out_dtype=dt)
            bias = None if r.bias is None else r.bias.to(dt)
            return invariant_linear(x.to(dt), r.weight.to(dt), bias)
        if (x.is_cuda and r.bias is None and self.config.moe_router_dtype == "fp32"
                and x.dtype in (torch.bfloat16, torch.float16) and r.weight.dtype == x.dtype
                and _MM_OUT_DTYPE):
            return torch.mm(x.reshape(-1, x.shape[-1]), r.weight.t(),
                            out_dtype=torch.float32).view(*x.shape[:-1], -1)
        return r.gating(x)

    def add_shared(self, out: torch.Tensor, x: torch.Tensor, invariant: bool = False) -> None:
        """out [n, H] fp32 += this rank's ATP-partial shared-expert output on x [n, H] (the
        normalised rows of this rank's replica). No-op without shared experts. ``invariant``:
        its GEMMs batch-invariant."""
        se = self.shared_experts
        if se is None or x.shape[0] == 0:
            return
        y = mlp_partial(se, x, invariant)
        if se.use_shared_expert_gate:
            # the gate is replicated (not sharded), so each ATP partial is scaled by the same
            # factor: the sum over ATP is gate * full output, as megatron computes it
            g = (invariant_linear(x, se.gate_weight) if invariant
                 else torch.nn.functional.linear(x, se.gate_weight))
            y = y * torch.sigmoid(g)
        out.add_(y.to(out.dtype))

    # ------------------------------------------------------------------ megatron experts
    def _megatron(self, x, probs, routing_map) -> torch.Tensor:
        local_map = routing_map[:, self.first_expert : self.first_expert + self.num_local]
        local_probs = probs[:, self.first_expert : self.first_expert + self.num_local]
        # Permute: tokens grouped by local expert (expert-major, token order within an expert).
        expert_idx, token_idx = local_map.t().nonzero(as_tuple=True)
        counts = torch.bincount(expert_idx, minlength=self.num_local)
        out = torch.zeros(x.shape, dtype=COMBINE_DTYPE, device=x.device)
        if token_idx.numel() == 0:
            return out
        permuted = x[token_idx]
        permuted_probs = local_probs[token_idx, expert_idx]
        y, _ = self.experts(permuted, counts.cpu(), permuted_probs)
        out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    # ------------------------------------------------------------------ grouped, sync-free
    def _grouped(self, x, weight, chosen, n_valid=None, pairs: bool = False,
                 invariant: bool = False) -> torch.Tensor:
        k = self.topk
        backend = self.kernel_for(x)
        # the pairs sorted by local expert (other ranks' experts and padding rows last, past
        # offs[-1]; model/moe_align.py: one Triton kernel or torch's sort)
        al = align(chosen, weight, self.first_expert, self.num_local, n_valid,
                   backend=backend, expert_ids=self._expert_ids(x.device))
        fc1, fc2 = self.expert_weights()
        R = al.order.shape[0]
        # a caller summing the slots itself may read them where fc2 leaves them, in sorted
        # order (fused_moe.stores_sorted: the prefill launches), through each pair's row
        keep_sorted = pairs and stores_sorted(R, self.num_local, backend)
        # fc1 -> activation -> * router prob (megatron: probs after the activation) -> fc2, on
        # the sorted pairs, each result row stored back at its (token, slot) place -- or left
        # in sorted order (model/fused_moe.py: torch._grouped_mm or the Triton kernel); other
        # ranks' rows are zero
        y = moe_experts(x, al.token, al.offs, al.prob, fc1, fc2, self.config.activation_func,
                        self.config.gated_linear_unit, backend,
                        order=None if keep_sorted else al.order,
                        invariant=invariant)  # [N*k, H]
        if keep_sorted:  # pair p's row: al.where[p] (the align kernel's inverse of order)
            return SortedSlots(y, al.where.view(-1, k))
        y = y.view(-1, k, y.shape[-1])
        if pairs:  # the caller sums the slots (into the residual, in one launch)
            return y
        # combine: the k slots of a token summed in fp32 -- a fixed order, so bitwise
        # reproducible (an fp32 index_add_ is atomics on a GPU)
        return y.sum(dim=1, dtype=COMBINE_DTYPE)

    def _expert_ids(self, device: torch.device) -> torch.Tensor:
        """0..E_local-1 on ``device``, made once (a constant the grouped path reads each
        forward; captured D graphs read it in place)."""
        ids = self._ids
        if ids is None or ids.device != device:
            ids = self._ids = torch.arange(self.num_local, device=device)
        return ids

    def prepare(self) -> None:
        """Make the grouped path's weight stacks current now (no-op for the megatron path), so
        the expert parameters' addresses are final before anything records them (D graphs)."""
        w = self._expert_weights()[0][0]
        if self.uses_grouped(torch.empty(0, dtype=w.dtype, device=w.device)):
            self.expert_weights()  # the stacks (and with model.fp8 their FP8 copies)

    def align_variants(self) -> set[tuple]:
        """The align kernel's launches this layer can make, as ``moe_align.warm`` arguments
        (topk, local experts, device, weight dtype): none off the Triton path."""
        w = self._expert_weights()[0][0]
        probe = torch.empty(0, dtype=w.dtype, device=w.device)
        if not (self.uses_grouped(probe) and self.kernel_for(probe) == "triton"):
            return set()
        router = torch.float32 if self.config.moe_router_dtype == "fp32" else w.dtype
        # the routed pairs, and the dispatch backends' one slot per received row (fp32)
        return {(self.topk, self.num_local, w.device, router),
                (1, self.num_local, w.device, torch.float32)}

    def expert_weights(self):
        """What the grouped path's expert GEMMs multiply by: the [E_local, out, in] stacks, or
        with model.fp8 their FP8 copies (made now if missing)."""
        if not self.fp8:
            return self._stacked()
        if self.fp8_weights is None:
            self.refresh_fp8()
        return self.fp8_weights

    def expert_params(self) -> list[torch.nn.Parameter]:
        w1, w2 = self._expert_weights()
        return [*w1, *w2]

    def refresh_fp8(self) -> None:
        """Re-quantise the FP8 expert copies from the 16-bit stacks, in place where they still
        match (model.fp8; see InferenceGPT.weights_updated)."""
        if not self.fp8:
            return
        st = self._stacked()
        old = self.fp8_weights
        if old is not None and all(o.matches(w) for o, w in zip(old, st)):
            for o, w in zip(old, st):
                o.refresh(w)
        else:
            self.fp8_weights = (Fp8Weight.of(st[0], self.fp8_block, self.fp8_te),
                                Fp8Weight.of(st[1], self.fp8_block, self.fp8_te))

    def drop_stack(self) -> None:
        """Forget the stacked views (memory release: the parameters' storage is replaced)."""
        self._stack = None

    def _expert_weights(self) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        if self._weights is None:
            ex = self.experts
            if hasattr(ex, "local_experts"):  # SequentialMLP
                self._weights = ([e.linear_fc1.weight for e in ex.local_experts],
                                 [e.linear_fc2.weight for e in ex.local_experts])
            else:  # TEGroupedMLP: one parameter per local expert, weight{j}
                self._weights = (
                    [getattr(ex.linear_fc1, f"weight{j}") for j in range(self.num_local)],
                    [getattr(ex.linear_fc2, f"weight{j}") for j in range(self.num_local)])
        return self._weights

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[E_local, out, in] views shared with the experts' parameters."""
        w1, w2 = self._expert_weights()
        st = self._stack
        if st is not None:
            # fast path: every parameter still at the address it had as a view of the stack
            # (the stack keeps that storage alive, so no other tensor can start there)
            if [p.data_ptr() for p in w1 + w2] == self._stack_ptrs:
                return st
            if _aliases(st[0], w1) and _aliases(st[1], w2):
                self._stack_ptrs = [p.data_ptr() for p in w1 + w2]
                return st
        stack = []
        # outside inference mode: the parameters must stay updatable in place (weight sync)
        with torch.inference_mode(False), torch.no_grad():
            for ws in (w1, w2):
                s = torch.stack([w.detach() for w in ws])
                for j, w in enumerate(ws):
                    w.data = s[j]  # the parameter now lives in the stack (same values)
                stack.append(s)
        self._stack = (stack[0], stack[1])
        self._stack_ptrs = [p.data_ptr() for p in w1 + w2]
        return self._stack


def _aliases(stack: torch.Tensor, params) -> bool:
    """Every parameter j is still the view stack[j] (not replaced, same device and dtype)."""
    step = stack.stride(0) * stack.element_size()
    base = stack.data_ptr()
    return all(p.data_ptr() == base + j * step and p.dtype == stack.dtype
               and p.shape == stack.shape[1:] for j, p in enumerate(params))
