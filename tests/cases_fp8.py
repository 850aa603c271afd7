"""Worker bodies for the FP8 tests (model.fp8, model/fp8.py): the FP8 engine against the
fp32 megatron reference, beside the bf16 engine and megatron's own bf16 model of the same
weights, on CPU (gloo: the dequantised reference math) and on GPU (NCCL: the FP8 kernels)."""

from __future__ import annotations

import dataclasses

import torch

from colo_rollout.engine.engine import Engine
from colo_rollout.model.megatron_gpt import (
    build_reference,
    reference_logprobs,
    singleton_pg_collection,
    tp_pg_collection,
)
from colo_rollout.model.weights import random_state_dict
from colo_rollout.runtime.parallel import init_parallel
from tests.cases_engine import mixed_requests
from tests.cases_gpu import _teacher, compare_bf16, gpu_config, timed_generate


def fp8_vs_reference(rank: int, world: int, adp: int, ep: int, backend: str = "gloo",
                     mode: str = "normal", n_requests: int = 12,
                     model_kw: dict | None = None, engine_kw: dict | None = None) -> dict:
    """bf16 and FP8 engines on one random bf16 checkpoint, greedy. Per engine: the mean and
    max |logprob - fp32 truth| of its tokens (the fp32 megatron model teacher-forced on the
    engine's own sequence), its argmax agreement with fp32 (the token within slack of the
    fp32 argmax), and -- the yardstick -- megatron bf16's on the same sequences; the share of
    streams the two engines produce identically; the FP8 copies' bytes."""
    base = gpu_config(world, adp, ep, "bfloat16", backend=backend, model_kw=model_kw)
    base = dataclasses.replace(base, engine=dataclasses.replace(base.engine, mode=mode,
                                                                **(engine_kw or {})))
    groups = init_parallel(base.parallel)
    if backend == "gloo":
        from colo_rollout.runtime.cpu_compat import install_cpu_compat

        install_cpu_compat()
    sd = random_state_dict(base.model)
    requests = mixed_requests(n_requests, 3, base.model.vocab_size)
    dev = groups.device
    pgc = singleton_pg_collection()
    ypgc = tp_pg_collection(groups.atp) if groups.layout.atp > 1 else pgc
    ref16 = build_reference(base.model, sd, ypgc, dev)
    ref32 = None
    if rank == 0:
        ref_cfg = dataclasses.replace(base.model, params_dtype="float32", use_te="off")
        ref32 = build_reference(ref_cfg, {k: v.float() for k, v in sd.items()}, pgc, dev)
    res = {"layout": groups.layout.name, "device": str(dev)}
    outs_by = {}
    for name, fp8 in (("bf16", None), ("fp8", "e4m3")):
        cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, fp8=fp8))
        engine = Engine(cfg, groups, sd)
        engine.warmup(max_context=128)
        outs, wall = timed_generate(engine, requests)
        outs_by[name] = outs
        lp16 = [reference_logprobs(ref16, _teacher(r, outs)) for r in requests]
        row = {"wall_s": wall, "graphs": engine.runner.graphs is not None,
               "fp8_bytes": sum(t.numel() * t.element_size()
                                for t in engine.model.fp8_tensors()),
               # per attention: the GEMMs that stay in params_dtype (None in colo_fp8)
               "bf16_gemms": [[i for i, w in enumerate(getattr(layer.self_attention,
                                                               "colo_fp8", None) or ())
                               if w is None] for layer in engine.model._all_layers()]
               if fp8 else []}
        if ref32 is not None:  # the GPU tier's bf16 comparison (cases_gpu.compare_bf16)
            row.update({k: v for k, v in compare_bf16(ref32, lp16, requests, outs).items()
                        if k != "mismatches"})
        res[name] = row
        engine.close()
    same = [outs_by["bf16"][r.request_id].tokens == outs_by["fp8"][r.request_id].tokens
            for r in requests]
    res["identical_streams"] = sum(same) / len(same)
    res["first_tokens_equal"] = sum(outs_by["bf16"][r.request_id].tokens[:1]
                                    == outs_by["fp8"][r.request_id].tokens[:1]
                                    for r in requests) / len(requests)
    res["tokens"] = {r.request_id: outs_by["fp8"][r.request_id].tokens for r in requests}
    return res


def _fp8_model(groups, **kw):
    from colo_rollout.config import ModelConfig
    from colo_rollout.model.model import InferenceGPT

    cfg = ModelConfig(**{"vocab_size": 128, "hidden_size": 64, "num_layers": 2,
                         "num_attention_heads": 4, "num_query_groups": 2,
                         "moe_ffn_hidden_size": 32, "num_experts": 4, "moe_router_topk": 2,
                         "params_dtype": "bfloat16", "fp8": "e4m3", **kw})
    return InferenceGPT(cfg, groups, torch.bfloat16), cfg


def fp8_weight_copies(rank: int, world: int) -> dict:
    """The FP8 copies through a model's weight writes (load, replace, drop) and the model
    build's refusals."""
    from colo_rollout.config import ParallelConfig
    from colo_rollout.model.fp8 import Fp8Weight

    groups = init_parallel(ParallelConfig(world_size=1, backend="gloo"))
    model, cfg = _fp8_model(groups, first_k_dense=1, shared_expert_ffn_hidden_size=32)
    model.load_full_state_dict(random_state_dict(cfg))
    res = {"made_where_the_model_runs": model.fp8_tensors() == []}
    model.weights_updated()
    att = model.decoder.layers[0].self_attention
    moe = model.moe_layers()[0]
    sites = model._fp8_sites()  # each attention, layer 0's dense MLP, layer 1's shared experts
    res["sites"] = sum(h.colo_fp8 is not None for h, _ in sites)
    res["grouped"] = moe.fp8_weights is not None and moe.uses_grouped(
        torch.zeros(1, dtype=torch.bfloat16))
    ptrs = [t.data_ptr() for t in model.fp8_tensors()]
    model.load_full_state_dict(random_state_dict(cfg, seed=5))
    res["same_addresses_after_load"] = [t.data_ptr() for t in model.fp8_tensors()] == ptrs
    res["qkv_requantised"] = torch.equal(att.colo_fp8[0].q.float(),
                                         Fp8Weight.of(att.linear_qkv.weight).q.float())
    res["experts_requantised"] = torch.equal(moe.fp8_weights[1].scale,
                                             Fp8Weight.of(moe._stacked()[1]).scale)
    res["check_clean"] = model.check_fp8()
    att.linear_proj.weight.data = att.linear_proj.weight.data * 2
    res["check_after_replace"] = model.check_fp8()
    res["proj_requantised"] = torch.equal(att.colo_fp8[1].scale,
                                          Fp8Weight.of(att.linear_proj.weight).scale)
    model.drop_fp8()
    res["dropped"] = model.fp8_tensors() == []
    try:
        _fp8_model(groups, hidden_size=72, head_dim=18)[0].weights_updated()
        res["refused_shapes"] = ""
    except ValueError as e:
        res["refused_shapes"] = str(e)
    try:
        _fp8_model(groups, moe_compute="megatron")[0].moe_layers()[0].uses_grouped(
            torch.zeros(1))
        res["refused_megatron"] = ""
    except ValueError as e:
        res["refused_megatron"] = str(e)
    try:  # TE's FP8 GEMMs (model/fp8_te.py) need CUDA
        _fp8_model(groups, fp8_backend="te", fp8_recipe="tensorwise")
        res["refused_te"] = ""
    except ValueError as e:
        res["refused_te"] = str(e)
    return res
