"""Per-rank bodies of the multi-process engine tests (run by colo_rollout.testing.WorkerGroup)."""

from __future__ import annotations

import random

import torch

from colo_rollout.config import Config, EngineConfig, ModelConfig, ParallelConfig
from colo_rollout.inference.cpu_compat import install_cpu_compat
from colo_rollout.inference.engine import Engine
from colo_rollout.inference.model import random_state_dict
from colo_rollout.inference.parallel import init_parallel
from colo_rollout.inference.reference import build_reference, reference_logprobs, singleton_pg_collection
from colo_rollout.inference.request import FinishReason, Request, SamplingParams

# fp32 on CPU: the engine (paged KV, sharded, gathered) and the reference (megatron GPTModel, full
# recompute, TP1) differ only in summation order, ~1e-6 in logprobs; 1e-4 leaves a wide margin
# while any real bug (wrong position, wrong shard, wrong row) moves logprobs by >1e-2.
LOGPROB_TOL = 1e-4


def tiny_config(world: int, adp: int, ep: int, **engine) -> Config:
    return Config(
        parallel=ParallelConfig(world_size=world, adp=adp, ep=ep, backend="gloo", timeout_s=60.0),
        model=ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4,
                          num_query_groups=2, moe_ffn_hidden_size=64, num_experts=8,
                          moe_router_topk=2, max_position_embeddings=512, init_method_std=0.1,
                          seed=7),
        engine=EngineConfig(**{"max_batch_size": 8, "max_prefill_tokens": 256, "kv_block_size": 4,
                               "num_kv_blocks": 128, "max_seq_len": 256,
                               "decode_buckets": [1, 2, 4, 8], **engine}),
    )


def mixed_requests(n: int, seed: int, vocab: int) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        plen = rng.choice([1, 3, 7, 12, 25, 40])
        prompt = tuple(rng.randrange(vocab) for _ in range(plen))
        reqs.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 12),
                                                            ignore_eos=True)))
    return reqs


def compare_with_reference(ref, requests, outs) -> dict:
    worst, mismatches, checked = 0.0, [], 0
    for req in requests:
        out = outs[req.request_id]
        full = list(req.prompt) + out.tokens
        ref_lp = reference_logprobs(ref, full[:-1])
        for j, (tok, lp) in enumerate(zip(out.tokens, out.logprobs)):
            row = ref_lp[len(req.prompt) - 1 + j]
            worst = max(worst, abs(float(row[tok]) - lp))
            top2 = row.topk(2).values
            is_argmax = float(row[tok]) >= float(top2[0]) - LOGPROB_TOL
            if not is_argmax:
                mismatches.append((req.request_id, j, tok, int(row.argmax())))
            checked += 1
    return {"max_logprob_diff": worst, "mismatches": mismatches, "checked": checked}


def engine_matches_reference(rank: int, world: int, adp: int, ep: int, n_requests: int = 8,
                             seed: int = 0) -> dict:
    cfg = tiny_config(world, adp, ep)
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    sd = random_state_dict(cfg.model)
    engine = Engine(cfg, groups, sd)
    requests = mixed_requests(n_requests, seed, cfg.model.vocab_size)
    outs = engine.generate(requests)
    engine.check_integrity()
    pgc = singleton_pg_collection()
    result = {"layout": groups.layout.name, "steps": len(engine.history),
              "owners_left": sum(len(kv.owners()) for kv in engine.scheduler.kv),
              "lengths": {r.request_id: len(outs[r.request_id].tokens) for r in requests},
              "expected": {r.request_id: r.params.max_tokens for r in requests},
              "reasons": {r.request_id: outs[r.request_id].finish_reason.value for r in requests},
              "tokens": {r.request_id: outs[r.request_id].tokens for r in requests}}
    if rank == 0:
        ref = build_reference(cfg.model, sd, pgc, torch.device("cpu"))
        result.update(compare_with_reference(ref, requests, outs))
    return result
