"""Hugging Face tensor names <-> megatron tensor names, per family.

Owns, for every tensor of the full megatron-named state dict (``inference.model.tensor_shapes``,
local-spec names), where it lives in a Hugging Face checkpoint of a family:
  * ``Direct(name)``: one HF tensor, same layout (norms, embeddings, o_proj, down_proj, router,
    the score-correction bias, the shared-expert gate);
  * ``GateUp(gate, up)``: megatron's SwiGLU fc1 is [gate; up] stacked on dim 0;
  * ``QKV(q, k, v, ...)``: megatron's fused linear_qkv is grouped per KV head:
    [q_0 .. q_{n-1}, k, v] for each query group (rows; the bias likewise).
Both directions use the same table: import (checkpoint/loader.py cuts each rank's slices from
the sources) and export (checkpoint/export.py splits full tensors back into HF tensors).

MTP layer j (megatron ``mtp.layers.{j}.``; GLM-4.5 / DeepSeek-V3's "nextn" layer) lives at HF
``model.layers.{num_layers + j}.``: enorm, hnorm, eh_proj [H, 2H] and final_layernorm
(= ``shared_head.norm``) under their own names, and its transformer layer
(``mtp_model_layer.``) under exactly the decoder-layer names. The layer also stores
``embed_tokens`` and ``shared_head.head``, duplicates of the main model's embedding and lm_head
(``mtp_duplicates``): GLM-4.5 ships them, GLM-4.6 omits them. They are never read (the MTP
layer shares the main model's) and export writes them as copies.

Must not go in here: file access (store.py), config.json parsing (hf_config.py), sharding rules
(model/model.py ``shard_rule``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from colo_rollout.config.hf_config import (
    DEEPSEEK2,
    DEEPSEEK3,
    DOTS1,
    GLM4,
    GLM4_LITE,
    MIXTRAL,
    QWEN2,
)
from colo_rollout.config import ModelConfig
from colo_rollout.config.tensor_shapes import MTP_PREFIX, tensor_shapes

# families whose format stores MTP layers after the decoder layers (DeepSeek-V3's naming)
MTP_FAMILIES = (GLM4, DEEPSEEK3, GLM4_LITE)


@dataclass(frozen=True)
class Direct:
    name: str

    def hf_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        return {self.name: shape}

    def split(self, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(self.name, full)]


@dataclass(frozen=True)
class GateUp:
    gate: str
    up: str

    def hf_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        half = (shape[0] // 2, *shape[1:])
        return {self.gate: half, self.up: half}

    def split(self, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        gate, up = torch.chunk(full, 2, dim=0)
        return [(self.gate, gate), (self.up, up)]


@dataclass(frozen=True)
class QKV:
    q: str
    k: str
    v: str
    groups: int  # KV heads
    q_per_group: int
    head_dim: int

    def hf_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        rest = shape[1:]
        d, g, n = self.head_dim, self.groups, self.q_per_group
        return {self.q: (g * n * d, *rest), self.k: (g * d, *rest), self.v: (g * d, *rest)}

    def split(self, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        d, g, n = self.head_dim, self.groups, self.q_per_group
        rest = full.shape[1:]
        per = full.reshape(g, (n + 2) * d, *rest)
        return [(self.q, per[:, : n * d].reshape(g * n * d, *rest)),
                (self.k, per[:, n * d : (n + 1) * d].reshape(g * d, *rest)),
                (self.v, per[:, (n + 1) * d :].reshape(g * d, *rest))]

    def fuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """HF q, k, v rows of some whole number of groups -> megatron's grouped rows."""
        d, n = self.head_dim, self.q_per_group
        groups = k.shape[0] // d
        rest = q.shape[1:]
        return torch.cat([q.reshape(groups, n * d, *rest), k.reshape(groups, d, *rest),
                          v.reshape(groups, d, *rest)], dim=1).reshape(-1, *rest)


@dataclass(frozen=True)
class FusedExpert:
    """One expert of a fused [experts, rows, cols] tensor: transformers 5's own layout
    (``save_pretrained(save_original_format=False)``): ``mlp.experts.gate_up_proj``
    [E, 2 I, H], each expert's [gate; up] rows -- megatron's fc1 of that expert --, and
    ``mlp.experts.down_proj`` [E, H, I], its fc2. Import only: export writes the family's
    per-expert tensors."""

    name: str
    expert: int
    experts: int
    glu: bool  # gate_up_proj (gate rows, then up rows) vs down_proj

    def hf_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        return {self.name: (self.experts, *shape)}

    def split(self, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        raise ValueError(f"{self.name}: fused experts are read, never written (export writes "
                         "one tensor per expert)")


Source = Direct | GateUp | QKV | FusedExpert

# the stored name that marks a checkpoint of fused experts
FUSED_EXPERTS_SUFFIX = ".experts.gate_up_proj"


def hf_sources(cfg: ModelConfig, family: str, fused: bool = False) -> dict[str, Source]:
    """megatron name -> its HF source, for every tensor of ``cfg`` (in state-dict order).
    ``fused``: the routed experts as transformers 5 holds them in memory (``FusedExpert``);
    every family keeps them under ``mlp.`` then, Mixtral included."""
    moe = "block_sparse_moe" if family == MIXTRAL and not fused else "mlp"
    shared = {QWEN2: "mlp.shared_expert.", GLM4: "mlp.shared_experts.",
              DEEPSEEK3: "mlp.shared_experts.", DEEPSEEK2: "mlp.shared_experts.",
              GLM4_LITE: "mlp.shared_experts.", DOTS1: "mlp.shared_experts."}.get(family)
    gate_up_down = ("w1", "w3", "w2") if family == MIXTRAL else ("gate_proj", "up_proj",
                                                                 "down_proj")
    n = cfg.num_attention_heads // cfg.num_query_groups
    out: dict[str, Source] = {}
    for name in tensor_shapes(cfg):
        out[name] = _source(name, cfg, moe, shared, gate_up_down, n, family, fused)
    return out


def _source(name: str, cfg: ModelConfig, moe: str, shared: str | None,
            gud: tuple[str, str, str], n: int, family: str, fused: bool) -> Source:
    if name == "embedding.word_embeddings.weight":
        return Direct("model.embed_tokens.weight")
    if name == "decoder.final_layernorm.weight":
        return Direct("model.norm.weight")
    if name == "output_layer.weight":
        return Direct("lm_head.weight")
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)
    if m is not None:
        return _layer_source(name, f"model.layers.{m.group(1)}.", m.group(2), cfg, moe,
                             shared, gud, n, family, fused)
    m = re.match(re.escape(MTP_PREFIX) + r"(\d+)\.(.*)$", name)
    if m is None:  # pragma: no cover - tensor_shapes names nothing else
        raise KeyError(name)
    if family not in MTP_FAMILIES:
        raise ValueError(f"{name}: the {family} format stores no MTP layers (model."
                         "mtp_num_layers must be 0 for it)")
    p, rest = mtp_hf_prefix(cfg, int(m.group(1))), m.group(2)
    own = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
           "eh_proj.weight": "eh_proj.weight", "final_layernorm.weight": "shared_head.norm.weight"}
    if rest in own:
        return Direct(p + own[rest])
    if rest.startswith("mtp_model_layer."):
        return _layer_source(name, p, rest[len("mtp_model_layer."):], cfg, moe, shared, gud, n,
                             family, fused)
    raise KeyError(name)  # pragma: no cover - tensor_shapes names nothing else


def _layer_source(name: str, p: str, rest: str, cfg: ModelConfig, moe: str, shared: str | None,
                  gud: tuple[str, str, str], n: int, family: str, fused: bool) -> Source:
    """Tensor ``rest`` of a transformer layer whose HF names start with ``p`` (a decoder layer,
    or an MTP layer's)."""
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "mlp.router.weight": f"{moe}.gate.weight",
        "mlp.router.expert_bias": f"{moe}.gate.e_score_correction_bias",
        "mlp.linear_fc2.weight": f"mlp.{gud[2]}.weight",
    }
    if cfg.is_mla:  # DeepSeek-V3's names; every row in megatron's order already
        simple.update(_MLA_NAMES)
        simple.pop("self_attention.k_layernorm.weight")
    if rest in simple:
        return Direct(p + simple[rest])
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]  # weight | bias
        return QKV(*(f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"), cfg.num_query_groups, n,
                   cfg.head_dim)
    if rest == "mlp.linear_fc1.weight":  # a dense layer
        return GateUp(f"{p}mlp.{gud[0]}.weight", f"{p}mlp.{gud[1]}.weight")
    e = re.match(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$", rest)
    if e and fused:
        glu = e.group(2) == "1"
        return FusedExpert(f"{p}{moe}.experts.{'gate_up_proj' if glu else 'down_proj'}",
                           int(e.group(1)), cfg.num_experts, glu)
    if e:
        q = f"{p}{moe}.experts.{e.group(1)}."
        if e.group(2) == "1":
            return GateUp(f"{q}{gud[0]}.weight", f"{q}{gud[1]}.weight")
        return Direct(f"{q}{gud[2]}.weight")
    if rest.startswith("mlp.shared_experts.") and shared is not None:
        tail = rest[len("mlp.shared_experts."):]
        if tail == "linear_fc1.weight":
            return GateUp(f"{p}{shared}gate_proj.weight", f"{p}{shared}up_proj.weight")
        if tail == "linear_fc2.weight":
            return Direct(f"{p}{shared}down_proj.weight")
        if tail == "gate_weight" and family == QWEN2:
            return Direct(f"{p}mlp.shared_expert_gate.weight")
    raise ValueError(f"{name}: the {family} format has no tensor for it (the model section "
                     "asks for something this family does not store)")


# megatron MLASelfAttention -> DeepseekV3Attention / DeepseekV2Attention: the same rows in the
# same order (q heads [nope | rope], kv_a [latent | rope key], kv_b heads [k_nope | v]; the
# rope dims are rotated in interleaved pairs -- V2's complex numbers, V3's rope_interleave --
# which megatron's MLA de-interleaves first: the same scores)
_MLA_NAMES = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}


def mtp_hf_prefix(cfg: ModelConfig, j: int) -> str:
    """HF name prefix of MTP layer ``j``: the layer after the decoder's last."""
    return f"model.layers.{cfg.num_layers + j}."


def mtp_duplicates(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """megatron name -> the HF names of the MTP layers' copies of it: each MTP layer's
    ``embed_tokens`` (the embedding) and ``shared_head.head`` (the output layer; the embedding
    when tied). Optional on import (never read), written on export."""
    emb = "embedding.word_embeddings.weight"
    head = emb if cfg.tie_embeddings else "output_layer.weight"
    prefixes = [mtp_hf_prefix(cfg, j) for j in range(cfg.mtp_num_layers)]
    if not prefixes:
        return {}
    copies = {emb: [p + "embed_tokens.weight" for p in prefixes]}
    copies.setdefault(head, []).extend(p + "shared_head.head.weight" for p in prefixes)
    return {k: tuple(v) for k, v in copies.items()}


def expected_hf_shapes(cfg: ModelConfig, family: str,
                       fused: bool = False) -> dict[str, tuple[int, ...]]:
    """Every HF tensor a checkpoint of ``cfg`` in ``family``'s format holds (``fused``: with
    fused experts), with its shape."""
    shapes = tensor_shapes(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for name, src in hf_sources(cfg, family, fused).items():
        out.update(src.hf_shapes(shapes[name]))
    return out


def optional_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensors a checkpoint of ``cfg`` may hold or omit, with the shape they must have when
    present: the MTP layers' duplicates of the embedding and lm_head (``mtp_duplicates``)."""
    shapes = tensor_shapes(cfg)
    return {dup: shapes[name] for name, dups in mtp_duplicates(cfg).items() for dup in dups}


def ignorable(name: str, cfg: ModelConfig, extra_layers: int) -> bool:
    """HF tensors a checkpoint may hold that the model does not use: lm_head beside tied
    embeddings, old checkpoints' rotary inv_freq buffers, and the MTP layers config.json
    declares (``extra_layers``, at num_layers ..) beyond the model section's
    ``mtp_num_layers`` (a model section that serves without them)."""
    if name == "lm_head.weight" and cfg.tie_embeddings:
        return True
    if name.endswith("rotary_emb.inv_freq"):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    first = cfg.num_layers + cfg.mtp_num_layers
    return bool(m) and first <= int(m.group(1)) < cfg.num_layers + extra_layers
