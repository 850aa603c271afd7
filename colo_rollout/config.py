"""Run configuration for colo_rollout: schema, validation, YAML loading and dumping.

This module owns the typed description of one rollout job -- parallel layout,
model shape, engine limits and the synthetic workload -- as frozen dataclasses,
plus the single place where YAML files (and dotted-key overrides) become a
validated :class:`Config`.  Every problem is reported as a :class:`ConfigError`
whose message names the source file (when there is one) and the dotted key,
e.g. ``configs/x.yaml: model.hidden_size: expected int, got str 'abc'``.

Only the standard library and PyYAML are used; YAML is always parsed with
``yaml.safe_load``.
"""

import copy
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml

__all__ = [
    "BACKENDS",
    "ENGINE_MODES",
    "BenchConfig",
    "RLConfig",
    "SEGMENT_POLICIES",
    "FP8_FORMATS",
    "NORMALIZATIONS",
    "PARAMS_DTYPES",
    "USE_TE_MODES",
    "Config",
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "WorkloadConfig",
    "config_from_dict",
    "config_to_dict",
    "dump_config",
    "load_config",
]

# Allowed values of the enum-like string fields.
BACKENDS = ("auto", "gloo", "nccl")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
PARAMS_DTYPES = ("float32", "bfloat16", "float16")
USE_TE_MODES = ("auto", "on", "off")
MOE_COMPUTE = ("auto", "grouped", "megatron")
STREAM_ROUTES = ("auto", "off", "always")
FP8_FORMATS = ("hybrid", "e4m3")
# normal: strict P priority, no multiplexing. The ordering ladder of P/D multiplexing (PD mode):
# global_complete (whole-P epoch, D only after P completes), global_enqueue (whole-P epoch, D
# after all ranks host-enqueued it), fine (segment turnstile: D at every K boundaries).
ENGINE_MODES = ("normal", "global_complete", "global_enqueue", "fine")
SEGMENT_POLICIES = ("fixed", "load")


class ConfigError(ValueError):
    """An invalid configuration.

    The message names the source (file path or ``"<dict>"``) when known and the
    dotted key of the offending setting; both are also kept as attributes.
    """

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None):
        super().__init__(message)
        self.key = key  # dotted key of the offending setting, when there is one
        self.source = source  # file path (or "<dict>") the setting came from, when known

    def __reduce__(self):
        # Keep key/source across pickling (errors may cross process boundaries).
        return (_rebuild_config_error, (str(self), self.key, self.source))


def _rebuild_config_error(message: str, key: str | None, source: str | None) -> ConfigError:
    return ConfigError(message, key=key, source=source)


def _error(key: str, detail: str) -> ConfigError:
    """A ConfigError for ``key`` (dotted) with the standard ``key: detail`` message."""
    return ConfigError(f"{key}: {detail}" if key else detail, key=key or None)


def _with_source(err: ConfigError, source: str) -> ConfigError:
    """The same error with ``source: `` prefixed to the message."""
    return ConfigError(f"{source}: {err}", key=err.key, source=source)


# --------------------------------------------------------------------------- #
# Generic type checking (driven by the dataclass annotations)
# --------------------------------------------------------------------------- #


def _type_name(tp: Any) -> str:
    """Human-readable name of an annotation, for error messages."""
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arm) for arm in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"list of {_type_name(item)}"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    """``<type> <repr>`` of a value, for error messages."""
    return f"{type(value).__name__} {value!r}"


def _check_value(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it normalised.

    Normalisation: an int given for a float field becomes a float, and a list
    (or tuple) for a ``list[...]`` field becomes a fresh list.  bool is never
    accepted where an int or float is expected.
    """
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(tp)
        if value is None and type(None) in arms:
            return None
        others = [arm for arm in arms if arm is not type(None)]
        if len(others) == 1:
            try:
                return _check_value(value, others[0], key)
            except ConfigError:
                pass
        raise _error(key, f"expected {_type_name(tp)}, got {_describe(value)}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise _error(key, f"expected {_type_name(tp)}, got {_describe(value)}")
        return [_check_value(item, item_tp, f"{key}[{i}]") for i, item in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _parses_as_float(value):
            raise _error(
                key,
                f"expected float, got str {value!r} (YAML reads exponents without a "
                f"dot as strings; write e.g. 1.0e+6)",
            )
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):
            raise _error(
                key,
                f"expected str, got bool {value!r} (YAML reads unquoted on/off/yes/no/true/false "
                f"as booleans; quote the value, e.g. 'off')",
            )
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
    else:  # pragma: no cover - guards against an unsupported annotation in this module
        raise TypeError(f"config.py: unsupported field annotation {tp!r} for {key}")
    raise _error(key, f"expected {_type_name(tp)}, got {_describe(value)}")


def _parses_as_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_field_types(obj: Any) -> None:
    """Type-check and normalise every field of a config dataclass instance in place.

    Called first in each ``__post_init__`` so later checks can rely on types.
    Keys in messages are ``<section>.<field>`` using the class's ``SECTION``.
    """
    hints = typing.get_type_hints(type(obj))
    section = type(obj).SECTION
    for f in dataclasses.fields(obj):
        key = f"{section}.{f.name}" if section else f.name
        value = getattr(obj, f.name)
        normalised = _check_value(value, hints[f.name], key)
        if normalised is not value:
            object.__setattr__(obj, f.name, normalised)


def _require(cond: bool, key: str, detail: str) -> None:
    if not cond:
        raise _error(key, detail)


def _require_min(obj: Any, names: tuple[str, ...], minimum: int) -> None:
    """Each named int field of ``obj`` must be ``>= minimum``."""
    for name in names:
        value = getattr(obj, name)
        _require(value >= minimum, f"{obj.SECTION}.{name}", f"must be >= {minimum}, got {value}")


def _require_choice(obj: Any, name: str, choices: tuple[Any, ...]) -> None:
    value = getattr(obj, name)
    _require(
        value in choices,
        f"{obj.SECTION}.{name}",
        f"expected one of {', '.join('null' if c is None else repr(c) for c in choices)}; "
        f"got {value!r}",
    )


# --------------------------------------------------------------------------- #
# Sections
# --------------------------------------------------------------------------- #


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Process layout: g ranks split into d attention-DP replicas and e expert-parallel shards."""

    SECTION: ClassVar[str] = "parallel"

    # g: number of ranks (one process per GPU, or per simulated CPU rank).
    world_size: int = 1
    # d: attention data-parallel replicas; attention TP width is atp = g // d.
    adp: int = 1
    # e: expert-parallel width; expert TP width is etp = g // e.
    ep: int = 1
    # torch.distributed backend: "auto" (nccl when CUDA is available, else gloo), "gloo" or "nccl".
    backend: str = "auto"
    # Timeout in seconds for collectives and the control plane; > 0.
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _check_field_types(self)
        _require_min(self, ("world_size", "adp", "ep"), 1)
        _require(
            self.world_size % self.adp == 0,
            "parallel.adp",
            f"world_size {self.world_size} is not divisible by adp {self.adp}",
        )
        _require(
            self.world_size % self.ep == 0,
            "parallel.ep",
            f"world_size {self.world_size} is not divisible by ep {self.ep}",
        )
        _require_choice(self, "backend", BACKENDS)
        _require(self.timeout_s > 0, "parallel.timeout_s", f"must be > 0, got {self.timeout_s}")

    @property
    def atp(self) -> int:
        """Attention tensor-parallel width (ranks per attention replica)."""
        return self.world_size // self.adp

    @property
    def etp(self) -> int:
        """Expert tensor-parallel width (ranks sharing each expert)."""
        return self.world_size // self.ep


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of the MoE transformer (megatron-core GPT with MoE layers)."""

    SECTION: ClassVar[str] = "model"

    # Vocabulary size; must be divisible by parallel.atp (vocab-parallel embedding).
    vocab_size: int = 256
    # Model (residual stream) width; divisible by num_attention_heads.
    hidden_size: int = 64
    # Number of transformer layers.
    num_layers: int = 2
    # Query heads per layer.
    num_attention_heads: int = 4
    # GQA key/value groups; num_attention_heads must be divisible by it.
    num_query_groups: int = 2
    # FFN hidden width of each expert.
    moe_ffn_hidden_size: int = 128
    # Routed experts per MoE layer.
    num_experts: int = 8
    # Experts each token is routed to; 1 <= topk <= num_experts.
    moe_router_topk: int = 2
    # Longest position the rotary embedding is built for.
    max_position_embeddings: int = 2048
    # RoPE base frequency; > 0.
    rotary_base: float = 10000.0
    # Normalisation layer: "RMSNorm" or "LayerNorm".
    normalization: str = "RMSNorm"
    # Parameter dtype: "float32", "bfloat16" or "float16".
    params_dtype: str = "float32"
    # Std of the normal weight initialisation; > 0.
    init_method_std: float = 0.02
    # Seed for weight initialisation; >= 0.
    seed: int = 1234
    # Transformer Engine modules: "auto" (when importable), "on" (required) or "off".
    use_te: str = "auto"
    # Expert compute: "grouped" (host-sync-free grouped GEMM; needed for P/D overlap on GPUs),
    # "megatron" (the experts module's own forward; one host sync per MoE layer) or "auto"
    # (grouped on CUDA in bf16 on sm90+, megatron otherwise).
    moe_compute: str = "auto"
    # FP8 recipe: null (off), "hybrid" or "e4m3"; requires use_te != "off".
    fp8: str | None = None

    def __post_init__(self) -> None:
        _check_field_types(self)
        _require_min(
            self,
            (
                "vocab_size",
                "hidden_size",
                "num_layers",
                "num_attention_heads",
                "num_query_groups",
                "moe_ffn_hidden_size",
                "num_experts",
                "moe_router_topk",
                "max_position_embeddings",
            ),
            1,
        )
        _require_min(self, ("seed",), 0)
        _require(
            self.hidden_size % self.num_attention_heads == 0,
            "model.hidden_size",
            f"{self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}",
        )
        _require(
            self.num_attention_heads % self.num_query_groups == 0,
            "model.num_query_groups",
            f"num_attention_heads {self.num_attention_heads} is not divisible by "
            f"num_query_groups {self.num_query_groups}",
        )
        _require(
            self.moe_router_topk <= self.num_experts,
            "model.moe_router_topk",
            f"{self.moe_router_topk} exceeds num_experts {self.num_experts}",
        )
        _require(self.rotary_base > 0, "model.rotary_base", f"must be > 0, got {self.rotary_base}")
        _require(
            self.init_method_std > 0,
            "model.init_method_std",
            f"must be > 0, got {self.init_method_std}",
        )
        _require_choice(self, "normalization", NORMALIZATIONS)
        _require_choice(self, "params_dtype", PARAMS_DTYPES)
        _require_choice(self, "use_te", USE_TE_MODES)
        _require_choice(self, "moe_compute", MOE_COMPUTE)
        _require_choice(self, "fp8", (None, *FP8_FORMATS))
        _require(
            self.fp8 is None or self.use_te != "off",
            "model.fp8",
            f"fp8 {self.fp8!r} requires Transformer Engine, but use_te is 'off'",
        )

    @property
    def head_dim(self) -> int:
        """Per-head width (hidden_size // num_attention_heads)."""
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Per-replica scheduling and KV-cache limits of the rollout engine."""

    SECTION: ClassVar[str] = "engine"

    # Max running sequences (decode rows, D) per replica.
    max_batch_size: int = 32
    # Prefill token budget (P) per iteration per replica.
    max_prefill_tokens: int = 2048
    # Tokens per paged KV-cache block.
    kv_block_size: int = 16
    # KV-cache blocks per replica.
    num_kv_blocks: int = 512
    # Cap on prompt + output tokens of one sequence; <= model.max_position_embeddings.
    max_seq_len: int = 1024
    # Decode graph buckets (rows per replica): strictly increasing, all >= 1, last >= max_batch_size.
    decode_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    # Token id that ends a sequence; null = never stop on EOS.
    eos_token_id: int | None = None
    # Scheduling mode; one of ENGINE_MODES.
    mode: str = "normal"
    # fine mode: boundary intervals P may advance per turnstile round ("fixed"), or chosen per
    # round among segment_spans from D occupancy and P pressure ("load").
    segment_policy: str = "fixed"
    segment_span: int = 2
    segment_spans: list[int] = field(default_factory=lambda: [1, 2, 4])
    # rendezvous implementation: "auto" (shared memory when all ranks share a host), "shm", "gloo"
    rendezvous: str = "auto"
    # GPU, PD modes: "auto" puts P's full-group AllReduce on D's stream where the paths cross
    # (ADP > 1 and ATP > 1); "off" drops that route (the unsafe control of the crossed-path run);
    # "always" routes on every layout (tests the route where paths do not cross).
    stream_route: str = "auto"
    # GPU: record CUDA events around every P segment/epoch and D iteration (timelines).
    cuda_timing: bool = False
    # GPU: D by CUDA-graph replay, one graph per (row bucket, block-table width); needs the
    # grouped expert path (model.moe_compute), otherwise D runs eagerly.
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        _check_field_types(self)
        _require_min(
            self,
            ("max_batch_size", "max_prefill_tokens", "kv_block_size", "num_kv_blocks", "max_seq_len"),
            1,
        )
        buckets = self.decode_buckets
        _require(bool(buckets), "engine.decode_buckets", "must not be empty")
        _require(
            all(b >= 1 for b in buckets),
            "engine.decode_buckets",
            f"all buckets must be >= 1, got {buckets}",
        )
        _require(
            all(a < b for a, b in zip(buckets, buckets[1:])),
            "engine.decode_buckets",
            f"must be sorted strictly increasing, got {buckets}",
        )
        _require(
            buckets[-1] >= self.max_batch_size,
            "engine.decode_buckets",
            f"largest bucket {buckets[-1]} is smaller than max_batch_size {self.max_batch_size}",
        )
        if self.eos_token_id is not None:
            _require(
                self.eos_token_id >= 0,
                "engine.eos_token_id",
                f"must be >= 0 or null, got {self.eos_token_id}",
            )
        _require_choice(self, "mode", ENGINE_MODES)
        _require_choice(self, "segment_policy", SEGMENT_POLICIES)
        _require_choice(self, "stream_route", STREAM_ROUTES)
        _require_choice(self, "rendezvous", ("auto", "shm", "gloo"))
        _require_min(self, ("segment_span",), 1)
        spans = self.segment_spans
        _require(
            bool(spans) and all(k >= 1 for k in spans) and list(spans) == sorted(set(spans)),
            "engine.segment_spans",
            f"must be distinct ascending spans >= 1, got {spans}",
        )


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """The synthetic request mix the demo serves (lengths drawn uniformly in [min, max])."""

    SECTION: ClassVar[str] = "workload"

    # Number of requests to generate.
    num_requests: int = 32
    # Shortest prompt, in tokens.
    prompt_len_min: int = 4
    # Longest prompt, in tokens.
    prompt_len_max: int = 64
    # Fewest tokens to generate per request.
    output_len_min: int = 4
    # Most tokens to generate per request.
    output_len_max: int = 32
    # Sampling temperature; 0 = greedy.
    temperature: float = 0.0
    # Top-k sampling cutoff; 0 = disabled.
    top_k: int = 0
    # Nucleus sampling mass; 0 < top_p <= 1 (1 = disabled).
    top_p: float = 1.0
    # Seed for the request mix and sampling; >= 0.
    seed: int = 0

    def __post_init__(self) -> None:
        _check_field_types(self)
        _require_min(
            self,
            ("num_requests", "prompt_len_min", "prompt_len_max", "output_len_min", "output_len_max"),
            1,
        )
        _require_min(self, ("top_k", "seed"), 0)
        _require(
            self.prompt_len_min <= self.prompt_len_max,
            "workload.prompt_len_min",
            f"{self.prompt_len_min} exceeds prompt_len_max {self.prompt_len_max}",
        )
        _require(
            self.output_len_min <= self.output_len_max,
            "workload.output_len_min",
            f"{self.output_len_min} exceeds output_len_max {self.output_len_max}",
        )
        _require(
            self.temperature >= 0, "workload.temperature", f"must be >= 0, got {self.temperature}"
        )
        _require(0 < self.top_p <= 1, "workload.top_p", f"must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """`colo-rollout bench`: which trace, how it is shrunk to the model, which modes, how often."""

    SECTION: ClassVar[str] = "bench"

    # "synthetic" (the paper's statistics, seeded) or "mooncake" (../shared/traces), or a path
    # to a trace JSONL file.
    trace: str = "synthetic"
    # Conversations taken from the trace (the first N by arrival).
    conversations: int = 16
    # Turns kept per conversation (later turns dropped).
    max_turns: int = 4
    # Multiply prompt/output lengths (shrinks the paper-sized trace for small CPU models).
    length_scale: float = 0.05
    # Client-wait multipliers; one replay per value (0 = the no-wait trace).
    wait_scales: list[float] = field(default_factory=lambda: [0.0])
    # Engine modes to compare; "fine" runs once per span in spans and once with the selector.
    modes: list[str] = field(default_factory=lambda: ["normal", "global_complete",
                                                       "global_enqueue", "fine"])
    # Fixed segment spans for "fine"; the load-selected policy also runs when "fine" is listed.
    spans: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    # Repetitions per cell (medians and IQRs reported).
    reps: int = 3
    # Trace generator seed.
    seed: int = 0
    # Where JSON and plots go.
    out_dir: str = "runs/bench"

    def __post_init__(self) -> None:
        _check_field_types(self)
        _require_min(self, ("conversations", "max_turns", "reps"), 1)
        _require_min(self, ("seed",), 0)
        _require(self.length_scale > 0, "bench.length_scale",
                 f"must be > 0, got {self.length_scale}")
        _require(bool(self.wait_scales) and all(w >= 0 for w in self.wait_scales),
                 "bench.wait_scales", f"must be a non-empty list of values >= 0, got "
                 f"{self.wait_scales}")
        bad = [m for m in self.modes if m not in ENGINE_MODES]
        _require(bool(self.modes) and not bad, "bench.modes",
                 f"unknown mode(s) {bad}; choose from {list(ENGINE_MODES)}")
        _require(bool(self.spans) and all(k >= 1 for k in self.spans), "bench.spans",
                 f"must be spans >= 1, got {self.spans}")


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """`colo-rollout train` / `python -m colo_rollout.rl.train`: colocated GRPO."""

    SECTION: ClassVar[str] = "rl"

    # "grpo" (group-relative advantages) or "ppo" (a value head on the trainer as baseline).
    algorithm: str = "grpo"
    # PPO: weight of the value loss.
    vf_coef: float = 0.5
    # Optimizer steps.
    steps: int = 20
    # Prompts per step; each is sampled samples_per_prompt times (a GRPO group).
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    # Generated tokens per sample.
    max_new_tokens: int = 4
    # Sampling temperature during rollout.
    temperature: float = 1.0
    # Adam learning rate.
    lr: float = 0.01
    # PPO-style ratio clip.
    clip: float = 0.2
    # Weight of the KL term to the initial (reference) policy; 0 = off.
    kl_coef: float = 0.0
    # Trainer tensor-parallel width (trainer DP = world / trainer_tp); may differ from the
    # inference layout: weights are resharded after every step.
    trainer_tp: int = 1
    # The verifiable task: "target_token" (reward = fraction of generated tokens equal to
    # target_token).
    task: str = "target_token"
    target_token: int = 7
    # Prompt lengths are drawn in [2, prompt_len_max]; seed of the prompt stream.
    prompt_len_max: int = 8
    seed: int = 0
    # Metrics JSONL, TensorBoard events and the reward curve go here.
    out_dir: str = "runs/grpo"
    # Engine memory while the trainer runs: "off" (keep everything), "keep" (release KV cache
    # and D graphs), "offload" (also weights, to pinned host memory) or "discard" (also
    # weights; the weight sync after the step refills them).
    release_memory: str = "off"

    def __post_init__(self) -> None:
        _check_field_types(self)
        _require_min(self, ("steps", "prompts_per_step", "samples_per_prompt", "max_new_tokens",
                            "trainer_tp", "prompt_len_max"), 1)
        _require_min(self, ("seed", "target_token"), 0)
        _require(self.lr > 0, "rl.lr", f"must be > 0, got {self.lr}")
        _require(0 < self.clip < 1, "rl.clip", f"must be in (0, 1), got {self.clip}")
        _require(self.kl_coef >= 0, "rl.kl_coef", f"must be >= 0, got {self.kl_coef}")
        _require(self.temperature > 0, "rl.temperature",
                 f"must be > 0 for exploration, got {self.temperature}")
        _require_choice(self, "task", ("target_token",))
        _require_choice(self, "algorithm", ("grpo", "ppo"))
        _require_choice(self, "release_memory", ("off", "keep", "offload", "discard"))
        _require(self.vf_coef >= 0, "rl.vf_coef", f"must be >= 0, got {self.vf_coef}")


@dataclass(frozen=True, kw_only=True)
class Config:
    """A whole rollout job; checks the constraints that span sections.

    (decode_buckets[-1] >= max_batch_size lives in EngineConfig, which owns both keys.)
    """

    SECTION: ClassVar[str] = ""

    # Process layout.
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Model shape and numerics.
    model: ModelConfig = field(default_factory=ModelConfig)
    # Engine limits.
    engine: EngineConfig = field(default_factory=EngineConfig)
    # Synthetic workload.
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    # Trace-replay benchmark.
    bench: BenchConfig = field(default_factory=BenchConfig)
    # Colocated RL training.
    rl: RLConfig = field(default_factory=RLConfig)

    def __post_init__(self) -> None:
        _check_field_types(self)
        par, model, engine, work = self.parallel, self.model, self.engine, self.workload
        atp_desc = f"parallel.atp {par.atp} (world_size {par.world_size} / adp {par.adp})"
        _require(
            model.num_attention_heads % par.atp == 0,
            "model.num_attention_heads",
            f"{model.num_attention_heads} is not divisible by {atp_desc}; ATP shards attention heads",
        )
        _require(
            model.num_query_groups % par.atp == 0,
            "model.num_query_groups",
            f"{model.num_query_groups} is not divisible by {atp_desc}; ATP shards KV groups",
        )
        _require(
            model.vocab_size % par.atp == 0,
            "model.vocab_size",
            f"{model.vocab_size} is not divisible by {atp_desc}; the embedding is vocab-parallel",
        )
        _require(
            model.num_experts % par.ep == 0,
            "model.num_experts",
            f"{model.num_experts} is not divisible by parallel.ep {par.ep}",
        )
        _require(
            engine.max_seq_len <= model.max_position_embeddings,
            "engine.max_seq_len",
            f"{engine.max_seq_len} exceeds model.max_position_embeddings "
            f"{model.max_position_embeddings}",
        )
        if engine.eos_token_id is not None:
            _require(
                engine.eos_token_id < model.vocab_size,
                "engine.eos_token_id",
                f"{engine.eos_token_id} is out of range for model.vocab_size {model.vocab_size}",
            )
        total = work.prompt_len_max + work.output_len_max
        _require(
            total <= engine.max_seq_len,
            "workload.prompt_len_max",
            f"prompt_len_max {work.prompt_len_max} + output_len_max {work.output_len_max} = "
            f"{total} exceeds engine.max_seq_len {engine.max_seq_len}",
        )


# --------------------------------------------------------------------------- #
# dict <-> Config, YAML
# --------------------------------------------------------------------------- #


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from mapping ``data``, recursing into dataclass-typed fields.

    Unknown keys are rejected here; scalar type checks and validation run in
    each class's ``__post_init__``.  ``prefix`` is the dotted key of ``data``.
    """
    where = prefix or "top level"
    if not isinstance(data, Mapping):
        at = "" if prefix else " at the top level"
        raise _error(prefix, f"expected a mapping{at}, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in allowed:
            raise _error(dotted, f"unknown key; allowed keys at {where}: {', '.join(allowed)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            value = _build(tp, value, dotted)
        kwargs[key] = value
    return cls(**kwargs)


def config_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> Config:
    """Build and validate a :class:`Config` from plain nested data (as parsed from YAML).

    Missing keys take their defaults.  Any problem is a :class:`ConfigError`
    whose message starts with ``source``.
    """
    try:
        return _build(Config, data, "")
    except ConfigError as err:
        raise _with_source(err, source) from err


def _apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """Set each dotted key of ``overrides`` in nested ``data`` (in place), checking it exists."""
    for dotted, value in overrides.items():
        if not isinstance(dotted, str) or not dotted:
            raise _error(repr(dotted), "override keys must be non-empty dotted strings")
        parts = dotted.split(".")
        cls: Any = Config
        node = data
        for depth, part in enumerate(parts):
            names = [f.name for f in dataclasses.fields(cls) if f.init]
            if part not in names:
                where = ".".join(parts[:depth]) or "top level"
                raise _error(
                    dotted, f"unknown override key; allowed keys at {where}: {', '.join(names)}"
                )
            if depth == len(parts) - 1:
                node[part] = copy.deepcopy(value)
                break
            sub_cls = typing.get_type_hints(cls)[part]
            if not dataclasses.is_dataclass(sub_cls):
                raise _error(dotted, f"{'.'.join(parts[: depth + 1])} is not a section")
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                # Leave it for _build to report as "expected a mapping".
                break
            cls, node = sub_cls, child


def load_config(path: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> Config:
    """Load a YAML config file, apply dotted-key ``overrides``, and validate it.

    ``overrides`` maps dotted keys to values, e.g. ``{"parallel.world_size": 4}``.
    Raises :class:`ConfigError` (message prefixed with the file path) for
    unreadable files, YAML syntax errors, unknown keys, wrong types and
    failed validation.
    """
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise ConfigError(
            f"{source}: cannot read config file: {err.strerror or err}", source=source
        ) from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: {_yaml_error_text(err)}", source=source) from err
    if not isinstance(data, dict):
        got = "an empty document" if data is None else _describe(data)
        raise ConfigError(
            f"{source}: expected a mapping at the top level, got {got}", source=source
        )
    if overrides:
        try:
            _apply_overrides(data, overrides)
        except ConfigError as err:
            raise _with_source(err, source) from err
    return config_from_dict(data, source=source)


def _yaml_error_text(err: yaml.YAMLError) -> str:
    """``line L, column C: invalid YAML: <problem>`` (1-based) for a PyYAML error."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        problem = err.problem or err.context or "syntax error"
        if mark is not None:
            return f"line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {problem}"
        return f"invalid YAML: {problem}"
    return f"invalid YAML: {err}"


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of ``cfg`` (like dataclasses.asdict); config_from_dict inverts it."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write ``cfg`` as YAML to ``path``; ``load_config(path) == cfg`` afterwards."""
    with open(os.fspath(path), "w", encoding="utf-8") as fh:
        yaml.safe_dump(config_to_dict(cfg), fh, sort_keys=False, default_flow_style=False)
