"""megatron's Multi-head Latent Attention (MLA) on the local (non-Transformer-Engine) spec.

Why it exists: megatron-core 0.19's ``MLASelfAttention`` builds its core attention with
``k_channels=q_head_dim, v_channels=v_head_dim`` (and its own ``softmax_scale``: YaRN's
``mscale_all_dim`` squared over sqrt(q_head_dim)), keywords only Transformer Engine's
``TEDotProductAttention`` takes. The local spec's ``DotProductAttention``
(transformer/dot_product_attention.py) takes neither, and sizes its output as
``kv_channels x heads``, so MLA builds only with TE, i.e. not on CPU. Second, with
``q_lora_rank`` None (DeepSeek-V2-Lite's plain ``q_proj``) and ``qk_layernorm`` (the
``kv_a_layernorm``), megatron's ``QKNormConfigResolver`` (transformer/mla_qk_norm_config.py)
rejects the local spec's Q norm and then demands a fused norm+linear for ``linear_q_proj``,
which only TE has (there it is an extra RMSNorm in front of q_proj that DeepSeek does not have).

Owns
  * ``MLADotProductAttention``: megatron's ``DotProductAttention`` with query/key heads of
    ``k_channels`` and value heads of ``v_channels``. The forward is megatron's unfused path,
    step for step: ``baddbmm`` of q k^T with ``alpha = softmax_scale`` in the input dtype,
    megatron's ``FusedScaleMaskSoftmax`` (fp32 softmax under ``attention_softmax_in_fp32``;
    a boolean ``attention_mask`` True = masked, filled with -10000), attention dropout
    (identity in eval or at p 0), probs @ v. One departure: with no ``attention_mask`` and a
    causal mask type, the causal mask megatron would generate is built here on the query's
    device (megatron's ``get_default_causal_mask`` hard-codes ``device="cuda"``).
  * ``LocalMLASelfAttention``: megatron's ``MLASelfAttention`` with three repairs, same math.
    (1) With ``q_lora_rank`` None and ``qk_layernorm``: a plain column-parallel
    ``linear_q_proj`` (no Q norm), the spec's ``kv_layernorm`` and ``linear_kv_up_proj`` --
    DeepSeek's q_proj / kv_a_layernorm / kv_b_proj -- instead of megatron's resolver (every
    other case: the resolver). (2) ``linear_q_proj`` gets the attention's TP group, which
    megatron's ``__init__`` does not pass it (unlike every other projection). (3) The TP
    gathers after the local spec's column-parallel q/kv down projections name the
    attention's TP group (megatron's name none). Without (2) and (3) those fall back to
    megatron's global parallel_state TP group: none under explicit process groups
    (model/megatron_gpt.py), so TP > 1 crashes and TP 1 cannot run backward with
    ``q_lora_rank`` None.
  * ``with_local_mla``: a copy of a megatron spec (layer, decoder block, MTP block) with every
    ``MLASelfAttention`` slot set to ``LocalMLASelfAttention`` and every MLA core attention
    slot that holds ``DotProductAttention`` set to ``MLADotProductAttention``
    (model/megatron_gpt.py applies it to its decoder block spec; an MTP block spec built from
    the result inherits it: megatron copies the last decoder layer's spec).

Invariants
  * Tensor layouts are megatron's: query [sq, b, np, k_channels], key [sk, b, np, k_channels],
    value [sk, b, np, v_channels] with np = heads / TP (MLA expands its shared rope key to
    every head: no grouped-query repeat here); output [sq, b, np * v_channels].
  * ``softmax_scale`` is used as given (MLA passes mscale^2 / sqrt(q_head_dim)); without
    one, 1 / sqrt(k_channels). ``apply_query_key_layer_scaling`` divides it by the layer
    number and the softmax multiplies it back in fp32, as megatron does.
  * Differentiable end to end (the RL trainer's backward): no in-place op on a tensor
    autograd saves except megatron's own mask fill of the scores, which ``baddbmm``'s
    backward does not read.
  * No packed sequences (THD), no attention bias, no context parallelism: megatron's
    ``DotProductAttention`` refuses them too. No sliding-window attention (megatron's torch
    softmax would build that mask on CUDA, over any mask passed in).

GPTModel with MLA: build it with ``position_embedding_type="rope"`` (megatron then builds no
model-level RoPE for MLA); MLA applies its own (``config.rope_type`` "rope" or "yarn" of the
``MLATransformerConfig``). ``"yarn"`` would hand a rotary embedding to ``MLASelfAttention``,
which asserts it gets none.

Must not go in here: the MLA projections' math and RoPE (megatron's), weight names or
checkpoint mapping (model/weights.py, checkpoint/), building the GPTModel
(model/megatron_gpt.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import divide

from colo_rollout.model.spec_edit import replace_in_spec


class MLADotProductAttention(DotProductAttention):
    """megatron's local ``DotProductAttention`` for key heads of ``k_channels`` and value heads
    of ``v_channels`` (MLA: q_head_dim = qk_head_dim + qk_pos_emb_head_dim, v_head_dim)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, attention_type=attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        heads = self.num_attention_heads_per_partition  # heads / TP (divide() checked it)
        self.k_channels = k_channels or self.hidden_size_per_attention_head
        self.v_channels = v_channels or self.k_channels
        # the output width megatron's linear_proj expects: np * v_channels on this TP rank
        self.hidden_size_per_partition = heads * self.v_channels
        self.hidden_size_per_attention_head = self.k_channels
        # MLA hands every head its own key and value: no grouped-query repeat
        self.num_query_groups_per_partition = heads
        if softmax_scale is None:  # the base class took kv_channels; the key width decides
            self.softmax_scale = 1.0 / math.sqrt(self.k_channels)
            if self.config.apply_query_key_layer_scaling:
                self.softmax_scale /= self.layer_number
        assert divide(self.config.num_attention_heads, self.tp_group.size()) == heads
        if self.scale_mask_softmax.window_size is not None:
            raise NotImplementedError("MLADotProductAttention: no sliding-window attention")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None
                ) -> torch.Tensor:
        """query [sq, b, np, k], key [sk, b, np, k], value [sk, b, np, v] -> [sq, b, np * v].
        ``attn_mask_type`` is not read (megatron's DotProductAttention does not either): the
        mask type given at construction decides, an explicit ``attention_mask`` wins; None
        with a causal type: the causal mask, built on the query's device."""
        if packed_seq_params is not None:
            raise NotImplementedError("MLADotProductAttention: packed sequences (THD) need "
                                      "TE's core attention")
        if attention_bias is not None:
            raise NotImplementedError("MLADotProductAttention: no attention bias")
        sq, b, heads, kc = query.shape
        sk = key.size(0)
        if (heads != self.num_attention_heads_per_partition or kc != self.k_channels
                or key.shape != (sk, b, heads, kc)
                or value.shape != (sk, b, heads, self.v_channels)):
            raise ValueError(
                f"MLADotProductAttention: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                f"value {tuple(value.shape)}; expected {heads} == "
                f"{self.num_attention_heads_per_partition} heads per partition, key width "
                f"{self.k_channels}, value width {self.v_channels}")

        if attention_mask is None and self.attn_mask_type == AttnMaskType.causal and sq > 1:
            if sq != sk:
                raise ValueError("MLADotProductAttention: a causal mask needs sq == sk")
            attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(1)

        # raw scores [b * np, sq, sk] = softmax_scale * q k^T, as megatron's baddbmm (beta 0:
        # the scratch input is never read, so a fresh one matches its global buffer)
        q = query.reshape(sq, b * heads, kc).transpose(0, 1)
        k = key.reshape(sk, b * heads, kc).transpose(0, 1).transpose(1, 2)
        scratch = torch.empty((b * heads, sq, sk), dtype=query.dtype, device=query.device)
        scores = torch.baddbmm(scratch, q, k, beta=0.0, alpha=self.softmax_scale)
        probs = self.scale_mask_softmax(scores.view(b, heads, sq, sk), attention_mask,
                                        self.softmax_offset)
        if self.training and self.attention_dropout.p > 0:
            if not self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
            else:
                probs = self.attention_dropout(probs)

        # context [b * np, sq, v] = probs @ v -> [sq, b, np * v]
        v = value.reshape(sk, b * heads, self.v_channels).transpose(0, 1)
        context = torch.bmm(probs.view(b * heads, sq, sk), v)
        context = context.view(b, heads, sq, self.v_channels).permute(2, 0, 1, 3)
        return context.reshape(sq, b, self.hidden_size_per_partition)


class LocalMLASelfAttention(MLASelfAttention):
    """megatron's ``MLASelfAttention`` that builds on the local spec with ``q_lora_rank`` None
    and runs under explicit process groups with TP > 1 (see the module docstring)."""

    def _qkv_down_projection(self, hidden_states):
        """megatron's down projections, the local spec's column-parallel q/kv down projections
        gathered over this attention's TP group (megatron's gathers name no group: they take
        the global parallel_state one). q_compressed [s(/TP under SP), b, q_lora_rank] as
        megatron's; kv_combined whole [s(/TP under SP), b, kv_lora_rank + rope] -- the layout
        of a duplicated down projection, which megatron's caller splits (and, under sequence
        parallelism, gathers the rope key of) over ``self.tp_group``."""
        tp = self.pg_collection.tp
        sp = self.config.sequence_parallel
        if self.config.q_lora_rank is not None:
            q_compressed, _ = self.linear_q_down_proj(hidden_states)
            if q_compressed.size(-1) != self.config.q_lora_rank:
                q_compressed = gather_from_tensor_model_parallel_region(q_compressed, group=tp)
                if sp:
                    q_compressed = scatter_to_sequence_parallel_region(q_compressed, group=tp)
        else:
            q_compressed = hidden_states
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        if kv_combined.size(-1) != self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim:
            kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=tp)
            if sp:
                kv_combined = scatter_to_sequence_parallel_region(kv_combined, group=tp)
        return q_compressed, kv_combined

    def _resolve_qk_norm_config(self, submodules) -> dict:
        if self.config.q_lora_rank is not None:
            return super()._resolve_qk_norm_config(submodules)
        if not self.config.qk_layernorm:
            resolved = super()._resolve_qk_norm_config(submodules)
        else:
            if self.config.qk_l2_norm or self.config.experimental_attention_variant is not None:
                raise ValueError("LocalMLASelfAttention: no qk_l2_norm, no attention variants")
            kv_norm = submodules.kv_layernorm
            if kv_norm in (None, IdentityOp):
                raise ValueError("LocalMLASelfAttention: qk_layernorm without q_lora_rank needs "
                                 "the spec's kv_layernorm (the local spec sets it)")
            resolved = dict(linear_q_proj=submodules.linear_q_proj or ColumnParallelLinear,
                            linear_q_up_proj=IdentityOp,
                            linear_kv_up_proj=submodules.linear_kv_up_proj or ColumnParallelLinear,
                            q_layernorm=IdentityOp, kv_layernorm=kv_norm)
        # MLASelfAttention.__init__ builds linear_q_proj without tp_group (unlike every other
        # projection), so a ColumnParallelLinear would fall back to megatron's global
        # parallel_state TP group -- none under explicit process groups: an unsplit weight,
        # and a backward that asserts. Hand it this attention's TP group.
        if resolved["linear_q_proj"] is ColumnParallelLinear:
            resolved["linear_q_proj"] = ModuleSpec(module=ColumnParallelLinear,
                                                   params={"tp_group": self.pg_collection.tp})
        return resolved


def with_local_mla(spec):
    """A copy of ``spec`` (model/spec_edit.py) where every ``MLASelfAttention`` module is
    ``LocalMLASelfAttention`` and the core attention of every ``MLASelfAttentionSubmodules``
    that is megatron's local ``DotProductAttention`` is ``MLADotProductAttention``; anything
    else (TE's core attention, non-MLA attention) is kept."""

    def swap(obj):
        if obj is MLASelfAttention:
            return LocalMLASelfAttention
        if isinstance(obj, MLASelfAttentionSubmodules):  # its core attention slot only
            core = obj.core_attention
            if core is DotProductAttention:
                core = MLADotProductAttention
            elif isinstance(core, ModuleSpec) and core.module is DotProductAttention:
                core = dataclasses.replace(core, module=MLADotProductAttention)
            return dataclasses.replace(obj, core_attention=core)
        return None

    return replace_in_spec(spec, swap)
