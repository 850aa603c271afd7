"""Hugging Face checkpoint import: config.json -> model section, per-rank loading, equivalence with
transformers (the independent reference), and errors that name the file / tensor / key.

Checkpoints are tiny (vocab 256, hidden 64, 8 experts) with every weight randomised
(tests/cases_hf.py), built once per module. Equivalence runs the engine on 1 rank, EP2/ADP2,
EP2/ATP2 and ATP2 (ETP2 experts) and compares with transformers' fp32 logprobs of the same
sequences; config.json and bad-input checks run at the door (headers only, no ranks).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil

import pytest
import torch
import yaml

from colo_rollout.config.hf_config import hf_architecture
from colo_rollout.checkpoint.loader import check_checkpoint
from colo_rollout.checkpoint.store import CheckpointError, CheckpointStore
from colo_rollout.config import ConfigError, config_from_dict, load_config
from tests.cases_hf import FAMILIES, save_tiny_checkpoint

CASES = "tests.cases_hf"
# fp32 on CPU: the engine and transformers differ only in summation order (~1e-5 at most);
# a wrong row, sign, scale or routing decision moves logprobs by > 1e-1
TOL = 1e-3
SMALL_ENGINE = {"max_seq_len": 128}  # within the tiny max_position_embeddings 512
SHARDED = "qwen2"  # this family's checkpoint is saved in ~50 KB shards with an index


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """family -> directory of its tiny randomised checkpoint (made once per module)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for fam in FAMILIES:
        d = root / fam
        # the GLM one as transformers saves it: config.json declares num_nextn_predict_layers
        # 1 (Glm4MoeConfig's default) and no MTP tensor is stored, so it loads without the
        # layer; MTP checkpoints: tests/test_hf_mtp.py
        save_tiny_checkpoint(d, fam, sharded=fam == SHARDED)
        out[fam] = str(d)
    return out


def model_cfg(directory: str, source: str = "<dict>", parallel: dict | None = None, **model):
    """The validated Config of a run whose model section is ``checkpoint: directory`` + model."""
    return config_from_dict({"parallel": parallel or {}, "engine": SMALL_ENGINE,
                             "model": {"checkpoint": directory, **model}}, source=source)


def total_tensor_bytes(directory: str) -> int:
    with CheckpointStore(directory) as store:
        return sum(math.prod(store.shape(n)) * store.dtype(n).itemsize for n in store.names())


def copy_ckpt(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def edit_config(directory: str, **changes) -> None:
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def rewrite_weights(directory: str, change) -> None:
    """Apply ``change(dict name -> tensor)`` to a single-file checkpoint's tensors, in place."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    tensors = dict(load_file(path))
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# ---------------------------------------------------------------------- equivalence
def check_equivalent(res: list[dict]) -> dict:
    r0 = res[0]
    assert r0["checked"] >= 50
    assert r0["mismatches"] == [], r0["mismatches"]  # greedy = transformers' argmax
    assert r0["max_logprob_diff"] < TOL, r0["max_logprob_diff"]
    assert {k: len(v) for k, v in r0["tokens"].items()} == r0["expected"]
    for r in res[1:]:  # every rank returns the same outputs
        assert r["tokens"] == r0["tokens"]
        for k, lps in r0["logprobs"].items():
            assert r["logprobs"][k] == pytest.approx(lps, abs=1e-6)
    return r0


@pytest.mark.parametrize("family", FAMILIES)
def test_one_rank_matches_transformers_and_reads_everything_once(worker_groups, ckpt, family):
    res = worker_groups(1).run(f"{CASES}:serve_checkpoint", directory=ckpt[family], adp=1, ep=1)
    r0 = check_equivalent(res)
    assert r0["bytes_read"] == total_tensor_bytes(ckpt[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_ep2_adp2_matches_transformers_and_splits_the_experts(worker_groups, ckpt, family):
    res = worker_groups(2).run(f"{CASES}:serve_checkpoint", directory=ckpt[family], adp=2, ep=2)
    assert res[0]["layout"] == "EP2/ADP2"
    check_equivalent(res)
    total = total_tensor_bytes(ckpt[family])
    for r in res:  # each rank reads its 4 experts of 8, not the whole model
        assert r["bytes_read"] < 0.8 * total, (r["bytes_read"], total)


@pytest.mark.parametrize("family", ["qwen2", "glm", "qwen3"])
def test_ep2_atp2_matches_transformers(worker_groups, ckpt, family):
    # attention TP: q/k/v row groups, o_proj columns, dense / shared-expert MLP rows, vocab rows
    res = worker_groups(2).run(f"{CASES}:serve_checkpoint", directory=ckpt[family], adp=1, ep=2)
    assert res[0]["layout"] == "EP2/ATP2"
    check_equivalent(res)
    total = total_tensor_bytes(ckpt[family])
    for r in res:
        assert r["bytes_read"] < 0.8 * total, (r["bytes_read"], total)


@pytest.mark.parametrize("family", ["glm", "mixtral"])
def test_etp2_matches_transformers(worker_groups, ckpt, family):
    # EP1 over 2 ranks: every expert's gate/up rows and down columns split in two (ETP2)
    res = worker_groups(2).run(f"{CASES}:serve_checkpoint", directory=ckpt[family], adp=1, ep=1)
    assert res[0]["layout"] == "ATP2"
    check_equivalent(res)


@pytest.fixture(scope="module")
def qwen_dense(tmp_path_factory):
    """Qwen checkpoints with dense layers between MoE ones: Qwen3 with mlp_only_layers [1] of
    3 layers, Qwen2 with decoder_sparse_step 2 of 4 (layers 0 and 2 dense)."""
    root = tmp_path_factory.mktemp("qwen_dense")
    save_tiny_checkpoint(root / "only", "qwen3", num_hidden_layers=3, mlp_only_layers=[1])
    save_tiny_checkpoint(root / "step", "qwen2", num_hidden_layers=4, decoder_sparse_step=2)
    return {"only": str(root / "only"), "step": str(root / "step")}


def test_qwen_dense_layers_are_read_as_transformers_builds_them(qwen_dense):
    only = hf_architecture(qwen_dense["only"]).fields
    assert only["dense_layers"] == [1] and only["ffn_hidden_size"] == 96
    assert hf_architecture(qwen_dense["step"]).fields["dense_layers"] == [0, 2]


@pytest.mark.parametrize("name,adp,ep", [("only", 1, 1), ("only", 1, 2), ("step", 2, 2)])
def test_qwen_dense_layers_match_transformers(worker_groups, qwen_dense, name, adp, ep):
    """A dense MLP (intermediate_size, ATP-sharded under EP2/ATP2) where transformers builds
    one, MoE elsewhere: transformers' tokens and logprobs on 1 rank, EP2/ATP2, EP2/ADP2."""
    world = 1 if ep == 1 else 2
    res = worker_groups(world).run(f"{CASES}:serve_checkpoint", directory=qwen_dense[name],
                                   adp=adp, ep=ep)
    check_equivalent(res)


@pytest.mark.parametrize("changes, key, fragment", [
    ({"decoder_sparse_step": 0}, "decoder_sparse_step", "expected a step >= 1"),
    ({"mlp_only_layers": [0, 1, 2]}, "mlp_only_layers", "every layer dense"),
    ({"mlp_only_layers": ["1"]}, "mlp_only_layers", "expected layer indices"),
])
def test_qwen_dense_layer_keys_that_make_no_moe_model_are_named(qwen_dense, tmp_path, changes,
                                                                key, fragment):
    d = copy_ckpt(qwen_dense["only"], tmp_path / "bad")
    edit_config(d, **changes)
    with pytest.raises(ConfigError) as e:
        model_cfg(d)
    assert f"config.json: {key}: " in str(e.value) and fragment in str(e.value), str(e.value)


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """family -> its tiny checkpoint saved with fused experts (transformers 5's in-memory
    layout: mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]; Mixtral's under mlp.),
    the same weights as ``ckpt``'s."""
    root = tmp_path_factory.mktemp("fused")
    out = {}
    for fam in FAMILIES:
        save_tiny_checkpoint(root / fam, fam, fused=True, sharded=fam == SHARDED)
        out[fam] = str(root / fam)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_experts_match_transformers_on_one_rank(worker_groups, fused, ckpt, family):
    """The same weights, fused: the same tokens, transformers' logprobs, every byte read
    once; the per-expert names are gone from the files."""
    from safetensors import safe_open

    names = set()
    for f in os.listdir(fused[family]):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(fused[family], f), "pt") as h:
                names |= set(h.keys())
    assert any(n.endswith("experts.gate_up_proj") for n in names)
    assert not any(".experts.0." in n for n in names)
    res = worker_groups(1).run(f"{CASES}:serve_checkpoint", directory=fused[family], adp=1,
                               ep=1)
    r0 = check_equivalent(res)
    assert r0["bytes_read"] == total_tensor_bytes(fused[family])
    per_expert = worker_groups(1).run(f"{CASES}:serve_checkpoint", directory=ckpt[family],
                                      adp=1, ep=1)[0]
    assert r0["tokens"] == per_expert["tokens"]


@pytest.mark.parametrize("family, adp, ep", [("qwen3", 2, 2), ("glm", 1, 1),
                                             ("mixtral", 1, 2)])
def test_fused_experts_are_cut_per_rank(worker_groups, fused, family, adp, ep):
    """EP2/ADP2 (each rank its experts' entries), ATP2 (expert TP 2: the same rows of gate and
    up, down's columns) and EP2/ATP2, against transformers; each rank reads its part."""
    res = worker_groups(2).run(f"{CASES}:serve_checkpoint", directory=fused[family], adp=adp,
                               ep=ep)
    check_equivalent(res)
    total = total_tensor_bytes(fused[family])
    for r in res:
        assert r["bytes_read"] < 0.8 * total, (r["bytes_read"], total)


def test_a_checkpoint_mixing_fused_and_per_expert_layers_is_named(fused, ckpt, tmp_path):
    """Layer 1's experts per expert beside layer 0's fused: the first missing fused tensor is
    named at the door."""
    from safetensors.torch import load_file, save_file

    d = copy_ckpt(fused["qwen3"], tmp_path / "mixed")
    path = os.path.join(d, "model.safetensors")
    tensors = dict(load_file(path))
    per = dict(load_file(os.path.join(ckpt["qwen3"], "model.safetensors")))
    for name in [n for n in tensors if n.startswith("model.layers.1.mlp.experts.")]:
        del tensors[name]
    tensors.update({n: t for n, t in per.items() if n.startswith("model.layers.1.mlp.experts.")})
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj: "
                                              r"missing"):
        check_checkpoint(model_cfg(d).model)


def test_a_stray_per_expert_tensor_beside_fused_ones_is_unexpected(fused, ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    d = copy_ckpt(fused["qwen3"], tmp_path / "stray")
    path = os.path.join(d, "model.safetensors")
    tensors = dict(load_file(path))
    name = "model.layers.0.mlp.experts.3.gate_proj.weight"
    tensors[name] = load_file(os.path.join(ckpt["qwen3"], "model.safetensors"))[name]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"{name}: unexpected tensor")):
        check_checkpoint(model_cfg(d).model)


def test_tied_bf16_checkpoint_matches_transformers(worker_groups, tmp_path_factory):
    # tied embeddings (no lm_head stored; the vocab-parallel embedding is the output layer) and
    # bf16 storage read into fp32 parameters (transformers upcasts the same values)
    d = str(tmp_path_factory.mktemp("tied") / "mixtral")
    save_tiny_checkpoint(d, "mixtral", save_dtype="bfloat16", tie_word_embeddings=True)
    with CheckpointStore(d) as store:
        assert "lm_head.weight" not in store
        assert store.dtype("model.embed_tokens.weight") == torch.bfloat16
    assert model_cfg(d).model.tie_embeddings
    res = worker_groups(2).run(f"{CASES}:serve_checkpoint", directory=d, adp=1, ep=2)
    check_equivalent(res)


@pytest.mark.parametrize("family,key", [("qwen2", "shared_expert_intermediate_size"),
                                        ("glm", "n_shared_experts")])
def test_zero_width_shared_expert_matches_transformers(worker_groups, tmp_path_factory, family,
                                                       key):
    """A shared expert of width 0: transformers saves zero-size projections (and Qwen2-MoE's
    gate, which multiplies their zero output); the engine loads the model without one and
    serves transformers' tokens."""
    d = str(tmp_path_factory.mktemp("shared0") / family)
    save_tiny_checkpoint(d, family, **{key: 0})
    with CheckpointStore(d) as store:
        assert any(0 in tuple(store.shape(n)) for n in store.names() if "shared_expert" in n)
    assert model_cfg(d).model.shared_expert_ffn_hidden_size is None
    check_equivalent(worker_groups(1).run(f"{CASES}:serve_checkpoint", directory=d, adp=1, ep=1))


def test_sharded_checkpoint_is_sharded(ckpt):
    files = os.listdir(ckpt[SHARDED])
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert sum(f.endswith(".safetensors") for f in files) >= 4


# ---------------------------------------------------------------------- config.json
EXPECTED = {
    "qwen3": {"vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4,
              "num_query_groups": 2, "head_dim": 32, "qk_layernorm": True, "qkv_bias": False,
              "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
              "router_norm_topk": True, "router_score": "softmax", "norm_epsilon": 1e-6,
              "shared_expert_ffn_hidden_size": None, "first_k_dense": 0, "rotary_percent": 1.0,
              "rotary_base": 10000.0, "max_position_embeddings": 512},
    "qwen2": {"head_dim": 16, "qkv_bias": True, "qk_layernorm": False, "router_norm_topk": False,
              "shared_expert_ffn_hidden_size": 48, "shared_expert_gate": True},
    "mixtral": {"router_norm_topk": True, "moe_ffn_hidden_size": 32, "rotary_base": 1e6,
                "shared_expert_ffn_hidden_size": None, "norm_epsilon": 1e-5},
    "glm": {"num_layers": 3, "first_k_dense": 1, "ffn_hidden_size": 96, "head_dim": 16,
            "moe_router_topk": 4, "router_score": "sigmoid", "router_expert_bias": True,
            "router_scaling_factor": 2.5, "router_num_groups": 4, "router_group_topk": 2,
            "router_norm_topk": True, "shared_expert_ffn_hidden_size": 32,
            "shared_expert_gate": False, "qkv_bias": True, "qk_layernorm": True,
            "rotary_percent": 0.5,
            "mtp_num_layers": 0},  # declared (transformers' default 1), not stored
    "dots": {"num_layers": 3, "first_k_dense": 1, "ffn_hidden_size": 96, "head_dim": 32,
             "num_query_groups": 2, "qk_layernorm": True, "qkv_bias": False,
             "router_score": "sigmoid", "router_expert_bias": True, "router_norm_topk": True,
             "router_scaling_factor": 2.5, "router_num_groups": 4, "router_group_topk": 2,
             "shared_expert_ffn_hidden_size": 32, "rotary_percent": 1.0, "mtp_num_layers": 0},
}


@pytest.mark.parametrize("changes, key, fragment", [
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     "layer_types", "sliding-window attention is not supported"),
    ({"layer_types": None, "sliding_window": 64, "max_window_layers": 1}, "sliding_window",
     "64 from layer max_window_layers 1"),
    # Dots1Config's default of 62 where the key is absent (found by probing: a 63-layer
    # model's last layer slides in transformers)
    ({"layer_types": None, "sliding_window": 64, "max_window_layers": None,
      "num_hidden_layers": 63}, "sliding_window", "64 from layer max_window_layers 62"),
    ({"attention_bias": True}, "attention_bias", "includes o_proj"),
    # (found by probing: both were read -- transformers refuses the first and cannot build
    # the second; the door had assumed one shared expert)
    ({"layer_types": ["full_attention"] * 2}, "layer_types", "2 entries for num_hidden_layers 3"),
    ({"n_shared_experts": None}, "n_shared_experts", "missing"),
])
def test_what_dots1_has_and_megatron_has_not_is_named(ckpt, tmp_path, changes, key, fragment):
    d = copy_ckpt(ckpt["dots"], tmp_path / "dots")
    edit_config(d, **changes)
    with pytest.raises(ConfigError) as e:
        model_cfg(d)
    assert f"config.json: {key}: " in str(e.value) and fragment in str(e.value), str(e.value)


def test_dots1_reads_no_mtp_layers(ckpt, tmp_path):
    """transformers' Dots1 reads no MTP keys and builds no MTP layer: neither does the door
    (found by probing: num_nextn_predict_layers was read, then the names had no MTP layer)."""
    d = copy_ckpt(ckpt["dots"], tmp_path / "dots")
    edit_config(d, num_nextn_predict_layers=1)
    assert model_cfg(d).model.mtp_num_layers == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_architecture_fields_come_from_config_json(ckpt, family):
    cfg = model_cfg(ckpt[family])
    got = {k: getattr(cfg.model, k) for k in EXPECTED[family]}
    assert got == EXPECTED[family]
    assert cfg.model.checkpoint == ckpt[family]
    check_checkpoint(cfg.model)  # the headers agree with the config


def _with_generation_config(src: str, dst, **gen) -> str:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(gen), encoding="utf-8")
    return str(dst)


def test_the_checkpoints_eos_ids_stop_the_engine_unless_the_yaml_says(ckpt, tmp_path):
    """As transformers' generate stops: generation_config.json's eos ids, else config.json's
    (found by probing: an engine built from a checkpoint in Python ran past its eos to
    max_tokens); the YAML's own value, null included, wins; ids past the vocabulary are never
    generated and left out."""
    d = _with_generation_config(ckpt["qwen3"], tmp_path / "one", eos_token_id=7)
    assert model_cfg(d).engine.eos_token_id == 7
    d = _with_generation_config(ckpt["qwen3"], tmp_path / "list", eos_token_id=[9, 3, 9, 4096])
    e = model_cfg(d).engine
    assert (e.eos_token_id, e.stop_token_ids) == (9, [3])
    for engine, want in (({"eos_token_id": None}, (None, [])),
                         ({"eos_token_id": 5}, (5, [])),
                         ({"stop_token_ids": [1]}, (9, [1]))):
        e = config_from_dict({"engine": {**SMALL_ENGINE, **engine},
                              "model": {"checkpoint": d}}).engine
        assert (e.eos_token_id, e.stop_token_ids) == want, engine
    # no generation_config.json: config.json's, as GenerationConfig.from_model_config
    d = tmp_path / "cfg"
    shutil.copytree(ckpt["mixtral"], d)
    (d / "generation_config.json").unlink(missing_ok=True)
    conf = json.loads((d / "config.json").read_text())
    conf["eos_token_id"] = 11
    (d / "config.json").write_text(json.dumps(conf))
    assert model_cfg(str(d)).engine.eos_token_id == 11
    d = _with_generation_config(ckpt["qwen3"], tmp_path / "bad", eos_token_id="</s>")
    with pytest.raises(ConfigError) as info:
        model_cfg(d, source="run.yaml")
    assert str(info.value) == (f"run.yaml: model.checkpoint: {d}/generation_config.json: "
                               "eos_token_id: must be a token id >= 0 or a list of them, got "
                               "'</s>'")


def test_a_model_of_few_positions_is_served_without_naming_max_seq_len(ckpt, tmp_path):
    """engine.max_seq_len left unset is at most the checkpoint's positions (the default
    1024 refused a 512-position model naming a key the user never wrote); set, it is held to
    them; a pathlib.Path names the checkpoint as its string does."""
    import pathlib

    cfg = config_from_dict({"model": {"checkpoint": pathlib.Path(ckpt["qwen3"])}})
    assert cfg.engine.max_seq_len == 512 and cfg.model.checkpoint == ckpt["qwen3"]
    with pytest.raises(ConfigError, match="engine.max_seq_len: 1024 exceeds "
                                          "model.max_position_embeddings 512"):
        config_from_dict({"engine": {"max_seq_len": 1024},
                          "model": {"checkpoint": ckpt["qwen3"]}})


def test_swish_is_silu(ckpt, tmp_path):
    d = tmp_path / "swish"
    shutil.copytree(ckpt["qwen3"], d)
    conf = json.loads((d / "config.json").read_text())
    conf["hidden_act"] = "swish"  # transformers' ACT2FN: the same function
    (d / "config.json").write_text(json.dumps(conf))
    assert model_cfg(str(d)).model == model_cfg(ckpt["qwen3"]).model.__class__(
        **{**dataclasses.asdict(model_cfg(ckpt["qwen3"]).model), "checkpoint": str(d)})


def test_agreeing_yaml_fields_are_fine_and_run_choices_stay(ckpt):
    cfg = model_cfg(ckpt["glm"], hidden_size=64, num_experts=8, router_scaling_factor=2.5,
                    max_position_embeddings=256,  # may be lower
                    params_dtype="bfloat16", seed=3)
    assert cfg.model.hidden_size == 64 and cfg.model.max_position_embeddings == 256
    assert cfg.model.params_dtype == "bfloat16" and cfg.model.seed == 3


@pytest.mark.parametrize("field,value,key", [
    ("hidden_size", 128, "config.json hidden_size = 64"),
    ("num_query_groups", 4, "config.json num_key_value_heads = 2"),
    ("head_dim", 16, "config.json head_dim = 32"),
    ("num_experts", 16, "config.json num_local_experts = 8"),
    ("qk_layernorm", False, "Qwen3MoeForCausalLM"),
    ("max_position_embeddings", 1024, "config.json max_position_embeddings = 512"),
])
def test_contradicting_yaml_field_is_an_error_naming_both(ckpt, field, value, key):
    with pytest.raises(ConfigError) as e:
        model_cfg(ckpt["qwen3"], source="x.yaml", **{field: value})
    msg = str(e.value)
    assert e.value.key == f"model.{field}"
    assert msg.startswith("x.yaml: ") and f"model.{field}: {value!r}" in msg and key in msg, msg


def test_glm_contradiction_names_the_glm_key(ckpt):
    with pytest.raises(ConfigError, match=r"model\.router_group_topk: 1 .*config\.json "
                                          r"topk_group = 2"):
        model_cfg(ckpt["glm"], router_group_topk=1)


def _old_style(directory: str, family: str) -> None:
    """config.json as transformers 4 wrote it: top-level rope_theta / partial_rotary_factor,
    torch_dtype, Qwen3's num_experts."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        c = json.load(f)
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" in rope:
        c["partial_rotary_factor"] = rope["partial_rotary_factor"]
    # a scaled RoPE (the tiny Qwen3's YaRN) as transformers 4's rope_scaling dict
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    c["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    c["torch_dtype"] = c.pop("dtype")
    if family == "qwen3":
        c["num_experts"] = c.pop("num_local_experts")
    c["transformers_version"] = "4.51.0"
    with open(path, "w") as f:
        json.dump(c, f, indent=2)


@pytest.mark.parametrize("family", ["qwen3", "glm"])
def test_both_config_json_spellings_parse_to_the_same_fields(ckpt, tmp_path, family):
    old = copy_ckpt(ckpt[family], tmp_path / "old")
    _old_style(old, family)
    raw = json.load(open(os.path.join(old, "config.json")))
    assert "rope_parameters" not in raw and "torch_dtype" in raw and "dtype" not in raw
    new_arch, old_arch = hf_architecture(ckpt[family]), hf_architecture(old)
    assert old_arch.fields == new_arch.fields
    assert old_arch.dtype == new_arch.dtype == "float32"
    if family == "qwen3":
        assert old_arch.sources["num_experts"] == "num_experts"
        assert new_arch.sources["num_experts"] == "num_local_experts"
    else:
        assert old_arch.fields["rotary_percent"] == 0.5
        assert old_arch.sources["rotary_percent"] == "partial_rotary_factor"
        assert new_arch.sources["rotary_percent"] == "rope_parameters.partial_rotary_factor"
    a = model_cfg(old).model
    b = model_cfg(ckpt[family]).model
    assert {**vars(a), "checkpoint": None} == {**vars(b), "checkpoint": None}
    check_checkpoint(a)


def test_keys_absent_from_config_json_take_transformers_defaults(ckpt, tmp_path):
    # what transformers builds from a config.json is the reference: Glm4MoeConfig defaults
    # partial_rotary_factor to 0.5, n_shared_experts and first_k_dense_replace to 1 (the tiny
    # GLM's values), Qwen2MoeConfig shared_expert_intermediate_size to 5632
    import transformers as tf

    g = copy_ckpt(ckpt["glm"], tmp_path / "g")
    edit_config(g, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                n_shared_experts=None, first_k_dense_replace=None)
    hf = tf.AutoConfig.from_pretrained(g)
    assert (hf.rope_parameters["partial_rotary_factor"], hf.n_shared_experts,
            hf.first_k_dense_replace) == (0.5, 1, 1)
    assert hf_architecture(g).fields == hf_architecture(ckpt["glm"]).fields
    check_checkpoint(model_cfg(g).model)
    q = copy_ckpt(ckpt["qwen2"], tmp_path / "q")
    edit_config(q, shared_expert_intermediate_size=None)
    assert tf.AutoConfig.from_pretrained(q).shared_expert_intermediate_size == 5632
    fields = hf_architecture(q).fields
    assert (fields["shared_expert_ffn_hidden_size"], fields["shared_expert_gate"]) == (5632, True)


def test_load_config_with_set_style_checkpoint_override(ckpt, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "parallel": {"world_size": 2, "adp": 2, "ep": 2, "backend": "gloo"},
        "model": {"params_dtype": "float32"},
        "engine": {"max_seq_len": 128}}))
    cfg = load_config(path, {"model.checkpoint": ckpt["mixtral"]})
    assert cfg.model.checkpoint == ckpt["mixtral"]
    assert cfg.model.rotary_base == 1e6 and cfg.model.num_experts == 8
    assert cfg.parallel.ep == 2
    with pytest.raises(ConfigError, match=r"run\.yaml: model\.hidden_size: 32 contradicts "
                                          r"config\.json hidden_size = 64"):
        load_config(path, {"model.checkpoint": ckpt["mixtral"], "model.hidden_size": 32})


# ---------------------------------------------------------------------- bad input
def test_missing_config_json(ckpt, tmp_path):
    d = copy_ckpt(ckpt["qwen3"], tmp_path / "c")
    os.remove(os.path.join(d, "config.json"))
    cfg_path = os.path.join(d, "config.json")
    with pytest.raises(ConfigError) as e:
        model_cfg(d)
    assert e.value.key == "model.checkpoint"
    assert f"{cfg_path}: missing" in str(e.value)
    with pytest.raises(CheckpointError, match="config.json: missing"):
        CheckpointStore(d)


def test_missing_shard_names_the_file_and_a_tensor(ckpt, tmp_path):
    d = copy_ckpt(ckpt[SHARDED], tmp_path / "s")
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
    shard = sorted(set(index.values()))[2]
    os.remove(os.path.join(d, shard))
    cfg = model_cfg(d)  # config.json alone is fine
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(cfg.model)
    msg = str(e.value)
    assert shard in msg and "shard file missing" in msg
    assert e.value.name in index and index[e.value.name] == shard and e.value.name in msg


def _broken(ckpt, tmp_path, change) -> tuple[str, str]:
    d = copy_ckpt(ckpt["qwen3"], tmp_path / "b")
    rewrite_weights(d, change)
    cfg = model_cfg(d)
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(cfg.model)
    return d, str(e.value)


def test_wrong_shape_names_the_tensor_and_file(ckpt, tmp_path, worker_groups):
    name = "model.layers.1.self_attn.k_proj.weight"

    def change(t):
        t[name] = t[name][:48].clone()

    d, msg = _broken(ckpt, tmp_path, change)
    assert f"{os.path.join(d, 'model.safetensors')}: {name}: shape [48, 64], expected [64, 64]" \
        in msg, msg
    # and the engine refuses it on every rank, before allocating anything
    res = worker_groups(2).run(f"{CASES}:load_error", directory=d)
    for r in res:
        assert "CheckpointError" in r and name in r and "shape [48, 64]" in r, r


def test_missing_tensor_is_named(ckpt, tmp_path):
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    _, msg = _broken(ckpt, tmp_path, lambda t: t.pop(name))
    assert f"{name}: missing" in msg and "[64, 32]" in msg, msg


def test_unexpected_tensor_is_named(ckpt, tmp_path):
    name = "model.layers.0.self_attn.o_proj.bias"

    def change(t):
        t[name] = torch.zeros(64)

    _, msg = _broken(ckpt, tmp_path, change)
    assert "unexpected tensor" in msg and name in msg, msg


def test_stored_router_bias_in_a_family_without_one_is_unexpected(ckpt, tmp_path):
    name = "model.layers.1.mlp.gate.e_score_correction_bias"

    def change(t):
        t[name] = torch.zeros(8)

    _, msg = _broken(ckpt, tmp_path, change)
    assert name in msg, msg


def test_hand_built_model_section_that_disagrees_is_refused_at_the_door(ckpt):
    import dataclasses

    cfg = model_cfg(ckpt["qwen3"])
    wrong = dataclasses.replace(cfg.model, num_query_groups=4)
    with pytest.raises(CheckpointError, match=r"config\.json: num_key_value_heads: the model "
                                              r"section has num_query_groups = 4"):
        check_checkpoint(wrong)


def _config_error(ckpt, tmp_path, family: str = "qwen3", parallel: dict | None = None,
                  **changes) -> ConfigError:
    d = tmp_path / "cfg"
    if not d.exists():
        d.mkdir()
        shutil.copy(os.path.join(ckpt[family], "config.json"), d / "config.json")
    edit_config(str(d), **changes)
    with pytest.raises(ConfigError) as e:
        model_cfg(str(d), parallel=parallel)
    return e.value


def test_unsupported_architecture(ckpt, tmp_path):
    e = _config_error(ckpt, tmp_path, architectures=["LlamaForCausalLM"])
    msg = str(e)
    assert e.key == "model.checkpoint"
    assert "config.json: architectures: 'LlamaForCausalLM' is not supported" in msg, msg
    assert "Qwen3MoeForCausalLM" in msg  # lists what is


@pytest.mark.parametrize("family", FAMILIES)
def test_a_config_without_architectures_is_read_by_its_model_type(ckpt, tmp_path, family):
    """As transformers' Auto classes: model_type picks the family (found by probing)."""
    d = copy_ckpt(ckpt[family], tmp_path / family)
    want = model_cfg(d).model
    edit_config(d, architectures=None)
    assert model_cfg(d).model == want
    edit_config(d, architectures=[])  # transformers loads this one by model_type too
    assert model_cfg(d).model == want
    edit_config(d, model_type="llama")
    with pytest.raises(ConfigError, match="architectures: expected a non-empty list"):
        model_cfg(d)


def test_other_mla_families_are_refused(ckpt, tmp_path):
    # DeepSeek-V2/V3's MLA is served (tests/test_mla.py); Kimi-K2's remote-code name is not
    # read as DeepSeek-V3's, and a latent width on another family is not its attention
    e = _config_error(ckpt, tmp_path, architectures=["KimiK2ForCausalLM"], kv_lora_rank=512)
    assert "architectures: 'KimiK2ForCausalLM' with multi-head latent attention" in str(e)
    e = _config_error(ckpt, tmp_path, architectures=["Qwen3MoeForCausalLM"], kv_lora_rank=512)
    assert "'Qwen3MoeForCausalLM' with multi-head latent attention" in str(e), str(e)


@pytest.mark.parametrize("rope,key", [
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0,
                          "original_max_position_embeddings": 128}}, "rope_parameters.rope_type"),
    ({"rope_parameters": None, "rope_theta": 10000.0,
      "rope_scaling": {"type": "longrope", "factor": 4.0}}, "rope_scaling.type"),
])
def test_unsupported_rope_type_names_the_key(ckpt, tmp_path, rope, key):
    e = _config_error(ckpt, tmp_path, **rope)
    assert f"config.json: {key}: RoPE type 'longrope' is not supported" in str(e), str(e)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}


@pytest.mark.parametrize("rope, top, want", [
    # Qwen3's recipe: the attention factor 0.1 ln 4 + 1 as megatron's (mscale 1, all_dim 0)
    (YARN, {}, {"rope_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 16,
                "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_mscale": 1.0,
                "yarn_mscale_all_dim": 0.0, "yarn_truncate": True}),
    # DeepSeek-V3's: both mscales given (the ratio); no factor: max_position / original
    ({**YARN, "factor": None, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16,
      "truncate": False}, {},
     {"rope_scaling_factor": 32.0, "yarn_mscale": 0.707, "yarn_mscale_all_dim": 0.707,
      "yarn_beta_fast": 16.0, "yarn_truncate": False}),
    # mscale alone: transformers ignores it (0.1 ln f + 1)
    ({**YARN, "mscale": 3.0}, {}, {"yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.0}),
    # 0 betas are transformers' defaults (`get(key) or default`)
    ({**YARN, "beta_fast": 0, "beta_slow": 0}, {}, {"yarn_beta_fast": 32.0,
                                                    "yarn_beta_slow": 1.0}),
    # a top-level original length wins over the dict's (transformers' standardisation)
    (YARN, {"original_max_position_embeddings": 64},
     {"yarn_original_max_position_embeddings": 64}),
    # ... but no other top-level RoPE key is read (transformers ignores them)
    (YARN, {"truncate": False, "beta_fast": 8, "mscale": 2.0, "mscale_all_dim": 1.0,
            "attention_factor": 1.5},
     {"yarn_truncate": True, "yarn_beta_fast": 32.0, "yarn_mscale": 1.0,
      "yarn_mscale_all_dim": 0.0}),
    ({**YARN, "original_max_position_embeddings": 16.0}, {},
     {"yarn_original_max_position_embeddings": 16}),
    # a null truncate is transformers' falsy None: no rounding of the correction range
    ({**YARN, "truncate": None}, {}, {"yarn_truncate": False}),
])
def test_yarn_is_read_as_transformers_reads_it(ckpt, tmp_path, rope, top, want):
    d = tmp_path / "cfg"
    d.mkdir()
    shutil.copy(os.path.join(ckpt["qwen3"], "config.json"), d / "config.json")
    edit_config(str(d), rope_parameters=rope, **top)
    m = model_cfg(str(d)).model
    assert m.rope_scaling == "yarn"
    assert {k: getattr(m, k) for k in want} == want


@pytest.mark.parametrize("family, rope, want", [
    # no theta anywhere: the config class's default_theta (Mixtral's 1e6)
    ("mixtral", {"rope_parameters": None, "rope_theta": None,
                 "rope_scaling": {"type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 32}}, 1e6),
    # a legacy rope_scaling replaces rope_parameters, its theta with it
    ("mixtral", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                 "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 32}}, 1e6),
    ("qwen3", {"rope_parameters": None, "rope_theta": None}, 1e4),
])
def test_a_missing_rope_theta_is_the_familys_default(ckpt, tmp_path, family, rope, want):
    d = tmp_path / "cfg"
    d.mkdir()
    shutil.copy(os.path.join(ckpt[family], "config.json"), d / "config.json")
    edit_config(str(d), **rope)
    assert model_cfg(str(d)).model.rotary_base == want


@pytest.mark.parametrize("family, want", [("qwen3", 1.0), ("qwen2", 1.0), ("mixtral", 1.0),
                                          ("glm", 0.25)])
def test_partial_rotary_is_read_only_where_transformers_applies_it(ckpt, tmp_path, family,
                                                                   want):
    """transformers' default RoPE reads partial_rotary_factor in GLM's families only; Qwen's
    and Mixtral's rotate whole heads whatever config.json says (found by probing: tokens
    differed from transformers where the engine applied it)."""
    d = copy_ckpt(ckpt[family], tmp_path / family)
    edit_config(d, partial_rotary_factor=0.25, rope_parameters={"rope_type": "default",
                                                                "rope_theta": 10000.0})
    assert model_cfg(d).model.rotary_percent == want


def test_partial_rotary_beside_whole_head_attention_matches_transformers(worker_groups,
                                                                        ckpt, tmp_path):
    d = copy_ckpt(ckpt["qwen2"], tmp_path / "qwen2")
    edit_config(d, partial_rotary_factor=0.5)
    check_equivalent(worker_groups(1).run(f"{CASES}:serve_checkpoint", directory=d, adp=1,
                                          ep=1))


@pytest.mark.parametrize("factor", [0.6, 0.3])
def test_a_partial_rotary_width_that_is_not_even_matches_transformers(worker_groups, ckpt,
                                                                       tmp_path, factor):
    """GLM's head_dim 16 x 0.6 = 9.6: transformers and megatron take int() = 9 frequencies'
    worth -- 5 frequencies over 10 dims --; x 0.3 = 4.8: 4 dims (was refused)."""
    d = copy_ckpt(ckpt["glm"], tmp_path / "glm")
    edit_config(d, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": factor})
    assert model_cfg(d).model.rotary_percent == factor
    check_equivalent(worker_groups(1).run(f"{CASES}:serve_checkpoint", directory=d, adp=1,
                                          ep=1))


def test_partial_rotary_with_llama3_scaling_is_refused_where_transformers_cannot_run_it(
        ckpt, tmp_path):
    e = _config_error(ckpt, tmp_path, partial_rotary_factor=0.5, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                       "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0})
    assert "partial_rotary_factor: 0.5 with rope_type llama3" in str(e), str(e)


def test_a_yarn_mscale_all_dim_megatron_cannot_take_names_its_own_key(ckpt, tmp_path):
    e = _config_error(ckpt, tmp_path, rope_parameters={**YARN, "factor": 16.0, "mscale": 1.0,
                                                       "mscale_all_dim": -5.0})
    assert e.key == "model.yarn_mscale_all_dim", str(e)
    assert "denominator <= 0" in str(e) and str(e).endswith(
        "config.json: rope_parameters.mscale_all_dim)"), str(e)


def test_yarn_attention_factor_is_megatrons_mscale():
    """An explicit attention_factor becomes the mscale whose megatron factor
    (0.1 m ln f + 1) equals it, and goes back out as that attention factor."""
    from colo_rollout.checkpoint.export import hf_config_dict
    from colo_rollout.config.schema import ModelConfig
    from colo_rollout.model.model import yarn_attributes
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor)

    cfg = ModelConfig(num_attention_heads=4, hidden_size=64, head_dim=32, qk_layernorm=True,
                      max_position_embeddings=512, rope_scaling="yarn",
                      rope_scaling_factor=8.0, yarn_original_max_position_embeddings=64)
    c = hf_config_dict(cfg, "Qwen3MoeForCausalLM")
    assert c["rope_parameters"]["rope_type"] == "yarn" and "attention_factor" not in \
        c["rope_parameters"]
    c["rope_parameters"]["attention_factor"] = 1.5
    back = hf_architecture(".", c).fields
    a = yarn_attributes(ModelConfig(**{**dataclasses.asdict(cfg), **back}))
    got = _yarn_get_concentration_factor(8.0, a["yarn_mscale"], a["yarn_mscale_all_dim"])
    assert got == pytest.approx(1.5, rel=1e-12)
    out = hf_config_dict(ModelConfig(**{**dataclasses.asdict(cfg), **back}),
                         "Qwen3MoeForCausalLM")
    assert out["rope_parameters"]["attention_factor"] == pytest.approx(1.5, rel=1e-12)


@pytest.mark.parametrize("rope, top, key, fragment", [
    ({**YARN, "partial_rotary_factor": 0.5}, {}, "rope_parameters.partial_rotary_factor",
     "0.5 partial rotary with rope_type yarn is not supported"),
    ({**YARN, "factor": "4"}, {}, "rope_parameters.factor", "expected a positive number"),
    ({**YARN, "beta_fast": -1}, {}, "rope_parameters.beta_fast", "expected a number >= 0"),
    ({**YARN, "truncate": "yes"}, {}, "rope_parameters.truncate", "expected true or false"),
    ({**YARN, "factor": 1.0, "attention_factor": 1.2}, {}, "rope_parameters.attention_factor",
     "1.2 with factor 1.0 <= 1: megatron-core's YaRN scales cos and sin only for factors"),
    (YARN, {"original_max_position_embeddings": 0}, "original_max_position_embeddings",
     "expected a positive int"),
])
def test_yarn_values_megatron_cannot_take_name_the_key(ckpt, tmp_path, rope, top, key,
                                                       fragment):
    e = _config_error(ckpt, tmp_path, rope_parameters=rope, **top)
    assert f"config.json: {key}: {fragment}" in str(e), str(e)


@pytest.mark.parametrize("family", ["glm", "dots"])
def test_group_limited_routing_that_keeps_every_group_is_plain_top_k(ckpt, tmp_path, family):
    """topk_group = n_group limits nothing: transformers' logits are the ungrouped router's
    (found by probing: it was refused)."""
    d = copy_ckpt(ckpt[family], tmp_path / family)
    edit_config(d, n_group=1, topk_group=1)
    want = model_cfg(d).model
    edit_config(d, n_group=4, topk_group=4)
    got = model_cfg(d).model
    assert got == want and got.router_num_groups is None


def test_top1_renormalised_routing_names_the_key(ckpt, tmp_path):
    e = _config_error(ckpt, tmp_path, num_experts_per_tok=1)  # Qwen3 with norm_topk_prob
    assert "config.json: num_experts_per_tok: 1 with Qwen3MoeForCausalLM's renormalised" in str(e)


def test_a_legacy_rope_scaling_beside_rope_parameters_wins(ckpt, tmp_path):
    """transformers 5 lets a non-empty rope_scaling replace rope_parameters (a long-context
    recipe added by hand beside the saved default): read the same way, not ignored."""
    e = _config_error(ckpt, tmp_path, rope_parameters={"rope_type": "default",
                                                       "rope_theta": 10000.0},
                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert "config.json: rope_scaling.rope_type: RoPE type 'linear' is not supported" in str(e)


@pytest.mark.parametrize("extra,key,value", [
    ({}, "max_position_embeddings", 512),  # none in the dict: transformers takes this
    ({"original_max_position_embeddings": 256}, "original_max_position_embeddings", 256),
])
def test_llama3_original_length_is_read_as_transformers_does(ckpt, tmp_path, extra, key, value):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "rope_theta": 10000.0}
    if extra:
        rope["original_max_position_embeddings"] = 8192  # the top-level value wins over it
    e = _config_error(ckpt, tmp_path, rope_parameters=rope, max_position_embeddings=512, **extra)
    assert f"config.json: {key}: {value}: the original max position embeddings" in str(e), str(e)


@pytest.mark.parametrize("parallel,key", [
    ({"world_size": 8, "adp": 1, "ep": 8}, "model.num_attention_heads"),  # 4 heads, ATP 8
    ({"world_size": 4, "adp": 1, "ep": 4}, "model.num_query_groups"),  # 2 KV heads, ATP 4
    ({"world_size": 16, "adp": 16, "ep": 16}, "model.num_experts"),  # 8 experts, EP 16
])
def test_layout_the_checkpoint_cannot_be_split_into(ckpt, tmp_path, parallel, key):
    # refused at config construction (in the launching process, before any rank starts)
    e = _config_error(ckpt, tmp_path, parallel=parallel)
    assert e.key == key and key in str(e), str(e)
    assert "not divisible by parallel." in str(e)


def test_kv_heads_from_config_json_checked_against_atp(ckpt, tmp_path):
    e = _config_error(ckpt, tmp_path, parallel={"world_size": 2, "adp": 1, "ep": 2},
                      num_key_value_heads=1)
    assert e.key == "model.num_query_groups" and "1 is not divisible by parallel.atp 2" in str(e)


# ---- export: the trainer's weights written back as a Hugging Face checkpoint that transformers
# loads and that round-trips bit-exactly (through this project's loader, and from a checkpoint
# transformers saved); same module as the import tests to share their spawned ranks
from tests.cases_export import FAMILY_MODELS  # noqa: E402


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
    # what a hub checkpoint ships beside its weights (remote code, a sentencepiece model, a
    # BPE vocabulary): copied, bytes as they are (found by probing: five named files were)
    extras = {"configuration_custom.py": b"X = 1\n", "tokenizer.model": bytes(range(256)),
              "vocab.json": b'{"a": 0}', "merges.txt": b"#version: 0.2\n"}
    for name, data in extras.items():
        (src / name).write_bytes(data)
    # the export folder already holds links into another checkpoint (a hub cache's layout, a
    # `cp -rs` copy): replaced, never written through (found by probing)
    other = tmp_path / "other"
    other.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.json", "generation_config.json", "vocab.json"):
        (other / name).write_text("untouched")
        (out / name).symlink_to(other / name)
    res = worker_groups(2).run("tests.cases_export:hf_round_trip", source=str(src),
                               directory=str(out))
    r0 = res[0]
    assert r0["names_equal"] and r0["unequal"] == [] and r0["dtype_equal"]
    assert "config.json" in r0["copied"] and "generation_config.json" in r0["copied"]
    for name, data in extras.items():
        assert (out / name).read_bytes() == data, name
    for name in ("config.json", "generation_config.json", "vocab.json"):
        assert (other / name).read_text() == "untouched" and not (out / name).is_symlink()


# ---------------------------------------------------------------------- found by probing
def test_zero_heads_without_head_dim_is_refused_before_dividing(ckpt, tmp_path):
    e = _config_error(ckpt, tmp_path, num_attention_heads=0, head_dim=None)
    assert "config.json: num_attention_heads: must be >= 1, got 0" in str(e), str(e)


@pytest.mark.parametrize("key, value, fragment", [
    ("num_hidden_layers", 10 ** 6, "model.layers.2.*: missing: config.json num_hidden_layers = "
                                   "1000000, but the checkpoint stores layers 0..1 only"),
    ("num_experts", 10 ** 6, "experts.8.*: missing: config.json num_experts = 1000000, but "
                             "the checkpoint stores experts 0..7 only")])
def test_counts_past_the_stored_tensors_are_named_at_once(ckpt, tmp_path, key, value,
                                                          fragment):
    """A config.json claiming far more layers or experts than stored: named from the tensor
    names, before the table of every expected tensor (9 GB for a million layers) is built."""
    import time

    d = copy_ckpt(ckpt["qwen3"], tmp_path / "c")
    edit_config(d, **{key: value})
    start = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(model_cfg(d).model)
    assert fragment in str(e.value), str(e.value)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float8_e5m2])
def test_weights_stored_in_a_non_float_dtype_are_refused(ckpt, tmp_path, dtype):
    name = "model.layers.1.self_attn.o_proj.weight"

    def change(t):
        t[name] = t[name].to(dtype)

    d, msg = _broken(ckpt, tmp_path, change)
    what = str(dtype).removeprefix("torch.")
    assert f"{os.path.join(d, 'model.safetensors')}: {name}: stored as {what}: weights load " \
           "from float32, float16 or bfloat16" in msg, msg


def test_a_stored_head_beside_tied_embeddings(ckpt, tmp_path):
    """transformers serves tie_word_embeddings with a stored, different lm_head untied (and
    warns): refused, naming the fix; a stored head equal to the embedding loads tied."""
    d = copy_ckpt(ckpt["qwen3"], tmp_path / "t")
    edit_config(d, tie_word_embeddings=True)
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(model_cfg(d).model)
    assert "lm_head.weight: stored beside config.json tie_word_embeddings: true, and not " \
           "equal to model.embed_tokens.weight" in str(e.value), str(e.value)
    assert "set tie_word_embeddings: false" in str(e.value)

    def same(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    rewrite_weights(d, same)
    check_checkpoint(model_cfg(d).model)


def test_config_json_nested_too_deeply(ckpt, tmp_path):
    d = tmp_path / "deep"
    d.mkdir()
    (d / "config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ConfigError, match="config.json: invalid JSON: nested too deeply"):
        model_cfg(str(d))
