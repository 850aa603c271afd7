"""megatron's state dict of a model section, as shapes: which tensors it has and how big.

Owns ``tensor_shapes`` (every tensor of the full, unsharded state dict of a ``ModelConfig``, in
megatron's local-spec names, MTP layers under ``mtp.layers.{j}.``) and ``parameter_counts``
(their totals by part, in O(1) of layers and experts: what the door sizes a run by before
anything is built). Pure Python, no torch: the door imports it. How each tensor is sharded and
filled: model/weights.py; the checkpoint's names: checkpoint/hf_names.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from colo_rollout.config.schema import ModelConfig


MTP_PREFIX = "mtp.layers."  # megatron's MTP block: mtp.layers.{j}.{enorm,hnorm,eh_proj,...}


def mtp_layer_prefix(j: int) -> str:
    """Megatron's name prefix of MTP layer j's transformer layer."""
    return f"{MTP_PREFIX}{j}.mtp_model_layer."


def mtp_is_moe(cfg: ModelConfig) -> bool:
    """MTP's transformer layer is of the last decoder layer's kind (megatron's
    get_gpt_mtp_block_spec takes the last layer spec)."""
    return cfg.is_moe_layer(cfg.num_layers - 1)


def mla_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """An MLA attention's tensors under prefix ``p`` (megatron's MLASelfAttention names):
    the query bottleneck (or the full-rank query projection), the key/value latent's down
    projection [latent | rope key] and its per-head up projection [k_nope | v], the latents'
    norms, the output projection."""
    H, n = cfg.hidden_size, cfg.num_attention_heads
    q_out = n * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    a = p + "self_attention."
    out: dict[str, tuple[int, ...]] = {}
    if cfg.q_lora_rank is None:
        out[a + "linear_q_proj.weight"] = (q_out, H)
    else:
        out[a + "linear_q_down_proj.weight"] = (cfg.q_lora_rank, H)
        out[a + "linear_q_up_proj.weight"] = (q_out, cfg.q_lora_rank)
        out[a + "q_layernorm.weight"] = (cfg.q_lora_rank,)
    out[a + "linear_kv_down_proj.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
    out[a + "linear_kv_up_proj.weight"] = (n * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                           cfg.kv_lora_rank)
    out[a + "kv_layernorm.weight"] = (cfg.kv_lora_rank,)
    out[a + "linear_proj.weight"] = (H, n * cfg.v_head_dim)
    return out


def _layer_shapes(cfg: ModelConfig, p: str, is_moe: bool,
                  experts: bool = True) -> dict[str, tuple[int, ...]]:
    """One transformer layer's tensors under prefix ``p`` (``experts`` False: without the
    routed experts' own tensors)."""
    H, F_, E, hd = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * hd
    out: dict[str, tuple[int, ...]] = {}
    out[p + "input_layernorm.weight"] = (H,)
    if cfg.is_mla:
        out.update(mla_shapes(cfg, p))
    else:
        out[p + "self_attention.linear_qkv.weight"] = (qkv, H)
        if cfg.qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = (qkv,)
        if cfg.qk_layernorm:
            out[p + "self_attention.q_layernorm.weight"] = (hd,)
            out[p + "self_attention.k_layernorm.weight"] = (hd,)
        out[p + "self_attention.linear_proj.weight"] = (H, cfg.num_attention_heads * hd)
    out[p + "pre_mlp_layernorm.weight"] = (H,)
    if not is_moe:
        Fd = cfg.dense_ffn_hidden_size
        out[p + "mlp.linear_fc1.weight"] = (2 * Fd, H)
        out[p + "mlp.linear_fc2.weight"] = (H, Fd)
        return out
    out[p + "mlp.router.weight"] = (E, H)
    if cfg.router_expert_bias:
        out[p + "mlp.router.expert_bias"] = (E,)
    for e in range(E if experts else 0):
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
    return out


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the full (unsharded) megatron-named state dict of ``cfg`` (local-spec
    names) with its shape, in state-dict order: what a checkpoint must provide. MTP layers
    (``model.mtp_num_layers``) under megatron's ``mtp.layers.{j}.`` names: enorm, hnorm,
    eh_proj [H, 2H] (its input [enorm(embedding); hnorm(hidden)]), the transformer layer
    (``mtp_model_layer.``), final_layernorm."""
    H = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        out.update(_layer_shapes(cfg, f"decoder.layers.{i}.", cfg.is_moe_layer(i)))
    out["decoder.final_layernorm.weight"] = (H,)
    for j in range(cfg.mtp_num_layers):
        m = f"{MTP_PREFIX}{j}."
        out[m + "enorm.weight"] = (H,)
        out[m + "hnorm.weight"] = (H,)
        out[m + "eh_proj.weight"] = (H, 2 * H)
        out.update(_layer_shapes(cfg, mtp_layer_prefix(j), mtp_is_moe(cfg)))
        out[m + "final_layernorm.weight"] = (H,)
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = (cfg.vocab_size, H)
    return out


@dataclass(frozen=True)
class ParameterCounts:
    """Values of the full state dict by part (``tensor_shapes``' totals)."""

    vocab: int  # the embedding and the output layer
    experts: int  # the routed experts of every MoE layer
    rest: int  # attention, norms, routers, dense and shared-expert MLPs, MTP's own tensors

    @property
    def total(self) -> int:
        return self.vocab + self.experts + self.rest


def parameter_counts(cfg: ModelConfig) -> ParameterCounts:
    """``tensor_shapes``' totals in O(1) of layers and experts (the door sizes a run with it
    before anything is built: a count of 10^8 layers or experts must not be enumerated)."""
    def size(shapes: dict) -> int:
        return sum(math.prod(s) for s in shapes.values())

    H = cfg.hidden_size
    n_dense = cfg.first_k_dense + sum(1 for d in set(cfg.dense_layers)
                                      if cfg.first_k_dense <= d < cfg.num_layers)
    n_moe = cfg.num_layers - n_dense
    dense = size(_layer_shapes(cfg, "", False))
    moe = size(_layer_shapes(cfg, "", True, experts=False))
    mtp = cfg.mtp_num_layers
    mtp_moe = mtp_is_moe(cfg) if mtp else False
    rest = (n_dense * dense + n_moe * moe + H
            + mtp * (3 * H + 2 * H * H + (moe if mtp_moe else dense)))
    per_expert = 3 * H * cfg.moe_ffn_hidden_size
    experts = (n_moe + (mtp if mtp_moe else 0)) * cfg.num_experts * per_expert
    vocab = cfg.vocab_size * H * (1 if cfg.tie_embeddings else 2)
    return ParameterCounts(vocab, experts, rest)
