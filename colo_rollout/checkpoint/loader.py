"""Per-rank loading of a Hugging Face checkpoint into a megatron-named model.

Owns ``check_checkpoint`` (every tensor the model needs is present with its shape, nothing
unexpected is there -- from the safetensors headers only, before any model is allocated; the
MTP layer's optional copies of the embedding and lm_head, when present, have their shapes) and
``load_checkpoint``: each rank reads only the slices it owns (``inference.model.shard_rule``
applied to the HF sources of ``hf_names``), tensor by tensor, straight into its parameters. No
rank ever holds the whole model, nor more than one tensor's slice in host memory.

Works for the inference model (any ADP/ATP/EP layout; local or TE spec) and for the trainer's
megatron GPTModel (TP x DP, EP1): the layout and rank say which slices a model holds.

Must not go in here: name mapping (hf_names.py), file access beyond the store's reads.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from colo_rollout.config.hf_config import (
    AT_MOST_FIELDS,
    HFArchitecture,
    hf_architecture,
    mtp_unstored,
    stored_architecture,
)
from colo_rollout.checkpoint.hf_names import (
    FUSED_EXPERTS_SUFFIX,
    QKV,
    Direct,
    FusedExpert,
    GateUp,
    Source,
    expected_hf_shapes,
    hf_sources,
    ignorable,
    mtp_hf_prefix,
    optional_hf_shapes,
)
from colo_rollout.checkpoint.fp8_blocks import FP8_DTYPES, SCALE_SUFFIX, float_view
from colo_rollout.checkpoint.store import CheckpointError, CheckpointStore
from colo_rollout.config import ModelConfig
from colo_rollout.model.weights import (
    ShardRule,
    loadable_tensors,
    held_rule,
    shard_rule,
    to_spec_names,
)
from colo_rollout.config.tensor_shapes import tensor_shapes
from colo_rollout.runtime.parallel import Layout


@dataclass
class LoadStats:
    tensors: int  # local tensors filled
    bytes_read: int  # bytes read from the checkpoint (stored dtype)
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / max(self.seconds, 1e-9) / 1e9


def check_checkpoint(cfg: ModelConfig, store: CheckpointStore | None = None,
                     arch: HFArchitecture | None = None) -> HFArchitecture:
    """Raise CheckpointError unless ``cfg.model.checkpoint`` holds exactly the tensors ``cfg``
    needs, with their shapes (headers only: no weights are read). ``cfg`` must agree with the
    checkpoint's config.json (a config built by config_from_dict does; its mtp_num_layers is 0
    for a declared MTP layer the checkpoint stores none of). Returns the checkpoint's
    architecture as stored (``hf_config.stored_architecture``)."""
    arch = arch or hf_architecture(cfg.checkpoint)
    mismatched = {k: (getattr(cfg, k), v) for k, v in arch.fields.items()
                  if _disagrees(k, getattr(cfg, k), v)}
    if mismatched:
        k, (mine, theirs) = next(iter(mismatched.items()))
        raise CheckpointError(f"the model section has {k} = {mine!r}, the checkpoint "
                              f"{theirs!r} (build the config with config_from_dict or "
                              "load_config, which read config.json)", path=arch.path,
                              name=arch.sources[k])
    own = store is None
    # a block-scaled FP8 checkpoint is checked (and read) as the float one it stands for
    store = float_view(store or CheckpointStore(cfg.checkpoint), arch.weight_block)
    try:
        have = set(store.names())
        _check_counts(cfg, arch, have, store.directory)
        fused = fused_experts(have)
        want = expected_hf_shapes(cfg, arch.family, fused)
        optional = optional_hf_shapes(cfg)
        stored = stored_architecture(arch, have)
        mtp = tuple(mtp_hf_prefix(cfg, j) for j in range(cfg.mtp_num_layers))
        for name, shape in want.items():
            if name not in have:
                hint = _mtp_hint(arch, stored, mtp[0]) if name.startswith(mtp) else ""
                raise CheckpointError(f"missing: a {arch.family} checkpoint of this config "
                                      f"needs it (shape {list(shape)}){hint}",
                                      path=store.directory, name=name)
        for name, shape in (want | optional).items():
            got = tuple(store.shape(name)) if name in have else shape
            if got != shape:
                raise CheckpointError(f"shape {list(got)}, expected {list(shape)} (from "
                                      "config.json)", path=store.file_of(name), name=name)
        empty = _empty_shared_expert(cfg, store, have)
        unexpected = sorted(n for n in have - set(want) - set(optional) - empty
                            if not ignorable(n, cfg, arch.extra_layers))
        if unexpected:
            # block scales beside e4m3 weights: an FP8 release whose config.json says nothing
            fp8 = ("; block-scaled FP8 weights load when config.json's quantization_config "
                   "says so (quant_method 'fp8', weight_block_size)"
                   if arch.weight_block is None and unexpected[0].endswith(SCALE_SUFFIX) else "")
            raise CheckpointError(
                f"unexpected tensor{'s' if len(unexpected) > 1 else ''} for {arch.family} "
                f"with this config.json ({len(unexpected)}: {unexpected[:3]}"
                f"{'...' if len(unexpected) > 3 else ''}){fp8}",
                path=store.file_of(unexpected[0]), name=unexpected[0])
        if cfg.tie_embeddings and "lm_head.weight" in have:
            _check_tied_head(store, want)
        for name in want:
            dtype = store.dtype(name)
            if arch.weight_block is None and dtype in FP8_DTYPES:
                # e4m3 data read as floats would be the unscaled codes
                raise CheckpointError(
                    "stored in e4m3 but config.json has no quantization_config (a "
                    "block-scaled FP8 release declares quant_method 'fp8' and "
                    "weight_block_size, and stores each weight's weight_scale_inv)",
                    path=store.file_of(name), name=name)
            if not dtype.is_floating_point or dtype.itemsize == 1:
                # integers, bools, other 8-bit floats: codes of a quantisation this loader
                # does not know (a cast would serve them as weights)
                raise CheckpointError(
                    f"stored as {str(dtype).removeprefix('torch.')}: weights load from "
                    "float32, float16 or bfloat16 (or e4m3 blocks with config.json's "
                    "quantization_config)", path=store.file_of(name), name=name)
    finally:
        if own:
            store.close()
    return stored


def fused_experts(names) -> bool:
    """Whether a checkpoint holding tensors ``names`` stores its routed experts fused, as
    transformers 5 holds them (``save_pretrained(save_original_format=False)``): then every
    MoE layer's are (``check_checkpoint`` names any per-expert tensor as unexpected)."""
    return any(n.endswith(FUSED_EXPERTS_SUFFIX) for n in names)


# a shared expert's stored names (Qwen2-MoE's, GLM's) and its gate's
_SHARED_PARTS = (".mlp.shared_expert.", ".mlp.shared_experts.", ".mlp.shared_expert_gate.")


def _empty_shared_expert(cfg: ModelConfig, store, have: set[str]) -> set[str]:
    """The shared-expert tensors transformers saves for a shared expert of width 0
    (shared_expert_intermediate_size / n_shared_experts 0): zero-size projections -- and
    Qwen2-MoE's gate, whose product with their zero output is zero -- which this config
    (no shared expert) does not load. Empty unless every stored shared projection has a zero
    dimension."""
    if cfg.shared_expert_ffn_hidden_size is not None:
        return set()
    names = {n for n in have if any(part in n for part in _SHARED_PARTS)}
    projections = [n for n in names if ".mlp.shared_expert_gate." not in n]
    if not projections or any(0 not in tuple(store.shape(n)) for n in projections):
        return set()
    return names


def _check_tied_head(store, want: dict, rows: int = 8192) -> None:
    """tie_word_embeddings with an lm_head.weight stored too: transformers serves such a
    checkpoint untied, with the stored head, when the two differ (and warns); the engine ties
    (the config says so). Refused unless they are equal (compared in blocks of ``rows``): a
    silent tie would give other tokens than the checkpoint's own library."""
    emb = next(n for n in want if n.endswith("embed_tokens.weight"))
    if tuple(store.shape("lm_head.weight")) == tuple(store.shape(emb)):
        n = store.shape(emb)[0]
        if all(torch.equal(store.read("lm_head.weight", rows=(i, min(i + rows, n)),
                                      dtype=torch.float32),
                           store.read(emb, rows=(i, min(i + rows, n)), dtype=torch.float32))
               for i in range(0, n, rows)):
            return
    raise CheckpointError(
        f"stored beside config.json tie_word_embeddings: true, and not equal to {emb} "
        "(transformers serves this checkpoint untied, with the stored head): set "
        "tie_word_embeddings: false in config.json to serve it so, or drop lm_head.weight",
        path=store.file_of("lm_head.weight"), name="lm_head.weight")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _check_counts(cfg: ModelConfig, arch: HFArchitecture, have: set[str], where) -> None:
    """config.json's layer and expert counts against the tensors stored, before the table of
    every expected tensor is built: that table grows with the counts (a config.json claiming
    a million layers took 9 GB to find its first missing tensor). Names the first layer or
    expert the checkpoint lacks."""
    layers = [int(m.group(1)) for n in have if (m := _LAYER.match(n))]
    stored = max(layers, default=-1) + 1
    if stored < cfg.num_layers:
        raise CheckpointError(
            f"missing: config.json {arch.sources['num_layers']} = {cfg.num_layers}, but the "
            f"checkpoint stores layers 0..{stored - 1} only", path=where,
            name=f"model.layers.{stored}.*")
    # (fused experts hold every expert in one tensor per layer: their shapes are checked, and
    # a stray per-expert tensor beside them is named as unexpected)
    experts = [] if fused_experts(have) else [int(m.group(1)) for n in have
                                              if (m := _EXPERT.search(n))]
    if experts and max(experts) + 1 < cfg.num_experts:
        raise CheckpointError(
            f"missing: config.json {arch.sources['num_experts']} = {cfg.num_experts}, but the "
            f"checkpoint stores experts 0..{max(experts)} only", path=where,
            name=f"experts.{max(experts) + 1}.*")


def _mtp_hint(arch: HFArchitecture, stored: HFArchitecture, prefix: str) -> str:
    """What a missing tensor of the MTP layer (at ``prefix``) the model section asks for means:
    the checkpoint stores none of the layer (as transformers saves GLM), or only part of it."""
    key = f"config.json {arch.sources['mtp_num_layers']} = {arch.extra_layers}"
    if mtp_unstored(stored):
        return (f"; the checkpoint stores no MTP layer ({key} declares one, but no tensor is "
                f"stored under {prefix}; transformers' save_pretrained writes none): "
                "model.mtp_num_layers: 0 loads without it, as config_from_dict derives")
    return f"; {key} declares the MTP layer (model.mtp_num_layers: 0 loads without it)"


def _disagrees(field: str, mine, theirs) -> bool:
    """The model section's ``field`` cannot be the checkpoint's: a different value, or for
    ``AT_MOST_FIELDS`` a larger one (max_position_embeddings is not checked here: no tensor
    depends on it)."""
    if field == "max_position_embeddings":
        return False
    if field in AT_MOST_FIELDS:
        return mine > theirs
    return mine != theirs


def load_checkpoint(model: torch.nn.Module, cfg: ModelConfig, layout: Layout, rank: int, *,
                    te: bool = False, store: CheckpointStore | None = None,
                    arch: HFArchitecture | None = None) -> LoadStats:
    """Fill ``model``'s parameters and persistent buffers (their shards on ``rank`` of
    ``layout``) from ``cfg.checkpoint``. The model may already live on its device: slices are
    copied into the parameters in place. Checks the checkpoint first (``check_checkpoint``)
    unless ``arch`` is the result of that check on ``store``."""
    t0 = time.perf_counter()
    own = store is None
    store = store or CheckpointStore(cfg.checkpoint)
    try:
        arch = arch or check_checkpoint(cfg, store)
        sources = hf_sources(cfg, arch.family, fused_experts(store.names()))
        # the model's names (local or TE spec) of every global local-spec name
        spec = to_spec_names({n: n for n in tensor_shapes(cfg)}, te)
        spec_of = {local: name for name, local in spec.items()}
        params = loadable_tensors(model)
        # FP8 blocks dequantised on read, on the parameters' device
        device = next(iter(params.values())).device if params else None
        store = float_view(store, arch.weight_block, device)
        num_local = cfg.num_experts // layout.ep
        seen: set[str] = set()
        before = store.bytes_read
        with torch.no_grad():
            for name, src in sources.items():
                rule = shard_rule(spec_of[name], layout, rank, num_local)
                if rule is None:
                    continue
                target = params.get(rule.local)
                if target is None:
                    raise KeyError(f"{name}: the model has no {rule.local!r}")
                rule = held_rule(rule, target)
                part = read_shard(store, src, rule, target.dtype)
                if tuple(part.shape) != tuple(target.shape):
                    raise CheckpointError(f"slice shape {list(part.shape)} does not fit the "
                                          f"model's {list(target.shape)} ({name})",
                                          path=store.directory, name=_first(src))
                target.copy_(part)
                seen.add(rule.local)
        missing = sorted(set(params) - seen)
        if missing:
            raise KeyError(f"checkpoint load left {missing[:5]} unfilled")
        return LoadStats(len(seen), store.bytes_read - before, time.perf_counter() - t0)
    finally:
        if own:
            store.close()


def _first(src: Source) -> str:
    return (src.name if isinstance(src, (Direct, FusedExpert)) else
            src.gate if isinstance(src, GateUp) else src.q)


def read_shard(store: CheckpointStore, src: Source, rule: ShardRule,
               dtype: torch.dtype) -> torch.Tensor:
    """This rank's part of one megatron tensor, read as slices of its HF sources; a value that
    is not finite (NaN, inf: a corrupt or badly converted file) is a CheckpointError naming
    the tensor -- served, it would turn every logit to NaN (found by probing)."""
    part = _read_shard(store, src, rule, dtype)
    finite = torch.isfinite(part)
    if not bool(finite.all()):
        bad = part.numel() - int(finite.sum())
        name = _first(src)
        where = "this rank's slice" if rule.kind != "full" and rule.size > 1 else "it"
        raise CheckpointError(f"{bad} value{'s' if bad > 1 else ''} not finite (NaN or inf) "
                              f"in {where}", path=store.file_of(name), name=name)
    return part


def _read_shard(store: CheckpointStore, src: Source, rule: ShardRule,
                dtype: torch.dtype) -> torch.Tensor:
    if isinstance(src, Direct):
        if rule.kind == "full" or rule.size == 1:
            return store.read(src.name, dtype=dtype)
        n = store.shape(src.name)[0 if rule.kind == "rows" else 1]
        span = rule.rows_of(n)
        if rule.kind == "rows":
            return store.read(src.name, rows=span, dtype=dtype)
        return store.read(src.name, cols=span, dtype=dtype)
    if isinstance(src, FusedExpert):  # expert src.expert's [rows, cols] of [E, rows, cols]
        rows, cols = store.shape(src.name)[1:]
        if src.glu and rule.kind == "glu" and rule.size > 1:  # the same rows of gate and up
            a, b = rule.rows_of(rows // 2)
            gate = store.read(src.name, at=src.expert, rows=(a, b), dtype=dtype)
            up = store.read(src.name, at=src.expert, rows=(rows // 2 + a, rows // 2 + b),
                            dtype=dtype)
            return torch.cat([gate, up])
        if rule.kind == "rows" and rule.size > 1:
            return store.read(src.name, at=src.expert, rows=rule.rows_of(rows), dtype=dtype)
        if rule.kind == "cols" and rule.size > 1:
            return store.read(src.name, at=src.expert, cols=rule.rows_of(cols), dtype=dtype)
        return store.read(src.name, at=src.expert, dtype=dtype)
    if isinstance(src, GateUp):  # "glu": the same rows of gate and of up
        span = rule.rows_of(store.shape(src.gate)[0]) if rule.kind == "glu" else None
        gate = store.read(src.gate, rows=span, dtype=dtype)
        # (a block-scaled FP8 source reads onto the parameters' device: keep the pair together)
        return torch.cat([gate, store.read(src.up, rows=span, dtype=dtype).to(gate.device)])
    assert isinstance(src, QKV)
    # "rows" of megatron's grouped qkv = a run of whole query groups [g0, g1)
    g0, g1 = rule.rows_of(src.groups) if rule.kind == "rows" else (0, src.groups)
    d, n = src.head_dim, src.q_per_group
    q = store.read(src.q, rows=(g0 * n * d, g1 * n * d), dtype=dtype)
    k = store.read(src.k, rows=(g0 * d, g1 * d), dtype=dtype).to(q.device)
    v = store.read(src.v, rows=(g0 * d, g1 * d), dtype=dtype).to(q.device)
    return src.fuse(q, k, v)


def megatron_loader(cfg: ModelConfig, tp: int, tp_rank: int, *,
                    te: bool = False) -> Callable[[torch.nn.Module], None]:
    """The weights argument of ``model.megatron_gpt.build_reference`` for a checkpoint: loads
    rank ``tp_rank``'s TP-``tp`` slices of ``cfg.checkpoint`` into megatron's GPTModel."""
    if cfg.checkpoint is None:
        raise ValueError("megatron_loader: model.checkpoint is not set")

    def load(model: torch.nn.Module) -> None:
        load_checkpoint(model, cfg, Layout(world_size=tp, adp=1, ep=1), tp_rank, te=te)

    return load
