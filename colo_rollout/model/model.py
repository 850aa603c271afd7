"""The inference MoE GPT: megatron-core modules, paged KV attention, per-phase gather comm.

Owns
  * ``megatron_config``: the one mapping from our ``ModelConfig`` + layout to megatron's
    ``TransformerConfig`` (shared with the training/reference ``GPTModel`` so both agree);
  * ``InferenceGPT``: embedding -> L x (norm, paged attention, norm, gather-MoE) -> norm -> head,
    with ``forward_prefill`` (P, sum-len) and ``forward_decode`` (D, padded max-len);
  * loading a full (unsharded) megatron-named state dict into this rank's shards (the rules:
    model/weights.py).

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
than through ``GatherComm`` or a dispatcher (model/dispatch.py, ``model.moe_dispatch``).
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from colo_rollout.config import ModelConfig
from colo_rollout.config.schema import batch_invariance_problem, normalization_problem
from colo_rollout.config.te_support import te_available, te_fp8_problem
from colo_rollout.model.batch_invariant import invariant_linear
from colo_rollout.model.attention import (
    AttnMetadata,
    KVStorage,
    PagedSelfAttention,
    RopeAngles,
)
from colo_rollout.model.comm import GatherComm
from colo_rollout.model.mla_attention import LatentKVStorage, PagedMLAttention
from colo_rollout.model.mla_attention import resolve_prefill as resolve_mla_prefill
from colo_rollout.model.dispatch import new_dispatchers
from colo_rollout.model.fp8 import ROW_MULTIPLE, Fp8Weight, fp8_supported, recipe_block
from colo_rollout.model.fused_moe import resolve_backend as resolve_moe_kernel
from colo_rollout.model.paged_attention import resolve_backend
from colo_rollout.model.norm_add import (
    FusedRMSNorm,
    add_rms_norm,
    add_slots_rms_norm,
    embed_rms_norm,
    fused_rms_norm,
)
from colo_rollout.model.residual import add_rounded, add_rounded_slots
from colo_rollout.model import dense_prefill
from colo_rollout.model.dense_prefill import (
    DENSE_BACKENDS,
    dense_held,
    dense_sequences,
    warm_mla_plans,
)
from colo_rollout.model.dense_prefill import warm_plans as warm_dense_plans
from colo_rollout.model.paged_prefill import resolve_backend as resolve_prefill_backend
from colo_rollout.model.moe import GatherMoE, mlp_partial
from colo_rollout.model.greedy_pick import warm as warm_greedy
from colo_rollout.model.moe_align import warm as warm_align
from colo_rollout.model.mtp import (
    MTPBlock,
    MTPLayer,
    mtp_prefill,
    mtp_prefill_own,
    prefill_boundaries,
    shift_tokens,
)
from colo_rollout.runtime.parallel import ParallelGroups
from colo_rollout.model.weights import DTYPES, sharded_writes, to_spec_names, write_shards
from colo_rollout.runtime.control import first_problem
from colo_rollout.config.tensor_shapes import mtp_is_moe

class MoEBlock(Protocol):
    """How P computes MoE layer i's routed experts on the residual stream h [N, H] (every
    replica's rows): the modules (``ModulesMoE``, the default) or the P graphs' replays
    (worker/prefill_graph.py)."""

    def partial(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """This rank's fp32 partial [N, H], which P's combine collective sums."""

    def residual(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """h + the k slots' fp32 sum rounded to h's dtype (model/residual.py:
        ``add_rounded_slots``), where the combine is the identity
        (``InferenceGPT.p_moe_into_residual``)."""

    def normed(self, i: int, h: torch.Tensor, u: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where ``InferenceGPT.p_fusion(i)`` holds: h + the k slots of the experts on u (h's
        rows through the pre-MLP norm, which the caller computed with its add) -> (the new
        residual rows, their RMSNorm by ``p_fusion(i).after``: the next layer's input)."""

    def input(self, n: int, normed: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Where the caller may write the next block's h [n, H] -- and with ``normed`` its u
        (else None) -- (a graph's input buffers: its replay then copies nothing), or None."""


@dataclass(frozen=True)
class ModulesMoE:
    """P's MoE blocks computed by the model's modules (no graphs)."""

    model: "InferenceGPT"

    def partial(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self.model.moe_block(i, h)

    def residual(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return add_rounded_slots(h, self.model.moe_block(i, h, pairs=True),
                                 self.model.residual_kernel)

    def normed(self, i: int, h: torch.Tensor, u: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        pairs = m.decoder.layers[i].mlp(u, record=m.route_record("P", i, u.shape[0]),
                                        pairs=True)
        return add_slots_rms_norm(h, pairs, m.p_fusion(i).after, m.residual_kernel)

    def input(self, n: int, normed: bool = False) -> None:
        return None


@dataclass(frozen=True)
class PrefillFusion:
    """P's norms of one MoE layer fused into the adds that produce their inputs (one rank:
    every collective around those adds is the identity; model/norm_add.py): ``pre`` (the
    layer's pre-MLP norm) into the attention's residual add, ``after`` (the next layer's
    input norm, or the final norm after the last layer) into the slots' add."""

    pre: FusedRMSNorm
    after: FusedRMSNorm


def resolve_use_te(cfg: ModelConfig, local: bool = False) -> bool:
    """model.use_te for the engine: "on" builds TE's layers (requires Transformer Engine on a
    CUDA host); "auto" and "off" the local spec, whose GEMMs and norms the engine's own fused
    kernels run. Why "auto" is not TE where it is importable: on one H200 (session 25, TE
    2.20.2, bench-speed same-run A/B) the TE spec's decode step was 1.15x the local spec's at
    B = 1 on the first shape and 1.28x on the Qwen3 shape, 1.03-1.05x at B = 32-128, its 4k
    prefill 1.07x on Qwen3 (docs/benchmarks.md session 25); and the RL trainer builds the
    local spec, so an engine on TE's layers could not take its weight sync (other parameter
    names: linear_qkv.layer_norm_weight). ``local`` (engine.batch_invariant) and FP8
    rollouts run the local spec whatever use_te says."""
    if cfg.use_te != "on" or cfg.fp8 is not None or local:
        return False
    if not (te_available() and torch.cuda.is_available()):
        raise RuntimeError("model.use_te is 'on' but Transformer Engine (with CUDA) is not "
                           "available; install the 'te' extra or set model.use_te: 'off'")
    return True


def _check_fp8_shapes(holder: torch.nn.Module, weights, block: int = 0) -> None:
    """The FP8 linear's GEMM (torch._scaled_mm) needs both dims of each weight (this rank's
    shard) in multiples of 16 -- of the scale block with the blockwise recipe."""
    m = max(ROW_MULTIPLE, block)
    for w in weights:
        if w is None:  # stays in params_dtype
            continue
        if w.dim() != 2 or w.shape[0] % m or w.shape[1] % m:
            raise ValueError(
                f"model.fp8: {type(holder).__name__} has a weight of shape {tuple(w.shape)} "
                f"on this rank; FP8 GEMMs need both dims in multiples of {m} "
                "(hidden_size, the attention heads x head_dim per attention-TP rank, the FFN "
                "sizes per rank)")


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
    # HF norm_topk_prob with softmax: renormalised top-k = softmax over the top-k logits
    # (pre_softmax False); not renormalised = softmax over all experts first (pre_softmax True).
    pre_softmax = cfg.router_score == "softmax" and not cfg.router_norm_topk
    layer_freq = [int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]
    config = (MLATransformerConfig if cfg.is_mla else TransformerConfig)(
        **mla_fields(cfg),
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
        moe_layer_freq=layer_freq if cfg.has_dense_layers else 1,
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
        mtp_num_layers=cfg.mtp_num_layers or None,
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
    # YaRN: megatron's GPTModel and its attention's concentration factor read these as
    # dynamic attributes of the config (megatron.training sets them the same way)
    for key, value in yarn_attributes(cfg).items():
        setattr(config, key, value)
    return config


def mla_fields(cfg: ModelConfig) -> dict:
    """``MLATransformerConfig``'s own fields for an MLA ``cfg`` ({} otherwise). Its RoPE is
    its attention's own (rope or YaRN over qk_rope_head_dim; megatron's MLA YaRN always
    rounds the correction range: the door refuses yarn_truncate false)."""
    if not cfg.is_mla:
        return {}
    yarn = cfg.rope_scaling == "yarn"
    return {"multi_latent_attention": True, "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank, "qk_head_dim": cfg.qk_nope_head_dim,
            "qk_pos_emb_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
            "rope_type": "yarn" if yarn else "rope", "rotary_base": cfg.rotary_base,
            "rotary_scaling_factor": cfg.rope_scaling_factor if yarn else 1.0,
            "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings,
            "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
            "mscale": cfg.yarn_mscale if yarn else 1.0,
            "mscale_all_dim": cfg.yarn_mscale_all_dim if yarn else 0.0}


def mla_softmax_scale(config: MLATransformerConfig) -> float:
    """megatron's MLASelfAttention.softmax_scale: mscale(factor, mscale_all_dim)^2 over the
    square root of the query head width (YaRN's attention temperature; 1 without YaRN)."""
    factor = config.rotary_scaling_factor
    m = 1.0 if factor <= 1 else 0.1 * config.mscale_all_dim * math.log(factor) + 1.0
    return m * m / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


def yarn_attributes(cfg: ModelConfig) -> dict:
    """megatron's ``yarn_*`` config attributes for ``cfg`` ({} without YaRN)."""
    if cfg.rope_scaling != "yarn":
        return {}
    return {"yarn_rotary_scaling_factor": cfg.rope_scaling_factor,
            "yarn_original_max_position_embeddings": cfg.yarn_original_max_position_embeddings,
            "yarn_beta_fast": cfg.yarn_beta_fast, "yarn_beta_slow": cfg.yarn_beta_slow,
            "yarn_mscale": cfg.yarn_mscale, "yarn_mscale_all_dim": cfg.yarn_mscale_all_dim,
            "yarn_correction_range_round_to_int": cfg.yarn_truncate}


def rotary_embedding(cfg: ModelConfig) -> RotaryEmbedding:
    """megatron's RoPE for ``cfg`` (partial rotary, llama3 scaling, YaRN): what GPTModel
    builds."""
    if cfg.rope_scaling == "yarn":
        a = yarn_attributes(cfg)
        return YarnRotaryEmbedding(
            kv_channels=cfg.rope_dim(), rotary_base=cfg.rotary_base, use_cpu_initialization=True,
            scaling_factor=a["yarn_rotary_scaling_factor"],
            original_max_position_embeddings=a["yarn_original_max_position_embeddings"],
            beta_fast=a["yarn_beta_fast"], beta_slow=a["yarn_beta_slow"],
            mscale=a["yarn_mscale"], mscale_all_dim=a["yarn_mscale_all_dim"],
            correction_range_round_to_int=a["yarn_correction_range_round_to_int"])
    return RotaryEmbedding(
        kv_channels=cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim,
        rotary_percent=cfg.rotary_percent,
        rotary_base=cfg.rotary_base, use_cpu_initialization=True,
        rope_scaling=cfg.rope_scaling == "llama3", rope_scaling_factor=cfg.rope_scaling_factor,
    )


def rope_emb(rotary: RotaryEmbedding, n: int) -> tuple[torch.Tensor, float]:
    """The angles of positions 0..n-1 ([n, 1, 1, rot]) and the factor megatron's attention
    scales cos and sin by (``mscale``: YaRN's concentration factor, else 1)."""
    got = rotary.get_emb(n)
    if isinstance(rotary, YarnRotaryEmbedding):  # (emb, mscale)
        return got[0], float(got[1])
    return got, 1.0


def _norm(backend: BackendSpecProvider, config: TransformerConfig) -> torch.nn.Module:
    cls = backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)
    return build_module(cls, config=config, hidden_size=config.hidden_size,
                        eps=config.layernorm_epsilon)


class InferenceLayer(torch.nn.Module):
    """One decoder layer, its modules chosen by megatron's backend provider (local or TE).

    The FFN is either MoE (``GatherMoE``: router, routed experts, optional shared experts) or,
    for the dense layers (``first_k_dense``, ``dense_layers``), a dense MLP of megatron's
    ``MLP`` (ATP-sharded).
    Names follow megatron's TransformerLayer (dense TE layers fuse the pre-MLP norm into
    ``mlp.linear_fc1``, as its TE spec does)."""

    def __init__(self, config: TransformerConfig, groups: ParallelGroups, layer_number: int,
                 backend: BackendSpecProvider, is_moe: bool, moe_compute: str = "auto",
                 moe_kernel: str = "auto"):
        super().__init__()
        fused = backend.fuse_layernorm_and_linear()  # TE: norm lives in linear_qkv
        self.is_moe = is_moe
        self.input_layernorm = IdentityOp() if fused else _norm(backend, config)
        qkv_cls = (backend.column_parallel_layer_norm_linear() if fused
                   else backend.column_parallel_linear())
        qk_norm = (backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=True)
                   if config.qk_layernorm else None)
        if getattr(config, "multi_latent_attention", False):
            if fused:
                raise ValueError("attention 'mla' runs the local layer spec (model.use_te: "
                                 "'on' is refused)")
            self.self_attention = PagedMLAttention(
                config, layer_number, groups.atp, config.init_method, qk_norm,
                q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                qk_nope_head_dim=config.qk_head_dim,
                qk_rope_head_dim=config.qk_pos_emb_head_dim, v_head_dim=config.v_head_dim,
                softmax_scale=mla_softmax_scale(config))
        else:
            self.self_attention = PagedSelfAttention(config, layer_number, groups.atp,
                                                     config.init_method, qkv_cls,
                                                     backend.row_parallel_linear(), qk_norm)
        if is_moe:
            self.pre_mlp_layernorm = _norm(backend, config)
            ep_rank = groups.rank // groups.layout.etp  # EP index: experts are EP-major
            self.mlp = GatherMoE(config, groups.pg_collection, ep_rank, groups.layout.ep,
                                 layer_number, backend.grouped_mlp_modules(config.moe_grouped_gemm),
                                 compute=moe_compute, shared_fc=backend.column_parallel_linear(),
                                 shared_proj=backend.row_parallel_linear(), kernel=moe_kernel)
        else:  # TE fuses the pre-MLP norm into fc1 here, as megatron's TE dense layer does
            self.pre_mlp_layernorm = IdentityOp() if fused else _norm(backend, config)
            fc1 = (backend.column_parallel_layer_norm_linear() if fused
                   else backend.column_parallel_linear())
            self.mlp = MLP(config, MLPSubmodules(linear_fc1=fc1,
                                                 linear_fc2=backend.row_parallel_linear()),
                           ffn_hidden_size=config.ffn_hidden_size, tp_group=groups.atp)

    def dense_partial(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """Dense layer: this rank's ATP-partial MLP output on the normalised rows x (its
        replica's rows); the caller's phase collective reduces it. ``invariant``: its GEMMs
        batch-invariant (engine.batch_invariant's D)."""
        return mlp_partial(self.mlp, x, invariant)


class _Decoder(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, config, groups, backend, moe_compute="auto",
                 moe_kernel="auto"):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [InferenceLayer(config, groups, i + 1, backend, cfg.is_moe_layer(i), moe_compute,
                            moe_kernel)
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

    @property
    def whole_vocab(self) -> bool:
        """Whether this rank holds every row of the vocabulary (attention TP 1)."""
        emb = self.word_embeddings
        return emb.vocab_start_index == 0 and emb.vocab_end_index == emb.num_embeddings

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's vocab-shard contribution (zero rows for ids outside the shard); the sum
        over the ATP group is the embedding. megatron's forward would reduce it itself."""
        emb = self.word_embeddings
        if self.whole_vocab:
            # the whole vocabulary here (attention TP 1): every id is inside (the scheduler
            # refuses others at submit, D's padding rows are token 0), so the mask is all
            # false -- six launches fewer per P step and D iteration, the same rows
            return F.embedding(ids, emb.weight)
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


def _norms_to(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Norm weights in the model's dtype. megatron's torch norms are built in fp32 whatever
    params_dtype says (its Float16Module converts them later, for megatron's own bf16 model);
    an fp32 weight on bf16 activations also keeps torch's rms_norm off its fused kernel (on an
    H200 the norms took 5% of a decode step). Same values as megatron's bf16 GPTModel."""
    for m in model.modules():
        if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            m.to(dtype)


class InferenceGPT(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, dtype: torch.dtype,
                 decode_attention: str = "auto", prefill_attention: str = "auto",
                 moe_kernel: str = "auto", *, max_decode_rows: int = 0,
                 timeout_s: float = 60.0, mtp_draft: bool = False,
                 batch_invariant: bool = False):
        """``max_decode_rows``: D's most rows per replica (the largest decode bucket), which
        sizes the deepep backend's low-latency buffer; ``timeout_s`` bounds its host waits.
        ``mtp_draft`` (engine.mtp): the MTP layer drafts -- its KV is allocated (layer
        ``num_layers`` of the storage) and P runs it after sampling (model/mtp.py). The MTP
        layer's weights exist whenever ``cfg.mtp_num_layers`` is 1 (loaded and synced).
        ``batch_invariant`` (engine.batch_invariant): D's GEMMs, attention splits and expert
        tiles batch-invariant (model/batch_invariant.py); refused where a layout or a kernel
        the model would run cannot be (``batch_invariance_problem``)."""
        super().__init__()
        why = normalization_problem(cfg)
        if why is not None:
            raise ValueError(f"model.normalization: {why}")
        # D and P attention's backends (engine.decode_attention, engine.prefill_attention),
        # chosen once for the model's device before anything is allocated: "triton" without
        # CUDA or triton fails here
        if cfg.is_mla:  # MLA attends in its own ops (model/mla_attention.py, mla_decode.py)
            # D: its Triton kernel (model/mla_decode.py) or its torch ops, "auto" as GQA's
            # (triton on CUDA where it imports: 1.08-1.73x faster D steps on an H200, session
            # 29); resolve_backend refuses "triton" without CUDA or triton
            self.decode_attention = resolve_backend(decode_attention, groups.device)
            # P: fresh long sequences in dense calls (cudnn, flash), the rest per context
            # bucket through SDPA (cudnn) or in one variable-length call (flash)
            self.prefill_attention = resolve_mla_prefill(prefill_attention, groups.device,
                                                         dtype, cfg.head_dim, cfg.v_head_dim)
        else:
            self.decode_attention = resolve_backend(decode_attention, groups.device)
            self.prefill_attention = resolve_prefill_backend(prefill_attention, groups.device,
                                                             dtype, cfg.head_dim)
        # the grouped MoE path's expert GEMMs (engine.moe_kernel): torch._grouped_mm or the
        # Triton fused-MoE kernel ("auto": triton on CUDA for bf16/fp16 models)
        self.moe_kernel = resolve_moe_kernel(moe_kernel, groups.device, dtype)
        # the residual add of the fp32 MLP/MoE partials (model/residual.py) follows it
        self.residual_kernel = self.moe_kernel
        # routing replay's record (model/routing_record.py), set by the worker when
        # engine.record_routing is on; None: the routers write nothing
        self.routing = None
        lay = groups.layout
        self.cfg = cfg
        self.groups = groups
        self.use_te = resolve_use_te(cfg, local=batch_invariant)
        self.config = megatron_config(cfg, tp=lay.atp, ep=lay.ep, etp=lay.etp, dtype=dtype,
                                      init=False, use_te=self.use_te)
        # the experts' path (model.moe_compute): batch_invariant needs the grouped one ("auto"
        # takes the megatron path off sm90 bf16; its GEMMs follow the row count)
        compute = ("grouped" if batch_invariant and cfg.moe_compute == "auto"
                   else cfg.moe_compute)
        self.embedding = _Embedding(self.config, cfg.vocab_size, groups.atp)
        self.decoder = _Decoder(cfg, self.config, groups, spec_backend(self.use_te),
                                compute, self.moe_kernel)
        self.mtp = None
        if cfg.mtp_num_layers:
            self.mtp = MTPBlock([MTPLayer(self.config, groups, cfg.num_layers + 1 + j,
                                          spec_backend(self.use_te), mtp_is_moe(cfg),
                                          compute, self.moe_kernel)
                                 for j in range(cfg.mtp_num_layers)])
        if mtp_draft and self.mtp is None:
            raise ValueError("engine.mtp needs the model's MTP layer (model.mtp_num_layers: 1)")
        self.mtp_draft = mtp_draft
        self.batch_invariant = batch_invariant
        if batch_invariant:
            why = batch_invariance_problem(cfg)
            if why is None and groups.device.type == "cuda" and "torch" in (
                    self.decode_attention, self.moe_kernel):
                why = ("on a GPU it needs the Triton D attention and expert kernels "
                       "(engine.decode_attention and engine.moe_kernel: auto or triton)")
            if why is not None:
                raise ValueError(f"engine.batch_invariant: {why}")
        for layer in self._all_layers():
            layer.self_attention.decode_backend = self.decode_attention
            layer.self_attention.prefill_backend = self.prefill_attention
            layer.self_attention.batch_invariant = batch_invariant
        # tied embeddings: no output_layer weight (megatron's GPTModel has none either); the
        # logits use the embedding's vocab shard, which is the same [V/ATP, H] slice
        self.output_layer = ColumnParallelLinear(
            cfg.hidden_size, cfg.vocab_size, config=self.config,
            init_method=self.config.init_method, bias=False, gather_output=False,
            skip_bias_add=False, tp_group=groups.atp,
            skip_weight_param_allocation=cfg.tie_embeddings,
        )
        self.rotary_pos_emb = rotary_embedding(cfg)
        _norms_to(self, dtype)
        # engine.batch_invariant: D's sums across ranks in rank order (model/comm.py)
        self.comm = GatherComm(groups, ordered_sums=batch_invariant)
        # model.moe_dispatch: None for "gather" (the MoE computes every replica's rows), else
        # P's and D's dispatchers (model/dispatch.py), each with its own communicator --
        # collective here: every rank builds the model with the same config
        self.moe_dispatch = cfg.moe_dispatch
        pair = new_dispatchers(cfg.moe_dispatch, groups, cfg.num_experts // lay.ep,
                               cfg.moe_router_topk, cfg.moe_dispatch_capacity,
                               hidden=cfg.hidden_size,
                               max_decode_tokens=-(-max_decode_rows // lay.atp),
                               p_sms=cfg.deepep_p_sms, timeout_s=timeout_s)
        self.dispatch_p, self.dispatch_d = pair if pair is not None else (None, None)
        if self.dispatch_d is not None:
            self.dispatch_d.invariant = batch_invariant
        self._rope: torch.Tensor | None = None
        self._rope_mscale = 1.0  # megatron's mscale: cos and sin scaled by it (YaRN)
        # writes of new weights (WeightSync, load_full_state_dict): rl/rollout.py's carry
        # refuses to label tokens of new weights with the old weight_version
        self.weight_epoch = 0
        self._rope_tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        # diagnostics: when a list, P appends the residual stream after every attention and
        # MoE block (fp32 copies) -- for locating precision loss against a reference
        self.trace: list[torch.Tensor] | None = None
        # megatron's groups for this model's parameters (TP = ATP, EP, expert TP): what
        # megatron's resharding reads to know which shard each rank holds
        self.pg_collection = groups.pg_collection
        # model.fp8: the FP8 copies of the GEMM weights (model/fp8.py), made and re-made from
        # the 16-bit parameters by weights_updated(); the sources' addresses at that point
        self.fp8 = cfg.fp8 is not None
        # the weights' scale block (model.fp8_recipe; model/fp8.py): 0 rowwise, 128 blockwise
        self.fp8_block = recipe_block(cfg.fp8_recipe)
        self._fp8_ptrs: list[int] | None = None
        if self.fp8:
            ok, why = fp8_supported(groups.device)
            if not ok:
                raise ValueError(f"model.fp8: {why}")
            if cfg.fp8_backend == "te":  # the dense GEMMs through TE (model/fp8_te.py)
                problem = (te_fp8_problem(cfg.fp8_recipe) if groups.device.type == "cuda"
                           else "Transformer Engine's FP8 GEMMs run on a CUDA GPU only")
                if problem:
                    raise ValueError(f"model.fp8_backend: {problem}")
            if dtype != torch.bfloat16:
                raise ValueError(f"model.fp8 needs bfloat16 parameters, got {dtype}")
            if groups.device.type == "cuda" and self.moe_kernel != "triton":
                raise ValueError("model.fp8 on a GPU needs the Triton expert kernel "
                                 f"(engine.moe_kernel resolved to {self.moe_kernel!r})")
            for moe in self.moe_layers():
                moe.fp8, moe.fp8_block = True, self.fp8_block
                moe.fp8_te = cfg.fp8_backend == "te"

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

    def _all_layers(self) -> list[InferenceLayer]:
        """The decoder's layers, then the MTP layers' transformer layers."""
        mtp = [m.mtp_model_layer for m in self.mtp.layers] if self.mtp is not None else []
        return [*self.decoder.layers, *mtp]

    # ------------------------------------------------------------------ FP8 weights
    def _fp8_sites(self) -> list[tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]:
        """(holder, its 16-bit GEMM weights) of every FP8 GEMM but the routed experts': each
        layer's attention projections, its dense MLP or its MoE's shared experts."""
        sites = []
        for layer in self._all_layers():
            att = layer.self_attention
            sites.append((att, att.fp8_weights(self.fp8_block)))
            mlp = layer.mlp
            if isinstance(mlp, GatherMoE):
                mlp = mlp.shared_experts
            if mlp is not None:
                sites.append((mlp, (mlp.linear_fc1.weight, mlp.linear_fc2.weight)))
        return sites

    def _fp8_sources(self) -> list[torch.Tensor]:
        return ([w for _, ws in self._fp8_sites() for w in ws if w is not None]
                + [w for moe in self.moe_layers() for w in moe.expert_params()])

    def weights_updated(self) -> None:
        """The 16-bit weights were written (a load, a weight sync, a resume): re-quantise every
        FP8 copy from them -- in place where its shape and device still match, so captured
        graphs read the new values. No-op without model.fp8. Collective-free."""
        if not self.fp8:
            return
        with torch.inference_mode(False), torch.no_grad():
            for holder, ws in self._fp8_sites():
                _check_fp8_shapes(holder, ws, self.fp8_block)
                old = getattr(holder, "colo_fp8", None)
                # (None: a GEMM that stays in params_dtype, fp8_weights says which)
                if old is not None and all(o is None if w is None else o is not None
                                           and o.matches(w) for o, w in zip(old, ws)):
                    for o, w in zip(old, ws):
                        if o is not None:
                            o.refresh(w)
                else:
                    holder.colo_fp8 = tuple(None if w is None else self._fp8_weight(w)
                                            for w in ws)
            for moe in self.moe_layers():
                moe.refresh_fp8()
        self._fp8_ptrs = [w.data_ptr() for w in self._fp8_sources()]

    def _fp8_weight(self, w: torch.Tensor):
        """A dense GEMM weight's FP8 copy: the engine's (``Fp8Weight``) or, with
        model.fp8_backend te, Transformer Engine's (``TeFp8Weight``)."""
        if self.cfg.fp8_backend == "te":
            from colo_rollout.model.fp8_te import TeFp8Weight

            return TeFp8Weight.of(w, self.cfg.fp8_recipe, self.cfg.fp8)
        return Fp8Weight.of(w, self.fp8_block)

    def check_fp8(self) -> bool:
        """Idle engine only: re-quantise when a 16-bit source was replaced (its address moved)
        since the last weights_updated(). In-place writes are not seen here: the writers call
        weights_updated() (weight sync, the loaders). Returns whether it re-quantised."""
        if not self.fp8 or [w.data_ptr() for w in self._fp8_sources()] == self._fp8_ptrs:
            return False
        self.weights_updated()
        return True

    def drop_fp8(self) -> None:
        """Free the FP8 copies (memory release of the weights); weights_updated() remakes them."""
        for holder, _ in self._fp8_sites():
            holder.colo_fp8 = None
        for moe in self.moe_layers():
            moe.fp8_weights = None
        self._fp8_ptrs = None

    def fp8_tensors(self) -> list[torch.Tensor]:
        """Every FP8 copy's tensors (what graphs read besides the parameters)."""
        if not self.fp8:
            return []
        out = []
        for holder, _ in self._fp8_sites():
            for w in getattr(holder, "colo_fp8", None) or ():
                if w is not None:
                    out += w.tensors()
        for moe in self.moe_layers():
            for w in moe.fp8_weights or ():
                out += w.tensors()
        return out

    def moe_layers(self) -> list[GatherMoE]:
        """The MoE blocks of the MoE layers (dense layers have none), the MTP layer's last."""
        return [layer.mlp for layer in self._all_layers() if layer.is_moe]

    # ------------------------------------------------------------------ weights
    def warm_kernels(self) -> None:
        """Compile the kernel variants the model's shapes need now, at build: a first compile
        while serving stalls the host for about a second (model/moe_align.py: ``warm``). Each
        distinct variant once, however many layers share it."""
        for args in set().union(*(moe.align_variants() for moe in self.moe_layers())):
            warm_align(*args)
        if self.device.type == "cuda":  # the greedy sampler's kernel (its logits: full vocab)
            warm_greedy(self.cfg.vocab_size, self.dtype, self.device)

    def warm_prefill_attention(self, max_tokens: int, max_len: int) -> int:
        """Build cuDNN's plans for every dense P-attention shape (model/dense_prefill.py)
        of P steps up to ``max_tokens`` rows on this rank and sequences up to ``max_len``,
        where P attention is "cudnn" -- or FlashAttention-4's kernel, "flash" (else nothing).
        Returns the shapes run."""
        if self.prefill_attention not in ("cudnn", "flash"):
            return 0
        att = self.decoder.layers[0].self_attention
        if self.cfg.is_mla:
            return warm_mla_plans(att.heads, att.nope, att.rope_dim, att.v_dim,
                                  att.kv_lora_rank, self.dtype, self.device, max_tokens,
                                  max_len, kernel=self.prefill_attention)
        return warm_dense_plans(att.heads, att.groups, att.head_dim, self.dtype, self.device,
                                max_tokens, max_len, kernel=self.prefill_attention)

    def close_dispatch(self) -> None:
        """Release the dispatch backends' own buffers (DeepEP's: collective over the EP
        group, after every graph that captured them is gone)."""
        for d in (self.dispatch_p, self.dispatch_d):
            close = getattr(d, "close", None)
            if close is not None:
                close()

    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Collective (every rank of the model's layout calls it): copy this rank's shard of
        every parameter from an unsharded megatron state dict (local-spec or TE-spec names;
        converted to this model's spec first). All or nothing on every rank: each rank checks
        its shards (``sharded_writes``) and that its engine serves nothing (``serving``: set
        by the engine; tokens would mix two models), the ranks agree (one all-gather of each
        verdict), and only then does any rank write -- a problem on one rank raises on every
        rank, naming it (found by probing: one rank refused, the others served new weights
        beside its old ones)."""
        problem, writes = None, []
        serving = getattr(self, "serving", None)
        released = getattr(self, "released", None)
        try:
            if serving is not None and serving():
                raise RuntimeError("the engine has requests in flight; finish them or "
                                   "engine.pause() first (their tokens would mix two models)")
            if released is not None and released():
                raise RuntimeError("the engine's memory is released (engine.release_memory); "
                                   "call engine.resume_memory() first, then load the weights")
            full = to_spec_names(full, self.use_te)
            writes = sharded_writes(self, full, self.groups.layout, self.groups.rank)
        except (TypeError, ValueError, KeyError, RuntimeError) as e:
            problem = [type(e).__name__, str(e).strip("'\"")]
        got = first_problem(problem, self.groups.control, self.groups.layout.world_size,
                            "load_full_state_dict")
        if got is not None:
            r, (kind, text) = got
            where = "" if r == self.groups.rank else f"rank {r}: "
            raise {"TypeError": TypeError, "KeyError": KeyError,
                   "RuntimeError": RuntimeError}.get(kind, ValueError)(
                f"load_full_state_dict: {where}{text}")
        write_shards(writes)
        self.weight_epoch += 1  # new weights: what a partial rollout's carry checks
        if self._fp8_ptrs is not None:  # FP8 copies exist: follow the new weights (a first
            self.weights_updated()  # load's are made where the model runs: build_model)

    def rope_table(self) -> torch.Tensor:
        if self._rope is None or self._rope.device != self.device:
            emb, self._rope_mscale = rope_emb(self.rotary_pos_emb,
                                              self.cfg.max_position_embeddings)
            self._rope = emb.to(self.device)
            self._rope_tables = {}
            self.rope_tables(self.dtype)  # before any graph capture (see rope_tables)
        return self._rope

    def rope_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position's angles, [P, rot] in ``dtype``: RopeAngles's ops
        (cos, sin in fp32 on this device, then the cast) over the whole table, so row p is
        bitwise what a step computes for position p. Made once per dtype (the rope kernel
        reads them at the step's positions)."""
        table = self.rope_table()
        got = self._rope_tables.get(dtype)
        if got is None:
            # made inside a capture, the tables would live in that graph's pool and be
            # recomputed by its replays; the model dtype's are made with the rope table
            if table.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"rope tables for {dtype} requested first inside a CUDA "
                                   "graph capture")
            freqs = table.view(table.shape[0], table.shape[-1])
            m = self._rope_mscale
            got = self._rope_tables[dtype] = ((torch.cos(freqs) * m).to(dtype),
                                              (torch.sin(freqs) * m).to(dtype))
        return got

    def prefill_plan(self, new: list[int], ctx: list[int]):
        """The host half of a P epoch's attention plan for this replica's sequences (new
        tokens, contexts), which every layer reads (``PagedSelfAttention.prefill_plan``:
        ``PlanHost``, or None for the torch backend): made with the step's inputs so its
        tables ride their host->device copy."""
        att = self.decoder.layers[0].self_attention
        return att.prefill_plan(new, ctx, self.dtype, self.device)

    @property
    def bucketed_prefill(self) -> bool:
        """P attention reads ``AttnMetadata.buckets`` (the torch backend; MLA's cudnn, for
        the sequences its dense calls leave)."""
        return self.prefill_attention == "torch" or (self.cfg.is_mla and not self.varlen_prefill)

    @property
    def varlen_prefill(self) -> bool:
        """P attention reads ``AttnMetadata.varlen`` (MLA's flash: the sequences its dense
        calls leave, in one FlashAttention-4 variable-length call)."""
        return self.cfg.is_mla and self.prefill_attention == "flash"

    def dense_prefill(self, new: list[int], ctx: list[int]) -> tuple[tuple[int, int, int], ...]:
        """MLA's dense calls' sequences (sequence, first row, new tokens) for a P epoch of
        these sequences, where its P backend is cudnn or flash; () otherwise (GQA's come with
        its kernel plan, ``prefill_plan``)."""
        if not self.cfg.is_mla or self.prefill_attention not in DENSE_BACKENDS:
            return ()
        return dense_held(new, dense_sequences(new, ctx, dense_prefill.MIN_TOKENS))

    def rope_angles(self, positions: torch.Tensor) -> RopeAngles:
        """One forward's angles at ``positions`` (every layer reads them)."""
        return RopeAngles(self.rope_table(), positions, self.rope_tables, self._rope_mscale)

    def new_kv_storage(self, num_blocks: int, block_size: int) -> KVStorage | LatentKVStorage:
        atp = self.groups.layout.atp
        layers = self.cfg.num_layers + (self.cfg.mtp_num_layers if self.mtp_draft else 0)
        if self.cfg.is_mla:
            return LatentKVStorage(layers, num_blocks, block_size, self.cfg.kv_lora_rank,
                                   self.cfg.qk_rope_head_dim, self.dtype, self.device)
        return KVStorage(layers, num_blocks, block_size,
                         self.cfg.num_query_groups // atp, self.config.kv_channels,
                         self.dtype, self.device)

    # ------------------------------------------------------------------ P
    def forward_prefill(self, inp: PrefillInputs, kv: KVStorage,
                        moe: MoEBlock | None = None, sample=None):
        """The whole P epoch at once (Normal mode): every boundary is crossed immediately."""
        return run_to_completion(self.prefill_segments(inp, kv, moe, sample))

    def moe_block(self, i: int, h: torch.Tensor, pairs: bool = False) -> torch.Tensor:
        """MoE layer i's routed experts on the residual stream h [N, H] (all replicas' rows):
        this rank's fp32 partial. Shared experts are added by the caller on its own rows.
        ``pairs``: the unsummed slots instead (``GatherMoE``; see ``_slots_into_residual``)."""
        layer = self.decoder.layers[i]
        return layer.mlp(layer.pre_mlp_layernorm(h), record=self.route_record("P", i,
                                                                              h.shape[0]),
                         pairs=pairs)

    def p_moe_into_residual(self, i: int, h: torch.Tensor) -> bool:
        """Whether P's MoE layer i on the residual stream h goes through
        ``MoEBlock.residual`` (the slots summed straight into h) rather than a partial and
        P's combine: the gather backend where ``_slots_into_residual`` holds."""
        layer = self.decoder.layers[i]
        return (self.dispatch_p is None and layer.is_moe
                and self._slots_into_residual(layer.mlp, h))

    def p_fusion(self, i: int) -> PrefillFusion | None:
        """P's MoE layer i with its norms fused into the adds around it (``PrefillFusion``),
        where its slots go into the residual (``p_moe_into_residual``, checked by the caller)
        and both norms are torch's RMSNorm; else None."""
        layers = self.decoder.layers
        pre = self._fusable_norm(layers[i].pre_mlp_layernorm)
        after = self._fusable_norm(layers[i + 1].input_layernorm if i + 1 < len(layers)
                                   else self.decoder.final_layernorm)
        return None if pre is None or after is None else PrefillFusion(pre, after)

    def p_moe_kind(self, i: int, h: torch.Tensor) -> str | None:
        """How P computes MoE layer i on h without a dispatch backend: "normed" (the slots
        into h with both norms fused, ``MoEBlock.normed``), "residual" (the slots into h),
        "partial" (an fp32 partial and P's combine); None for a dense layer or a dispatch
        backend."""
        return self._p_moe_plan(i, h)[0]

    def _p_moe_plan(self, i: int, h: torch.Tensor) -> tuple[str | None, PrefillFusion | None]:
        """(``p_moe_kind``, the layer's ``p_fusion`` where the kind is "normed")."""
        if not self.decoder.layers[i].is_moe or self.dispatch_p is not None:
            return None, None
        if not self.p_moe_into_residual(i, h):
            return "partial", None
        fusion = self.p_fusion(i)
        return ("residual", None) if fusion is None else ("normed", fusion)

    def _slots_into_residual(self, mlp: GatherMoE, x: torch.Tensor) -> bool:
        """Whether an MoE layer's k slots go straight into the residual stream (model/
        residual.py: ``add_rounded_slots``, one launch for the slot sum and the add): its
        combine collective is the identity -- one rank, where GatherComm's full-group
        collectives return their input -- no shared expert adds into the fp32 sum, and the
        grouped expert path (the one with unsummed slots) computes x's rows."""
        return self.comm.world == 1 and mlp.shared_experts is None and mlp.uses_grouped(x)

    @property
    def records_own_rows(self) -> bool:
        """Whether a rank's routing record holds only its own rows: with a dispatch backend
        each rank routes its share of its replica's rows (the gather backend routes every
        replica's rows on every rank)."""
        return self.dispatch_p is not None

    def route_record(self, phase: str, i: int, rows: int) -> torch.Tensor | None:
        """Where MoE layer i's router writes the expert ids of ``rows`` rows of ``phase`` (the
        routing record's slot, model/routing_record.py), or None when nothing is recorded."""
        rec = self.routing
        return None if rec is None else rec.view(phase, i, rows)

    @torch.inference_mode()
    def prefill_segments(self, inp: PrefillInputs, kv: KVStorage,
                         moe: MoEBlock | None = None, sample=None
                         ) -> Generator[int, None, torch.Tensor]:
        """P as segments (the boundary producer).

        Yields boundary id i (0, 1, ...) just before P's i-th registered collective; resuming
        the generator issues that collective and computes up to the next boundary. Returns
        this replica's last-token logits. With the gather backend an epoch has
        2 * num_layers + 2 boundaries (each before a full-group AllReduce): the embedding
        gather, per layer the attention gather and the MoE combine (or dense gather), the
        logits. With a dispatch backend (``model.moe_dispatch``: alltoall, deepep) each MoE
        layer has one more, between the attention gather's and the combine's: the split point
        of P's dispatch, after the expert-count exchange (DeepEP: its notification) and before
        the host read of the counts and the payload (``boundaries_per_prefill`` counts them).
        With a dispatch backend at attention TP 1 the rank computes its replica's rows alone
        (``_forward_prefill_own``): P has no collectives but the dispatcher's, and the split
        points are the epoch's only boundaries -- one producer, the backend
        (``boundary_producer``).

        ``moe(i, h)`` computes layer i's MoE block (pre-MLP norm, router, local experts) on the
        residual stream h: the P graphs' replay (worker/prefill_graph.py), or by default
        the modules themselves.
        """
        if self.mtp_draft and sample is None:
            raise ValueError("an MTP-drafting P needs the sampler (sample=)")
        sample = sample if self.mtp_draft else None
        if self.own_rows_prefill:
            return (yield from self._forward_prefill_own(inp, kv, sample))
        return (yield from self._forward_prefill(inp, kv, moe or ModulesMoE(self), sample))

    @property
    def own_rows_prefill(self) -> bool:
        """P computes only its replica's rows: a dispatch backend moves the MoE rows, and at
        attention TP 1 nothing else needs another replica's rows or a partial's sum."""
        return self.dispatch_p is not None and self.groups.layout.atp == 1

    @property
    def boundary_producer(self) -> str:
        """Who publishes P's boundaries (the turnstile takes exactly one): the dispatch
        backend's split points where P computes its own rows, else the model's registered
        collective points ("gather")."""
        return self.moe_dispatch if self.own_rows_prefill else "gather"

    @property
    def boundaries_per_prefill(self) -> int:
        """One P epoch's boundary count (the turnstile's epoch length): 2 per layer and 2
        more, plus one per MoE layer (its dispatch split) with the alltoall backend."""
        moe_layers = sum(1 for i in range(self.cfg.num_layers) if self.cfg.is_moe_layer(i))
        # the MTP pass after the first token is sampled (model/mtp.py)
        mtp = (prefill_boundaries(self.groups.layout.atp, self.own_rows_prefill,
                                  self.dispatch_p is not None and mtp_is_moe(self.cfg))
               if self.mtp_draft else 0)
        if self.own_rows_prefill:
            return moe_layers + mtp  # the dispatch splits only
        n = 2 * self.cfg.num_layers + 2
        if self.dispatch_p is not None:
            n += moe_layers
        return n + mtp

    @torch.inference_mode()
    def forward_decode(self, inp: DecodeInputs, kv: KVStorage, hidden: bool = False):
        """Full-vocab logits [B, V] of this replica's D rows; with ``hidden``, (logits, the
        final-normed decoder output [B, H] of the rows -- MTP's input, whole on every ATP
        rank)."""
        return self._forward_decode(inp, kv, hidden)

    def _forward_prefill_own(self, inp: PrefillInputs, kv: KVStorage, sample=None):
        """Generator body, a dispatch backend at attention TP 1: this replica's rows only
        (every module's output complete on its rank), the routed experts through P's
        dispatcher, one boundary per MoE layer at its dispatch split. The same numbers as
        ``_forward_prefill``'s path for the backend (its gathers place rows, its sums add
        zeros); ``trace`` holds this replica's rows. With ``sample`` (MTP drafting) as
        ``_forward_prefill``'s: the tokens sampled here, then the MTP pass on the same rows
        (model/mtp.py: ``mtp_prefill_own``, its MoE's split one more boundary)."""
        r = self.groups.replica
        off, n_local = sum(inp.row_counts[:r]), inp.row_counts[r]
        record_rows = sum(inp.row_counts)  # the record's P rows: every replica's
        h = self.embedding.partial(inp.token_ids)  # attention TP 1: the whole embedding
        rope = self.rope_angles(inp.attn.positions)
        boundary = 0
        for i, layer in enumerate(self.decoder.layers):
            record = self.route_record("P", i, record_rows) if layer.is_moe else None
            h, boundary = yield from self.own_rows_layer(
                layer, i, h, rope, inp, kv, boundary,
                None if record is None else record[off : off + n_local], trace=True)
        seq_off, n_seq = sum(inp.last_counts[:r]), inp.last_counts[r]
        local_last = inp.last_rows[seq_off : seq_off + n_seq] - off
        if sample is None:
            last = self.decoder.final_layernorm(h[local_last])
            return F.linear(last, self.output_weight)  # attention TP 1: the whole vocabulary
        hidden = self.decoder.final_layernorm(h)  # every row: the MTP layer reads them all
        tokens, logprobs = sample(F.linear(hidden[local_last], self.output_weight))
        nxt = shift_tokens(inp.token_ids, local_last, tokens)
        drafts = yield from mtp_prefill_own(self, hidden, nxt, local_last, inp, kv, rope,
                                            boundary)
        return tokens, logprobs, drafts

    def own_rows_layer(self, layer: InferenceLayer, kv_layer: int, h: torch.Tensor, rope,
                       inp: PrefillInputs, kv: KVStorage, boundary: int,
                       record: torch.Tensor | None, trace: bool = False
                       ) -> Generator[int, None, tuple[torch.Tensor, int]]:
        """One layer of P where the rank computes its replica's rows ``h`` [n, H] alone (a
        dispatch backend at attention TP 1; a generator): attention (KV of layer
        ``kv_layer``), then a dense MLP, or the routed experts through P's dispatcher --
        yielding ``boundary`` at its split, after the count exchange -- plus the shared
        experts. ``record``: where the router writes these rows' expert ids (None: not
        recorded, as the MTP layer). Returns (h, the next boundary id). The decoder's layers
        and the MTP layer's share it."""
        h = h + layer.self_attention(layer.input_layernorm(h), rope, inp.attn, kv, kv_layer)
        if trace and self.trace is not None:
            self.trace.append(h.float().clone())
        x = layer.pre_mlp_layernorm(h)
        if layer.is_moe:
            split = self.dispatch_p.routed_split(layer.mlp, x, kv_layer, record)
            next(split)  # route, notify the counts
            yield boundary
            boundary += 1
            out = run_to_completion(split)  # counts, payload, experts, combine: fp32
            if layer.mlp.shared_experts is not None:
                layer.mlp.add_shared(out, x)
            h = add_rounded(h, out, self.residual_kernel)
        else:  # dense MLP: complete on this rank at attention TP 1
            h = h + layer.dense_partial(x)
        if trace and self.trace is not None:
            self.trace.append(h.float().clone())
        return h, boundary

    def _forward_prefill(self, inp: PrefillInputs, kv: KVStorage, moe: MoEBlock, sample=None):
        """Generator body: full-vocab logits [n_local_seqs, V] of this replica's last P tokens,
        yielding a boundary id before every P collective. With ``sample`` (MTP drafting):
        ``sample(logits)`` -> (tokens, logprobs) of this replica's sequences, on every rank of
        the replica, then the MTP pass (model/mtp.py); returns (tokens, logprobs, draft
        logits)."""
        comm, r = self.comm, self.groups.replica
        total = sum(inp.row_counts)
        off = sum(inp.row_counts[:r])
        n_local = inp.row_counts[r]
        boundary = 0
        first = self._p_embed_norm()
        if first is not None:  # the rows and layer 0's input norm of them in one launch
            emb_partial, normed = embed_rms_norm(inp.token_ids,
                                                 self.embedding.word_embeddings.weight, first,
                                                 self.residual_kernel)
        else:
            emb_partial = self.embedding.partial(inp.token_ids)
            normed = None  # this layer's normalised input, where the last add computed it
        rope = self.rope_angles(inp.attn.positions)
        yield boundary
        boundary += 1
        h = comm.p_gather(emb_partial, off, total)
        own = slice(off, off + n_local)
        for i, layer in enumerate(self.decoder.layers):
            # one rank, no shared experts: the unsummed slots summed straight into h (no
            # fp32 partial, no combine over one rank) -- with the norms around them fused
            # into the adds ("normed")
            kind, fusion = self._p_moe_plan(i, h)
            dispatch = layer.is_moe and self.dispatch_p is not None
            h, boundary, normed = yield from self.prefill_layer(
                layer, i, h, rope, inp, kv, own, total, boundary,
                (lambda x, i=i: moe.partial(i, x)) if kind == "partial"
                else (lambda x, i=i: moe.residual(i, x)),
                dispatch=dispatch, slots=kind in ("residual", "normed"), trace=True,
                moe_input=(None if kind is None
                           else lambda n, u=kind == "normed": moe.input(n, u)), normed=normed,
                fused=(lambda x, u, i=i: moe.normed(i, x, u)) if kind == "normed" else None,
                pre=None if fusion is None else fusion.pre)
        if normed is not None:  # the last layer's add computed the final norm of every row
            hidden_all = normed
            last = normed[inp.last_rows]
        elif sample is not None:  # every row's normed output: the MTP layer reads them all
            hidden_all = self.decoder.final_layernorm(h)
            last = hidden_all[inp.last_rows]
        else:
            last = self.decoder.final_layernorm(h[inp.last_rows])  # all replicas' last tokens
        seq_off = sum(inp.last_counts[:r])
        n_seq = inp.last_counts[r]
        full = self.p_logits_partial(last[seq_off : seq_off + n_seq], last.shape[0], seq_off)
        yield boundary
        full = comm.p_allreduce(full)
        if sample is None:
            return full[seq_off : seq_off + n_seq]
        tokens, logprobs = sample(full[seq_off : seq_off + n_seq])
        local_last = inp.last_rows[seq_off : seq_off + n_seq] - off
        nxt = shift_tokens(inp.token_ids, local_last, tokens)
        drafts = yield from mtp_prefill(self, hidden_all, nxt, inp, kv, boundary + 1)
        return tokens, logprobs, drafts

    # ------------------------------------------------------------------ D
    def _forward_decode(self, inp: DecodeInputs, kv: KVStorage, hidden: bool = False):
        """Returns full-vocab logits [B, V] for this replica's (padded) D rows.

        Where an MoE layer's slots go straight into the residual (``_slots_into_residual``:
        one rank, so every collective around the adds is the identity) each residual add is
        fused with the RMSNorm that reads it (model/norm_add.py, where ``_fusable_norm``
        says the norm is torch's RMSNorm): the attention's add with the pre-MLP norm, the
        slots' add with the next layer's input norm (the final norm after the last layer),
        which that layer then does not run."""
        comm, backend = self.comm, self.residual_kernel
        res = comm.d_reduce_scatter_atp(self.embedding.partial(inp.token_ids))
        rope = self.rope_angles(inp.attn.positions)
        B = inp.token_ids.shape[0]  # rows per replica: replica r's rows of u are [r*B, r*B+B)
        own = slice(self.groups.replica * B, (self.groups.replica + 1) * B)
        layers = self.decoder.layers
        normed = None  # the next layer's normalised input, when the last add computed it
        for i, layer in enumerate(layers):
            x = comm.d_all_gather_atp(layer.input_layernorm(res)) if normed is None else normed
            normed = None
            attn = layer.self_attention(x, rope, inp.attn, kv, i)
            slots = (layer.is_moe and self.dispatch_d is None
                     and self._slots_into_residual(layer.mlp, res))
            pre = self._fusable_norm(layer.pre_mlp_layernorm) if slots else None
            if pre is not None:  # one rank: the add and the pre-MLP norm in one launch
                res, u = add_rms_norm(res, attn, pre, backend)
            else:
                res = res + comm.d_reduce_scatter_atp(attn)
            if slots:  # one rank: no combine, the k slots summed into the residual
                if pre is None:
                    u = comm.d_all_gather_full(layer.pre_mlp_layernorm(res))
                pairs = layer.mlp(u, record=self.route_record("D", i, u.shape[0]), pairs=True,
                                  invariant=self.batch_invariant)
                after = self._fusable_norm(layers[i + 1].input_layernorm if i + 1 < len(layers)
                                           else self.decoder.final_layernorm)
                if after is not None:  # and the next norm in the same launch
                    res, normed = add_slots_rms_norm(res, pairs, after, backend)
                else:
                    res = add_rounded_slots(res, pairs, backend)
            else:
                res = self.d_mlp(layer, res, own, i if layer.is_moe else None)
        if normed is None:
            normed = comm.d_all_gather_atp(self.decoder.final_layernorm(res))
        shard = self.d_linear(normed, self.output_weight)
        logits = comm.d_all_gather_vocab(shard)
        return (logits, normed) if hidden else logits

    def d_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight^T in D: batch-invariant under engine.batch_invariant, else F.linear."""
        return invariant_linear(x, weight) if self.batch_invariant else F.linear(x, weight)

    def prefill_layer(self, layer: InferenceLayer, kv_layer: int, h: torch.Tensor, rope,
                      inp: PrefillInputs, kv: KVStorage, own: slice, total: int,
                      boundary: int, moe_partial, *, dispatch: bool = False,
                      slots: bool = False, trace: bool = False, moe_input=None,
                      normed: torch.Tensor | None = None, fused=None,
                      pre: FusedRMSNorm | None = None
                      ) -> Generator[int, None, tuple[torch.Tensor, int, torch.Tensor | None]]:
        """One layer of P on the gather backend's layout (a generator; yields ``boundary``
        on, one id before each collective): ``h`` [T, H] holds every replica's rows on every
        rank, this replica's at ``own``. Attention on this replica's rows (KV of layer
        ``kv_layer``), gathered; then the MLP half: a dense MLP on this replica's rows,
        gathered; or the MoE -- ``moe_partial(h)`` (fp32 partial [T, H]; with ``slots`` the
        new residual, the k slots summed into h without a collective), or with ``dispatch``
        this rank's share of the rows through P's dispatcher (one more boundary, at its
        split) -- plus the shared experts on this replica's rows, reduced by P's AllReduce.
        ``trace``: append the residual stream after each half (model.trace). ``moe_input``
        (``MoEBlock.input``): where the attention half's residual add may write h for
        ``moe_partial`` (a P graph's input: no copy into it). ``normed``: h's rows already
        through this layer's input norm (the last layer's fused add made them). ``fused``
        (``MoEBlock.normed``, one rank, with ``pre`` the pre-MLP norm): the attention's add
        computes h and its pre-MLP norm u in one kernel, and ``fused(h, u)`` the new h and
        the next norm's rows. Returns (h, the next boundary id, the next layer's normalised
        input or None). The decoder's layers and the MTP layer's share it."""
        comm = self.comm
        off, n_local = own.start, own.stop - own.start
        src = h if normed is None else normed
        x = src if n_local == src.shape[0] else src[own]  # (one replica: no slice op)
        if normed is None:
            x = layer.input_layernorm(x)
        attn = layer.self_attention(x, rope, inp.attn, kv, kv_layer)
        yield boundary
        boundary += 1
        buf = None if moe_input is None else moe_input(h.shape[0])
        nxt = u = None
        if fused is not None:  # one rank: the add and the pre-MLP norm in one launch
            h, u = add_rms_norm(h, attn, pre, self.residual_kernel, out=buf)
        elif buf is not None:  # the add straight into the MoE graph's input
            h = torch.add(h, comm.p_gather(attn, off, total), out=buf[0])
        else:
            h = h + comm.p_gather(attn, off, total)
        if trace and self.trace is not None:
            self.trace.append(h.float().clone())
        if layer.is_moe:
            if dispatch:  # routed experts: this rank's share of rows; yields the split's id
                partial = yield from self._dispatch_prefill_moe(layer, kv_layer, h, off,
                                                                n_local, boundary)
                boundary += 1
            elif fused is not None:
                partial, nxt = fused(h, u)
            else:
                partial = moe_partial(h)
            if layer.mlp.shared_experts is not None:  # shared: this replica's rows
                layer.mlp.add_shared(partial[own], layer.pre_mlp_layernorm(h[own]))
            yield boundary
            boundary += 1
            if slots:  # moe_partial gave the new residual already
                h = partial
            else:  # fp32 combine, round
                h = add_rounded(h, comm.p_allreduce(partial), self.residual_kernel)
        else:  # dense MLP on this replica's rows, gathered like attention
            partial = layer.dense_partial(layer.pre_mlp_layernorm(h[own]))
            yield boundary
            boundary += 1
            h = h + comm.p_gather(partial, off, total)
        if trace and self.trace is not None:
            self.trace.append(h.float().clone())
        return h, boundary, nxt

    def p_logits_partial(self, last: torch.Tensor, n_all: int, seq_off: int) -> torch.Tensor:
        """P's logits of this replica's last rows ``last`` [n_seq, H] (final-normed) as this
        rank's block of the [n_all, V] result -- its vocabulary shard of rows seq_off ..
        seq_off + n_seq, zeros elsewhere. Each (replica, vocab shard) block is written by
        exactly one rank, so the phase's AllReduce of it is a gather."""
        shard = F.linear(last, self.output_weight)  # [n_seq, V/ATP]
        full = shard.new_zeros((n_all, self.cfg.vocab_size))
        emb = self.embedding.word_embeddings
        full[seq_off : seq_off + last.shape[0], emb.vocab_start_index : emb.vocab_end_index] = shard
        return full

    def d_mlp(self, layer: InferenceLayer, res: torch.Tensor, own: slice,
              record_layer: int | None) -> torch.Tensor:
        """D's MLP half of ``layer`` on the gather backend, unfused: the residual chunk
        ``res`` [B/ATP, H] after the pre-MLP norm, the MoE over every rank's rows (``own``:
        this replica's among them, for the shared experts; routing recorded as MoE layer
        ``record_layer``, None: not recorded) or the dense MLP over the replica's rows, added
        back rounded; with a dispatch backend the MoE through D's dispatcher
        (``_dispatch_decode_moe``). The decoder's layers and the MTP layer's (model/mtp.py)
        share it."""
        comm, backend = self.comm, self.residual_kernel
        if layer.is_moe and self.dispatch_d is not None:  # all-to-all of this chunk
            return add_rounded(res, self._dispatch_decode_moe(layer, res, record_layer),
                               backend)
        if layer.is_moe:
            u = comm.d_all_gather_full(layer.pre_mlp_layernorm(res))
            record = (None if record_layer is None
                      else self.route_record("D", record_layer, u.shape[0]))
            inv = self.batch_invariant
            partial = layer.mlp(u, record=record, invariant=inv)
            if layer.mlp.shared_experts is not None:
                layer.mlp.add_shared(partial[own], u[own], inv)
            return add_rounded(res, comm.d_reduce_scatter_full(partial), backend)  # fp32 sum
        # dense: the replica's rows, ATP gather and reduce-scatter like attention
        x = comm.d_all_gather_atp(layer.pre_mlp_layernorm(res))
        return add_rounded(res, comm.d_reduce_scatter_atp(
            layer.dense_partial(x, self.batch_invariant)), backend)

    def _p_embed_norm(self) -> FusedRMSNorm | None:
        """Layer 0's input norm as ``embed_rms_norm``'s where P may compute it with the
        embedding: one rank (the embedding's gather is the identity), the whole vocabulary
        here (``_Embedding.partial``'s unmasked case) and torch's RMSNorm; else None."""
        if self.comm.world != 1 or not self.embedding.whole_vocab:
            return None
        return self._fusable_norm(self.decoder.layers[0].input_layernorm)

    def _fusable_norm(self, norm: torch.nn.Module) -> FusedRMSNorm | None:
        """``norm`` as norm_add's fused RMSNorm (exactly torch's RMSNorm over the hidden
        dim), or None: it stays a module (TE's norms, LayerNorm, TE's IdentityOp)."""
        return fused_rms_norm(norm, self.cfg.hidden_size)


    # ------------------------------------------------------------------ dispatch backends
    def _dispatch_prefill_moe(self, layer: InferenceLayer, i: int, h: torch.Tensor, off: int,
                              n_local: int, boundary: int) -> Generator[int, None, torch.Tensor]:
        """P, alltoall (a generator): this rank's share of its replica's rows (split over ATP)
        through ``layer``'s routed experts (KV layer ``i``: MoE layer i of the routing
        record, or the MTP layer's, ``num_layers``, not recorded) by P's dispatcher, placed
        into a zero fp32 [N, H] partial -- the same form as the gather backend's, so P's
        combine AllReduce completes it. Yields ``boundary`` once, after the expert-count
        exchange and before the counts' host read and the payload all-to-all (the
        split-phase dispatch's safe boundary)."""
        atp, a = self.groups.layout.atp, self.groups.atp_rank
        lo = off + n_local * a // atp
        hi = off + n_local * (a + 1) // atp
        partial = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        x = layer.pre_mlp_layernorm(h[lo:hi])
        record = (self.route_record("P", i, h.shape[0])  # all replicas' rows; this rank's
                  if i < self.cfg.num_layers else None)
        split = self.dispatch_p.routed_split(layer.mlp, x, i,
                                             None if record is None else record[lo:hi])
        next(split)  # route, issue the count exchange
        yield boundary
        partial[lo:hi] = run_to_completion(split)
        return partial

    def _dispatch_decode_moe(self, layer, res: torch.Tensor,
                             record_layer: int | None) -> torch.Tensor:
        """D, alltoall: this rank's ATP chunk [B/ATP, H] of its replica's rows through the
        routed experts by D's dispatcher (complete, fp32), plus the shared experts (ATP-sharded:
        the replica's rows gathered over ATP, the partials reduce-scattered back). Routing
        recorded as MoE layer ``record_layer`` (None: not recorded -- the MTP layer)."""
        comm = self.comm
        x = layer.pre_mlp_layernorm(res)
        # the record holds replica r's rows at [r * B, r * B + B); this rank's ATP chunk
        c, atp = res.shape[0], self.groups.layout.atp
        record = (None if record_layer is None else
                  self.route_record("D", record_layer, c * atp * self.groups.layout.adp))
        if record is not None:
            first = (self.groups.replica * atp + self.groups.atp_rank) * c
            record = record[first : first + c]
        layer_id = self.cfg.num_layers if record_layer is None else record_layer
        out = self.dispatch_d.routed(layer.mlp, x, layer_id, record)
        if layer.mlp.shared_experts is not None:
            rows = comm.d_all_gather_atp(x)
            shared = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
            layer.mlp.add_shared(shared, rows, self.batch_invariant)
            out = out + comm.d_reduce_scatter_atp(shared)
        return out


def run_to_completion(gen: Generator[int, None, torch.Tensor]) -> torch.Tensor:
    """Drive a segment generator without stopping at its boundaries."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value
