"""Per-rank bodies of the export tests: a TP-sharded megatron model written as a Hugging Face
checkpoint, read back by this project's loader and by transformers."""

from __future__ import annotations

import pathlib

import torch
import torch.distributed as dist

from colo_rollout.checkpoint.export import export_checkpoint
from colo_rollout.checkpoint.hf_names import hf_sources
from colo_rollout.checkpoint.store import CheckpointStore
from colo_rollout.config import config_from_dict
from colo_rollout.runtime.cpu_compat import install_cpu_compat
from colo_rollout.model.weights import loadable_tensors, random_state_dict
from colo_rollout.checkpoint.loader import megatron_loader
from colo_rollout.model.megatron_gpt import (
    build_reference,
    reference_logprobs,
    singleton_pg_collection,
    tp_pg_collection,
)
from tests.cases_engine import MLA_ARCH, tiny_config

# model sections that each family's format expresses (export picks the family from them)
FAMILY_MODELS = {
    # YaRN: megatron's GPTModel (the trainer) against transformers, and written back out
    "Qwen3MoeForCausalLM": {"qk_layernorm": True, "head_dim": 24, "norm_epsilon": 1e-6,
                            "router_norm_topk": False, "rope_scaling": "yarn",
                            "rope_scaling_factor": 4.0,
                            "yarn_original_max_position_embeddings": 32,
                            "yarn_beta_fast": 16.0},
    "Qwen2MoeForCausalLM": {"qkv_bias": True, "shared_expert_ffn_hidden_size": 48,
                            "shared_expert_gate": True, "router_norm_topk": False,
                            "num_layers": 3, "dense_layers": [1], "ffn_hidden_size": 96},
    "MixtralForCausalLM": {"rotary_base": 1e6, "tie_embeddings": True},
    "Glm4MoeForCausalLM": {"router_score": "sigmoid", "router_expert_bias": True,
                           "router_num_groups": 4, "router_group_topk": 1,
                           "router_scaling_factor": 2.5, "shared_expert_ffn_hidden_size": 64,
                           "first_k_dense": 1, "ffn_hidden_size": 96, "num_layers": 3,
                           "rotary_percent": 0.5, "qkv_bias": True, "qk_layernorm": True},
    # dots.llm1: Qwen3's attention, DeepSeek-V3's MoE
    "Dots1ForCausalLM": {"router_score": "sigmoid", "router_expert_bias": True,
                         "router_num_groups": 4, "router_group_topk": 2, "moe_router_topk": 4,
                         "router_scaling_factor": 2.5, "shared_expert_ffn_hidden_size": 64,
                         "first_k_dense": 1, "ffn_hidden_size": 96, "num_layers": 3,
                         "qk_layernorm": True, "head_dim": 24},
}
# MLA runs at TP 1: its export test's trainer is one rank (tests/test_mla.py)
MLA_FAMILY_MODELS = {
    "DeepseekV3ForCausalLM": MLA_ARCH,
    # DeepSeek-V2's router: softmax top-k, not renormalised, groups ranked by their best
    "DeepseekV2ForCausalLM": {**MLA_ARCH, "router_score": "softmax", "router_norm_topk": False,
                              "router_expert_bias": False, "router_group_topk": 4,
                              "router_scaling_factor": 1.5, "q_lora_rank": None},
    # GLM-4.7-Flash: the dense layers by mlp_layer_types, here not only the first
    "Glm4MoeLiteForCausalLM": {**MLA_ARCH, "first_k_dense": 0, "dense_layers": [1],
                               "ffn_hidden_size": 48},
}


def export_round_trip(rank: int, world: int, family: str, directory: str) -> dict:
    """Trainer layout TP=world: export, then (1) the files hold exactly the HF split of the
    full weights, (2) loading them back into a TP model gives the same weights bit for bit,
    (3) transformers computes the megatron model's logprobs."""
    install_cpu_compat()
    cfg = tiny_config(world, 1, 1,
                      model_kw={**FAMILY_MODELS, **MLA_FAMILY_MODELS}[family]).model
    sd = random_state_dict(cfg)
    tp = dist.new_group(list(range(world)))
    pgc = tp_pg_collection(tp)
    model = build_reference(cfg, sd, pgc, torch.device("cpu"))
    files = export_checkpoint(model, cfg, directory, tp_group=tp, max_shard_bytes=200_000,
                              family=family)
    dist.barrier()
    res: dict = {"files": len(files)}
    # (2) back through this project's loader, into a TP model of the same layout
    back_cfg = config_from_dict({"model": {"checkpoint": directory},
                                "engine": {"max_seq_len": 256}}).model
    tpg = tp_pg_collection(tp)
    back = build_reference(back_cfg, megatron_loader(back_cfg, tpg.tp.size(), tpg.tp.rank()),
                           tpg, torch.device("cpu"))
    a, b = loadable_tensors(model), loadable_tensors(back)
    res["same_names"] = sorted(a) == sorted(b)
    res["unequal"] = [k for k in a if not torch.equal(a[k], b[k])]
    if rank == 0:
        # (1) the files: exactly the split of the full tensors
        with CheckpointStore(directory) as store:
            expected = {}
            for name, src in hf_sources(cfg, family).items():
                expected.update(src.split(sd[name]))
            res["file_names_equal"] = sorted(store.names()) == sorted(expected)
            res["file_unequal"] = [n for n, t in expected.items()
                                   if not torch.equal(store.read(n), t)]
            res["architectures"] = store.config["architectures"]
        # (3) transformers on the exported checkpoint against megatron (TP1, same weights)
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        ref = build_reference(cfg, sd, singleton_pg_collection(), torch.device("cpu"))
        tokens = torch.randint(0, cfg.vocab_size, (29,),
                               generator=torch.Generator().manual_seed(3)).tolist()
        with torch.no_grad():
            hf_lp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)
        res["max_diff_vs_transformers"] = float((hf_lp - reference_logprobs(ref, tokens)).abs()
                                                .max())
    else:
        singleton_pg_collection()
    return res


def hf_round_trip(rank: int, world: int, source: str, directory: str) -> dict:
    """A checkpoint saved by transformers -> the trainer (TP=world, each rank its slices) ->
    export: every tensor of the export equals the original file's, bit for bit."""
    install_cpu_compat()
    cfg = config_from_dict({"model": {"checkpoint": source, "params_dtype": "bfloat16"},
                            "engine": {"max_seq_len": 256}}).model
    tp = dist.new_group(list(range(world)))
    tpg = tp_pg_collection(tp)
    model = build_reference(cfg, megatron_loader(cfg, tpg.tp.size(), tpg.tp.rank()), tpg,
                            torch.device("cpu"))
    export_checkpoint(model, cfg, directory, tp_group=tp)
    dist.barrier()
    res: dict = {}
    if rank == 0:
        with CheckpointStore(source) as a, CheckpointStore(directory) as b:
            res["names_equal"] = a.names() == b.names()
            res["unequal"] = [n for n in a.names() if not torch.equal(a.read(n), b.read(n))]
            res["dtype_equal"] = all(a.dtype(n) == b.dtype(n) for n in a.names())
        res["copied"] = sorted(p.name for p in pathlib.Path(directory).iterdir()
                               if not p.name.startswith("model"))
    return res
