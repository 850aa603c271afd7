"""The inference MoE GPT: megatron-core modules, paged KV attention, per-phase gather comm.

Owns
  * ``megatron_config``: the one mapping from our ``ModelConfig`` + layout to megatron's
    ``TransformerConfig`` (shared with the training/reference ``GPTModel`` so both agree);
  * ``InferenceGPT``: embedding -> L x (norm, paged attention, norm, gather-MoE) -> norm -> head,
    with ``forward_prefill`` (P, sum-len) and ``forward_decode`` (D, padded max-len);
  * loading a full (unsharded) megatron-named state dict into this rank's shards.

Parameter names equal megatron ``GPTModel``'s (local spec): ``embedding.word_embeddings``,
``decoder.layers.{i}.{input_layernorm,self_attention.linear_qkv,self_attention.linear_proj,
pre_mlp_layernorm,mlp.router,mlp.experts.local_experts.{j}.linear_fc{1,2}}``,
``decoder.final_layernorm``, ``output_layer``.

Residual-stream layout per phase (why: each phase has exactly the collectives DESIGN.md names):
  P: every rank holds the hidden states of *all* replicas' P tokens; attention runs on this
     replica's rows and its ATP-partial output is gathered+reduced with one full AllReduce.
  D: every rank holds its ATP chunk [B/ATP, H] of its replica's padded rows; attention gathers
     the chunks over ATP, the MoE gathers every rank's chunk over the full D group.

Must not go in here: scheduling, sampling, block allocation, and any collective issued other
than through ``GatherComm``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from colo_rollout.config import ModelConfig
from colo_rollout.inference.attention import (
    AttnMetadata,
    KVStorage,
    PagedSelfAttention,
    RopeAngles,
)
from colo_rollout.inference.comm import GatherComm
from colo_rollout.inference.moe import GatherMoE, mlp_partial
from colo_rollout.inference.parallel import Layout, ParallelGroups

# (layer index, residual stream [N, H]) -> this rank's fp32 MoE partial [N, H]
MoEBlock = Callable[[int, torch.Tensor], torch.Tensor]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing CUDA libraries)
        return False
    return True


def resolve_use_te(cfg: ModelConfig) -> bool:
    """model.use_te: "on" requires Transformer Engine, "auto" uses it when importable on a CUDA
    host, "off" never. FP8 (model.fp8) needs it."""
    if cfg.use_te == "off":
        if cfg.fp8:
            raise ValueError("model.fp8 needs Transformer Engine but model.use_te is 'off'")
        return False
    have = te_available() and torch.cuda.is_available()
    if cfg.use_te == "on" and not have:
        raise RuntimeError("model.use_te is 'on' but Transformer Engine (with CUDA) is not "
                           "available; install the 'te' extra or set model.use_te: 'off'")
    if cfg.fp8:
        # TE's FP8 GEMMs need token counts padded to multiples of 16 in every P/D batch and
        # a calibrated scaling recipe; neither is wired into the runner yet, so refuse clearly
        # rather than run something untested.
        raise NotImplementedError(
            f"model.fp8={cfg.fp8!r}: FP8 inference is not supported yet (bf16/fp32 with the "
            "TE layer spec are); set model.fp8: null")
    return have


def spec_backend(use_te: bool) -> BackendSpecProvider:
    """megatron's module provider: the same choice its GPT layer specs make."""
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    return LocalSpecProvider()


def megatron_config(cfg: ModelConfig, *, tp: int = 1, ep: int = 1, etp: int = 1,
                    dtype: torch.dtype | None = None, init: bool = True,
                    sequence_parallel: bool = False, use_te: bool = False) -> TransformerConfig:
    """Megatron ``TransformerConfig`` for ``cfg``: SwiGLU experts, no linear biases (q/k/v bias
    by ``qkv_bias``), RoPE, routing in fp32 without aux loss, dropout off; FP8 only with TE.
    The one mapping of the architecture surface onto megatron: the engine, the reference and
    the trainer all build from it."""
    dtype = dtype or DTYPES[cfg.params_dtype]
    init_std = cfg.init_method_std
    fp8 = {"fp8": cfg.fp8, "fp8_recipe": "delayed"} if (use_te and cfg.fp8) else {}
    # HF norm_topk_prob with softmax: renormalised top-k = softmax over the top-k logits
    # (pre_softmax False); not renormalised = softmax over all experts first (pre_softmax True).
    pre_softmax = cfg.router_score == "softmax" and not cfg.router_norm_topk
    layer_freq = [0 if i < cfg.first_k_dense else 1 for i in range(cfg.num_layers)]
    return TransformerConfig(
        **fp8,
        moe_grouped_gemm=use_te,
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        qk_layernorm=cfg.qk_layernorm,
        add_qkv_bias=cfg.qkv_bias,
        layernorm_epsilon=cfg.norm_epsilon,
        ffn_hidden_size=cfg.dense_ffn_hidden_size,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_layer_freq=layer_freq if cfg.first_k_dense else 1,
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_router_score_function=cfg.router_score,
        moe_router_pre_softmax=pre_softmax,
        moe_router_enable_expert_bias=cfg.router_expert_bias,
        moe_router_topk_scaling_factor=(cfg.router_scaling_factor
                                        if cfg.router_scaling_factor != 1.0 else None),
        moe_router_num_groups=cfg.router_num_groups,
        moe_router_group_topk=cfg.router_group_topk,
        moe_shared_expert_intermediate_size=cfg.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=cfg.shared_expert_gate,
        moe_router_dtype="fp32",  # routing in fp32: bf16 logits flip near-tied top-k choices
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        normalization=cfg.normalization,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        perform_initialization=init,
        init_method_std=init_std,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def rotary_embedding(cfg: ModelConfig) -> RotaryEmbedding:
    """megatron's RoPE for ``cfg`` (partial rotary, llama3 scaling): what GPTModel builds."""
    return RotaryEmbedding(
        kv_channels=cfg.head_dim, rotary_percent=cfg.rotary_percent,
        rotary_base=cfg.rotary_base, use_cpu_initialization=True,
        rope_scaling=cfg.rope_scaling == "llama3", rope_scaling_factor=cfg.rope_scaling_factor,
    )


def _norm(backend: BackendSpecProvider, config: TransformerConfig) -> torch.nn.Module:
    cls = backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)
    return build_module(cls, config=config, hidden_size=config.hidden_size,
                        eps=config.layernorm_epsilon)


class InferenceLayer(torch.nn.Module):
    """One decoder layer, its modules chosen by megatron's backend provider (local or TE).

    The FFN is either MoE (``GatherMoE``: router, routed experts, optional shared experts) or,
    for the first ``first_k_dense`` layers, a dense MLP of megatron's ``MLP`` (ATP-sharded).
    Names follow megatron's TransformerLayer (dense TE layers fuse the pre-MLP norm into
    ``mlp.linear_fc1``, as its TE spec does)."""

    def __init__(self, config: TransformerConfig, groups: ParallelGroups, layer_number: int,
                 backend: BackendSpecProvider, is_moe: bool, moe_compute: str = "auto"):
        super().__init__()
        fused = backend.fuse_layernorm_and_linear()  # TE: norm lives in linear_qkv
        self.is_moe = is_moe
        self.input_layernorm = IdentityOp() if fused else _norm(backend, config)
        qkv_cls = (backend.column_parallel_layer_norm_linear() if fused
                   else backend.column_parallel_linear())
        qk_norm = (backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=True)
                   if config.qk_layernorm else None)
        self.self_attention = PagedSelfAttention(config, layer_number, groups.atp,
                                                 config.init_method, qkv_cls,
                                                 backend.row_parallel_linear(), qk_norm)
        if is_moe:
            self.pre_mlp_layernorm = _norm(backend, config)
            ep_rank = groups.rank // groups.layout.etp  # EP index: experts are EP-major
            self.mlp = GatherMoE(config, groups.pg_collection, ep_rank, groups.layout.ep,
                                 layer_number, backend.grouped_mlp_modules(config.moe_grouped_gemm),
                                 compute=moe_compute, shared_fc=backend.column_parallel_linear(),
                                 shared_proj=backend.row_parallel_linear())
        else:  # TE fuses the pre-MLP norm into fc1 here, as megatron's TE dense layer does
            self.pre_mlp_layernorm = IdentityOp() if fused else _norm(backend, config)
            fc1 = (backend.column_parallel_layer_norm_linear() if fused
                   else backend.column_parallel_linear())
            self.mlp = MLP(config, MLPSubmodules(linear_fc1=fc1,
                                                 linear_fc2=backend.row_parallel_linear()),
                           ffn_hidden_size=config.ffn_hidden_size, tp_group=groups.atp)

    def dense_partial(self, x: torch.Tensor) -> torch.Tensor:
        """Dense layer: this rank's ATP-partial MLP output on the normalised rows x (its
        replica's rows); the caller's phase collective reduces it."""
        return mlp_partial(self.mlp, x)


class _Decoder(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, config, groups, backend, moe_compute="auto"):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [InferenceLayer(config, groups, i + 1, backend, cfg.is_moe_layer(i), moe_compute)
             for i in range(config.num_layers)]
        )
        self.final_layernorm = _norm(backend, config)


class _Embedding(torch.nn.Module):
    def __init__(self, config, vocab_size, atp_group):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size, config.hidden_size, init_method=config.init_method, config=config,
            tp_group=atp_group,
        )

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's vocab-shard contribution (zero rows for ids outside the shard); the sum
        over the ATP group is the embedding. megatron's forward would reduce it itself."""
        emb = self.word_embeddings
        outside = (ids < emb.vocab_start_index) | (ids >= emb.vocab_end_index)
        local = (ids - emb.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local, emb.weight)
        return out.masked_fill(outside[:, None], 0.0)


@dataclass
class PrefillInputs:
    """One P forward. ``row_counts[r]`` = P tokens of replica r this step (all replicas)."""

    token_ids: torch.Tensor  # [T_local] this replica's new tokens
    attn: AttnMetadata
    row_counts: list[int]
    last_counts: list[int]  # sequences per replica (logit rows)
    last_rows: torch.Tensor  # [n_all] global row index of each sequence's last token


@dataclass
class DecodeInputs:
    """One D forward over a bucket of B rows per replica (padding rows target the sink)."""

    token_ids: torch.Tensor  # [B]
    attn: AttnMetadata


class InferenceGPT(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, dtype: torch.dtype):
        super().__init__()
        lay = groups.layout
        self.cfg = cfg
        self.groups = groups
        self.use_te = resolve_use_te(cfg)
        self.config = megatron_config(cfg, tp=lay.atp, ep=lay.ep, etp=lay.etp, dtype=dtype,
                                      init=False, use_te=self.use_te)
        self.embedding = _Embedding(self.config, cfg.vocab_size, groups.atp)
        self.decoder = _Decoder(cfg, self.config, groups, spec_backend(self.use_te),
                                cfg.moe_compute)
        # tied embeddings: no output_layer weight (megatron's GPTModel has none either); the
        # logits use the embedding's vocab shard, which is the same [V/ATP, H] slice
        self.output_layer = ColumnParallelLinear(
            cfg.hidden_size, cfg.vocab_size, config=self.config,
            init_method=self.config.init_method, bias=False, gather_output=False,
            skip_bias_add=False, tp_group=groups.atp,
            skip_weight_param_allocation=cfg.tie_embeddings,
        )
        self.rotary_pos_emb = rotary_embedding(cfg)
        self.comm = GatherComm(groups)
        self._rope: torch.Tensor | None = None
        # diagnostics: when a list, P appends the residual stream after every attention and
        # MoE block (fp32 copies) -- for locating precision loss against a reference
        self.trace: list[torch.Tensor] | None = None
        # megatron's groups for this model's parameters (TP = ATP, EP, expert TP): what
        # megatron's resharding reads to know which shard each rank holds
        self.pg_collection = groups.pg_collection

    @property
    def output_weight(self) -> torch.Tensor:
        """[V/ATP, H] weight of the logits (the embedding's when tied)."""
        if self.cfg.tie_embeddings:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    @property
    def device(self) -> torch.device:
        return self.embedding.word_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.word_embeddings.weight.dtype

    def moe_layers(self) -> list[GatherMoE]:
        """The MoE blocks of the MoE layers (dense layers have none)."""
        return [layer.mlp for layer in self.decoder.layers if layer.is_moe]

    # ------------------------------------------------------------------ weights
    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of every parameter from an unsharded megatron state dict
        (local-spec or TE-spec names; converted to this model's spec first)."""
        full = to_spec_names(full, self.use_te)
        load_sharded(self, full, self.groups.layout, self.groups.rank)

    def rope_table(self) -> torch.Tensor:
        if self._rope is None or self._rope.device != self.device:
            self._rope = self.rotary_pos_emb.get_emb(self.cfg.max_position_embeddings).to(
                self.device)
        return self._rope

    def new_kv_storage(self, num_blocks: int, block_size: int) -> KVStorage:
        atp = self.groups.layout.atp
        return KVStorage(self.cfg.num_layers, num_blocks, block_size,
                         self.cfg.num_query_groups // atp, self.config.kv_channels,
                         self.dtype, self.device)

    # ------------------------------------------------------------------ P
    def _precision(self):
        """FP8 autocast for TE modules when model.fp8 is set (megatron's own context)."""
        if self.config.fp8:
            from megatron.core.fp8_utils import get_fp8_context

            return get_fp8_context(self.config)
        return contextlib.nullcontext()

    def forward_prefill(self, inp: PrefillInputs, kv: KVStorage,
                        moe: MoEBlock | None = None) -> torch.Tensor:
        """The whole P epoch at once (Normal mode): every boundary is crossed immediately."""
        return run_to_completion(self.prefill_segments(inp, kv, moe))

    def moe_block(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """MoE layer i's routed experts on the residual stream h [N, H] (all replicas' rows):
        this rank's fp32 partial. Shared experts are added by the caller on its own rows."""
        layer = self.decoder.layers[i]
        return layer.mlp(layer.pre_mlp_layernorm(h))

    @torch.inference_mode()
    def prefill_segments(self, inp: PrefillInputs, kv: KVStorage,
                         moe: MoEBlock | None = None) -> Generator[int, None, torch.Tensor]:
        """P as segments (the gather backend's boundary producer).

        Yields boundary id i (0, 1, ...) just before P's i-th registered full-group AllReduce;
        resuming the generator issues that collective and computes up to the next boundary.
        Returns this replica's last-token logits. An epoch has 2 * num_layers + 2 boundaries:
        the embedding gather, per layer the attention gather and the MoE combine, the logits.
        (torch.inference_mode wraps each resume; an FP8 autocast would have to as well, which is
        one reason FP8 is not enabled yet.)

        ``moe(i, h)`` computes layer i's MoE block (pre-MLP norm, router, local experts) on the
        residual stream h: the P graphs' replay (inference/prefill_graph.py), or by default
        the modules themselves.
        """
        if self.config.fp8:
            raise NotImplementedError("FP8 prefill segments")
        return (yield from self._forward_prefill(inp, kv, moe or self.moe_block))

    @property
    def boundaries_per_prefill(self) -> int:
        return 2 * self.cfg.num_layers + 2

    @torch.inference_mode()
    def forward_decode(self, inp: DecodeInputs, kv: KVStorage) -> torch.Tensor:
        with self._precision():
            return self._forward_decode(inp, kv)

    def _forward_prefill(self, inp: PrefillInputs, kv: KVStorage, moe: MoEBlock):
        """Generator body: full-vocab logits [n_local_seqs, V] of this replica's last P tokens,
        yielding a boundary id before every P collective."""
        comm, r = self.comm, self.groups.replica
        total = sum(inp.row_counts)
        off = sum(inp.row_counts[:r])
        n_local = inp.row_counts[r]
        boundary = 0
        emb_partial = self.embedding.partial(inp.token_ids)
        rope = RopeAngles(self.rope_table(), inp.attn.positions)
        yield boundary
        boundary += 1
        h = comm.p_gather(emb_partial, off, total)
        own = slice(off, off + n_local)
        for i, layer in enumerate(self.decoder.layers):
            x = layer.input_layernorm(h[own])
            attn = layer.self_attention(x, rope, inp.attn, kv, i)
            yield boundary
            boundary += 1
            h = h + comm.p_gather(attn, off, total)
            if self.trace is not None:
                self.trace.append(h.float().clone())
            if layer.is_moe:
                partial = moe(i, h)  # routed experts: every replica's rows
                if layer.mlp.shared_experts is not None:  # shared: this replica's rows
                    layer.mlp.add_shared(partial[own], layer.pre_mlp_layernorm(h[own]))
                yield boundary
                boundary += 1
                h = h + comm.p_allreduce(partial).to(h.dtype)  # combine in fp32, then round
            else:  # dense MLP on this replica's rows, gathered like attention
                partial = layer.dense_partial(layer.pre_mlp_layernorm(h[own]))
                yield boundary
                boundary += 1
                h = h + comm.p_gather(partial, off, total)
            if self.trace is not None:
                self.trace.append(h.float().clone())
        last = self.decoder.final_layernorm(h[inp.last_rows])  # all replicas' last tokens
        n_all = last.shape[0]
        seq_off = sum(inp.last_counts[:r])
        n_seq = inp.last_counts[r]
        shard = F.linear(last[seq_off : seq_off + n_seq], self.output_weight)  # [n_seq, V/ATP]
        # Each (replica, vocab shard) block is written by exactly one rank: the sum is a gather.
        full = shard.new_zeros((n_all, self.cfg.vocab_size))
        emb = self.embedding.word_embeddings
        full[seq_off : seq_off + n_seq, emb.vocab_start_index : emb.vocab_end_index] = shard
        yield boundary
        full = comm.p_allreduce(full)
        return full[seq_off : seq_off + n_seq]

    # ------------------------------------------------------------------ D
    def _forward_decode(self, inp: DecodeInputs, kv: KVStorage) -> torch.Tensor:
        """Returns full-vocab logits [B, V] for this replica's (padded) D rows."""
        comm = self.comm
        res = comm.d_reduce_scatter_atp(self.embedding.partial(inp.token_ids))
        rope = RopeAngles(self.rope_table(), inp.attn.positions)
        B = inp.token_ids.shape[0]  # rows per replica: replica r's rows of u are [r*B, r*B+B)
        own = slice(self.groups.replica * B, (self.groups.replica + 1) * B)
        for i, layer in enumerate(self.decoder.layers):
            x = comm.d_all_gather_atp(layer.input_layernorm(res))
            attn = layer.self_attention(x, rope, inp.attn, kv, i)
            res = res + comm.d_reduce_scatter_atp(attn)
            if layer.is_moe:
                u = comm.d_all_gather_full(layer.pre_mlp_layernorm(res))
                partial = layer.mlp(u)
                if layer.mlp.shared_experts is not None:
                    layer.mlp.add_shared(partial[own], u[own])
                res = res + comm.d_reduce_scatter_full(partial).to(res.dtype)  # fp32 combine
            else:  # dense: the replica's rows, ATP gather and reduce-scatter like attention
                x = comm.d_all_gather_atp(layer.pre_mlp_layernorm(res))
                res = res + comm.d_reduce_scatter_atp(layer.dense_partial(x)).to(res.dtype)
        x = comm.d_all_gather_atp(self.decoder.final_layernorm(res))
        shard = F.linear(x, self.output_weight)
        return comm.d_all_gather_vocab(shard)


def run_to_completion(gen: Generator[int, None, torch.Tensor]) -> torch.Tensor:
    """Drive a segment generator without stopping at its boundaries."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


# ---------------------------------------------------------------------- sharding rules
@dataclass(frozen=True)
class ShardRule:
    """How a rank's local tensor ``local`` is cut from the full (unsharded) tensor: ``kind``
    "full" (replicated), "rows" / "cols" (chunk ``rank`` of ``size`` along dim 0 / 1) or "glu"
    (SwiGLU fc1 = [gate; up]: each half chunked along dim 0 and the chunks concatenated --
    megatron's stride-2 layout). Pure: the same rule cuts an in-memory tensor here and a
    checkpoint's slices in checkpoint/loader.py."""

    local: str
    kind: str
    rank: int = 0
    size: int = 1

    def rows_of(self, n: int) -> tuple[int, int]:
        """[start, end) of this rank's chunk of n rows (or columns): torch.chunk's split."""
        step = -(-n // self.size)
        return min(self.rank * step, n), min((self.rank + 1) * step, n)

    def apply(self, full: torch.Tensor) -> torch.Tensor:
        if self.kind == "full" or self.size == 1:
            return full
        if self.kind == "rows":
            a, b = self.rows_of(full.shape[0])
            return full[a:b]
        if self.kind == "cols":
            a, b = self.rows_of(full.shape[1])
            return full[:, a:b]
        gate, up = torch.chunk(full, 2, dim=0)
        a, b = self.rows_of(gate.shape[0])
        return torch.cat([gate[a:b], up[a:b]])


def shard_rule(name: str, layout: Layout, rank: int, num_local_experts: int) -> ShardRule | None:
    """The rule for full-model tensor ``name`` on ``rank``; None = this rank holds none of it.

    megatron's partitioning: column-parallel -> rows over the group, row-parallel -> columns,
    SwiGLU fc1 -> "glu"; routed experts -> only this EP rank's, each sharded over expert TP;
    dense and shared-expert MLPs are ATP-sharded like attention; norms, router (weight and
    expert bias) and the shared-expert gate are replicated."""
    atp, atp_rank = layout.atp, layout.atp_rank_of(rank)
    etp, etp_rank = layout.etp, rank % layout.etp
    ep_rank = rank // layout.etp
    te_expert = _TE_EXPERT.match(name)
    if te_expert:  # TE grouped experts: {pre}.mlp.experts.linear_fc{1,2}.weight{global idx}
        pre, fc, gidx = te_expert.group(1), te_expert.group(2), int(te_expert.group(3))
        if gidx // num_local_experts != ep_rank:
            return None
        local = f"{pre}.mlp.experts.linear_fc{fc}.weight{gidx % num_local_experts}"
        return ShardRule(local, "glu" if fc == "1" else "cols", etp_rank, etp)
    if ".mlp.experts.local_experts." in name:
        pre, rest = name.split(".mlp.experts.local_experts.")
        gidx, tail = rest.split(".", 1)
        gidx = int(gidx)
        if gidx // num_local_experts != ep_rank:
            return None
        local = f"{pre}.mlp.experts.local_experts.{gidx % num_local_experts}.{tail}"
        if tail.startswith("linear_fc1"):
            return ShardRule(local, "glu", etp_rank, etp)
        if tail.startswith("linear_fc2"):
            return ShardRule(local, "cols", etp_rank, etp)
        raise KeyError(name)
    if name.endswith(("mlp.linear_fc1.weight", "shared_experts.linear_fc1.weight")):
        return ShardRule(name, "glu", atp_rank, atp)
    if name.endswith(("mlp.linear_fc2.weight", "shared_experts.linear_fc2.weight",
                      "linear_proj.weight")):
        return ShardRule(name, "cols", atp_rank, atp)
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "output_layer.weight",
                      "word_embeddings.weight")):
        return ShardRule(name, "rows", atp_rank, atp)
    return ShardRule(name, "full")  # norms, router, expert bias, shared-expert gate


def shard_for(name: str, full: torch.Tensor, layout: Layout, rank: int,
              num_local_experts: int) -> tuple[str, torch.Tensor] | None:
    """(local name, local shard) of full-model tensor ``name`` on ``rank``; None = not held."""
    rule = shard_rule(name, layout, rank, num_local_experts)
    return None if rule is None else (rule.local, rule.apply(full))


def loadable_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a state dict fills: the parameters and the persistent buffers (the router's
    expert bias) by name, without TE's _extra_state."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items()
            if not k.endswith("_extra_state")}


_TE_EXPERT = re.compile(r"^(.*)\.mlp\.experts\.linear_fc([12])\.weight(\d+)$")
_LOCAL_EXPERT = re.compile(r"^(.*)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")


def to_spec_names(sd: dict[str, torch.Tensor], te: bool) -> dict[str, torch.Tensor]:
    """Rename a megatron GPT state dict between the local spec and the TE spec.

    TE fuses the attention input norm into ``linear_qkv`` (``layer_norm_weight``) and stores
    grouped experts as ``experts.linear_fc{1,2}.weight{e}``; the local spec has
    ``input_layernorm.weight`` and ``experts.local_experts.{e}.linear_fc{1,2}.weight``.
    ``_extra_state`` entries (TE's FP8 metadata) are dropped: they are not weights.
    """
    out = {}
    # dense layers (an unrouted mlp.linear_fc1): TE fuses their pre-MLP norm into fc1 too
    dense = {k[: -len("mlp.linear_fc1.weight")] for k in sd if k.endswith(".mlp.linear_fc1.weight")}
    for k, v in sd.items():
        if k.endswith("_extra_state"):
            continue
        if te:
            k = k.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
            if k.endswith(".pre_mlp_layernorm.weight") and k[: -len("pre_mlp_layernorm.weight")] in dense:
                k = k.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
            m = _LOCAL_EXPERT.match(k)
            if m:
                k = f"{m.group(1)}.mlp.experts.linear_fc{m.group(3)}.weight{m.group(2)}"
        else:
            k = k.replace(".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight")
            k = k.replace(".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight")
            m = _TE_EXPERT.match(k)
            if m:
                k = f"{m.group(1)}.mlp.experts.local_experts.{m.group(3)}.linear_fc{m.group(2)}.weight"
        out[k] = v
    return out


def load_sharded(model: torch.nn.Module, full: dict[str, torch.Tensor], layout: Layout,
                 rank: int, num_experts: int | None = None) -> None:
    """Copy ``rank``'s shard of every tensor of ``full`` into ``model``'s parameters; every
    parameter must be covered. Works for this inference model and for megatron GPTModels."""
    num_local = (num_experts if num_experts is not None else model.cfg.num_experts) // layout.ep
    params = loadable_tensors(model)
    seen = set()
    for name, t in full.items():
        if name.endswith("_extra_state"):
            continue
        mapped = shard_for(name, t, layout, rank, num_local)
        if mapped is None:
            continue
        local, shard = mapped
        if local not in params:
            raise KeyError(f"state dict has {name!r}; the inference model has no {local!r}")
        p = params[local]
        if p.shape != shard.shape:
            raise ValueError(f"{name}: shard shape {tuple(shard.shape)} != {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(shard)
        seen.add(local)
    missing = sorted(set(params) - seen)
    if missing:
        raise KeyError(f"state dict is missing {missing[:5]}{'...' if len(missing) > 5 else ''}")


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the full (unsharded) megatron-named state dict of ``cfg`` (local-spec
    names) with its shape, in state-dict order: what a checkpoint must provide."""
    H, F_, E, hd = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * hd
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "self_attention.linear_qkv.weight"] = (qkv, H)
        if cfg.qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = (qkv,)
        if cfg.qk_layernorm:
            out[p + "self_attention.q_layernorm.weight"] = (hd,)
            out[p + "self_attention.k_layernorm.weight"] = (hd,)
        out[p + "self_attention.linear_proj.weight"] = (H, cfg.num_attention_heads * hd)
        out[p + "pre_mlp_layernorm.weight"] = (H,)
        if not cfg.is_moe_layer(i):
            Fd = cfg.dense_ffn_hidden_size
            out[p + "mlp.linear_fc1.weight"] = (2 * Fd, H)
            out[p + "mlp.linear_fc2.weight"] = (H, Fd)
            continue
        out[p + "mlp.router.weight"] = (E, H)
        if cfg.router_expert_bias:
            out[p + "mlp.router.expert_bias"] = (E,)
        for e in range(E):
            q = p + f"mlp.experts.local_experts.{e}."
            out[q + "linear_fc1.weight"] = (2 * F_, H)
            out[q + "linear_fc2.weight"] = (H, F_)
        if cfg.shared_expert_ffn_hidden_size is not None:
            Fs = cfg.shared_expert_ffn_hidden_size
            q = p + "mlp.shared_experts."
            out[q + "linear_fc1.weight"] = (2 * Fs, H)
            out[q + "linear_fc2.weight"] = (H, Fs)
            if cfg.shared_expert_gate:
                out[q + "gate_weight"] = (1, H)
    out["decoder.final_layernorm.weight"] = (H,)
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = (cfg.vocab_size, H)
    return out


def random_state_dict(cfg: ModelConfig, seed: int | None = None,
                      device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """A full (unsharded) megatron-named state dict drawn from ``seed``: identical for every
    layout, so any two models built from it compute the same function. ``device``: where to
    draw it (default CPU). A CUDA generator gives other values than the CPU one, the same on
    every GPU; it is what makes a multi-GB bench model quick to draw (the CPU draws ~1e8
    values/s per thread, and torchrun gives each rank one thread)."""
    device = torch.device("cpu" if device is None else device)
    g = torch.Generator(device=device).manual_seed(cfg.seed if seed is None else seed)
    std = cfg.init_method_std
    H, F_, E = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts
    hd = cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * hd
    dtype = DTYPES[cfg.params_dtype]

    def normal(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * std * scale).to(dtype)

    def norm_weight(n):
        # around 1, not exactly 1: a norm weight loaded into the wrong place must show
        return (1.0 + 0.1 * torch.randn(n, generator=g, device=device)).to(dtype)

    out_scale = 1.0 / (2.0 * cfg.num_layers) ** 0.5  # megatron's scaled init for output projs
    sd = {"embedding.word_embeddings.weight": normal(cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.ones(H, dtype=dtype, device=device)
        sd[p + "self_attention.linear_qkv.weight"] = normal(qkv, H)
        if cfg.qkv_bias:
            sd[p + "self_attention.linear_qkv.bias"] = normal(qkv, scale=5.0)
        if cfg.qk_layernorm:
            sd[p + "self_attention.q_layernorm.weight"] = norm_weight(hd)
            sd[p + "self_attention.k_layernorm.weight"] = norm_weight(hd)
        sd[p + "self_attention.linear_proj.weight"] = normal(H, cfg.num_attention_heads * hd,
                                                             scale=out_scale)
        sd[p + "pre_mlp_layernorm.weight"] = torch.ones(H, dtype=dtype, device=device)
        if not cfg.is_moe_layer(i):
            Fd = cfg.dense_ffn_hidden_size
            sd[p + "mlp.linear_fc1.weight"] = normal(2 * Fd, H)
            sd[p + "mlp.linear_fc2.weight"] = normal(H, Fd, scale=out_scale)
            continue
        sd[p + "mlp.router.weight"] = normal(E, H)
        if cfg.router_expert_bias:  # fp32 buffer, as megatron keeps it
            sd[p + "mlp.router.expert_bias"] = 0.05 * torch.randn(E, generator=g, device=device)
        for e in range(E):
            q = p + f"mlp.experts.local_experts.{e}."
            sd[q + "linear_fc1.weight"] = normal(2 * F_, H)
            sd[q + "linear_fc2.weight"] = normal(H, F_, scale=out_scale)
        if cfg.shared_expert_ffn_hidden_size is not None:
            Fs = cfg.shared_expert_ffn_hidden_size
            q = p + "mlp.shared_experts."
            sd[q + "linear_fc1.weight"] = normal(2 * Fs, H)
            sd[q + "linear_fc2.weight"] = normal(H, Fs, scale=out_scale)
            if cfg.shared_expert_gate:
                sd[q + "gate_weight"] = normal(1, H, scale=10.0)
    sd["decoder.final_layernorm.weight"] = torch.ones(H, dtype=dtype, device=device)
    if not cfg.tie_embeddings:
        sd["output_layer.weight"] = normal(cfg.vocab_size, H)
    return sd
