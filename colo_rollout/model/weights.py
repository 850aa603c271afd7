"""Megatron-named weights: which tensors a model section has, how each is sharded, state dicts.

Owns ``tensor_shapes`` (every tensor of the full, unsharded state dict of a ``ModelConfig``, in
megatron's local-spec names), ``ShardRule`` / ``shard_rule`` (megatron's partitioning: which
slice of each full tensor a rank of a layout holds; pure, so the same rule cuts an in-memory
tensor here and a checkpoint's slices in checkpoint/loader.py), the local <-> TE spec names,
loading a full state dict into a model's shards, and ``random_state_dict``.

Must not go in here: modules and forwards (model.py), files (checkpoint/).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from colo_rollout.config import ModelConfig
from colo_rollout.config.tensor_shapes import MTP_PREFIX, mla_shapes, mtp_is_moe, mtp_layer_prefix
from colo_rollout.runtime.parallel import Layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        raise KeyError(f"state dict has {name!r}: an expert's tensors are linear_fc1 and "
                       "linear_fc2")
    if name.endswith(("mlp.linear_fc1.weight", "shared_experts.linear_fc1.weight")):
        return ShardRule(name, "glu", atp_rank, atp)
    if name.endswith(("mlp.linear_fc2.weight", "shared_experts.linear_fc2.weight",
                      "linear_proj.weight")):
        return ShardRule(name, "cols", atp_rank, atp)
    # MLA's projections are all column-parallel in megatron's local spec (the down
    # projections' outputs gathered after); the engine holds the down projections whole on
    # every ATP rank (``DUPLICATED``: ``held_rule``)
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "output_layer.weight",
                      "word_embeddings.weight", "eh_proj.weight", "linear_q_proj.weight",
                      "linear_q_down_proj.weight", "linear_q_up_proj.weight",
                      "linear_kv_down_proj.weight", "linear_kv_up_proj.weight")):
        return ShardRule(name, "rows", atp_rank, atp)
    return ShardRule(name, "full")  # norms, router, expert bias, shared-expert gate


# The attribute marking a parameter every attention-TP rank holds whole although megatron's
# local spec splits it (MLA's down projections in the engine: model/mla_attention.py)
DUPLICATED = "colo_duplicated"


def mark_duplicated(param: torch.Tensor) -> None:
    setattr(param, DUPLICATED, True)


def held_rule(rule: ShardRule, target: torch.Tensor | None) -> ShardRule:
    """``rule`` for the model tensor ``target`` it fills: the whole tensor where the model
    holds it duplicated (``DUPLICATED``), however megatron splits it."""
    if target is not None and getattr(target, DUPLICATED, False):
        return ShardRule(rule.local, "full")
    return rule


def shard_for(name: str, full: torch.Tensor, layout: Layout, rank: int,
              num_local_experts: int,
              held: dict[str, torch.Tensor] | None = None) -> tuple[str, torch.Tensor] | None:
    """(local name, local shard) of full-model tensor ``name`` on ``rank``; None = not held.
    ``held``: the model's tensors by local name (``loadable_tensors``), for the ones it
    holds whole (``held_rule``)."""
    rule = shard_rule(name, layout, rank, num_local_experts)
    if rule is None:
        return None
    rule = held_rule(rule, (held or {}).get(rule.local))
    return rule.local, rule.apply(full)


def loadable_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a state dict fills: the parameters and the persistent buffers (the router's
    expert bias) by name, without TE's _extra_state."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items()
            if not k.endswith("_extra_state")}


_TE_EXPERT = re.compile(r"^(.*)\.mlp\.experts\.linear_fc([12])\.weight(\d+)$")
_LOCAL_EXPERT = re.compile(r"^(.*)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")


def check_names(sd) -> None:
    """A state dict is a mapping keyed by parameter names: TypeError naming what is not."""
    if not isinstance(sd, Mapping):
        raise TypeError(f"a state dict maps names to tensors, got {type(sd).__name__}")
    bad = next((k for k in sd if not isinstance(k, str)), None)
    if bad is not None:
        raise TypeError(f"state dict key {bad!r}: expected a parameter name (str)")


def to_spec_names(sd: dict[str, torch.Tensor], te: bool) -> dict[str, torch.Tensor]:
    """Rename a megatron GPT state dict between the local spec and the TE spec (``sd``
    checked first: ``check_names``).

    TE fuses the attention input norm into ``linear_qkv`` (``layer_norm_weight``) and stores
    grouped experts as ``experts.linear_fc{1,2}.weight{e}``; the local spec has
    ``input_layernorm.weight`` and ``experts.local_experts.{e}.linear_fc{1,2}.weight``.
    ``_extra_state`` entries (TE's FP8 metadata) are dropped: they are not weights.
    """
    check_names(sd)
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
    parameter must be covered. Works for this inference model and for megatron GPTModels.
    All or nothing (``sharded_writes`` checks everything before the first write), so a bad
    state dict leaves the model as it was."""
    write_shards(sharded_writes(model, full, layout, rank, num_experts))


def write_shards(writes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for p, shard in writes:
            p.copy_(shard)


def sharded_writes(model: torch.nn.Module, full: dict[str, torch.Tensor], layout: Layout,
                   rank: int, num_experts: int | None = None
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, its shard) of every tensor of ``full`` on ``rank``, each checked -- a
    tensor of a float dtype with data (not on the meta device), a name the model has (an
    expert index below the model's count), the shard's shape, every parameter covered --
    nothing written: ValueError / KeyError naming the first entry that fails."""
    check_names(full)
    total = num_experts if num_experts is not None else model.cfg.num_experts
    num_local = total // layout.ep
    params = loadable_tensors(model)
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen = set()
    for name, t in full.items():
        if name.endswith("_extra_state"):
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a floating-point tensor, got {what}")
        if t.is_meta:  # (found by probing: the copy failed half-way through the writes)
            raise ValueError(f"{name}: a tensor on the meta device holds no values")
        if t.layout != torch.strided:  # (found by probing: a sparse one, too -- the model
            # served with 39 of 45 parameters new)
            raise ValueError(f"{name}: a {t.layout} tensor; weights are dense (.to_dense())")
        m = _LOCAL_EXPERT.match(name)
        if m and int(m.group(2)) >= total:
            raise KeyError(f"state dict has {name!r}: expert {m.group(2)} of a model with "
                           f"{total}")
        mapped = shard_for(name, t, layout, rank, num_local, params)
        if mapped is None:
            continue
        local, shard = mapped
        if local not in params:
            hint = (" (an MTP layer's weight, and the model has no MTP layer: model."
                    "mtp_num_layers 1 serves it)" if name.startswith("mtp.")
                    and not any(k.startswith("mtp.") for k in params) else "")
            raise KeyError(f"state dict has {name!r}; the inference model has no "
                           f"{local!r}{hint}")
        p = params[local]
        if p.shape != shard.shape:
            raise ValueError(f"{name}: shard shape {tuple(shard.shape)} != {tuple(p.shape)}")
        writes.append((p, shard))
        seen.add(local)
    missing = sorted(set(params) - seen)
    if missing:
        raise KeyError(f"state dict is missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return writes


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

    def layer(p: str, is_moe: bool) -> None:
        sd[p + "input_layernorm.weight"] = torch.ones(H, dtype=dtype, device=device)
        if cfg.is_mla:
            for name, shape in mla_shapes(cfg, p).items():
                sd[name] = (norm_weight(*shape) if len(shape) == 1
                            else normal(*shape, scale=out_scale)
                            if name.endswith("linear_proj.weight") else normal(*shape))
        else:
            sd[p + "self_attention.linear_qkv.weight"] = normal(qkv, H)
            if cfg.qkv_bias:
                sd[p + "self_attention.linear_qkv.bias"] = normal(qkv, scale=5.0)
            if cfg.qk_layernorm:
                sd[p + "self_attention.q_layernorm.weight"] = norm_weight(hd)
                sd[p + "self_attention.k_layernorm.weight"] = norm_weight(hd)
            sd[p + "self_attention.linear_proj.weight"] = normal(
                H, cfg.num_attention_heads * hd, scale=out_scale)
        sd[p + "pre_mlp_layernorm.weight"] = torch.ones(H, dtype=dtype, device=device)
        if not is_moe:
            Fd = cfg.dense_ffn_hidden_size
            sd[p + "mlp.linear_fc1.weight"] = normal(2 * Fd, H)
            sd[p + "mlp.linear_fc2.weight"] = normal(H, Fd, scale=out_scale)
            return
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

    sd = {"embedding.word_embeddings.weight": normal(cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        layer(f"decoder.layers.{i}.", cfg.is_moe_layer(i))
    sd["decoder.final_layernorm.weight"] = torch.ones(H, dtype=dtype, device=device)
    if not cfg.tie_embeddings:
        sd["output_layer.weight"] = normal(cfg.vocab_size, H)
    # MTP layers last: a model without them draws the same values as before
    for j in range(cfg.mtp_num_layers):
        m = f"{MTP_PREFIX}{j}."
        sd[m + "enorm.weight"] = norm_weight(H)
        sd[m + "hnorm.weight"] = norm_weight(H)
        sd[m + "eh_proj.weight"] = normal(H, 2 * H)
        layer(mtp_layer_prefix(j), mtp_is_moe(cfg))
        sd[m + "final_layernorm.weight"] = norm_weight(H)
    return sd
