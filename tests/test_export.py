"""Export: the trainer's weights written back as a Hugging Face checkpoint that transformers
loads and that round-trips bit-exactly (through this project's loader, and from a checkpoint
transformers saved)."""

from __future__ import annotations

import pytest

from tests.cases_export import FAMILY_MODELS

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", sorted(FAMILY_MODELS))
def test_export_is_exact_and_transformers_loads_it(worker_groups, tmp_path, family):
    res = worker_groups(2).run("tests.cases_export:export_round_trip", family=family,
                               directory=str(tmp_path / "out"))
    r0 = res[0]
    assert r0["files"] > 1  # sharded (200 kB shards)
    assert r0["architectures"] == [family]
    assert r0["file_names_equal"] and r0["file_unequal"] == []
    for r in res:
        assert r["same_names"] and r["unequal"] == []
    assert r0["max_diff_vs_transformers"] < 1e-4


def test_transformers_checkpoint_round_trips_bit_exactly(worker_groups, tmp_path):
    import json

    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=8, num_experts_per_tok=2, dtype="bfloat16")).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    src = tmp_path / "src"
    model.save_pretrained(src)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    res = worker_groups(2).run("tests.cases_export:hf_round_trip", source=str(src),
                               directory=str(tmp_path / "out"))
    r0 = res[0]
    assert r0["names_equal"] and r0["unequal"] == [] and r0["dtype_equal"]
    assert "config.json" in r0["copied"] and "generation_config.json" in r0["copied"]
