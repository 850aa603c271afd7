"""Tiny Hugging Face MoE checkpoints and the per-rank bodies of the checkpoint-import tests.

``save_tiny_checkpoint`` builds a small transformers model of one supported family, randomises
every weight (so that biases, norms, routing and gates all matter) and saves it with
``save_pretrained``. ``serve_checkpoint`` (run on every rank by WorkerGroup) builds the engine
from ``model.checkpoint`` and serves greedy requests; rank 0 scores the same sequences with
transformers in fp32 as the independent reference.
"""

from __future__ import annotations

import math
import random

import torch

FAMILIES = ("qwen3", "qwen2", "mixtral", "glm", "dots")
# multi-head latent attention (DeepSeek-V3): its own tests -- MLA runs at attention TP 1
MLA_FAMILIES = ("deepseek", "deepseek2", "glm_lite")

_COMMON = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": False}


def family_config(family: str, **overrides):
    """The transformers config of a tiny ``family`` model (overrides: config keyword args)."""
    import transformers as tf

    if family == "qwen3":  # head_dim 32 != hidden 64 / 4 heads; renormalised top-k; YaRN as
        # Qwen3's long-context recipe writes it (factor 4 over an original 16 positions here)
        kw = {**_COMMON, "num_hidden_layers": 2, "head_dim": 32, "moe_intermediate_size": 32,
              "intermediate_size": 96, "num_experts": 8, "num_experts_per_tok": 2,
              "norm_topk_prob": True,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 16}}
        cls = tf.Qwen3MoeConfig
    elif family == "qwen2":  # gated shared expert, qkv bias, no top-k renormalisation
        kw = {**_COMMON, "num_hidden_layers": 2, "moe_intermediate_size": 32,
              "intermediate_size": 96, "shared_expert_intermediate_size": 48, "num_experts": 8,
              "num_experts_per_tok": 2, "norm_topk_prob": False, "qkv_bias": True,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
        cls = tf.Qwen2MoeConfig
    elif family == "mixtral":
        kw = {**_COMMON, "num_hidden_layers": 2, "intermediate_size": 32,
              "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
        cls = tf.MixtralConfig
    elif family == "glm":  # dense first layer, shared expert, group-limited sigmoid routing
        kw = {**_COMMON, "num_hidden_layers": 3, "first_k_dense_replace": 1,
              "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
              "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "attention_bias": True,
              "use_qk_norm": True, "rms_norm_eps": 1e-5,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5}}
        cls = tf.Glm4MoeConfig
    elif family == "dots":  # dots.llm1: Qwen3's attention (q/k norms, head_dim != hidden /
        # heads) with DeepSeek-V3's MoE: group-limited sigmoid routing with the correction
        # bias, routed scaling, a shared expert, a dense first layer
        kw = {**_COMMON, "num_hidden_layers": 3, "first_k_dense_replace": 1, "head_dim": 32,
              "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
              "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6,
              "sliding_window": None,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
        cls = tf.Dots1Config
    elif family == "deepseek":  # MLA with a query bottleneck (q_lora_rank null: q_proj),
        # v head != nope head, YaRN with DeepSeek's mscale pair (the softmax scale too), GLM's
        # router, a dense first layer, a shared expert
        kw = {**_COMMON, "num_hidden_layers": 3, "first_k_dense_replace": 1,
              "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
              "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5,
              "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
              "qk_rope_head_dim": 8, "v_head_dim": 12, "num_key_value_heads": 4,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 16, "mscale": 1.0,
                                  "mscale_all_dim": 0.8}}
        cls = tf.DeepseekV3Config
    elif family == "deepseek2":  # DeepSeek-V2-Lite's shape: no query bottleneck, softmax
        # top-k never renormalised, routed scaling, 2 shared experts, a dense first layer,
        # YaRN with V2's mscale pair (0.707 / 0.707: the softmax scale moves, cos and sin not)
        kw = {**_COMMON, "num_hidden_layers": 3, "first_k_dense_replace": 1,
              "intermediate_size": 96, "moe_intermediate_size": 16, "n_routed_experts": 8,
              "n_shared_experts": 2, "num_experts_per_tok": 3, "topk_method": "greedy",
              "norm_topk_prob": False, "routed_scaling_factor": 1.5, "rms_norm_eps": 1e-6,
              "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
              "qk_rope_head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 16, "mscale": 0.707,
                                  "mscale_all_dim": 0.707}}
        cls = tf.DeepseekV2Config
    elif family == "glm_lite":  # GLM-4.7-Flash's shape: MLA with the value head as wide as
        # the query head, GLM's sigmoid router in one group, routed scaling 1.8, a shared
        # expert, its dense layers by mlp_layer_types (not only the first), rope theta 1e6
        kw = {**_COMMON, "num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "dense"],
              "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
              "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1,
              "norm_topk_prob": True, "routed_scaling_factor": 1.8, "rms_norm_eps": 1e-5,
              "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 12,
              "qk_rope_head_dim": 8, "v_head_dim": 20, "num_key_value_heads": 4,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
        cls = tf.Glm4MoeLiteConfig
    else:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES + MLA_FAMILIES}")
    kw.update(overrides)
    return cls(**kw)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and persistent buffer gets random values big enough to matter: norm
    weights 1 +- 0.3, biases (attention, GLM's score-correction bias) std 0.3-0.5 (they move
    the routing), router weights large (logits std ~4: no near-ties), other matrices
    std 1/sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if not t.is_floating_point():
                continue
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
            fan_in = t.shape[-1] if t.dim() >= 2 else 1
            if name.endswith("e_score_correction_bias"):
                value = 0.5 * noise
            elif "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):
                value = 1.0 + 0.3 * noise
            elif name.endswith(".bias"):
                value = 0.3 * noise
            elif name.endswith("shared_expert_gate.weight"):
                value = noise * (1.5 / math.sqrt(fan_in))
            elif name.endswith(".gate.weight"):  # the router
                value = noise * (4.0 / math.sqrt(fan_in))
            elif name.endswith("embed_tokens.weight"):
                value = noise
            elif name == "lm_head.weight":
                value = noise * (3.0 / math.sqrt(fan_in))
            else:
                value = noise / math.sqrt(fan_in)
            t.copy_(value.to(t.dtype))


def save_tiny_checkpoint(directory, family: str, sharded: bool = False, seed: int = 0,
                         save_dtype: str = "float32", fused: bool = False,
                         **overrides) -> None:
    """A tiny randomised ``family`` checkpoint in ``directory`` (config.json + safetensors; with
    ``sharded``, several ~50 KB shards and model.safetensors.index.json; stored in
    ``save_dtype``; with ``fused``, the routed experts as transformers 5 holds them:
    ``save_pretrained(save_original_format=False)``). ``overrides``: transformers config
    arguments. Deterministic."""
    import transformers as tf

    config = family_config(family, **overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed + 1000 * (FAMILIES + MLA_FAMILIES).index(family))
    if save_dtype != "float32":
        model = model.to(getattr(torch, save_dtype))
    kw = {"max_shard_size": "50KB"} if sharded else {}
    model.save_pretrained(str(directory), save_original_format=not fused, **kw)


def to_fp8_block_checkpoint(src: str, dst: str, reference: str,
                            block: tuple[int, int]) -> None:
    """The single-file float checkpoint ``src`` as a block-scaled FP8 release in ``dst``
    (every linear weight e4m3 + weight_scale_inv; embeddings, norms, the router and lm_head kept
    as stored; config.json's quantization_config), and in ``reference`` the float checkpoint
    whose weights are exactly the dequantised ones (transformers' side of the comparison)."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from colo_rollout.checkpoint.fp8_blocks import quantize_blocks

    tensors = load_file(os.path.join(src, "model.safetensors"))
    fp8, ref = {}, {}
    for name, t in tensors.items():
        keep = (t.dim() != 2 or "embed_tokens" in name or name.startswith("lm_head")
                or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")))
        if keep:
            fp8[name], ref[name] = t, t
            continue
        q, scale = quantize_blocks(t, block)
        fp8[name], fp8[name + "_scale_inv"] = q, scale
        ref[name] = (q.float() * scale.repeat_interleave(block[0], 0)[: t.shape[0]]
                     .repeat_interleave(block[1], 1)[:, : t.shape[1]]).to(t.dtype)
    for out, weights in ((dst, fp8), (reference, ref)):
        shutil.copytree(src, out)
        save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                     "quant_method": "fp8", "weight_block_size": list(block)}
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def requests_for(n: int, seed: int, vocab: int = 256):
    from colo_rollout.sched.request import Request, SamplingParams

    rng = random.Random(seed)
    lengths = [1, 3, 5, 8, 13, 21, 30, 40]
    out = []
    for i in range(n):
        prompt = tuple(rng.randrange(vocab) for _ in range(lengths[i % len(lengths)]))
        out.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=6 + i % 5,
                                                           ignore_eos=True)))
    return out


def hf_compare(directory: str, requests, outs) -> dict:
    """transformers' fp32 logprobs of each full sequence (teacher forcing) vs the engine's."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    worst, mismatches, checked = 0.0, [], 0
    with torch.no_grad():
        for req in requests:
            out = outs[req.request_id]
            full = list(req.prompt) + list(out.tokens)
            lp = torch.log_softmax(hf(torch.tensor([full[:-1]])).logits[0].float(), dim=-1)
            for j, (tok, got) in enumerate(zip(out.tokens, out.logprobs)):
                row = lp[len(req.prompt) - 1 + j]
                worst = max(worst, abs(float(row[tok]) - got))
                if int(row.argmax()) != tok:
                    mismatches.append([req.request_id, j, tok, int(row.argmax())])
                checked += 1
    return {"max_logprob_diff": worst, "mismatches": mismatches, "checked": checked}


def engine_config(directory: str, world: int, adp: int, ep: int, engine: dict | None = None,
                  **model):
    from colo_rollout.config import config_from_dict

    return config_from_dict({
        "parallel": {"world_size": world, "adp": adp, "ep": ep, "backend": "gloo",
                     "timeout_s": 60},
        "model": {"checkpoint": directory, **model},
        "engine": {"max_batch_size": 4, "max_prefill_tokens": 128, "kv_block_size": 4,
                   "num_kv_blocks": 128, "max_seq_len": 128, "decode_buckets": [1, 2, 4],
                   **(engine or {})},
    })


def serve_checkpoint(rank: int, world: int, directory: str, adp: int, ep: int,
                     n_requests: int = 8, seed: int = 0, reference: str | None = None,
                     engine: dict | None = None) -> dict:
    """Serve greedy requests from ``directory`` on this layout; rank 0 adds the comparison
    with transformers (of ``reference``, a checkpoint of the same weights, when given)."""
    from colo_rollout.runtime.cpu_compat import install_cpu_compat
    from colo_rollout.engine.engine import Engine
    from colo_rollout.runtime.parallel import init_parallel

    cfg = engine_config(directory, world, adp, ep, engine)
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    engine = Engine(cfg, groups)
    try:
        requests = requests_for(n_requests, seed, cfg.model.vocab_size)
        outs = engine.generate(requests)
        result = {
            "layout": groups.layout.name,
            "bytes_read": engine.load_stats.bytes_read,
            "tensors": engine.load_stats.tensors,
            "tokens": {r.request_id: list(outs[r.request_id].tokens) for r in requests},
            "logprobs": {r.request_id: list(outs[r.request_id].logprobs) for r in requests},
            "expected": {r.request_id: r.params.max_tokens for r in requests},
        }
    finally:
        engine.close()
    if rank == 0:
        result.update(hf_compare(reference or directory, requests, outs))
    return result


def serve_across_releases(rank: int, world: int, directory: str, adp: int, ep: int) -> dict:
    """Serve greedy requests, release the engine's memory (the KV cache, the D graphs and the
    weights kept, then offloaded), resume, and serve them again: the token lists of each
    round."""
    from colo_rollout.runtime.cpu_compat import install_cpu_compat
    from colo_rollout.engine.engine import Engine
    from colo_rollout.runtime.parallel import init_parallel

    cfg = engine_config(directory, world, adp, ep)
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    engine = Engine(cfg, groups)
    rounds = []
    try:
        for weights in (None, "keep", "offload"):
            if weights is not None:
                engine.release_memory(weights)
                engine.resume_memory()
            requests = requests_for(6, 0, cfg.model.vocab_size)
            outs = engine.generate(requests)
            rounds.append({r.request_id: list(outs[r.request_id].tokens) for r in requests})
    finally:
        engine.close()
    return {"rounds": rounds}


def load_error(rank: int, world: int, directory: str) -> str:
    """The error building an engine from a (broken) checkpoint raises on this rank."""
    from colo_rollout.runtime.cpu_compat import install_cpu_compat
    from colo_rollout.engine.engine import Engine
    from colo_rollout.runtime.parallel import init_parallel

    cfg = engine_config(directory, world, world, world)
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    try:
        Engine(cfg, groups).close()
    except Exception as e:  # noqa: BLE001 - the test asserts on the text
        return f"{type(e).__name__}: {e}"
    return ""
