"""The architecture surface (head_dim, q/k norms, q/k/v bias, tied embeddings, partial rotary and
RoPE scaling, softmax/sigmoid routers with and without renormalisation, expert bias, routed
scaling, group-limited routing, shared experts with and without a gate, dense first layers)
against megatron's own GPTModel full recompute, on 1 rank, EP2/ADP2 and EP4/ADP2/ATP2.

Each family-shaped variant turns on the options that family uses, with values chosen so that a
mistake shows: head_dim differs from hidden / heads, norm weights and biases are not 1 / 0, the
expert bias and the routed scaling change which experts win and by how much."""

from __future__ import annotations

import pytest

CASES = "tests.cases_engine"

ARCHS = {
    # Qwen3-MoE: head_dim independent of hidden/heads, q/k RMSNorm, eps 1e-6, renormalised top-k
    "qwen3": {"head_dim": 24, "qk_layernorm": True, "norm_epsilon": 1e-6},
    # Qwen2-MoE: q/k/v bias, softmax top-k without renormalisation, a gated shared expert
    "qwen2": {"qkv_bias": True, "router_norm_topk": False, "shared_expert_ffn_hidden_size": 48,
              "shared_expert_gate": True},
    # GLM-4.5 / DeepSeek-V3 routing: sigmoid + score-correction bias, 4 groups pick 2, routed
    # scaling, an ungated shared expert, a dense first layer, partial rotary, q/k/v bias
    "glm": {"router_score": "sigmoid", "router_expert_bias": True, "router_num_groups": 4,
            "router_group_topk": 2, "router_scaling_factor": 2.5,
            "shared_expert_ffn_hidden_size": 32, "first_k_dense": 1, "ffn_hidden_size": 96,
            "num_layers": 3, "rotary_percent": 0.5, "qkv_bias": True, "head_dim": 32},
    # tied embeddings and llama3 RoPE scaling (megatron's rope_scaling)
    "tied": {"tie_embeddings": True, "rope_scaling": "llama3", "rope_scaling_factor": 4.0,
             "rotary_base": 500000.0},
}

LAYOUTS = [(1, 1, 1), (2, 2, 2), (4, 2, 4)]  # single, EP2/ADP2, EP4/ADP2/ATP2


@pytest.mark.parametrize("world,adp,ep", LAYOUTS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_architecture_matches_megatron_reference(worker_groups, arch, world, adp, ep):
    from tests.cases_engine import LOGPROB_TOL

    res = worker_groups(world).run(f"{CASES}:engine_matches_reference", adp=adp, ep=ep,
                                   n_requests=10, model_kw=ARCHS[arch])
    r0 = res[0]
    assert r0["checked"] > 30
    assert r0["mismatches"] == []
    assert r0["max_logprob_diff"] < LOGPROB_TOL
    for r in res[1:]:
        assert r["tokens"] == r0["tokens"]


@pytest.mark.parametrize("arch", ["glm", "qwen2"])
def test_architecture_on_the_grouped_expert_path_and_in_fine_mode(worker_groups, arch):
    # the host-sync-free experts (what GPUs run) and the segment turnstile (P cut at its
    # boundaries: dense layers and shared experts keep one combine per layer)
    from tests.cases_engine import LOGPROB_TOL

    res = worker_groups(4).run(f"{CASES}:engine_matches_reference", adp=2, ep=4,
                               n_requests=10, model_kw=ARCHS[arch], moe_compute="grouped",
                               mode="fine")
    r0 = res[0]
    assert all(r0["grouped"])
    assert r0["checked"] > 30 and r0["mismatches"] == []
    assert r0["max_logprob_diff"] < LOGPROB_TOL
