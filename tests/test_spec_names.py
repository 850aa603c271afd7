"""State-dict naming between megatron's local and TE layer specs, and per-rank sharding rules."""

from __future__ import annotations

import torch

from colo_rollout.config import ModelConfig
from colo_rollout.model.weights import random_state_dict, shard_for, to_spec_names
from colo_rollout.runtime.parallel import Layout

CFG = ModelConfig(vocab_size=64, hidden_size=16, num_layers=2, num_attention_heads=4,
                  num_query_groups=2, moe_ffn_hidden_size=8, num_experts=4, moe_router_topk=2)


def test_local_te_round_trip_is_identity():
    sd = random_state_dict(CFG)
    te = to_spec_names(sd, te=True)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in te
    assert not any("local_experts" in k or "input_layernorm" in k for k in te)
    back = to_spec_names(te, te=False)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_expert_sharding_same_tensor_under_both_names():
    sd = random_state_dict(CFG)
    te = to_spec_names(sd, te=True)
    lay = Layout(4, 2, 2)  # EP2 / ATP2 / ETP2
    for rank in range(4):
        for e in range(4):
            a = shard_for(f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight",
                          sd[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"],
                          lay, rank, num_local_experts=2)
            b = shard_for(f"decoder.layers.0.mlp.experts.linear_fc1.weight{e}",
                          te[f"decoder.layers.0.mlp.experts.linear_fc1.weight{e}"],
                          lay, rank, num_local_experts=2)
            held = e // 2 == rank // 2  # EP index = rank // ETP
            assert (a is None) == (b is None) == (not held)
            if held:
                assert a[0].endswith(f"local_experts.{e % 2}.linear_fc1.weight")
                assert b[0].endswith(f"linear_fc1.weight{e % 2}")
                assert torch.equal(a[1], b[1])
                # SwiGLU fc1: gate and up halves are sharded separately over ETP
                full = sd[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"]
                gate, up = full.chunk(2)
                t = rank % 2
                assert torch.equal(a[1], torch.cat([gate.chunk(2)[t], up.chunk(2)[t]]))


def test_attention_shards_cover_the_full_weight():
    sd = random_state_dict(CFG)
    lay = Layout(2, 1, 2)  # ATP2
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    parts = [shard_for(name, sd[name], lay, r, 2)[1] for r in range(2)]
    assert torch.equal(torch.cat(parts, 0), sd[name])
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    parts = [shard_for(name, sd[name], lay, r, 2)[1] for r in range(2)]
    assert torch.equal(torch.cat(parts, 1), sd[name])


def test_random_state_dict_is_seeded_and_device_explicit():
    cfg = ModelConfig()
    a, b = random_state_dict(cfg), random_state_dict(cfg, device="cpu")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = random_state_dict(cfg, seed=cfg.seed + 1)
    assert not torch.equal(a["output_layer.weight"], c["output_layer.weight"])
    assert all(t.device.type == "cpu" for t in a.values())
