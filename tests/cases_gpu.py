"""Per-rank bodies of the GPU tests (NCCL, one process per GPU)."""

from __future__ import annotations

import dataclasses
import time

import torch

from colo_rollout.config import Config, EngineConfig, ModelConfig, ParallelConfig
from colo_rollout.inference.engine import Engine
from colo_rollout.inference.model import random_state_dict
from colo_rollout.inference.parallel import init_parallel
from colo_rollout.inference.reference import build_reference, singleton_pg_collection
from tests.cases_engine import compare_with_reference, mixed_requests

# bf16 engine vs an fp32 reference holding the same (bf16-representable) weights: the gap is
# bf16 activation rounding, ~1e-2 in logprobs over 4 layers; 0.08 bounds it with margin while
# a wrong shard/position/row moves logprobs by O(1). Greedy tokens must be the reference argmax
# up to the same slack (near-ties may flip under bf16 rounding).
BF16_LOGPROB_TOL = 0.08


def gpu_config(world: int, adp: int, ep: int) -> Config:
    return Config(
        parallel=ParallelConfig(world_size=world, adp=adp, ep=ep, backend="nccl", timeout_s=120.0),
        model=ModelConfig(vocab_size=2048, hidden_size=512, num_layers=4, num_attention_heads=8,
                          num_query_groups=4, moe_ffn_hidden_size=512, num_experts=16,
                          moe_router_topk=2, max_position_embeddings=1024, init_method_std=0.05,
                          params_dtype="bfloat16", seed=11),
        engine=EngineConfig(max_batch_size=4, max_prefill_tokens=512, kv_block_size=16,
                            num_kv_blocks=256, max_seq_len=512, decode_buckets=[1, 2, 4]),
    )


def gpu_engine_matches_reference(rank: int, world: int, adp: int, ep: int,
                                 n_requests: int = 16, seed: int = 0) -> dict:
    cfg = gpu_config(world, adp, ep)
    groups = init_parallel(cfg.parallel)
    sd = random_state_dict(cfg.model)
    engine = Engine(cfg, groups, sd)
    requests = mixed_requests(n_requests, seed, cfg.model.vocab_size)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(requests)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    engine.check_integrity()
    pgc = singleton_pg_collection()
    res = {"layout": groups.layout.name, "wall_s": wall, "device": torch.cuda.get_device_name(),
           "tokens": {r.request_id: outs[r.request_id].tokens for r in requests},
           "generated": sum(len(outs[r.request_id].tokens) for r in requests)}
    if rank == 0:
        ref_cfg = dataclasses.replace(cfg.model, params_dtype="float32")
        sd32 = {k: v.float() for k, v in sd.items()}
        ref = build_reference(ref_cfg, sd32, pgc, torch.device("cuda", torch.cuda.current_device()))
        cmp = compare_with_reference(ref, requests, outs, tol=BF16_LOGPROB_TOL)
        res.update(cmp)
    return res
