"""The sections of a run configuration: parallel layout, model, engine, workload, bench, RL.

Each section is a frozen dataclass whose ``__post_init__`` checks its own keys (types via the
annotations, then value rules); errors name the dotted key. Cross-section rules live in
``loader.Config``.
"""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

from colo_rollout.config.checks import (
    _check_field_types,
    _require,
    _require_choice,
    _require_min,
    _require_seed,
    _short,
)

BACKENDS = ("auto", "gloo", "nccl")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
PARAMS_DTYPES = ("float32", "bfloat16", "float16")
USE_TE_MODES = ("auto", "on", "off")
MOE_COMPUTE = ("auto", "grouped", "megatron")
# MoE token dispatch (model/dispatch.py): "gather" (every rank computes every replica's rows,
# GatherComm), "alltoall" (torch.distributed all-to-all of each rank's own rows), "deepep"
# (model/deepep.py: DeepEP normal mode for P, low-latency for D)
MOE_DISPATCH = ("gather", "alltoall", "deepep")
# What DeepEP V1 (567632d) can run: its low-latency kernels' hidden sizes and top-k
# (csrc/kernels/launch.cuh, internode_ll.cu), its intranode kernels' rank counts (EP 1: D
# only, P has no peer)
DEEPEP_LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
DEEPEP_LL_MAX_TOPK = 11
DEEPEP_EP_SIZES = (1, 2, 4, 8)


def trainer_tp_widths(model: "ModelConfig", ep: int = 1) -> dict[str, int]:
    """The model widths a trainer TP group splits (keyed by their ``model.`` key): heads, KV
    groups, the vocabulary (vocab-parallel embedding), the dense and shared-expert FFNs, and
    the experts' FFN only at EP 1 (expert TP = TP there; with EP the experts are whole). The
    door (config/loader.py) and the trainer (rl/trainer.py) both refuse a TP that leaves a
    remainder in one of them."""
    widths = {"model.num_attention_heads": model.num_attention_heads,
              "model.num_query_groups": model.num_query_groups,
              "model.vocab_size": model.vocab_size}
    if ep == 1:
        widths["model.moe_ffn_hidden_size"] = model.moe_ffn_hidden_size
    if model.has_dense_layers:
        widths["model.ffn_hidden_size"] = model.dense_ffn_hidden_size
    if model.shared_expert_ffn_hidden_size is not None:
        widths["model.shared_expert_ffn_hidden_size"] = model.shared_expert_ffn_hidden_size
    if model.attention == "mla":  # megatron's column-parallel down projections' rows
        if model.q_lora_rank is not None:
            widths["model.q_lora_rank"] = model.q_lora_rank
        widths["model.kv_lora_rank + qk_rope_head_dim"] = (model.kv_lora_rank
                                                           + model.qk_rope_head_dim)
    return widths


def deepep_layout_problem(ep: int, hidden: int, topk: int) -> str | None:
    """Why this EP size / hidden size / top-k cannot run the deepep backend (None: it can)."""
    if ep not in DEEPEP_EP_SIZES:
        return f"DeepEP's intranode kernels take 2, 4 or 8 EP ranks (or 1), not {ep}"
    if hidden not in DEEPEP_LL_HIDDEN:
        return (f"DeepEP's low-latency kernels (D) take hidden sizes "
                f"{', '.join(map(str, DEEPEP_LL_HIDDEN))}; model.hidden_size is {hidden}")
    if topk > DEEPEP_LL_MAX_TOPK:
        return (f"DeepEP's low-latency kernels take top-k <= {DEEPEP_LL_MAX_TOPK}; "
                f"model.moe_router_topk is {topk}")
    return None


def normalization_problem(cfg: "ModelConfig") -> str | None:
    """Why the engine cannot serve ``cfg``'s normalisation, or None: its norm kernels, random
    weights and checkpoint names are RMSNorm's (found by probing: LayerNorm passed the config
    check, then every command failed on the norms' missing biases)."""
    if cfg.normalization == "RMSNorm":
        return None
    return (f"{cfg.normalization!r} is not served by the engine (its norms, weights and "
            "checkpoints are RMSNorm's, as every supported family's): use RMSNorm")


def batch_invariance_problem(model: "ModelConfig") -> str | None:
    """Why engine.batch_invariant cannot hold for this model (None: it can): a combine or
    GEMMs that pick their order or algorithm by the row count (model/batch_invariant.py; D's
    sums across ranks go in rank order under the option, model/comm.py)."""
    if model.moe_dispatch == "deepep":
        return ("DeepEP's low-latency combine is not shown batch-invariant; set "
                "model.moe_dispatch: alltoall or gather")
    if model.fp8 is not None:
        return "the FP8 GEMMs (torch._scaled_mm) pick their algorithm by the row count"
    if model.use_te == "on":
        return ("Transformer Engine's GEMMs are cuBLAS's, picked by the row count; set "
                "model.use_te: auto or off")
    if model.moe_compute == "megatron":
        return "megatron's expert path has no batch-invariant form; set model.moe_compute: auto"
    if model.attention == "mla":
        return "MLA's attention has no batch-invariant form yet (attention 'mla')"
    return None


STREAM_ROUTES = ("auto", "off", "always")
STREAM_PRIORITIES = ("decode", "prefill", "equal")
PREFILL_GRAPHS = ("auto", "always", "never")
FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("rowwise", "blockwise", "tensorwise")  # model/fp8.py, model/fp8_te.py
# who runs the dense FP8 GEMMs (attention projections, dense MLPs, shared experts): the
# engine's own (torch._scaled_mm / the fused-MoE kernel) or Transformer Engine's
FP8_BACKENDS = ("engine", "te")
# the recipes each backend has: TE names tensorwise Float8CurrentScaling and blockwise
# Float8BlockScaling; the engine's kernels scale per row or per block
FP8_BACKEND_RECIPES = {"engine": ("rowwise", "blockwise"), "te": ("tensorwise", "blockwise")}
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89), Hopper (sm90) and later
# bench.length_scale and bench.wait_scales: the largest factor (lengths, client waits)
MAX_SCALE = 1000.0
# engine.prefill_attention "flash": the compute capabilities (major) FlashAttention-4's
# forward is used on -- Hopper (measured) and Blackwell's datacenter parts (its other main
# target) -- and the largest head dim it takes
FLASH_MAJORS = (9, 10)
FLASH_MAX_HEAD_DIM = 256
# engine.prefill_attention "cudnn": the oldest cuDNN (torch.backends.cudnn.version()) whose
# fused attention it calls (model/dense_prefill.py; measured with 9.19 on one H200)
CUDNN_MIN_VERSION = 90000
FP8_ROW_MULTIPLE = 16  # the FP8 GEMMs' dimension multiple (torch._scaled_mm)
FP8_BLOCK = 128  # the blockwise recipe's scale block (1 x 128 inputs, 128 x 128 weights)
ROUTER_SCORES = ("softmax", "sigmoid")
ROPE_SCALINGS = (None, "llama3", "yarn")
ATTENTIONS = ("gqa", "mla")
# the model keys only attention "mla" reads
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# normal: strict P priority, no multiplexing. The ordering ladder of P/D multiplexing (PD mode):
# global_complete (whole-P epoch, D only after P completes), global_enqueue (whole-P epoch, D
# after all ranks host-enqueued it), fine (segment turnstile: D at every K boundaries).
ENGINE_MODES = ("normal", "global_complete", "global_enqueue", "fine")
SEGMENT_POLICIES = ("fixed", "load", "balanced")
# parallel.timeout_s at most a day: every host wait is bounded by it (torch's timedelta and
# threading waits overflow far above that, and a wait of a day is a hang)
MAX_TIMEOUT_S = 86_400.0
# float32's largest finite value and smallest normal one (the trainer's arithmetic)
FP32_MAX = 3.4028234663852886e38
FP32_TINY = 1.1754943508222875e-38

# bench-speed's repeat counts (iters, warmup, profile steps) at most this
MAX_BENCH_REPEATS = 10_000
# ... and at least this: the ranks' gloo connections need it to form (0.001 s failed inside
# gloo's mesh set-up after the ranks started)
MIN_TIMEOUT_S = 0.5



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
    # Timeout in seconds for collectives and the control plane; in (0, MAX_TIMEOUT_S].
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
        _require(MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S, "parallel.timeout_s",
                 f"must be a number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] (the "
                 "ranks' connections need the least to form; a collective waiting a day has "
                 f"hung), got {self.timeout_s!r}")

    @property
    def atp(self) -> int:
        """Attention tensor-parallel width (ranks per attention replica)."""
        return self.world_size // self.adp

    @property
    def etp(self) -> int:
        """Expert tensor-parallel width (ranks sharing each expert)."""
        return self.world_size // self.ep


# model.max_position_embeddings' bound: 16M positions (the longest real contexts are ~10M; the
# fp32 angle table alone is then ~4 GB). Found by probing: 10^20 passed the door and failed
# building the rotary table in every rank
MAX_POSITIONS = 2**24


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of the MoE transformer (megatron-core GPT with MoE layers)."""

    SECTION: ClassVar[str] = "model"

    # Hugging Face checkpoint directory (config.json + safetensors). When set, the architecture
    # fields below come from its config.json (config/hf_config.py; a field set here that
    # contradicts it is an error naming both) and Engine(cfg, groups) loads the weights itself,
    # each rank reading only its slices. params_dtype still comes from here.
    checkpoint: str | None = None
    # Vocabulary size; must be divisible by parallel.atp (vocab-parallel embedding).
    vocab_size: int = 256
    # Model (residual stream) width.
    hidden_size: int = 64
    # Number of transformer layers.
    num_layers: int = 2
    # Query heads per layer.
    num_attention_heads: int = 4
    # GQA key/value groups; num_attention_heads must be divisible by it.
    num_query_groups: int = 2
    # Per-head width (megatron's kv_channels); null = hidden_size // num_attention_heads.
    # attention "mla": the query/key head width, qk_nope_head_dim + qk_rope_head_dim (null or
    # that value).
    head_dim: int | None = None
    # Attention: "gqa" (megatron's SelfAttention: query heads over num_query_groups key/value
    # heads) or "mla" (multi-head latent attention, DeepSeek-V2/V3 / Kimi-K2: megatron's
    # MLASelfAttention -- queries through a q_lora_rank bottleneck, keys and values
    # decompressed per head from one kv_lora_rank latent per token, which is what the KV cache
    # holds beside the token's rotated qk_rope_head_dim key; model/mla_attention.py). With
    # "mla": num_query_groups = num_attention_heads, qk_layernorm true (the latents' RMSNorms),
    # whole-head RoPE (rotary_percent 1; no llama3 scaling: megatron's MLA has rope or yarn).
    attention: str = "gqa"
    # mla: the query bottleneck's width (megatron q_lora_rank); null = a full-rank query
    # projection (linear_q_proj; DeepSeek-V2-Lite).
    q_lora_rank: int | None = None
    # mla: the key/value latent's width (megatron kv_lora_rank).
    kv_lora_rank: int = 512
    # mla: per-head widths -- the query/key part without RoPE (megatron qk_head_dim), the
    # rotated part (megatron qk_pos_emb_head_dim; one key per token shared by the heads) and
    # the value head (megatron v_head_dim).
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # RMSNorm on each head's queries and keys before RoPE (Qwen3-MoE; megatron qk_layernorm).
    qk_layernorm: bool = False
    # Epsilon of every norm (megatron layernorm_epsilon; HF rms_norm_eps).
    norm_epsilon: float = 1e-5
    # Bias on the q, k and v projections (Qwen2-MoE, GLM-4.5; megatron add_qkv_bias).
    qkv_bias: bool = False
    # The output layer reuses the embedding matrix (megatron share_embeddings_and_output_weights).
    tie_embeddings: bool = False
    # FFN hidden width of each routed expert.
    moe_ffn_hidden_size: int = 128
    # Routed experts per MoE layer.
    num_experts: int = 8
    # Experts each token is routed to; 1 <= topk <= num_experts.
    moe_router_topk: int = 2
    # Router score: "softmax" or "sigmoid" (DeepSeek-V3 / GLM-4.5 style).
    router_score: str = "softmax"
    # Renormalise the top-k probabilities to sum to 1 (HF norm_topk_prob). softmax: true = top-k
    # of the logits then softmax over them (megatron pre_softmax false), false = softmax over all
    # experts, then top-k (pre_softmax true). sigmoid: megatron always renormalises (top-k > 1).
    router_norm_topk: bool = True
    # sigmoid: a per-expert score-correction bias added to the scores for the top-k choice only
    # (HF e_score_correction_bias; megatron expert_bias: a buffer, not a trained parameter).
    router_expert_bias: bool = False
    # Multiplies the routing probabilities (HF routed_scaling_factor); 1.0 = none.
    router_scaling_factor: float = 1.0
    # Group-limited routing: experts in router_num_groups groups, each token picks
    # router_group_topk groups by the sum of its top-(topk / group_topk) scores per group, then
    # its top-k experts inside them. null = off (both null).
    router_num_groups: int | None = None
    router_group_topk: int | None = None
    # Shared experts (every token, beside the routed ones): their total FFN width; null = none.
    shared_expert_ffn_hidden_size: int | None = None
    # Scale the shared experts' output by sigmoid(x . w_gate) (Qwen2-MoE shared_expert_gate).
    shared_expert_gate: bool = False
    # The first k layers have a dense MLP of width ffn_hidden_size instead of MoE (DeepSeek/GLM).
    first_k_dense: int = 0
    # Further layers (0-based indices, increasing) with a dense MLP instead of MoE: Qwen's
    # mlp_only_layers and decoder_sparse_step (megatron's moe_layer_freq pattern).
    dense_layers: list[int] = field(default_factory=list)
    # FFN width of the dense layers (first_k_dense, dense_layers); null = moe_ffn_hidden_size.
    ffn_hidden_size: int | None = None
    # Longest position the rotary embedding is built for.
    max_position_embeddings: int = 2048
    # RoPE base frequency; > 0.
    rotary_base: float = 10000.0
    # Fraction of each head's dims that RoPE rotates (GLM-4.5: 0.5); in (0, 1].
    rotary_percent: float = 1.0
    # RoPE frequency scaling: null, "llama3" (megatron's rope_scaling, by rope_scaling_factor)
    # or "yarn" (megatron's YarnRotaryEmbedding: the factor is rope_scaling_factor, the rest
    # below; transformers' rope_type yarn).
    rope_scaling: str | None = None
    rope_scaling_factor: float = 8.0
    # YaRN: the context the model was pretrained for (its correction range), the ramp's
    # rotation bounds, and the attention factor's mscale / mscale_all_dim (cos and sin scaled by
    # (0.1 mscale ln f + 1) / (0.1 mscale_all_dim ln f + 1) for factor f > 1); truncate rounds
    # the correction range to whole dims. Megatron's names without the yarn_ prefix.
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_truncate: bool = True
    # Normalisation layer: "RMSNorm" or "LayerNorm" (megatron's; the trainer's models take
    # either, the engine serves RMSNorm -- every supported family's -- only:
    # ``normalization_problem``).
    normalization: str = "RMSNorm"
    # Parameter dtype: "float32", "bfloat16" or "float16".
    params_dtype: str = "float32"
    # Std of the normal weight initialisation; > 0.
    init_method_std: float = 0.02
    # Seed of the random weights (without a checkpoint) and of the sampler: each replica's
    # generator is seeded from it (seed * 1_000_003 + replica), the one seed of every
    # sampled draw (there is no per-request seed); >= 0.
    seed: int = 1234
    # Transformer Engine's layers in the engine: "on" (required: TE's fused norm + QKV,
    # grouped-GEMM experts, like megatron's TE spec) or "auto" / "off" (the local spec, which
    # the engine's own fused kernels run: faster on the H200, and the RL trainer's spec --
    # model/model.py resolve_use_te says why "auto" is not TE where it is importable). Quote
    # 'on' / 'off' in YAML (unquoted, YAML 1.1 reads them as bools: refused with that hint).
    use_te: str = "auto"
    # Expert compute: "grouped" (host-sync-free grouped GEMM; needed for P/D overlap on GPUs),
    # "megatron" (the experts module's own forward; one host sync per MoE layer) or "auto"
    # (grouped on CUDA in bf16 on sm90+, megatron otherwise).
    moe_compute: str = "auto"
    # MoE token dispatch: "gather" (default), "alltoall" (needs parallel.ep == world_size) or
    # "deepep" (GPU, the deep_ep package built with scripts/deepep_setup.sh; ep == world_size
    # in 1, 2, 4, 8; hidden_size one of DeepEP's low-latency sizes; model/deepep.py).
    moe_dispatch: str = "gather"
    # deepep: the SMs P's normal-mode dispatch/combine kernels may occupy (even, >= 2).
    deepep_p_sms: int = 20
    # alltoall's D capacity: (token, expert) pairs per peer per layer; 0 = the worst case
    # (rows x min(top-k, experts per rank)), which cannot overflow. A smaller value that
    # overflows raises (naming rank, layer and counts) and cannot be captured in a D graph.
    moe_dispatch_capacity: int = 0
    # FP8 rollouts: null (off), "e4m3" or "hybrid" (TE's name for e4m3 forward / e5m2
    # gradients: a rollout is forward only, so the same). The engine's GEMMs -- attention
    # projections, routed and shared experts, dense MLPs -- run e4m3 operands with fp32
    # accumulation (model/fp8.py); embedding, router, norms, attention and the output layer
    # stay in params_dtype (bfloat16), and so do the weights weight sync writes (the FP8
    # copies are re-quantised after every write). The trainer and the megatron reference do
    # not read this key. Needs a CUDA GPU with FP8 tensor cores (sm89+) and params_dtype
    # "bfloat16" (both checked at the door and at model build); the engine then runs
    # the local layer spec whatever use_te says ("on" is refused at the door: the FP8 GEMMs
    # read the weights directly, TE's modules would not run).
    fp8: str | None = None
    # How FP8 operands are scaled: "rowwise" -- each GEMM input row (token, or MoE pair) by its
    # own amax, each weight output channel by its own; "blockwise" -- each input row's every
    # 128 columns and each weight's every 128 x 128 block by its own (DeepSeek-V3's, megatron /
    # TE's Float8BlockScaling: every FP8 GEMM dimension a multiple of 128). Both computed from
    # the current tensors (no calibration, nothing lags a weight update). "tensorwise" (with
    # fp8_backend te only): Transformer Engine's Float8CurrentScaling -- one scale per GEMM
    # input tensor and one per weight -- for the dense GEMMs; the routed experts then run the
    # engine's rowwise kernel (TE's grouped GEMM cannot be captured in D's graphs here).
    fp8_recipe: str = "rowwise"
    # Who runs the dense FP8 GEMMs (attention projections, dense MLPs, shared experts):
    # "engine" (torch._scaled_mm / the engine's Triton kernel) or "te" -- Transformer Engine's
    # quantizers and cuBLASLt GEMM under fp8_recipe's TE recipe (tensorwise:
    # Float8CurrentScaling, blockwise: Float8BlockScaling), the numerics of a TE FP8 layer;
    # needs transformer_engine[pytorch] importable on an FP8 GPU (model/fp8_te.py). The
    # routed experts stay on the engine's FP8 kernel either way (model/fused_moe.py).
    fp8_backend: str = "engine"
    # Multi-token prediction layers after the decoder (megatron's mtp_num_layers; DeepSeek-V3 /
    # GLM-4.5's num_nextn_predict_layers): 0 = none, 1 = one MTP layer (enorm, hnorm, eh_proj,
    # a transformer layer of the last decoder layer's kind, final norm; embedding and output
    # layer shared with the model). engine.mtp drafts with it. More than 1 is refused: one
    # draft token per D iteration.
    mtp_num_layers: int = 0

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
        _require(self.max_position_embeddings <= MAX_POSITIONS, "model.max_position_embeddings",
                 f"{_short(self.max_position_embeddings)} positions: at most {MAX_POSITIONS} "
                 "(the rotary tables hold a row per position, built with the model)")
        _require_min(self, ("first_k_dense", "mtp_num_layers"), 0)
        _require_seed(self)
        _require(self.mtp_num_layers <= 1, "model.mtp_num_layers",
                 f"{self.mtp_num_layers} MTP layers: at most 1 is supported (one draft token "
                 "per D iteration)")
        _require_choice(self, "attention", ATTENTIONS)
        if self.attention == "mla":
            self._check_mla()
        else:  # MLA's keys would be ignored: a model section that sets one means MLA
            for f in dataclasses.fields(self):
                if f.name in MLA_KEYS and getattr(self, f.name) != f.default:
                    _require(False, f"model.{f.name}",
                             f"{getattr(self, f.name)!r} is a multi-head latent attention "
                             "width: set model.attention: mla, or leave it out")
        if self.head_dim is None:
            _require(
                self.hidden_size % self.num_attention_heads == 0,
                "model.hidden_size",
                f"{self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads} (set model.head_dim for another head width)",
            )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        _require(self.is_mla or (self.head_dim >= 2 and self.head_dim % 2 == 0),
                 "model.head_dim",
                 f"must be an even number >= 2 (RoPE rotates pairs), got {self.head_dim}")
        for name in ("ffn_hidden_size", "shared_expert_ffn_hidden_size", "router_num_groups",
                     "router_group_topk"):
            v = getattr(self, name)
            _require(v is None or v >= 1, f"model.{name}", f"must be >= 1 or null, got {v}")
        _require(self.first_k_dense < self.num_layers, "model.first_k_dense",
                 f"{self.first_k_dense} leaves no MoE layer of num_layers {self.num_layers}")
        d = self.dense_layers
        _require(all(0 <= i < self.num_layers for i in d) and list(d) == sorted(set(d)),
                 "model.dense_layers", f"{d}: expected increasing layer indices in "
                 f"[0, num_layers {self.num_layers})")
        _require(any(self.is_moe_layer(i) for i in range(self.num_layers)),
                 "model.dense_layers", f"{d} with first_k_dense {self.first_k_dense} leaves no "
                 f"MoE layer of num_layers {self.num_layers}")
        _require(self.norm_epsilon > 0, "model.norm_epsilon",
                 f"must be > 0, got {self.norm_epsilon}")
        _require(0 < self.rotary_percent <= 1, "model.rotary_percent",
                 f"must be in (0, 1], got {self.rotary_percent}")
        if self.is_mla:
            rot = self.rope_dim()
            _require(rot == int(rot) and int(rot) % 2 == 0, "model.rotary_percent",
                     f"head_dim {self.head_dim} x {self.rotary_percent} = {rot} is not an even "
                     "number of dims")
        else:
            # megatron's RotaryEmbedding and transformers' default RoPE alike: int(head_dim x
            # percent) frequencies' worth -- arange(0, dim, 2) / dim -- each rotating a pair, so
            # a width that is not even rotates the next even number of dims (found by probing:
            # GLM's 0.6 of 16 was refused; transformers serves it)
            _require(int(self.head_dim * self.rotary_percent) >= 1, "model.rotary_percent",
                     f"head_dim {self.head_dim} x {self.rotary_percent} leaves no rotary dim")
        _require_choice(self, "rope_scaling", ROPE_SCALINGS)
        _require(self.rope_scaling_factor > 0, "model.rope_scaling_factor",
                 f"must be > 0, got {self.rope_scaling_factor}")
        if self.rope_scaling == "yarn":
            # megatron's YarnRotaryEmbedding builds its frequencies over the whole head
            # (kv_channels) whatever rotary_percent says: a partial rotary would not be
            # transformers' (nor megatron's own partial) RoPE
            _require(self.rotary_percent == 1, "model.rotary_percent",
                     f"{self.rotary_percent} with rope_scaling yarn: megatron-core's YaRN "
                     "rotates whole heads (1.0)")
            _require(self.yarn_original_max_position_embeddings >= 1,
                     "model.yarn_original_max_position_embeddings",
                     f"must be >= 1, got {self.yarn_original_max_position_embeddings}")
            for key in ("yarn_beta_fast", "yarn_beta_slow"):
                _require(math.isfinite(getattr(self, key)) and getattr(self, key) > 0,
                         f"model.{key}", f"must be > 0, got {getattr(self, key)}")
            for key in ("yarn_mscale", "yarn_mscale_all_dim"):
                _require(math.isfinite(getattr(self, key)), f"model.{key}",
                         f"must be a finite number, got {getattr(self, key)}")
            if self.rope_scaling_factor > 1:
                den = 0.1 * self.yarn_mscale_all_dim * math.log(self.rope_scaling_factor) + 1
                _require(den > 0, "model.yarn_mscale_all_dim",
                         f"{self.yarn_mscale_all_dim} makes the attention factor's "
                         "denominator <= 0")
        _require_choice(self, "router_score", ROUTER_SCORES)
        _require(self.router_scaling_factor > 0, "model.router_scaling_factor",
                 f"must be > 0, got {self.router_scaling_factor}")
        _require(not self.router_expert_bias or self.router_score == "sigmoid",
                 "model.router_expert_bias",
                 "the score-correction bias needs router_score 'sigmoid' (megatron's rule)")
        _require(self.router_norm_topk or self.router_score == "softmax"
                 or self.moe_router_topk == 1, "model.router_norm_topk",
                 "false with router_score 'sigmoid' is not in megatron (its sigmoid router always "
                 "renormalises the top-k scores)")
        # megatron's TransformerConfig: "Please use --moe-router-pre-softmax when topk is 1"
        # (a softmax over one logit has no gradient); renormalised softmax top-k is its
        # pre_softmax false (model/model.py: megatron_config)
        _require(not (self.moe_router_topk == 1 and self.router_score == "softmax"
                      and self.router_norm_topk), "model.router_norm_topk",
                 "true with moe_router_topk 1 and router_score 'softmax' is refused by megatron "
                 "(it needs the softmax over all experts before the top-1, moe_router_pre_softmax; "
                 "renormalising one score would always give 1.0): set router_norm_topk: false "
                 "(the top-1 expert then gets its softmax probability, as in HF with "
                 "norm_topk_prob false)")
        _require((self.router_num_groups is None) == (self.router_group_topk is None),
                 "model.router_group_topk",
                 "set both router_num_groups and router_group_topk, or neither")
        if self.router_num_groups is not None:
            g, k = self.router_num_groups, self.router_group_topk
            _require(self.num_experts % g == 0, "model.router_num_groups",
                     f"num_experts {self.num_experts} is not divisible by {g} groups")
            _require(k <= g, "model.router_group_topk", f"{k} exceeds router_num_groups {g}")
            _require(self.moe_router_topk % k == 0, "model.router_group_topk",
                     f"moe_router_topk {self.moe_router_topk} is not divisible by {k} (megatron "
                     "scores each group by its top-(topk / group_topk) experts)")
            _require(self.moe_router_topk // k <= self.num_experts // g,
                     "model.router_group_topk",
                     f"top-{self.moe_router_topk // k} per group exceeds the "
                     f"{self.num_experts // g} experts of a group")
        _require(not self.shared_expert_gate or self.shared_expert_ffn_hidden_size is not None,
                 "model.shared_expert_gate", "needs shared_expert_ffn_hidden_size (no shared "
                 "experts to gate)")
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
        _require_choice(self, "moe_dispatch", MOE_DISPATCH)
        _require(self.deepep_p_sms >= 2 and self.deepep_p_sms % 2 == 0, "model.deepep_p_sms",
                 f"must be even and >= 2 (DeepEP runs one channel on two SMs), got "
                 f"{self.deepep_p_sms}")
        _require_min(self, ("moe_dispatch_capacity",), 0)
        _require_choice(self, "fp8", (None, *FP8_FORMATS))
        _require_choice(self, "fp8_recipe", FP8_RECIPES)
        _require_choice(self, "fp8_backend", FP8_BACKENDS)
        recipes = FP8_BACKEND_RECIPES[self.fp8_backend]
        _require(self.fp8_recipe in recipes, "model.fp8_recipe",
                 f"{self.fp8_recipe!r} is not a recipe of model.fp8_backend "
                 f"{self.fp8_backend!r} (its recipes: {', '.join(recipes)})"
                 + ("; 'tensorwise' is Transformer Engine's Float8CurrentScaling: set "
                    "model.fp8_backend: te" if self.fp8_recipe == "tensorwise" else
                    "; Transformer Engine has no per-row FP8 recipe (rowwise is "
                    "model.fp8_recipe's default: name one of te's beside model.fp8_backend)"
                    if self.fp8_recipe == "rowwise" else ""))

    def _check_mla(self) -> None:
        """attention "mla": the latent widths, and what megatron's MLASelfAttention fixes."""
        _require_min(self, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                            "v_head_dim"), 1)
        _require(self.q_lora_rank is None or self.q_lora_rank >= 1, "model.q_lora_rank",
                 f"must be >= 1 or null (a full-rank query projection), got {self.q_lora_rank}")
        _require(self.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim",
                 f"must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        q_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        _require(self.head_dim in (None, q_head), "model.head_dim",
                 f"{self.head_dim} with attention 'mla': the query/key head width is "
                 f"qk_nope_head_dim + qk_rope_head_dim = {q_head} (leave head_dim null)")
        object.__setattr__(self, "head_dim", q_head)
        _require(self.num_query_groups == self.num_attention_heads, "model.num_query_groups",
                 f"{self.num_query_groups} with attention 'mla': every head has its own key "
                 f"and value (set it to num_attention_heads {self.num_attention_heads})")
        _require(self.qk_layernorm, "model.qk_layernorm",
                 "false with attention 'mla': MLA normalises its query and key/value latents "
                 "(megatron's q_layernorm / kv_layernorm): set it true")
        _require(self.rotary_percent == 1, "model.rotary_percent",
                 f"{self.rotary_percent} with attention 'mla': RoPE rotates the whole "
                 "qk_rope_head_dim part (1.0)")
        _require(self.rope_scaling != "llama3", "model.rope_scaling",
                 "'llama3' with attention 'mla': megatron's MLA has plain RoPE or YaRN")
        _require(not self.qkv_bias, "model.qkv_bias",
                 "true with attention 'mla': megatron's MLA projections have no bias")
        _require(self.use_te != "on", "model.use_te",
                 "'on' with attention 'mla': the engine's MLA runs the local layer spec")
        _require(self.rope_scaling != "yarn" or self.yarn_truncate, "model.yarn_truncate",
                 "false with attention 'mla': megatron's MLA YaRN rounds the correction range "
                 "to whole dims")

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    def rope_dim(self) -> int:
        """The dims RoPE rotates per head: qk_rope_head_dim (MLA), head_dim x
        rotary_percent (GQA)."""
        return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.rotary_percent)

    def kv_cache_elems(self, atp: int = 1) -> int:
        """Cache elements per token and layer on one rank: K and V of its ATP share of the
        key/value heads (GQA), or the latent and the rotated key (MLA, one per token)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * (self.num_query_groups // atp) * self.head_dim

    @property
    def dense_ffn_hidden_size(self) -> int:
        """FFN width of the dense layers (first_k_dense, dense_layers)."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else self.moe_ffn_hidden_size

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (0-based) has routed experts; the first first_k_dense and the
        dense_layers are dense MLPs."""
        return i >= self.first_k_dense and i not in self.dense_layers

    @property
    def has_dense_layers(self) -> bool:
        return bool(self.first_k_dense or self.dense_layers)


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
    # Cap on prompt + output tokens of one sequence; <= model.max_position_embeddings (unset
    # with model.checkpoint: at most the checkpoint's max_position_embeddings).
    max_seq_len: int = 1024
    # How a sequence's KV blocks are held: "full" = prompt + max_tokens reserved at admission
    # (admitted work is never preempted; a long max_tokens caps the running rows at
    # capacity / (prompt + max_tokens)); "on_demand" = the prompt's blocks at admission, one
    # more as a row's next token needs it, one free block per growing sequence kept before
    # a new admission; when a replica runs out, idle retained contexts go first, then the
    # running row that arrived last is preempted: its blocks freed, re-queued first, its
    # prompt and tokens so far prefilled again when blocks free up (vLLM's recompute
    # preemption; its output continues where it stopped; counted in Scheduler.preemptions).
    # A request whose context + prompt + max_tokens exceeds max_prefill_tokens (one P step
    # could not prefill it again) takes its whole budget at admission and is never preempted.
    kv_reservation: str = "full"
    # Decode graph buckets (rows per replica): strictly increasing, all >= 1, last >= max_batch_size.
    decode_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    # Token id that ends a sequence; null = never stop on EOS. Unset with model.checkpoint:
    # the checkpoint's (generation_config.json's eos_token_id, else config.json's: as
    # transformers' generate stops); an explicit null keeps it off.
    eos_token_id: int | None = None
    # Further token ids that end a sequence (a checkpoint's other eos ids, e.g. Llama-3's
    # <|eot_id|> beside <|end_of_text|>; unset with model.checkpoint: the checkpoint's eos ids
    # after the first); a request's ignore_eos ignores them too.
    stop_token_ids: list[int] = field(default_factory=list)
    # Routing replay's rollout side: record the top-k expert ids of every token at every MoE
    # layer, in P and in D (D graphs write them to static buffers); rollout() returns them per
    # trajectory (Trajectory.routing) for rl.routing_replay.
    record_routing: bool = False
    # Speculative decoding with the model's MTP layer (model.mtp_num_layers = 1): every D
    # iteration verifies the last draft and drafts the next token in one forward (2 rows per
    # sequence), so a D iteration emits 1 or 2 tokens; sampled rows accept the draft exactly
    # when the target's own sample equals it (the output distribution is the target's).
    mtp: bool = False
    # Batch-invariant D iterations (model/batch_invariant.py): a row's logits independent of
    # the rows beside it (D's GEMMs on fixed Triton tiles, attention splits at fixed
    # positions, expert tiles never the prefill regime's), so greedy streams are the same at
    # any D batch size and with or without MTP, in bf16 too (P is not: a prompt's KV follows
    # its P batch's GEMMs). D steps 0-5% slower on an H200
    # (docs/benchmarks.md); D's sums across ranks in rank order; P unchanged. Refused where a
    # kernel cannot be made so (batch_invariance_problem).
    batch_invariant: bool = False
    # Scheduling mode; one of ENGINE_MODES.
    mode: str = "normal"
    # fine mode: boundary intervals P may advance per turnstile round ("fixed"), chosen per
    # epoch among segment_spans from D occupancy and P pressure ("load"), or re-sized every
    # round from measured P enqueue time against D's iteration time, starting at segment_span
    # ("balanced"; segment_policy.BalancedSpan).
    segment_policy: str = "fixed"
    segment_span: int = 2
    segment_spans: list[int] = field(default_factory=lambda: [1, 2, 4])
    # host agreement -- the per-step control exchange and the PreD/PostD rendezvous: "auto"
    # (shared memory when all ranks share a host), "shm", "gloo"
    rendezvous: str = "auto"
    # GPU, PD modes: "auto" puts P's full-group AllReduce on D's stream where the paths cross
    # (ADP > 1 and ATP > 1), and on any multi-rank layout when P's MoE blocks are graphs
    # (stream_route.routes_p_collective says why); "off" drops that route (the unsafe control of
    # the crossed-path run); "always" routes on every layout.
    stream_route: str = "auto"
    # GPU, PD modes: which phase's stream gets the higher CUDA priority when both have kernels
    # queued -- "prefill" (P at near-Normal speed, D in what P leaves), "decode" (protect D's
    # iteration time), or "equal". Prefill measured better on all three bench metrics on 1 and
    # 2 H200 (docs/benchmarks.md).
    stream_priority: str = "prefill"
    # P attention batches sequences by context-length bucket; neighbouring buckets are merged
    # while a merge adds at most this many padded (query, key) pairs. Each bucket costs a dozen
    # kernel launches per layer (host time: what short P epochs are bound by), padding costs
    # GPU time (what long ones are bound by). 0: never merge.
    prefill_merge_pairs: int = 4_194_304
    # GPU: record CUDA events around every P segment/epoch and D iteration (timelines).
    cuda_timing: bool = False
    # Diagnosis: when > 0, a rank whose step takes longer than this many seconds prints that
    # step's Python stack to stderr (engine/stall_watch.py), so a stalled round shows where
    # each host waits. 0: off.
    stall_dump_s: float = 0.0
    # GPU: D by CUDA-graph replay, one graph per (row bucket, block-table width); needs the
    # grouped expert path (model.moe_compute), otherwise D runs eagerly.
    cuda_graphs: bool = True
    # GPU, with cuda_graphs: P's MoE blocks (norm, router, experts) by CUDA-graph replay, one
    # graph per (layer, token bucket) -- half of P's per-layer host enqueue (its attention and
    # collectives stay eager). "auto": on in Normal mode, off in the PD modes: with P's GPU
    # work no longer paced by its host enqueue, Fine stalled 24-100 s on 2x H200 (EP2/ADP2, 64
    # conversations): P's unrouted AllReduce hung beside D's graph-captured collectives
    # (docs/benchmarks.md, sessions 6-7).
    # "always" enables them in every mode -- in the PD modes stream_route "auto" then also routes
    # P's AllReduce onto D's stream (no stall in that run, and no Fine gain: -1.9%) -- "never"
    # nowhere (words YAML does not read as bools).
    prefill_graphs: str = "auto"
    # Normal mode: a P step's first tokens are read one step late when the next waiting
    # prompt could be admitted -- the next P step is planned and enqueued while this one's
    # kernels run, so the GPU never idles through a P step's host head (SGLang's overlap
    # scheduler, for P bursts). The
    # tokens, and every request's output, are the same; a request's first token is committed
    # one step later. "auto": on CUDA devices; "always" also on CPU (tests); "never" off.
    # Normal mode only: the PD modes commit P epochs asynchronously already (a config that
    # the bench runs in every mode keeps its value for the Normal cell).
    overlap_prefill: str = "auto"
    # D attention (model/paged_attention.py): "triton" = the split-KV paged kernel (CUDA and
    # triton required: an error at model build otherwise), "torch" = gather + matmuls (the
    # CPU path and the reference), "auto" = triton on CUDA when it imports, else torch.
    decode_attention: str = "auto"
    # P attention (model/paged_prefill.py): "triton" = the varlen paged flash-attention kernel
    # (CUDA and triton required: an error at model build otherwise), "torch" = SDPA per
    # context bucket (the CPU path and the reference). "cudnn" = triton, except fresh sequences (>= 1024 new tokens, no
    # cached prefix), which go through cuDNN's dense attention, up to 8 of one padded length
    # per call (model/dense_prefill.py; CUDA, cuDNN >= 9 and triton required). "flash" = the
    # dense calls of one sequence through FlashAttention-4's kernel instead (``flash_attn.cute``
    # installed, an sm_90 / sm_100 GPU; batched calls stay cuDNN's). "auto" = flash, else
    # cudnn, else triton, else torch: the first that can run.
    prefill_attention: str = "auto"
    # The grouped MoE path's expert GEMMs (model/fused_moe.py): "triton" = the fused-MoE
    # kernel (row gather, per-expert tiles and SwiGLU fused; CUDA and triton required: an error
    # at model build otherwise), "torch" = torch._grouped_mm (the CPU path and the reference),
    # "auto" = triton on CUDA for bf16/fp16 models when it imports, else torch.
    moe_kernel: str = "auto"

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
        _require(all(i >= 0 for i in self.stop_token_ids), "engine.stop_token_ids",
                 f"must be token ids >= 0, got {self.stop_token_ids[:8]}")
        _require_choice(self, "mode", ENGINE_MODES)
        _require_choice(self, "kv_reservation", ("full", "on_demand"))
        _require_choice(self, "segment_policy", SEGMENT_POLICIES)
        _require_choice(self, "stream_route", STREAM_ROUTES)
        _require_choice(self, "prefill_graphs", PREFILL_GRAPHS)
        _require_choice(self, "overlap_prefill", PREFILL_GRAPHS)
        _require_choice(self, "stream_priority", STREAM_PRIORITIES)
        _require_choice(self, "rendezvous", ("auto", "shm", "gloo"))
        _require_choice(self, "decode_attention", ("auto", "torch", "triton"))
        _require_choice(self, "prefill_attention",
                        ("auto", "torch", "triton", "cudnn", "flash"))
        _require_choice(self, "moe_kernel", ("auto", "torch", "triton"))
        _require_min(self, ("segment_span",), 1)
        _require_min(self, ("prefill_merge_pairs",), 0)
        _require(0 <= self.stall_dump_s < float("inf"), "engine.stall_dump_s",
                 f"must be a finite number of seconds >= 0, got {self.stall_dump_s}")
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
        _require_min(self, ("top_k",), 0)
        _require_seed(self)
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
    # to a trace JSONL file (workloads/trace/jsonl.py), or "mooncake:PATH" for a Mooncake-format
    # file (timestamp in ms, input_length, output_length, hash_ids). Relative paths are
    # relative to the working directory.
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
    # One untimed replay before the timed cells (one-off first-use costs stay out of them).
    warmup_replay: bool = True
    # Only these variants of the ladder, by their table names (e.g. [normal, fine-8, fine-bal]);
    # empty: every variant the modes and spans make. Saves device time on large configs.
    variants: list[str] = field(default_factory=list)

    def variant_settings(self) -> list[tuple[str, dict]]:
        """(table name, engine settings) of the ladder's variants, in run order (the table's
        rows), restricted to ``variants`` when it is set."""
        out: list[tuple[str, dict]] = []
        for m in self.modes:
            if m == "fine":
                out += [(f"fine-{k}", {"mode": "fine", "segment_policy": "fixed",
                                       "segment_span": k}) for k in self.spans]
                out += [("fine-sel", {"mode": "fine", "segment_policy": "load"}),
                        ("fine-bal", {"mode": "fine", "segment_policy": "balanced"})]
            else:
                out.append((m, {"mode": m}))
        return [(n, kw) for n, kw in out if not self.variants or n in self.variants]

    def ladder(self) -> list[str]:
        """Variant names of the ladder, in run order."""
        return [n for n, _ in self.variant_settings()]

    def __post_init__(self) -> None:
        _check_field_types(self)
        _require_min(self, ("conversations", "max_turns", "reps"), 1)
        # (found by probing: 10^9 reps passed, then the cell list alone took the host's memory)
        _require(self.reps <= MAX_BENCH_REPEATS, "bench.reps",
                 f"must be at most {MAX_BENCH_REPEATS}, got {self.reps}")
        _require_seed(self)
        # (a scale past MAX_SCALE turns a trace's tokens or seconds into what no run holds)
        _require(0 < self.length_scale <= MAX_SCALE, "bench.length_scale",
                 f"must be in (0, {MAX_SCALE:g}], got {self.length_scale:.6g}")
        _require(bool(self.wait_scales) and all(0 <= w <= MAX_SCALE for w in self.wait_scales),
                 "bench.wait_scales", f"must be a non-empty list of values in [0, "
                 f"{MAX_SCALE:g}], got {[float(f'{w:.6g}') for w in self.wait_scales]}")
        bad = [m for m in self.modes if m not in ENGINE_MODES]
        _require(bool(self.modes), "bench.modes",
                 f"must list at least one mode, from {list(ENGINE_MODES)}")
        _require(not bad, "bench.modes",
                 f"unknown mode(s) {bad}; choose from {list(ENGINE_MODES)}")
        # a mode or span listed twice would run its cells twice and pool them as one variant's
        # reps (the table's rep counts then wrong)
        _require(len(set(self.modes)) == len(self.modes), "bench.modes",
                 f"lists a mode twice: {self.modes}")
        _require(bool(self.spans) and all(k >= 1 for k in self.spans), "bench.spans",
                 f"must be spans >= 1, got {self.spans}")
        _require(len(set(self.spans)) == len(self.spans), "bench.spans",
                 f"lists a span twice: {self.spans}")
        full = dataclasses.replace(self, variants=[]).ladder() if self.variants else []
        unknown = [v for v in self.variants if v not in full]
        _require(not unknown, "bench.variants",
                 f"not in the ladder of these modes and spans: {unknown}; choose from {full}")


@dataclass(frozen=True, kw_only=True)
class BenchSpeedConfig:
    """`colo-rollout bench-speed`: decode and prefill speed on one rank against the roofline."""

    SECTION: ClassVar[str] = "bench_speed"

    # Decode batch sizes (rows, all running) at the short context.
    decode_batches: list[int] = field(default_factory=lambda: [1, 8, 32, 64, 128])
    # KV context of every short-context decode row: tokens its step attends (its own included).
    short_context: int = 128
    # Decode batch sizes at each of long_contexts (empty: no long-context rows).
    long_batches: list[int] = field(default_factory=lambda: [8, 32, 64])
    long_contexts: list[int] = field(default_factory=lambda: [2048, 4096, 8192])
    # Decode batch sizes (short context) also timed with every row sampled at temperature 1
    # (drawn inside the D graph where there are graphs), against the greedy step (empty: none).
    sampled_batches: list[int] = field(default_factory=lambda: [1, 32])
    # Prefill of one sequence of each length on an empty cache (empty: none).
    prefill_lengths: list[int] = field(default_factory=lambda: [1024, 4096, 8192])
    # Prefill of prefill_batch_seqs sequences of prefill_batch_len tokens in one step (0: none).
    prefill_batch_seqs: int = 8
    prefill_batch_len: int = 1024
    # Prefill of fresh sequences of these lengths together in one step (empty: none): long
    # and short ones mixed, as RL rollout steps batch prompts -- with prefill_attention cudnn
    # the long ones go through dense calls (batched where their padded lengths match) beside
    # the Triton kernel's tiles for the rest.
    prefill_mixed: list[int] = field(default_factory=lambda: [4096, 1100, 1100, 600, 300, 100])
    # Continuation prefill in one step: continuation_seqs sequences whose new tokens spread
    # evenly over [continuation_new[0], continuation_new[1]] on cached contexts spread over
    # [continuation_context[0], continuation_context[1]] (0 sequences: none).
    continuation_seqs: int = 16
    continuation_new: list[int] = field(default_factory=lambda: [256, 1024])
    continuation_context: list[int] = field(default_factory=lambda: [4096, 8192])
    # Untimed runs of every shape first (graph capture, allocator growth, lazy inits), then
    # timed ones; the median is reported. Prefill shapes take prefill_iters timed runs (5: one
    # host hiccup in a 4k step moves a median of 3 by ~1%, session 19).
    warmup: int = 2
    iters: int = 10
    prefill_iters: int = 5
    # Each fresh prefill row's shape also as this many P steps back to back through the
    # engine's own step loop (its prompts submitted; where engine.overlap_prefill is on each
    # step's host head runs under the previous step's kernels): seconds per step in the
    # "back to back" columns. 0: none; else at least 2.
    prefill_burst: int = 10
    # Kernel-time breakdown per layer part from torch.profiler over profile_steps decode steps
    # (at profile_batch rows, short context; 0: the largest of decode_batches) and one prefill
    # step of profile_prefill_seqs sequences of profile_prefill tokens each (0: the first of
    # prefill_lengths, else prefill_batch_len; 8 sequences of 1024: the 8 x 1k row's step).
    profile: bool = True
    profile_steps: int = 3
    profile_batch: int = 0
    profile_prefill: int = 0
    profile_prefill_seqs: int = 1
    # The same shapes through Hugging Face transformers (random weights of this model section)
    # as the peer: decode at every decode_batches row (short context), prefill of one sequence
    # of each hf_prefill_lengths. Skipped (with a note) when transformers is not installed.
    hf_peer: bool = True
    hf_prefill_lengths: list[int] = field(default_factory=lambda: [1024, 4096])
    # The roofline's memory bandwidth (bytes/s) and the prefill's dense peak (FLOP/s); H200
    # defaults (HBM3e 4.0 TB/s, bf16 dense 989 TFLOP/s). The ratios are against these also on
    # CPU.
    hbm_bytes_per_s: float = 4.0e12
    peak_flops: float = 989e12
    # Seed of the token ids fed to the model.
    seed: int = 0
    # Where JSON and the breakdown plot go.
    out_dir: str = "runs/bench_speed"

    def __post_init__(self) -> None:
        _check_field_types(self)
        _require_seed(self)
        _require(bool(self.decode_batches), "bench_speed.decode_batches", "must not be empty")
        for name in ("decode_batches", "long_batches", "long_contexts", "sampled_batches",
                     "prefill_lengths", "prefill_mixed", "hf_prefill_lengths"):
            values = getattr(self, name)
            _require(all(v >= 1 for v in values), f"bench_speed.{name}",
                     f"every value must be >= 1, got {values}")
        _require(bool(self.long_batches) == bool(self.long_contexts), "bench_speed.long_batches",
                 "set both long_batches and long_contexts, or leave both empty")
        _require_min(self, ("prefill_batch_len", "iters", "prefill_iters", "warmup",
                            "profile_steps", "profile_prefill_seqs"), 1)
        for name in ("iters", "prefill_iters", "warmup", "profile_steps",
                     "profile_prefill_seqs"):
            # a timing count past this is a typo (1e22 iterations ran until killed)
            _require(getattr(self, name) <= MAX_BENCH_REPEATS, f"bench_speed.{name}",
                     f"must be at most {MAX_BENCH_REPEATS}, got {getattr(self, name)}")
        _require(self.prefill_burst == 0 or 2 <= self.prefill_burst <= MAX_BENCH_REPEATS,
                 "bench_speed.prefill_burst",
                 f"must be 0 (none) or 2 to {MAX_BENCH_REPEATS} steps, got {self.prefill_burst}")
        _require_min(self, ("short_context",), 2)  # the peer's cache holds short_context - 1
        _require_min(self, ("prefill_batch_seqs", "continuation_seqs", "profile_batch",
                            "profile_prefill", "seed"), 0)
        for name, low in (("continuation_new", 1), ("continuation_context", 0)):
            lo_hi = getattr(self, name)
            _require(len(lo_hi) == 2 and low <= lo_hi[0] <= lo_hi[1], f"bench_speed.{name}",
                     f"must be [low, high] with {low} <= low <= high, got {lo_hi}")
        _require(self.profile_batch == 0 or self.profile_batch in self.decode_batches,
                 "bench_speed.profile_batch",
                 f"{self.profile_batch} is not one of decode_batches {self.decode_batches} "
                 "(0: the largest)")
        for name in ("hbm_bytes_per_s", "peak_flops"):
            v = getattr(self, name)
            _require(0 < v < float("inf"), f"bench_speed.{name}", f"must be > 0, got {v}")

    @property
    def breakdown_batch(self) -> int:
        """Decode rows of the profiled steps."""
        return self.profile_batch or max(self.decode_batches)

    @property
    def breakdown_prefill(self) -> int:
        """Tokens of the profiled prefill (one sequence)."""
        if self.profile_prefill:
            return self.profile_prefill
        return self.prefill_lengths[0] if self.prefill_lengths else self.prefill_batch_len

    def continuation_shape(self) -> list[tuple[int, int]]:
        """(cached tokens, new tokens) of each continuation sequence: both spread evenly over
        their ranges, the longest contexts paired with the fewest new tokens."""
        n = self.continuation_seqs

        def spread(lo: int, hi: int, i: int) -> int:
            return lo if n == 1 else lo + round((hi - lo) * i / (n - 1))

        (nlo, nhi), (clo, chi) = self.continuation_new, self.continuation_context
        return [(spread(clo, chi, i), spread(nlo, nhi, n - 1 - i)) for i in range(n)]


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
    # Sampling temperature during rollout. The policy trained is the tempered one, pi_T =
    # softmax(logits / T), as in verl and OpenRLHF: the rollout reports its tokens' logprobs
    # under it (SamplingParams.tempered_logprobs) and the trainer divides its logits by T, so
    # the PPO ratio and the importance weights compare the distribution the tokens came from.
    temperature: float = 1.0
    # Adam learning rate.
    lr: float = 0.01
    # PPO-style ratio clip.
    clip: float = 0.2
    # Dual-clip PPO (verl's clip_ratio_c, typically 3): for negative advantages the objective
    # is bounded below by dual_clip x A, so tokens with a huge ratio (the rollout's logprobs
    # far below the trainer's: is_level none leaves the mismatch in the ratio) cannot dominate
    # the step. 0 = off; else > 1.
    dual_clip: float = 0.0
    # Weight of the KL term to the initial (reference) policy (k3 estimator per token; the
    # trainer keeps the first step's weights as the reference: one more copy of its shard);
    # 0 = off.
    kl_coef: float = 0.0
    # Train/inference mismatch correction (rl/grpo.py: MismatchCorrection): importance weights
    # w = pi_trainer / pi_rollout of the sampled tokens. "none": the rollout's logprobs are
    # PPO's old policy (the ratio clip absorbs the mismatch); "token": a weight per token;
    # "sequence": one per trajectory (the geometric mean over its generated tokens).
    is_level: str = "none"
    # "truncate": weights capped at is_cap (truncated IS); "mask": tokens (or trajectories)
    # whose weight is outside [is_floor, is_cap] are left out of the loss (masked IS).
    is_mode: str = "truncate"
    is_cap: float = 2.0
    is_floor: float = 0.0
    # Routing replay ("R3"): the trainer routes every token to the experts the rollout engine
    # chose for it (engine.record_routing must be on), in forward and in backward recompute.
    routing_replay: bool = False
    # The MTP layer (model.mtp_num_layers 1) in training: megatron's MTP loss on the batch's
    # own tokens (the layer predicts each token two ahead, as it drafts), scaled by this and
    # added to the policy loss -- so the drafts follow the policy as it moves. 0: the layer
    # is frozen (synced unchanged).
    mtp_loss_scale: float = 0.1
    # Partial rollout (over-sampling): a step's rollout returns once this many of its GRPO
    # groups are done; the in-flight rest is paused and resumed first by the next step under
    # the new weights (rl/rollout.py: Carry). 0: every group finishes within its step.
    finish_groups: int = 0
    # Trainer activation recompute: "none" or "full" (megatron's full recompute, one layer per
    # unit: the backward re-runs each layer's forward; with routing_replay the recomputed
    # routers replay the rollout's routing too). Needs CUDA (megatron saves CUDA RNG states).
    recompute: str = "none"
    # Trainer tensor-parallel width (trainer DP = world / trainer_tp); may differ from the
    # inference layout: weights are resharded after every step. Above 1 the trainer runs
    # megatron's sequence parallelism (megatron trains MoE under TP only so), with the experts
    # TP-sharded too when trainer_ep is 1; it must divide the world size, the heads, KV
    # groups, vocabulary and FFN widths (the experts' only at trainer_ep 1).
    trainer_tp: int = 1
    # Trainer expert-parallel width: each expert lives on one rank of every group of
    # trainer_ep consecutive ranks, whole (expert TP 1), and is data-parallel over the groups
    # (world / trainer_ep); megatron carves the groups out of TP x DP, its MoE token
    # dispatcher moves the tokens. With trainer_tp > 1 it must be a multiple of trainer_tp
    # (an EP group is whole TP groups), e.g. TP2 x EP2 or TP2 x EP4 on 4 ranks.
    trainer_ep: int = 1
    # The verifiable task (rl/tasks.py): "target_token" (reward = fraction of generated tokens
    # equal to target_token) or "reverse" (the prompt's reverse_len symbols, ids 1 ..
    # reverse_alphabet, are to be generated in reverse order; reward = share of positions right).
    task: str = "target_token"
    target_token: int = 7
    reverse_len: int = 3
    reverse_alphabet: int = 4
    # Prompt lengths are drawn in [2, prompt_len_max] (so >= 2); seed of the prompt stream.
    prompt_len_max: int = 8
    seed: int = 0
    # Metrics JSONL, TensorBoard events and the reward curve go here.
    out_dir: str = "runs/grpo"
    # After the last step, write the trainer's weights here as a Hugging Face checkpoint
    # (config.json + sharded safetensors; with model.checkpoint, its config.json and tokenizer
    # files); null = no export.
    export_dir: str | None = None
    # Engine memory while the trainer runs: "off" (keep everything), "keep" (release KV cache
    # and D graphs), "offload" (also weights, to pinned host memory) or "discard" (also
    # weights; the weight sync after the step refills them).
    release_memory: str = "off"

    @property
    def longest_prompt(self) -> tuple[int, str]:
        """The longest prompt the task draws (rl/tasks.py) and the key that sets it: the
        reverse task's are reverse_len symbols and a separator, target_token's up to
        prompt_len_max tokens (the door holds them to the engine)."""
        if self.task == "reverse":
            return self.reverse_len + 1, "rl.reverse_len"
        return self.prompt_len_max, "rl.prompt_len_max"

    def __post_init__(self) -> None:
        _check_field_types(self)
        _require_min(self, ("steps", "prompts_per_step", "samples_per_prompt", "max_new_tokens",
                            "trainer_tp", "trainer_ep"), 1)
        _require(self.prompt_len_max >= 2, "rl.prompt_len_max",
                 f"must be >= 2 (prompt lengths are drawn in [2, prompt_len_max]), got "
                 f"{self.prompt_len_max}")
        # TP x EP: the experts whole (ETP 1), an EP group whole TP groups -- the layouts the
        # weight shard rules cut (model/megatron_gpt.py shard_layout); the trainer refuses the
        # rest at start too, on every rank (rl/trainer.py check_trainer_layout)
        _require(self.trainer_tp == 1 or self.trainer_ep == 1
                 or self.trainer_ep % self.trainer_tp == 0,
                 "rl.trainer_ep",
                 f"{self.trainer_ep} with rl.trainer_tp {self.trainer_tp} is not supported: "
                 "with both above 1 trainer_ep must be a multiple of trainer_tp (an EP group "
                 "is whole TP groups)")
        _require_min(self, ("target_token",), 0)
        _require_seed(self)
        _require(self.lr > 0, "rl.lr", f"must be > 0, got {self.lr}")
        _require(self.mtp_loss_scale >= 0, "rl.mtp_loss_scale",
                 f"must be >= 0, got {self.mtp_loss_scale}")
        _require(0 < self.clip < 1, "rl.clip", f"must be in (0, 1), got {self.clip}")
        _require(self.dual_clip == 0 or 1 < self.dual_clip <= FP32_MAX, "rl.dual_clip",
                 f"must be 0 (off) or a finite number > 1 (verl's clip_ratio_c, e.g. 3), got "
                 f"{self.dual_clip}")
        _require(0 <= self.finish_groups <= self.prompts_per_step, "rl.finish_groups",
                 f"must be in [0, rl.prompts_per_step {self.prompts_per_step}], got "
                 f"{self.finish_groups}")
        _require(self.recompute in ("none", "full"), "rl.recompute",
                 f"must be none or full, got {self.recompute!r}")
        _require(self.is_level in ("none", "token", "sequence"), "rl.is_level",
                 f"must be none, token or sequence, got {self.is_level!r}")
        _require(self.is_mode in ("truncate", "mask"), "rl.is_mode",
                 f"must be truncate or mask, got {self.is_mode!r}")
        _require(self.is_cap > 1, "rl.is_cap", f"must be > 1 (a weight cap), got {self.is_cap}")
        _require(0 <= self.is_floor < 1, "rl.is_floor",
                 f"must be in [0, 1) (the mask's lower bound), got {self.is_floor}")
        _require(self.kl_coef >= 0 and math.isfinite(self.kl_coef), "rl.kl_coef",
                 f"must be a finite number >= 0, got {self.kl_coef}")
        _require(self.temperature > 0, "rl.temperature",
                 f"must be > 0 for exploration, got {self.temperature}")
        _require_choice(self, "task", ("target_token", "reverse"))
        _require_min(self, ("reverse_len", "reverse_alphabet"), 1)
        _require(self.task != "reverse" or self.max_new_tokens >= self.reverse_len,
                 "rl.max_new_tokens", f"{self.max_new_tokens} is shorter than rl.reverse_len "
                 f"{self.reverse_len}: the reversed sequence would not fit")
        _require_choice(self, "algorithm", ("grpo", "ppo"))
        # GRPO's advantage is a sample's reward against its group's: a group of one is all
        # zeros, and the run would train nothing
        _require(self.algorithm != "grpo" or self.samples_per_prompt >= 2,
                 "rl.samples_per_prompt", f"must be >= 2 for algorithm grpo (its advantages "
                 f"compare a prompt's samples), got {self.samples_per_prompt}")
        _require_choice(self, "release_memory", ("off", "keep", "offload", "discard"))
        _require(self.vf_coef >= 0, "rl.vf_coef", f"must be >= 0, got {self.vf_coef}")
        # the trainer's arithmetic is fp32: a coefficient past its range is inf there, and
        # the first step's loss (inf x a zero KL, say) NaN (found by probing: a traceback)
        for key in ("lr", "kl_coef", "vf_coef", "mtp_loss_scale", "is_cap", "temperature"):
            value = getattr(self, key)
            _require(not math.isfinite(value) or abs(value) <= FP32_MAX, f"rl.{key}",
                     f"{value:g} is past float32's range ({FP32_MAX:.4g}): the trainer "
                     "computes in float32")
        _require(self.temperature >= FP32_TINY, "rl.temperature",
                 f"{self.temperature:g} is below float32's smallest normal number "
                 f"({FP32_TINY:.4g}): logits / temperature would be inf")
