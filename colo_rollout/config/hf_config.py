"""config.json of a Hugging Face checkpoint -> the model section's architecture fields.

Owns which families are supported (the ``architectures`` value picks one), how each family's
keys map onto ``ModelConfig`` fields (both transformers-5 and older spellings: ``rope_parameters``
or ``rope_theta``/``rope_scaling``/``partial_rotary_factor``, ``dtype`` or ``torch_dtype``,
``num_experts`` or ``num_local_experts``, ``num_nextn_predict_layers`` or ``num_mtp_layers``),
what megatron cannot express (refused with an error naming the config.json key), and the merge of
those fields into a YAML model section, where an explicit field that contradicts the checkpoint
is an error naming both.

One field depends on the stored tensors too: a declared MTP layer none of whose tensors is
stored (every GLM checkpoint transformers' save_pretrained writes: Glm4MoeConfig declares
num_nextn_predict_layers 1, its model holds no such layer) is no MTP layer, as transformers
loads it (``stored_architecture``; the merge lists the names with config/checkpoint_index.py,
without torch). ``hf_architecture`` itself reads config.json only.

Must not go in here: tensor names and shapes (hf_names.py), reading weights (store.py).
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from colo_rollout.config.checkpoint_errors import (
    CONFIG_NAME,
    CheckpointError,
    read_checkpoint_file,
)
from colo_rollout.config.checkpoint_index import stored_tensor_names

QWEN3 = "Qwen3MoeForCausalLM"
QWEN2 = "Qwen2MoeForCausalLM"
MIXTRAL = "MixtralForCausalLM"
GLM4 = "Glm4MoeForCausalLM"
DEEPSEEK3 = "DeepseekV3ForCausalLM"  # also Kimi-K2's and Moonlight's architecture
DEEPSEEK2 = "DeepseekV2ForCausalLM"  # DeepSeek-V2(-Lite)
GLM4_LITE = "Glm4MoeLiteForCausalLM"  # GLM-4.7-Flash: DeepSeek-V3's MLA with GLM-4.5's MoE
DOTS1 = "Dots1ForCausalLM"  # dots.llm1: Qwen3's attention with DeepSeek-V3's MoE
FAMILIES = (QWEN3, QWEN2, MIXTRAL, GLM4, DEEPSEEK3, DEEPSEEK2, GLM4_LITE, DOTS1)
# the families whose attention is multi-head latent
MLA_ARCHS = (DEEPSEEK3, DEEPSEEK2, GLM4_LITE)
# config.json's model_type -> the family, where architectures is absent (transformers' Auto
# classes pick the model by model_type then)
MODEL_TYPES = {QWEN3: "qwen3_moe", QWEN2: "qwen2_moe", MIXTRAL: "mixtral", GLM4: "glm4_moe",
               DEEPSEEK3: "deepseek_v3", DEEPSEEK2: "deepseek_v2", GLM4_LITE: "glm4_moe_lite",
               DOTS1: "dots1"}
_MODEL_TYPE_FAMILIES = {t: f for f, t in MODEL_TYPES.items()}
# other names of multi-head latent attention architectures: not supported
UNSUPPORTED_MLA = ("KimiK2ForCausalLM",)

# ModelConfig fields a checkpoint determines (everything else -- params_dtype, use_te,
# moe_compute, fp8, seed -- stays the run's choice)
ARCH_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
    "head_dim", "qk_layernorm", "norm_epsilon", "qkv_bias", "tie_embeddings",
    "moe_ffn_hidden_size", "num_experts", "moe_router_topk", "router_score", "router_norm_topk",
    "router_expert_bias", "router_scaling_factor", "router_num_groups", "router_group_topk",
    "shared_expert_ffn_hidden_size", "shared_expert_gate", "first_k_dense", "dense_layers",
    "ffn_hidden_size",
    "max_position_embeddings", "rotary_base", "rotary_percent", "rope_scaling",
    "rope_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
    "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_truncate", "normalization",
    "mtp_num_layers", "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim",
)
# the YAML may lower these (a shorter RoPE table; 0 MTP layers: serve without the checkpoint's
# MTP layer, whose tensors are then not read); raising them is an error
AT_MOST_FIELDS = {"max_position_embeddings": 1, "mtp_num_layers": 0}  # field -> least value
# config.json keys of the MTP ("nextn") layer count: GLM-4.5 / DeepSeek-V3's, and the
# transformers-5 alias (Glm4MoeConfig.attribute_map)
MTP_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")


@dataclass(frozen=True)
class HFArchitecture:
    """What config.json says: the family, ModelConfig fields, and for each field the config.json
    key it came from (for error messages)."""

    path: pathlib.Path  # the config.json
    family: str
    fields: dict[str, Any]
    sources: dict[str, str]
    dtype: str | None  # the checkpoint's stored dtype name, when given
    # layers config.json declares beyond num_layers (GLM's MTP "nextn" layers, at
    # model.layers.{num_layers + j}); loaded as MTP layers unless the model section has fewer.
    # fields["mtp_num_layers"] is this count, or 0 in a ``stored_architecture`` whose
    # checkpoint stores none of those layers' tensors
    extra_layers: int = 0
    raw: dict = field(default_factory=dict, repr=False)
    # quantization_config of a block-scaled FP8 checkpoint (quant_method "fp8",
    # weight_block_size [rows, cols]: DeepSeek-V3's format, Qwen3-*-FP8): the
    # scale block of its e4m3 weights, which load dequantized (checkpoint/fp8_blocks.py); None
    # for a checkpoint stored in a float dtype
    weight_block: tuple[int, int] | None = None


class _Reader:
    """Typed access to config.json keys, remembering which key fed which field."""

    def __init__(self, config: dict, path: pathlib.Path) -> None:
        self.c, self.path = config, path
        self.fields: dict[str, Any] = {}
        self.sources: dict[str, str] = {}

    def error(self, key: str, problem: str) -> CheckpointError:
        return CheckpointError(problem, path=self.path, name=key)

    def get(self, key: str, kind: type, default: Any = ..., *, null_ok: bool = False) -> Any:
        if key not in self.c or (self.c[key] is None and not null_ok and default is not ...):
            if default is ...:
                raise self.error(key, "missing")
            return default
        v = self.c[key]
        if v is None and null_ok:
            return None
        ok = (isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float
              else isinstance(v, int) and not isinstance(v, bool) if kind is int
              else isinstance(v, kind))
        if not ok:
            raise self.error(key, f"expected {kind.__name__}, got {type(v).__name__} {v!r}")
        if kind is float:
            try:
                return float(v)
            except OverflowError:  # an integer past float's range (found by probing: a
                # traceback)
                raise self.error(key, f"must be a finite number, got an integer of "
                                 f"{len(str(abs(v)))} digits") from None
        return v

    def flag(self, key: str, default: bool) -> bool:
        """A boolean key as transformers tests it (``if config.key``): absent -> ``default``,
        null -> False (the config classes take None for these, and it is falsy)."""
        if key in self.c and self.c[key] is None:
            return False
        return self.get(key, bool, default)

    def count(self, key: str, default: int) -> int:
        """An int key that must be a number when present: absent -> ``default``; null is an
        error (transformers' model would be built with None)."""
        if key in self.c and self.c[key] is None:
            raise self.error(key, f"null: expected an int (absent: {default})")
        return self.get(key, int, default)

    def set(self, name: str, value: Any, key: str) -> None:
        self.fields[name] = value
        self.sources[name] = key

    def take(self, name: str, key: str, kind: type, default: Any = ...) -> Any:
        v = self.get(key, kind, default)
        self.set(name, v, key)
        return v

    def refuse(self, key: str, cond: bool, problem: str) -> None:
        if cond:
            raise self.error(key, problem)


def read_hf_config(directory: str | pathlib.Path) -> dict:
    path = pathlib.Path(directory) / CONFIG_NAME
    raw = read_checkpoint_file(path, "missing (a Hugging Face checkpoint directory holds "
                               "config.json and safetensors)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"cannot read: {e}", path=path) from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"line {e.lineno}: invalid JSON: {e.msg}", path=path) from None
    except RecursionError:
        raise CheckpointError("invalid JSON: nested too deeply", path=path) from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise CheckpointError(f"invalid JSON: {e}", path=path) from None
    if not isinstance(config, dict):
        raise CheckpointError("expected a JSON object", path=path)
    return config


GENERATION_CONFIG = "generation_config.json"


def checkpoint_eos_ids(directory: str | pathlib.Path) -> list[int]:
    """The checkpoint's end-of-sequence ids as transformers' ``generate`` takes them:
    generation_config.json's ``eos_token_id`` where that file exists, else config.json's
    (``GenerationConfig.from_model_config``); an int or a list of ints, null or absent: none.
    A value of another type is a CheckpointError naming the file and the key."""
    path = pathlib.Path(directory) / GENERATION_CONFIG
    if path.exists() and not path.is_file():  # never read as absent (transformers fails)
        raise CheckpointError("not a regular file (a directory, FIFO or device)", path=path)
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CheckpointError(f"cannot read: {type(e).__name__}: "
                                  f"{' '.join(str(e).split())[:200]}", path=path) from None
    else:
        path = pathlib.Path(directory) / CONFIG_NAME
        data = read_hf_config(directory)
    eos = data.get("eos_token_id") if isinstance(data, dict) else None
    if eos is None:
        return []
    ids = [eos] if not isinstance(eos, list) else eos
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"must be a token id >= 0 or a list of them, got {eos!r:.80}",
                              path=path, name="eos_token_id")
    return list(dict.fromkeys(ids))


def hf_architecture(directory: str | pathlib.Path, config: dict | None = None) -> HFArchitecture:
    """Parse ``directory``/config.json (or ``config``, already parsed from there)."""
    path = pathlib.Path(directory) / CONFIG_NAME
    config = read_hf_config(directory) if config is None else config
    r = _Reader(config, path)
    archs = config.get("architectures")
    if archs in (None, []) and config.get("model_type") in _MODEL_TYPE_FAMILIES:
        archs = [_MODEL_TYPE_FAMILIES[config["model_type"]]]  # as transformers' Auto classes
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        raise r.error("architectures", f"expected a non-empty list of names, got {archs!r}")
    family = archs[0]
    mtype = config.get("model_type")
    # transformers' Auto classes build the model_type's class: a supported model_type that
    # names another family than architectures is two models in one file (found by probing:
    # served as architectures' family, transformers built the other -- other tokens). A
    # model_type this module does not know (Kimi-K2's kimi_k2) is no contradiction.
    if (family in FAMILIES and isinstance(mtype, str) and mtype in _MODEL_TYPE_FAMILIES
            and _MODEL_TYPE_FAMILIES[mtype] != family):
        raise r.error("model_type", f"{mtype!r} is {_MODEL_TYPE_FAMILIES[mtype]}'s, but "
                      f"architectures names {family}: which model this is, is ambiguous")
    if family in UNSUPPORTED_MLA or ("kv_lora_rank" in config and family not in MLA_ARCHS):
        raise r.error("architectures", f"{family!r} with multi-head latent attention (MLA) "
                      "keys (kv_lora_rank) is not supported: MLA is read from "
                      f"{', '.join(MLA_ARCHS)} checkpoints; supported: "
                      f"{', '.join(FAMILIES)}")
    if family not in FAMILIES:
        raise r.error("architectures", f"{family!r} is not supported; supported: "
                      f"{', '.join(FAMILIES)}")
    _common(r, family)
    {QWEN3: _qwen3, QWEN2: _qwen2, MIXTRAL: _mixtral, GLM4: _glm4,
     DEEPSEEK3: _deepseek3, DEEPSEEK2: _deepseek2, GLM4_LITE: _glm4_lite,
     DOTS1: _dots1}[family](r)
    f = r.fields
    # transformers renormalises a single softmax score to 1.0; megatron refuses top-1 softmax
    # routing without its pre-softmax (model section's router_norm_topk check), and with
    # pre-softmax the weight would be the expert's probability -- no setting gives 1.0
    r.refuse("num_experts_per_tok", f["moe_router_topk"] == 1 and f["router_norm_topk"]
             and f["router_score"] == "sigmoid",
             f"1 with {family}'s renormalised sigmoid routing (the one expert weighted 1.0 "
             "times routed_scaling_factor) is not supported: megatron's sigmoid router "
             "renormalises only for top-k > 1 and weights a top-1 expert by its score")
    r.refuse("num_experts_per_tok", f["moe_router_topk"] == 1 and f["router_norm_topk"]
             and f["router_score"] == "softmax",
             f"1 with {family}'s renormalised softmax routing (every token's one expert weighted "
             "1.0) is not supported: megatron's router takes top-1 softmax routing only with "
             "the softmax over all experts first (moe_router_pre_softmax), which weights the "
             "expert by its probability instead")
    dtype = config.get("dtype", config.get("torch_dtype"))
    return HFArchitecture(path, family, r.fields, r.sources,
                          dtype if isinstance(dtype, str) else None, r.fields["mtp_num_layers"],
                          config, weight_block=_weight_block(r))


def _weight_block(r: _Reader) -> tuple[int, int] | None:
    """quantization_config: absent or null -> None (float weights); block-scaled FP8
    (quant_method "fp8", fmt e4m3, weight_block_size [rows, cols]) -> the block; any other
    quantisation is refused, naming the key."""
    q = r.c.get("quantization_config")
    if q is None:
        return None
    key = "quantization_config"
    r.refuse(key, not isinstance(q, dict), f"expected an object or null, got {q!r}")
    method = q.get("quant_method")
    r.refuse(f"{key}.quant_method", method != "fp8",
             f"{method!r} is not supported: checkpoints load in a float dtype or as "
             "block-scaled FP8 (quant_method 'fp8' with weight_block_size), dequantized")
    fmt = q.get("fmt", "e4m3")
    r.refuse(f"{key}.fmt", fmt != "e4m3", f"{fmt!r}: block-scaled FP8 weights load from e4m3")
    block = q.get("weight_block_size")
    ok = (isinstance(block, list) and len(block) == 2
          and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block))
    r.refuse(f"{key}.weight_block_size", not ok,
             f"expected [rows, cols] of positive ints (per-tensor FP8 checkpoints are not "
             f"supported), got {block!r}")
    # activations quantised per token group at run time (DeepSeek-V3's, Qwen3-FP8's): what
    # the dequantised float weights serve within FP8's rounding; a static scheme carries
    # activation scales transformers applies and this engine would not (found by probing:
    # any value was taken)
    scheme = q.get("activation_scheme", "dynamic")
    r.refuse(f"{key}.activation_scheme", scheme != "dynamic",
             f"{scheme!r}: block-scaled FP8 checkpoints load with dynamic activations only")
    return (block[0], block[1])


# ---------------------------------------------------------------------- the families
# config.json keys whose absence transformers fills with a family default other than "none":
# the model transformers builds from such a config.json is the reference, so read them alike
_PARTIAL_ROTARY_DEFAULT = {GLM4: 0.5}  # Glm4MoeConfig: partial_rotary_factor 0.5 when absent
# the families whose default RoPE reads partial_rotary_factor; the others' rotates whole heads
# whatever config.json says (transformers' own compute_default_rope_parameters; found by
# probing: a Qwen3 config.json with 0.5 served other tokens than transformers)
_PARTIAL_ROTARY_FAMILIES = (GLM4, GLM4_LITE)
_THETA_DEFAULT = {MIXTRAL: 1e6}  # the config classes' default_theta (others: 10000)


def _common(r: _Reader, family: str) -> None:
    r.take("vocab_size", "vocab_size", int)
    r.take("hidden_size", "hidden_size", int)
    layers = r.take("num_layers", "num_hidden_layers", int)
    # checked here, before the families read their per-layer keys against it (found by
    # probing: 0 layers of Qwen3 were refused as "mlp_only_layers: every layer dense", the
    # wrong key; the schema's own >= 1 check comes later)
    r.refuse("num_hidden_layers", layers < 1, f"must be >= 1, got {layers}")
    heads = r.take("num_attention_heads", "num_attention_heads", int)
    # checked here, before head_dim divides by it (the schema's own >= 1 check comes later)
    r.refuse("num_attention_heads", heads < 1, f"must be >= 1, got {heads}")
    if family in MLA_ARCHS:  # every head its own key and value; _mla sets the widths
        r.set("num_query_groups", heads, "num_attention_heads")
    else:
        r.take("num_query_groups", "num_key_value_heads", int, heads)
        head_dim = r.get("head_dim", int, None, null_ok=True)
        if head_dim is None:
            hidden = r.fields["hidden_size"]
            r.refuse("hidden_size", hidden % heads != 0, f"{hidden} is not divisible by "
                     f"num_attention_heads {heads} and head_dim is not given")
            head_dim = hidden // heads
        r.set("head_dim", head_dim, "head_dim")
    r.take("norm_epsilon", "rms_norm_eps", float)
    r.take("tie_embeddings", "tie_word_embeddings", bool, False)
    r.take("max_position_embeddings", "max_position_embeddings", int)
    r.take("moe_router_topk", "num_experts_per_tok", int)
    r.set("normalization", "RMSNorm", "rms_norm_eps")
    _not_null(r, "hidden_act")  # (null: transformers' ACT2FN has no None)
    act = r.get("hidden_act", str, "silu")
    # ('swish' is transformers' other name of the same function: ACT2FN maps both to SiLU)
    r.refuse("hidden_act", act not in ("silu", "swish"),
             f"{act!r}: only SwiGLU ('silu') MLPs are supported")
    _rope(r, _PARTIAL_ROTARY_DEFAULT.get(family, 1.0), _THETA_DEFAULT.get(family, 10000.0),
          family)
    # defaults that families override
    for name, value in (("qk_layernorm", False), ("qkv_bias", False), ("router_score", "softmax"),
                        ("router_norm_topk", True), ("router_expert_bias", False),
                        ("router_scaling_factor", 1.0), ("router_num_groups", None),
                        ("router_group_topk", None), ("shared_expert_ffn_hidden_size", None),
                        ("shared_expert_gate", False), ("first_k_dense", 0),
                        ("dense_layers", []),
                        ("ffn_hidden_size", None), ("mtp_num_layers", 0), ("attention", "gqa")):
        r.set(name, value, "architectures")


def _rope(r: _Reader, partial_default: float = 1.0, theta_default: float = 10000.0,
          family: str = "") -> None:
    """transformers 5: rope_parameters {rope_theta, rope_type, partial_rotary_factor, factor};
    older: top-level rope_theta, rope_scaling {type|rope_type, factor}, partial_rotary_factor.
    ``partial_default`` / ``theta_default``: the family's partial_rotary_factor / rope_theta
    when config.json gives none (its config class's defaults).

    Read as transformers 5 reads them (``convert_rope_params_to_dict``): a non-empty
    rope_scaling REPLACES rope_parameters (a legacy key added beside transformers' own
    rope_parameters wins, and the replaced dict's rope_theta goes with it); only rope_theta
    and partial_rotary_factor missing from that dict come from the top level (every other
    top-level RoPE key is ignored, as transformers ignores it); the scaled types' original
    max_position_embeddings is the top-level one where given, else the dict's, else
    max_position_embeddings."""
    params = r.c.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise r.error("rope_parameters", f"expected an object, got {params!r}")
    params = params or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise r.error("rope_parameters", "per-layer-type RoPE parameters are not supported")
    legacy = r.c.get("rope_scaling") or {}
    if not isinstance(legacy, dict):
        raise r.error("rope_scaling", f"expected an object or null, got {legacy!r}")
    if any(isinstance(v, dict) for v in legacy.values()):
        raise r.error("rope_scaling", "per-layer-type RoPE parameters are not supported")
    rope, rope_name = (legacy, "rope_scaling") if legacy else (params, "rope_parameters")

    def pick(key: str, default: Any, where: str, top_first: bool = False) -> tuple[Any, str]:
        order = [(f"{rope_name}.{key}", rope)]
        if key in _TOP_LEVEL_ROPE_KEYS:
            order.append((key, r.c))
        for src, d in (order[::-1] if top_first else order):
            if d.get(key) is not None:
                return d[key], src
        return default, where

    theta, src = pick("rope_theta", theta_default, "rope_theta")
    r.refuse(src, not _is_number(theta) or theta <= 0,
             f"expected a positive number, got {theta!r}")
    r.set("rotary_base", float(theta), src)
    partial, psrc = pick("partial_rotary_factor", partial_default, "partial_rotary_factor")
    r.refuse(psrc, not _is_number(partial)
             or not 0 < partial <= 1, f"expected a number in (0, 1], got {partial!r}")
    r.set("rotary_percent", float(partial), psrc)
    rtype, src = pick("rope_type", None, "rope_type")
    if rtype is None:
        rtype, src = pick("type", "default", "rope_scaling.type")
    if rtype == "default":
        if family not in _PARTIAL_ROTARY_FAMILIES:
            r.set("rotary_percent", 1.0, "architectures")
        r.set("rope_scaling", None, src)
        r.set("rope_scaling_factor", 8.0, src)
        return
    if rtype == "yarn":
        _yarn(r, pick, src, partial_default, family, rope, rope_name)
        return
    if rtype != "llama3":
        raise r.error(src, f"RoPE type {rtype!r} is not supported (default, llama3, yarn)")
    # transformers' llama3 frequencies cover partial_rotary_factor of the head, which only the
    # partial families' attention applies (the others' cannot run with it)
    r.refuse(psrc, partial != 1 and family not in _PARTIAL_ROTARY_FAMILIES,
             f"{partial!r} with rope_type llama3: {family}'s attention rotates whole heads")
    # megatron's llama3 scaling fixes the other three parameters; refuse different ones
    for key, want in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0)):
        got, ksrc = pick(key, want, key)
        r.refuse(ksrc, got != want, f"{got!r}: megatron's llama3 RoPE scaling uses {want}")
    # transformers: the top-level value first, else the dict's, else max_position_embeddings
    got, ksrc = pick("original_max_position_embeddings", None, "", top_first=True)
    if got is None:
        got, ksrc = r.c.get("max_position_embeddings"), "max_position_embeddings"
    r.refuse(ksrc, got != 8192, f"{got!r}: the original max position embeddings of megatron's "
             "llama3 RoPE scaling are 8192 (transformers takes max_position_embeddings where "
             "rope_parameters gives none)")
    factor, fsrc = pick("factor", 8.0, "factor")
    r.refuse(fsrc, not _is_number(factor)
             or factor <= 0, f"expected a positive number, got {factor!r}")
    r.set("rope_scaling", "llama3", src)
    r.set("rope_scaling_factor", float(factor), fsrc)


def _is_number(v: Any) -> bool:
    """A JSON number that is a finite float (bools are not numbers; an integer past float's
    range is not either: float() and math.isfinite raise on it -- found by probing, a
    traceback at the door)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return math.isfinite(v) if isinstance(v, float) else abs(v) < 2 ** 1023


# the RoPE keys transformers takes from config.json's top level when its RoPE dict lacks them
_TOP_LEVEL_ROPE_KEYS = ("rope_theta", "partial_rotary_factor",
                        "original_max_position_embeddings")


def _yarn(r: _Reader, pick, src: str, partial_default: float, family: str, rope: dict,
          rope_name: str) -> None:
    """rope_type yarn as transformers' ``_compute_yarn_parameters`` reads it, onto megatron's
    YarnRotaryEmbedding (model.rope_scaling: yarn): factor (None: max_position_embeddings /
    original), original_max_position_embeddings (the top level first, else the dict's, else
    max_position_embeddings), beta_fast / beta_slow (0 or null: 32 / 1), truncate. The
    attention factor cos and sin are scaled by: attention_factor where given, else the mscale
    ratio where mscale and mscale_all_dim are both non-zero, else 0.1 ln(factor) + 1 --
    expressed as megatron's mscale / mscale_all_dim (megatron takes no attention factor of
    its own)."""
    def number(key: str, default: Any, positive: bool = True) -> tuple[Any, str]:
        got, ksrc = pick(key, default, key)
        if got is not None:
            r.refuse(ksrc, not _is_number(got) or (positive and got <= 0),
                     f"expected a {'positive ' if positive else ''}number, got {got!r}")
        return got, ksrc

    partial, psrc = pick("partial_rotary_factor", partial_default, "")
    r.refuse(psrc or src, partial != 1,
             f"{partial!r}{'' if psrc else f' ({family} default)'} partial rotary with "
             "rope_type yarn is not supported: megatron-core's YaRN rotates whole heads")
    # the top level first: what transformers' model computes with -- its config object shows
    # the dict's value (or max_position_embeddings) until the rotary embedding's build
    # standardises again with the top-level attribute set (transformers 5.17 and 5.25,
    # checked against the model's inv_freq; the config alone misleads)
    original, osrc = pick("original_max_position_embeddings", None, "", top_first=True)
    if original is None:
        original, osrc = r.c.get("max_position_embeddings"), "max_position_embeddings"
    if isinstance(original, float) and original.is_integer():  # 4096.0: transformers' math
        original = int(original)
    r.refuse(osrc, isinstance(original, bool) or not isinstance(original, int) or original < 1,
             f"expected a positive int, got {original!r}")
    # transformers' YaRN requires the key (null: the ratio below); read without it, the
    # factor was the ratio of max_position_embeddings to itself -- 1, YaRN off -- where
    # transformers refuses the config.json (found by probing)
    r.refuse(f"{rope_name}.factor", "factor" not in rope, "missing: rope_type yarn requires "
             "it (null: max_position_embeddings / original_max_position_embeddings)")
    factor, fsrc = number("factor", None)
    if factor is None:  # DeepSeek-V3's rule: the ratio of the two context lengths
        longest = r.c.get("max_position_embeddings")
        r.refuse(fsrc, isinstance(longest, bool) or not isinstance(longest, int),
                 "missing, and no max_position_embeddings to derive it from")
        factor = longest / original
    betas = []
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        got, bsrc = number(key, None, positive=False)
        r.refuse(bsrc, got is not None and got < 0, f"expected a number >= 0, got {got!r}")
        betas.append((float(got or default), bsrc))  # transformers: `get(key) or default`
    truncate, tsrc = pick("truncate", True, "truncate")
    if "truncate" in rope and rope["truncate"] is None:  # transformers' get("truncate",
        truncate, tsrc = False, f"{rope_name}.truncate"  # True) is None: falsy, no rounding
    r.refuse(tsrc, not isinstance(truncate, bool), f"expected true or false, got {truncate!r}")
    attention, asrc = number("attention_factor", None)
    mscale, msrc = number("mscale", None, positive=False)
    mscale_all, masrc = number("mscale_all_dim", None, positive=False)
    raw_all = float(mscale_all or 0.0)
    # megatron's factor is 1 for factors <= 1 whatever the mscales say
    r.refuse(asrc, attention is not None and factor <= 1 and attention != 1,
             f"{attention!r} with factor {factor!r} <= 1: megatron-core's YaRN scales cos and "
             "sin only for factors above 1")
    if attention is not None and family in MLA_ARCHS:
        pass  # below: MLA keeps mscale_all_dim and solves mscale
    elif attention is not None:  # megatron's factor (0.1 m ln f + 1) / 1 equals it at this m
        mscale = (attention - 1) / (0.1 * math.log(factor)) if factor > 1 else 1.0
        mscale_all = 0.0
    elif family in MLA_ARCHS:  # below: MLA reads mscale_all_dim itself
        pass
    elif not (mscale and mscale_all):  # transformers: 0.1 ln f + 1 unless both are given
        mscale, mscale_all = 1.0, 0.0
    if family in MLA_ARCHS:
        # MLA's softmax scale is times mscale(factor, mscale_all_dim)^2 as given (transformers'
        # yarn_apply_mscale, megatron's MLA alike), so mscale_all_dim stays as config.json has
        # it; mscale is config.json's where transformers takes the pair's ratio (both
        # non-zero), else solved for megatron's cos/sin factor m(mscale) / m(mscale_all_dim)
        # to be transformers' attention factor (attention_factor, else 0.1 ln f + 1)
        mscale_all = raw_all
        if attention is None and mscale and raw_all:
            pass
        else:
            want = attention if attention is not None else _yarn_m(factor, 1.0)
            mscale = ((want * _yarn_m(factor, raw_all) - 1) / (0.1 * math.log(factor))
                      if factor > 1 else 1.0)
            if attention is not None:
                msrc = asrc
    elif attention is not None:
        msrc = masrc = asrc
    r.set("rope_scaling", "yarn", src)
    r.set("rope_scaling_factor", float(factor), fsrc)
    r.set("yarn_original_max_position_embeddings", original, osrc)
    r.set("yarn_beta_fast", betas[0][0], betas[0][1])
    r.set("yarn_beta_slow", betas[1][0], betas[1][1])
    r.set("yarn_mscale", float(mscale), msrc)
    r.set("yarn_mscale_all_dim", float(mscale_all), masrc)
    r.set("yarn_truncate", truncate, tsrc)


def _yarn_m(factor: float, m: float) -> float:
    """YaRN's mscale function (transformers' get_mscale, megatron's _yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _no_sliding_window(r: _Reader) -> None:
    r.refuse("use_sliding_window", r.flag("use_sliding_window", False),
             "sliding-window attention is not supported")


def _full_attention_layers(r: _Reader) -> list | None:
    """An explicit ``layer_types``: one entry per layer, every one full attention (the
    config classes build the layers from it as given, sliding ones included); None where the
    key is absent or null (the class derives it)."""
    n = r.fields["num_layers"]
    types = r.get("layer_types", list, None, null_ok=True)
    if types is not None:
        r.refuse("layer_types", len(types) != n,
                 f"{len(types)} entries for num_hidden_layers {n}")
        r.refuse("layer_types", any(t != "full_attention" for t in types),
                 "sliding-window attention is not supported")
    return types


def _qwen_dense_layers(r: _Reader, ffn_default: int) -> None:
    """Qwen's mlp_only_layers / decoder_sparse_step: as transformers builds the layers, layer i
    is MoE unless i is in mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step
    (an index outside the layers matches none); the dense ones get a dense MLP of
    intermediate_size (model.dense_layers, model.ffn_hidden_size; ``ffn_default``: the config
    class's intermediate_size)."""
    only = r.get("mlp_only_layers", list, [])
    r.refuse("mlp_only_layers", not all(isinstance(i, int) and not isinstance(i, bool)
                                        for i in only), f"{only}: expected layer indices")
    step = r.count("decoder_sparse_step", 1)  # (null: transformers' (i + 1) % None fails)
    r.refuse("decoder_sparse_step", step < 1, f"{step}: expected a step >= 1")
    n = r.fields["num_layers"]
    src = "decoder_sparse_step" if step != 1 else "mlp_only_layers"
    # (bounded by the entries given, not by num_hidden_layers: a far too large count is named
    # against the stored tensors later, without a list of every layer)
    dense = (sorted({i for i in only if 0 <= i < n}) if step == 1
             else [i for i in range(min(n, 1 << 16)) if i in only or (i + 1) % step])
    r.refuse(src, step != 1 and n > 1 << 16, f"{step} over {n} layers: at most 65536 layers")
    r.refuse(src, len(dense) == n, "every layer dense: not a MoE model")
    r.set("dense_layers", dense, src)
    if dense:
        r.take("ffn_hidden_size", "intermediate_size", int, ffn_default)


def _qwen3(r: _Reader) -> None:
    key = "num_experts" if "num_experts" in r.c else "num_local_experts"
    r.take("num_experts", key, int)
    r.take("moe_ffn_hidden_size", "moe_intermediate_size", int)
    r.set("router_norm_topk", r.flag("norm_topk_prob", False), "norm_topk_prob")
    r.set("qk_layernorm", True, "architectures")  # Qwen3 always has q_norm / k_norm
    r.refuse("attention_bias", r.flag("attention_bias", False),
             "true: Qwen3's attention bias includes o_proj, which megatron has no bias for")
    _no_sliding_window(r)
    _qwen_dense_layers(r, 6144)  # Qwen3MoeConfig's intermediate_size


def _qwen2(r: _Reader) -> None:
    key = "num_experts" if "num_experts" in r.c else "num_local_experts"
    r.take("num_experts", key, int)
    r.take("moe_ffn_hidden_size", "moe_intermediate_size", int)
    r.set("router_norm_topk", r.flag("norm_topk_prob", False), "norm_topk_prob")
    # older configs without the key: Qwen2-MoE always has it
    r.set("qkv_bias", r.flag("qkv_bias", True), "qkv_bias")
    # Qwen2MoeConfig's default (5632) when absent: transformers then builds a shared expert
    shared = r.get("shared_expert_intermediate_size", int, 5632)
    if shared:
        r.set("shared_expert_ffn_hidden_size", shared, "shared_expert_intermediate_size")
        r.set("shared_expert_gate", True, "architectures")  # Qwen2-MoE's shared_expert_gate
    _no_sliding_window(r)
    _full_attention_layers(r)  # (an explicit layer_types overrides use_sliding_window there)
    _qwen_dense_layers(r, 5632)  # Qwen2MoeConfig's intermediate_size


def _mixtral(r: _Reader) -> None:
    r.take("num_experts", "num_local_experts", int)
    r.take("moe_ffn_hidden_size", "intermediate_size", int)
    r.set("router_norm_topk", True, "architectures")  # softmax over the top-k logits
    window = r.get("sliding_window", int, None, null_ok=True)
    r.refuse("sliding_window", window is not None, f"{window}: sliding-window attention is "
             "not supported")


def _glm4(r: _Reader) -> None:
    r.set("qkv_bias", r.flag("attention_bias", False), "attention_bias")
    r.set("qk_layernorm", r.flag("use_qk_norm", False), "use_qk_norm")
    _deepseek_moe(r, scaling=1.0, groups=1, topk_group=1, dense=1)


def _deepseek3(r: _Reader) -> None:
    """DeepSeek-V3 (Kimi-K2, Moonlight): MLA attention (model.attention 'mla') and GLM-4.5's
    router; DeepseekV3Config's defaults where a key is absent."""
    _mla(r)
    _rope_interleaved(r)
    _deepseek_moe(r, scaling=2.5, groups=8, topk_group=4, dense=3)


def _glm4_lite(r: _Reader) -> None:
    """GLM-4.7-Flash (transformers' Glm4MoeLite): DeepSeek-V3's attention class and GLM-4.5's
    MoE, its dense layers named by ``mlp_layer_types`` ("dense" / "sparse" per layer;
    absent: layer 0 dense, the rest sparse -- Glm4MoeLiteConfig's default; transformers
    reads no first_k_dense_replace for this family, so neither does this);
    Glm4MoeLiteConfig's defaults where a key is absent."""
    _mla(r)
    _rope_interleaved(r)
    n = r.fields["num_layers"]
    types = r.get("mlp_layer_types", list, None, null_ok=True)
    if types is None:
        types = ["dense"] + ["sparse"] * (n - 1)
    bad = next((t for t in types if t not in ("dense", "sparse")), None)
    r.refuse("mlp_layer_types", bad is not None, f"{bad!r:.40}: expected 'dense' or 'sparse'")
    r.refuse("mlp_layer_types", len(types) != n,
             f"{len(types)} entries for num_hidden_layers {n}")
    dense = [i for i, t in enumerate(types) if t == "dense"]
    r.refuse("mlp_layer_types", len(dense) == n, "every layer dense: not a MoE model")
    _deepseek_moe(r, scaling=1.8, groups=1, topk_group=1, dense=0, first_k_dense=False)
    # a leading run of dense layers is first_k_dense (DeepSeek's form); others dense_layers
    if dense == list(range(len(dense))):
        r.set("first_k_dense", len(dense), "mlp_layer_types")
    else:
        r.set("dense_layers", dense, "mlp_layer_types")
    if dense:
        r.take("ffn_hidden_size", "intermediate_size", int, 10240)


def _dots1(r: _Reader) -> None:
    """dots.llm1 (transformers' Dots1): Qwen3's attention (q/k norms, no bias) with
    DeepSeek-V3's MoE (sigmoid scores with the score-correction bias, group-limited top-k,
    routed scaling, shared experts, dense first layers); Dots1Config's defaults where a key is
    absent (norm_topk_prob false -- which megatron's sigmoid router cannot take --, one group,
    scaling 1). Its sliding-window layers (``layer_types``, else every layer from
    ``max_window_layers`` where ``sliding_window`` is set) are refused."""
    r.set("qk_layernorm", True, "architectures")
    r.refuse("attention_bias", r.flag("attention_bias", False),
             "true: Qwen3's attention bias includes o_proj, which megatron has no bias for")
    n = r.fields["num_layers"]
    if _full_attention_layers(r) is None:
        # Dots1Config's defaults where a key is absent: sliding_window 4096 (found by
        # probing: read as none, the layers from max_window_layers were served with full
        # attention where transformers' slide) and max_window_layers 62, whatever the layer
        # count; a null max_window_layers beside a window is a config transformers cannot
        # build its layers from
        window = r.get("sliding_window", int, 4096, null_ok=True)
        first = r.get("max_window_layers", int, 62, null_ok=True)
        r.refuse("max_window_layers", window is not None and first is None,
                 f"null beside sliding_window {window}: expected the first sliding layer")
        r.refuse("sliding_window", window is not None and first is not None and first < n,
                 f"{window} from layer max_window_layers {first}: sliding-window attention is "
                 "not supported")
    # Dots1Config: no default shared-expert count (transformers multiplies None), no MTP
    # layers (transformers' Dots1 reads no MTP keys and builds none: stored ones are
    # unexpected tensors here)
    _deepseek_moe(r, scaling=1.0, groups=1, topk_group=1, dense=0, norm_topk=False,
                  shared=None, mtp=False)


def _rope_interleaved(r: _Reader) -> None:
    r.refuse("rope_interleave", not r.flag("rope_interleave", True),
             "false: megatron's MLA rotates DeepSeek's interleaved rope pairs (true) only")


def _deepseek2(r: _Reader) -> None:
    """DeepSeek-V2 (-Lite): MLA attention (its complex-number RoPE rotates interleaved pairs:
    megatron's MLA de-interleaves them, the same scores) and a softmax router as transformers'
    DeepseekV2TopkRouter computes it -- the softmax over every expert, its top-k (greedy, or
    group_limited_greedy: groups ranked by their best expert) weighted by routed_scaling_factor,
    never renormalised; DeepseekV2Config's defaults where a key is absent."""
    _mla(r)
    r.refuse("mlp_bias", r.flag("mlp_bias", False),
             "true: megatron's MLPs have no bias")
    # (transformers' attribute_map: num_experts is n_routed_experts)
    key = "num_experts" if "n_routed_experts" not in r.c and "num_experts" in r.c \
        else "n_routed_experts"
    experts = r.take("num_experts", key, int, 64)
    moe_ffn = r.take("moe_ffn_hidden_size", "moe_intermediate_size", int, 1407)
    heads = r.fields["num_attention_heads"]
    kv = r.get("num_key_value_heads", int, heads, null_ok=True)
    # (transformers' DeepseekV2 attention repeats no key/value head: its forward fails)
    r.refuse("num_key_value_heads", kv is not None and kv != heads,
             f"{kv}: DeepSeek-V2's attention has one key/value head per query head "
             f"(num_attention_heads {heads})")
    r.refuse("norm_topk_prob", r.flag("norm_topk_prob", False),
             "true: transformers' DeepseekV2 router never renormalises the top-k weights "
             "(DeepSeek's own code does): ambiguous, refused")
    r.set("router_norm_topk", False, "norm_topk_prob")
    _not_null(r, "routed_scaling_factor")
    r.take("router_scaling_factor", "routed_scaling_factor", float, 1.0)
    # (null: transformers' router has no branch for it -- its forward fails)
    r.refuse("topk_method", "topk_method" in r.c and r.c["topk_method"] is None,
             "null: expected 'greedy' or 'group_limited_greedy'")
    method = r.get("topk_method", str, "greedy")
    if method == "group_limited_greedy":  # transformers ranks groups by their best expert
        _groups(r, r.count("n_group", 1), r.count("topk_group", 1), experts, per_group=1)
    if method == "group_limited_greedy" and r.count("n_group", 1) in (1, r.count("topk_group", 1)):
        method = "greedy"  # every group kept limits nothing: transformers' scores are greedy's
    if method == "group_limited_greedy":
        groups, topk_group = r.get("n_group", int), r.get("topk_group", int)
        topk = r.fields["moe_router_topk"]
        # transformers ranks a group by its best expert; megatron by the sum of its
        # top-(topk / group_topk)
        r.refuse("topk_group", topk_group <= 0 or topk != topk_group,
                 f"{topk_group}: group_limited_greedy ranks groups by their best expert; "
                 f"megatron ranks them by num_experts_per_tok / topk_group = {topk} / "
                 f"{topk_group} experts, which must then be 1")
        r.set("router_num_groups", groups, "n_group")
        r.set("router_group_topk", topk_group, "topk_group")
    else:
        r.refuse("topk_method", method != "greedy", f"{method!r}: DeepSeek-V2's router takes "
                 "'greedy' or 'group_limited_greedy'")
    shared = r.count("n_shared_experts", 2)
    if shared:
        r.set("shared_expert_ffn_hidden_size", shared * moe_ffn, "n_shared_experts")
    r.set("first_k_dense", r.count("first_k_dense_replace", 0), "first_k_dense_replace")
    if r.fields["first_k_dense"]:
        r.take("ffn_hidden_size", "intermediate_size", int, 11008)


def _mla(r: _Reader) -> None:
    """The multi-head latent attention keys of the DeepSeek families (both configs' defaults
    are DeepSeek-V2/V3's: q_lora_rank 1536, kv_lora_rank 512, 128 + 64 query/key dims, 128
    value dims)."""
    r.set("attention", "mla", "architectures")
    q_lora = r.get("q_lora_rank", int, 1536, null_ok=True)
    r.set("q_lora_rank", q_lora, "q_lora_rank")
    for key, default in (("kv_lora_rank", 512), ("qk_nope_head_dim", 128),
                         ("qk_rope_head_dim", 64), ("v_head_dim", 128)):
        r.set(key, r.count(key, default), key)
    r.set("head_dim", r.fields["qk_nope_head_dim"] + r.fields["qk_rope_head_dim"],
          "qk_nope_head_dim + qk_rope_head_dim")  # transformers' head_dim is the rope
    r.set("qk_layernorm", True, "architectures")  # q_a_layernorm, kv_a_layernorm
    r.refuse("attention_bias", r.flag("attention_bias", False),
             "true: megatron's MLA projections have no bias")


def _deepseek_moe(r: _Reader, *, scaling: float, groups: int, topk_group: int,
                  dense: int, first_k_dense: bool = True, norm_topk: bool = True,
                  shared: int | None = 1, mtp: bool = True) -> None:
    """DeepSeek-V3's MoE (GLM-4.5 has it too): sigmoid scores with a score-correction bias,
    group-limited top-k, routed scaling, shared experts, dense first layers
    (``first_k_dense_replace``, where the family reads it), MTP layers (where the family has
    them); the arguments are the family config class's defaults for absent keys (``shared``
    None: none -- the key is required, transformers builds no model without it)."""
    # (transformers' attribute_map: num_local_experts is n_routed_experts)
    key = "num_local_experts" if "n_routed_experts" not in r.c and "num_local_experts" in r.c \
        else "n_routed_experts"
    experts = r.take("num_experts", key, int)
    moe_ffn = r.take("moe_ffn_hidden_size", "moe_intermediate_size", int)
    r.set("router_norm_topk", r.flag("norm_topk_prob", norm_topk), "norm_topk_prob")
    r.set("router_score", "sigmoid", "architectures")
    r.set("router_expert_bias", True, "architectures")  # e_score_correction_bias
    _not_null(r, "routed_scaling_factor")
    r.take("router_scaling_factor", "routed_scaling_factor", float, scaling)
    groups = r.count("n_group", groups)
    topk_group = r.count("topk_group", topk_group)
    # transformers scores every group by the sum of its top-2 experts and keeps topk_group
    # of them whatever the counts (found by probing: 0 groups, a count not dividing the
    # experts, one expert per group failed its forward; 0 kept groups masked every expert):
    # so checked also where every group is kept
    _groups(r, groups, topk_group, experts, per_group=2)
    if groups > 1 and topk_group != groups:  # (every group kept: plain top-k, as transformers)
        topk = r.fields["moe_router_topk"]
        # HF scores a group by the sum of its top-2 experts; megatron by its top-(k / groups)
        r.refuse("topk_group", topk_group <= 0 or topk % topk_group or topk // topk_group != 2,
                 f"{topk_group}: group-limited routing scores groups by their top 2 experts; "
                 f"megatron scores them by num_experts_per_tok / topk_group = {topk} / "
                 f"{topk_group}, which must then be 2")
        r.set("router_num_groups", groups, "n_group")
        r.set("router_group_topk", topk_group, "topk_group")
    # (Glm4MoeConfig's defaults when absent: 1 shared expert, 1 dense layer)
    shared = r.get("n_shared_experts", int) if shared is None else r.count("n_shared_experts",
                                                                           shared)
    if shared:
        r.set("shared_expert_ffn_hidden_size", shared * moe_ffn, "n_shared_experts")
    if first_k_dense:
        dense = r.count("first_k_dense_replace", dense)
        r.set("first_k_dense", dense, "first_k_dense_replace")
        if dense:
            r.take("ffn_hidden_size", "intermediate_size", int)
    if mtp:
        _mtp(r)


def _groups(r: _Reader, groups: int, topk_group: int, experts: int, per_group: int) -> None:
    """Group-limited routing's counts as transformers' routers need them: at least one group,
    the experts split evenly over them with at least ``per_group`` each (the experts a group
    is scored by), between 1 and all of them kept."""
    r.refuse("n_group", groups < 1, f"{groups}: expected at least 1 group")
    r.refuse("n_group", experts % groups, f"{groups}: {experts} experts do not split evenly "
             "into them")
    r.refuse("n_group", experts // groups < per_group,
             f"{groups}: {experts // groups} expert(s) per group; a group is scored by its top "
             f"{per_group}")
    r.refuse("topk_group", not 1 <= topk_group <= groups,
             f"{topk_group}: expected 1 to n_group {groups} groups kept")


def _not_null(r: _Reader, key: str) -> None:
    """A key whose absence takes the family's default but whose null transformers' config
    class refuses (a strictly typed field): refused too, not read as the default."""
    r.refuse(key, key in r.c and r.c[key] is None, "null: expected a value (absent: the "
             "family's default)")


def _mtp(r: _Reader) -> None:
    """MTP layers (``num_nextn_predict_layers``; transformers 5 also reads ``num_mtp_layers``).
    Absent: 0 -- not Glm4MoeConfig's default 1: a config.json without the key declares no
    tensors at model.layers.{num_hidden_layers}, and transformers' main model never builds
    them. At most 1 (one draft token per D iteration)."""
    given = [k for k in MTP_KEYS if r.c.get(k) is not None]
    values = {k: r.get(k, int) for k in given}
    if len(set(values.values())) > 1:
        raise r.error(given[1], f"{values[given[1]]} contradicts {given[0]} {values[given[0]]}")
    if not given:
        return
    key = given[0]
    n = values[key]
    r.refuse(key, n < 0, f"{n}: expected a count >= 0")
    r.refuse(key, n > 1, f"{n} MTP layers: at most 1 is supported (one draft token per D "
             "iteration)")
    r.set("mtp_num_layers", n, key)


# ---------------------------------------------------------------------- stored tensors
def mtp_layer_prefixes(arch: HFArchitecture) -> tuple[str, ...]:
    """HF name prefixes of the MTP layers config.json declares: model.layers.{num_layers + j}."""
    n = arch.fields["num_layers"]
    return tuple(f"model.layers.{n + j}." for j in range(arch.extra_layers))


def mtp_unstored(arch: HFArchitecture) -> bool:
    """config.json declares MTP layers and the checkpoint stores none of their tensors
    (``arch`` from ``stored_architecture``)."""
    return arch.extra_layers > 0 and arch.fields["mtp_num_layers"] == 0


def stored_architecture(arch: HFArchitecture, names: Iterable[str] | None) -> HFArchitecture:
    """``arch`` (config.json's) as the checkpoint holding tensors ``names`` has it: declared MTP
    layers of which no tensor is stored (nothing under model.layers.{num_hidden_layers}.) are
    not there -- mtp_num_layers 0, what transformers loads (it ignores those layers). Any of
    their tensors stored: the declared count stands, and ``check_checkpoint`` names the ones
    missing. ``names`` None (the weights could not be listed): ``arch`` unchanged; the store
    reports why when the checkpoint is checked."""
    prefixes = mtp_layer_prefixes(arch)
    if not prefixes or names is None or any(n.startswith(prefixes) for n in names):
        return arch
    return replace(arch, fields={**arch.fields, "mtp_num_layers": 0})


# ---------------------------------------------------------------------- merging into YAML
def merge_checkpoint_fields(model: dict, source: str) -> tuple[dict, HFArchitecture]:
    """The YAML model section ``model`` (a mapping with ``checkpoint`` set) with the
    checkpoint's architecture fields filled in (``stored_architecture``: a declared MTP layer
    the checkpoint does not store gives mtp_num_layers 0). A field given in the YAML must agree
    with the checkpoint (``AT_MOST_FIELDS`` may be lower); otherwise a ``ValueError`` naming the
    YAML key, both values and the config.json key. ``source`` names the YAML file."""
    arch = hf_architecture(model["checkpoint"])
    if arch.extra_layers:
        arch = stored_architecture(arch, stored_tensor_names(model["checkpoint"]))
    out = dict(model)
    for name, value in arch.fields.items():
        if name not in model or model[name] == value:
            out[name] = value
            continue
        given = model[name]
        if (name in AT_MOST_FIELDS and isinstance(given, int) and not isinstance(given, bool)
                and AT_MOST_FIELDS[name] <= given <= value):
            continue
        src = arch.sources[name]
        what = (f"{arch.family} (config.json architectures), which has {value!r}"
                if src == "architectures" else f"config.json {src} = {value!r}")
        if name == "mtp_num_layers" and mtp_unstored(arch):
            what = (f"the checkpoint, which stores no MTP layer (config.json {src} = "
                    f"{arch.extra_layers} declares one, but no tensor is stored under "
                    f"{mtp_layer_prefixes(arch)[0]}; transformers' save_pretrained writes none)")
        raise ContradictionError(f"model.{name}: {given!r} contradicts {what} ({arch.path}); "
                                 "drop the key or make them agree", key=f"model.{name}")
    return out, arch


class ContradictionError(ValueError):
    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key

