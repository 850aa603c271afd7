"""Export: megatron-named weights written back as a Hugging Face checkpoint.

Owns ``hf_config_dict`` (the config.json of a model section in one of the supported families,
checked to parse back to the same fields) and ``export_checkpoint``: the full tensors of a
TP-sharded megatron model (the trainer's layout: TP x DP, optionally with whole experts split
over an EP group, ETP 1) gathered one at a time onto global rank 0 -- dense tensors over the TP
group, each expert broadcast from its EP rank -- split into HF tensors (``hf_names``) and
streamed into sharded safetensors (``store.write_checkpoint``). At most one full tensor and one shard are in memory.
transformers loads the result, and loading it back gives the same weights bit for bit.

A model with MTP layers (megatron's ``mtp.layers.{j}.*``) is written with them at
``model.layers.{num_layers + j}.``, each with the copies of the embedding and lm_head GLM-4.5
ships (``hf_names.mtp_duplicates``), and config.json's ``num_nextn_predict_layers`` says how
many were written (0 for a model without them, whatever the source checkpoint declared).

Must not go in here: name mapping (hf_names.py), file format (store.py).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from colo_rollout.config.hf_config import (
    DEEPSEEK2,
    DEEPSEEK3,
    DOTS1,
    GLM4,
    GLM4_LITE,
    MIXTRAL,
    MODEL_TYPES,
    QWEN2,
    QWEN3,
    hf_architecture,
    read_hf_config,
)
from colo_rollout.checkpoint.hf_names import MTP_FAMILIES, hf_sources, mtp_duplicates
from colo_rollout.checkpoint.store import write_checkpoint
from colo_rollout.config.checkpoint_errors import CONFIG_NAME
from colo_rollout.config import ModelConfig
from colo_rollout.model.weights import (
    DTYPES,
    loadable_tensors,
    held_rule,
    shard_rule,
    to_spec_names,
)
from colo_rollout.config.tensor_shapes import MTP_PREFIX, tensor_shapes
from colo_rollout.runtime.parallel import Layout

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def default_family(cfg: ModelConfig) -> str:
    """The family whose format holds ``cfg`` most directly."""
    if cfg.is_mla:  # dense layers past the first ones: only GLM-4.7-Flash's format names them
        if cfg.dense_layers and cfg.router_score == "sigmoid":
            return GLM4_LITE
        return DEEPSEEK3 if cfg.router_score == "sigmoid" else DEEPSEEK2
    if cfg.router_score == "sigmoid" or cfg.first_k_dense:
        return GLM4
    if cfg.shared_expert_ffn_hidden_size is not None:
        return QWEN2
    return QWEN3 if cfg.qk_layernorm else MIXTRAL


def hf_config_dict(cfg: ModelConfig, family: str | None = None,
                   dtype: str = "bfloat16") -> dict:
    """config.json for ``cfg`` in ``family``'s format; ValueError if the family cannot express
    ``cfg`` (checked by parsing the result back: every architecture field must round-trip)."""
    family = family or default_family(cfg)
    if family not in MODEL_TYPES:
        raise ValueError(f"family {family!r}: choose one of {', '.join(MODEL_TYPES)}")
    rope = {"rope_theta": cfg.rotary_base, "rope_type": "default"}
    if cfg.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=cfg.rope_scaling_factor, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=8192)
    elif cfg.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=cfg.rope_scaling_factor,
                    original_max_position_embeddings=cfg.yarn_original_max_position_embeddings,
                    beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow,
                    truncate=cfg.yarn_truncate)
        m, m_all = cfg.yarn_mscale, cfg.yarn_mscale_all_dim
        if m and m_all:  # transformers takes the ratio only where both are non-zero
            rope.update(mscale=m, mscale_all_dim=m_all)
        elif (m, m_all) != (1.0, 0.0) and cfg.rope_scaling_factor > 1:
            # megatron's factor (0.1 m ln f + 1) / (0.1 m_all ln f + 1) with one of them 0
            f = math.log(cfg.rope_scaling_factor)
            rope["attention_factor"] = (0.1 * m * f + 1) / (0.1 * m_all * f + 1)
            if cfg.is_mla and m_all:  # MLA's softmax scale reads it on its own
                rope["mscale_all_dim"] = m_all
    # always written: a family's default when absent is not always 1 (GLM-4.5: 0.5)
    rope["partial_rotary_factor"] = cfg.rotary_percent
    c: dict = {
        "architectures": [family], "model_type": MODEL_TYPES[family],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_epsilon, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
        "num_experts_per_tok": cfg.moe_router_topk, "rope_parameters": rope,
        "initializer_range": cfg.init_method_std, "dtype": dtype, "use_cache": True,
    }
    ffn = cfg.moe_ffn_hidden_size
    if family in (QWEN3, QWEN2):
        dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
        c.update(num_experts=cfg.num_experts, moe_intermediate_size=ffn,
                 norm_topk_prob=cfg.router_norm_topk, decoder_sparse_step=1,
                 mlp_only_layers=dense, use_sliding_window=False,
                 intermediate_size=cfg.dense_ffn_hidden_size if dense else ffn)
        if family == QWEN3:
            c["attention_bias"] = False
        else:
            c.update(qkv_bias=cfg.qkv_bias,
                     shared_expert_intermediate_size=cfg.shared_expert_ffn_hidden_size or 0)
    elif family == MIXTRAL:
        c.update(num_local_experts=cfg.num_experts, intermediate_size=ffn, sliding_window=None)
    else:
        if family in (DEEPSEEK3, DEEPSEEK2, GLM4_LITE):
            c.update(head_dim=cfg.qk_rope_head_dim, q_lora_rank=cfg.q_lora_rank,
                     kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                     qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim)
        if family in (DEEPSEEK3, GLM4_LITE):
            c["rope_interleave"] = True
        shared = cfg.shared_expert_ffn_hidden_size or 0
        if shared % ffn:
            raise ValueError(f"{family}: shared experts of width {shared} are not a whole "
                             f"number of experts of width {ffn} (n_shared_experts)")
        c.update(n_routed_experts=cfg.num_experts, moe_intermediate_size=ffn,
                 n_shared_experts=shared // ffn, first_k_dense_replace=cfg.first_k_dense,
                 intermediate_size=cfg.dense_ffn_hidden_size,
                 routed_scaling_factor=cfg.router_scaling_factor,
                 n_group=cfg.router_num_groups or 1, topk_group=cfg.router_group_topk or 1,
                 norm_topk_prob=cfg.router_norm_topk, attention_bias=cfg.qkv_bias,
                 num_nextn_predict_layers=cfg.mtp_num_layers)
        if family == GLM4:
            c["use_qk_norm"] = cfg.qk_layernorm
        if family == DOTS1:  # every layer full attention; no MTP layers
            c.update(sliding_window=None, layer_types=["full_attention"] * cfg.num_layers)
            del c["num_nextn_predict_layers"]
        if family == GLM4_LITE:  # its dense layers by type, wherever they are
            del c["first_k_dense_replace"]
            c["mlp_layer_types"] = ["sparse" if cfg.is_moe_layer(i) else "dense"
                                    for i in range(cfg.num_layers)]
        if family == DEEPSEEK2:
            grouped = cfg.router_num_groups is not None
            c.update(topk_method="group_limited_greedy" if grouped else "greedy",
                     n_group=cfg.router_num_groups, topk_group=cfg.router_group_topk)
            del c["num_nextn_predict_layers"]
    back = hf_architecture(".", c).fields
    if back.get("ffn_hidden_size") == cfg.dense_ffn_hidden_size:  # (null = the experts' width)
        back["ffn_hidden_size"] = cfg.ffn_hidden_size
    if cfg.router_num_groups and cfg.router_group_topk == cfg.router_num_groups:
        # every group kept limits nothing: read back as plain top-k, the same routing
        back.update(router_num_groups=cfg.router_num_groups,
                    router_group_topk=cfg.router_group_topk)
    wrong = {k: (getattr(cfg, k), v) for k, v in back.items() if getattr(cfg, k) != v
             and not (isinstance(v, float) and math.isclose(getattr(cfg, k), v, rel_tol=1e-12,
                                                           abs_tol=1e-12))}
    if wrong:
        raise ValueError(f"{family} cannot express this model section: " + ", ".join(
            f"{k} = {mine!r} would be {theirs!r}" for k, (mine, theirs) in wrong.items()))
    return c


def _full_tensor(local: torch.Tensor, kind: str, group, size: int) -> torch.Tensor:
    """The full tensor from every TP rank's shard (``shard_rule``'s kinds reversed)."""
    if size == 1 or kind == "full":
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    if kind == "rows":
        return torch.cat(parts, dim=0)
    if kind == "cols":
        return torch.cat(parts, dim=1)
    halves = [torch.chunk(p, 2, dim=0) for p in parts]  # "glu": [gate_r; up_r] per rank
    return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])


def export_checkpoint(model: torch.nn.Module, cfg: ModelConfig, directory: str | pathlib.Path,
                      *, tp_group=None, ep_group=None, te: bool = False,
                      family: str | None = None, dtype: str | None = None,
                      max_shard_bytes: int = 5 * 2**30,
                      writer: bool | None = None) -> list[pathlib.Path]:
    """Write ``model`` (megatron-named, TP-sharded over ``tp_group``; all experts on every
    rank, or with ``ep_group`` each EP rank's experts whole) as a Hugging Face checkpoint in
    ``directory``. Collective over ``tp_group`` (and ``ep_group``: every rank of it calls, each
    with its own TP group inside it); every other group holding a replica of the same
    weights may skip the call. ``writer`` (default:
    global rank 0, or the only process) writes the files; the others only send their shards.
    ``dtype`` (default: the model's) is the stored dtype; config.json is the source
    checkpoint's (``cfg.checkpoint``) with that dtype when there is one, else generated for
    ``family``. The tokenizer files of the source checkpoint are copied beside it. MTP layers
    are written when ``cfg`` has them and the model holds them (a trainer built without its
    MTP layer exports a checkpoint without one). Returns the written weight files (empty on
    non-writers)."""
    size = tp_group.size() if tp_group is not None else 1
    tp_rank = tp_group.rank() if tp_group is not None else 0
    if writer is None:
        writer = (dist.get_rank() == 0) if dist.is_initialized() else True
    layout = Layout(world_size=size, adp=1, ep=1)
    ep = ep_group.size() if ep_group is not None else 1
    ep_layout = Layout(world_size=ep, adp=1, ep=ep)  # experts whole (ETP 1) over EP
    n_local = cfg.num_experts // ep
    params = loadable_tensors(model)
    if cfg.mtp_num_layers and not _has_param(params, f"{MTP_PREFIX}0.enorm.weight"):
        cfg = dataclasses.replace(cfg, mtp_num_layers=0)
    model_dtype = next(iter(params.values())).dtype
    if dtype is not None and dtype not in DTYPES:  # (was a bare KeyError)
        raise ValueError(f"export: dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    dtype_name = dtype or _DTYPE_NAMES.get(model_dtype, "bfloat16")
    out_dtype = DTYPES[dtype_name]
    shapes = tensor_shapes(cfg)
    spec = {local: name for name, local in to_spec_names({n: n for n in shapes}, te).items()}
    source = _source_family(cfg)
    if family is not None and cfg.checkpoint is not None and family != source:
        # config.json is the source checkpoint's: another family's tensor names beside it
        # load as random weights in transformers (found by probing: a Mixtral model exported
        # as Qwen2-MoE)
        raise ValueError(f"export: family {family!r} is not the source checkpoint's "
                         f"({source}, {cfg.checkpoint}), whose config.json the export "
                         "keeps; export in its family, or from a model section without "
                         "model.checkpoint")
    family = family or source
    sources = hf_sources(cfg, family)
    duplicates = mtp_duplicates(cfg)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, src in sources.items():
            if ep > 1 and _is_expert(spec[name]):
                full = _expert_tensor(spec[name], shapes[name], params, ep_group, ep_layout,
                                      n_local, model_dtype)
            else:
                rule = shard_rule(spec[name], layout, tp_rank, cfg.num_experts)
                local = _param(params, rule.local)
                rule = held_rule(rule, local)
                full = _full_tensor(local.detach(), rule.kind, tp_group, size)
            if tuple(full.shape) != shapes[name]:
                raise ValueError(f"export: {name} gathered to {tuple(full.shape)}, expected "
                                 f"{shapes[name]}")
            if writer:
                # the score-correction bias stays fp32, as HF stores it
                keep = full if name.endswith("expert_bias") else full.to(out_dtype)
                yield from ((n, t.cpu().clone()) for n, t in src.split(keep))
                yield from ((n, keep.cpu().clone()) for n in duplicates.get(name, ()))

    # config.json on every rank before any gather: a model section the family cannot express
    # raises everywhere alike (raised on the writer alone, it left the others in a gather)
    config = _export_config(cfg, family, dtype_name)
    if not writer:
        for _ in tensors():
            pass
        return []
    extra = _tokenizer_files(cfg.checkpoint)
    return write_checkpoint(directory, tensors(), config, max_shard_bytes=max_shard_bytes,
                            extra_files=extra)


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _expert_tensor(name: str, shape: tuple, params: dict, ep_group, ep_layout: Layout,
                   n_local: int, dtype: torch.dtype) -> torch.Tensor:
    """Routed expert tensor ``name`` (whole: expert TP 1) broadcast over the EP group from the
    EP rank that holds it."""
    me = ep_group.rank()
    owner = next(r for r in range(ep_group.size())
                 if shard_rule(name, ep_layout, r, n_local) is not None)
    if owner == me:
        buf = _param(params, shard_rule(name, ep_layout, me, n_local).local).detach()
        buf = buf.contiguous()
    else:
        device = next(iter(params.values())).device
        buf = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buf, src=dist.get_global_rank(ep_group, owner), group=ep_group)
    return buf


def _export_config(cfg: ModelConfig, family: str, dtype_name: str) -> dict:
    """The exported checkpoint's config.json: the source checkpoint's with the new dtype (and
    MTP count), else generated for ``family`` (ValueError where it cannot express ``cfg``)."""
    if cfg.checkpoint is None:
        return hf_config_dict(cfg, family, dtype_name)
    config = read_hf_config(cfg.checkpoint)
    config["dtype"] = dtype_name
    config.pop("torch_dtype", None)
    # the weights are written in dtype_name, never quantised: a source's quantization_config
    # (a block-FP8 release) would make transformers read them as FP8 (found by probing)
    config.pop("quantization_config", None)
    if family in MTP_FAMILIES:
        config.pop("num_mtp_layers", None)  # transformers 5's alias
        config["num_nextn_predict_layers"] = cfg.mtp_num_layers
    return config


def export_problem(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` cannot be exported as a Hugging Face checkpoint (the family its source
    checkpoint has, else the one that holds it most directly), or None: what the door asks
    of rl.export_dir before the run trains (found by probing: refused only after training)."""
    family = None
    try:
        family = _source_family(cfg)
        hf_sources(cfg, family)
        _export_config(cfg, family, "bfloat16")
    except (ValueError, KeyError) as e:  # (CheckpointError is a ValueError)
        what = f"a {family} checkpoint" if family else "a Hugging Face checkpoint"
        return f"the model cannot be written as {what}: {' '.join(str(e).split())}"
    return None


def _source_family(cfg: ModelConfig) -> str:
    if cfg.checkpoint is not None:
        return hf_architecture(cfg.checkpoint).family
    return default_family(cfg)


_WRAPPERS = ("", "module.", "module.module.")  # megatron's Float16Module, DDP


def _has_param(params: dict[str, torch.Tensor], local: str) -> bool:
    return any(w + local in params for w in _WRAPPERS)


def _param(params: dict[str, torch.Tensor], local: str) -> torch.Tensor:
    """``local`` in the model, also under megatron's wrappers (Float16Module, DDP: 'module.')."""
    for w in _WRAPPERS:
        if w + local in params:
            return params[w + local]
    raise KeyError(f"export: the model has no {local!r}")


# the source checkpoint's files that are its weights (written anew) or other formats of them
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5",
                    ".msgpack", ".safetensors.index.json", ".bin.index.json")


def _tokenizer_files(source: str | None) -> dict[str, bytes]:
    """The source checkpoint's other files, copied beside the exported weights so the export
    is usable on its own: tokenizer files of any kind (tokenizer.json, tokenizer.model,
    tiktoken.model, vocab.json / merges.txt, a custom tokenizer's .py), the chat template,
    generation_config.json, remote code that config.json's ``auto_map`` names (found by
    probing: only five named files were copied, and a DeepSeek / Kimi export kept its
    auto_map without the code, and its tokenizer config without the tokenizer). Top-level
    regular files only; config.json (written anew), weights in any format and hidden files
    are not copied."""
    if source is None:
        return {}
    out = {}
    for p in sorted(pathlib.Path(source).iterdir()):
        name = p.name
        if (name.startswith(".") or name == CONFIG_NAME or name.endswith(_WEIGHT_SUFFIXES)
                or not p.is_file()):
            continue
        out[name] = p.read_bytes()
    return out

