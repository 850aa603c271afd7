"""Hugging Face import and export of the MTP ("nextn") layer of GLM-4.5-style checkpoints.

transformers builds and saves no MTP layer, so the test checkpoints are the tiny GLM of
tests/cases_hf.py (config.json: num_nextn_predict_layers 1, transformers' default) with the
layer added at model.layers.3 as the released checkpoints store it: enorm, hnorm, eh_proj,
shared_head.norm, and a decoder layer whose every tensor is twice layer 2's (so each MTP
tensor's megatron value is known from a mapping test_hf_import.py checks against transformers,
and differs from the layer it copies). GLM-4.5 style: in a shard of its own with the
embed_tokens / shared_head.head duplicates; GLM-4.6 style: one file, no duplicates. Loading
goes into a flat megatron-named state dict (no processes), export writes it back.

Which MTP layer a checkpoint has is decided by what it stores: declared (num_nextn_predict_layers
1) with none of its tensors -- every GLM checkpoint transformers saves -- loads as
mtp_num_layers 0, as transformers loads it; part of them is refused naming a missing one; all of
them load as 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from colo_rollout.checkpoint.export import export_checkpoint, hf_config_dict
from colo_rollout.checkpoint.loader import check_checkpoint, load_checkpoint
from colo_rollout.checkpoint.store import CheckpointError, CheckpointStore
from colo_rollout.config import ConfigError, config_from_dict
from colo_rollout.config.checkpoint_index import stored_tensor_names
from colo_rollout.config.hf_config import GLM4, QWEN3, hf_architecture
from colo_rollout.model.weights import shard_rule
from colo_rollout.config.tensor_shapes import tensor_shapes
from colo_rollout.runtime.parallel import Layout
from tests.cases_hf import save_tiny_checkpoint
from tests.test_hf_import import edit_config

L = 3  # the tiny GLM's num_hidden_layers: the MTP layer is model.layers.3
MTP = f"model.layers.{L}."
LAST = f"model.layers.{L - 1}."  # MoE, as the MTP layer (its kind is the last layer's)
OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
       "eh_proj.weight": "eh_proj.weight", "final_layernorm.weight": "shared_head.norm.weight"}


def add_mtp_layer(directory: str, duplicates: bool, own_shard: bool) -> None:
    """Store an MTP layer at model.layers.3 of the single-file checkpoint in ``directory``:
    a decoder layer = 2 x layer 2, random enorm / hnorm / eh_proj / shared_head.norm, and with
    ``duplicates`` copies of embed_tokens and lm_head. ``own_shard``: in a second shard with
    model.safetensors.index.json (as released checkpoints keep MTP in the last shard)."""
    single = os.path.join(directory, "model.safetensors")
    main = load_file(single)
    g = torch.Generator().manual_seed(7)
    mtp = {MTP + k[len(LAST):]: 2 * t for k, t in main.items() if k.startswith(LAST)}
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        mtp[MTP + name] = 1.0 + 0.3 * torch.randn(64, generator=g)
    mtp[MTP + "eh_proj.weight"] = torch.randn(64, 128, generator=g) / 128**0.5
    if duplicates:
        mtp[MTP + "embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
        mtp[MTP + "shared_head.head.weight"] = main["lm_head.weight"].clone()
    if not own_shard:
        save_file({**main, **mtp}, single, metadata={"format": "pt"})
        return
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    os.replace(single, os.path.join(directory, files[0]))
    save_file(mtp, os.path.join(directory, files[1]), metadata={"format": "pt"})
    weight_map = {**{k: files[0] for k in main}, **{k: files[1] for k in mtp}}
    size = sum(t.numel() * t.element_size() for t in (*main.values(), *mtp.values()))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": size}, "weight_map": weight_map}, f)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """'glm45' (MTP shard with duplicates) and 'glm46' (one file, no duplicates)."""
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for name, dup in (("glm45", True), ("glm46", False)):
        d = str(root / name)
        save_tiny_checkpoint(d, "glm")
        add_mtp_layer(d, duplicates=dup, own_shard=dup)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """GLM checkpoints as transformers' save_pretrained writes them: config.json declares
    num_nextn_predict_layers 1 (Glm4MoeConfig's default), no MTP tensor is stored. 'single':
    model.safetensors; 'sharded': ~50 KB shards with model.safetensors.index.json."""
    root = tmp_path_factory.mktemp("saved")
    out = {}
    for name in ("single", "sharded"):
        d = str(root / name)
        save_tiny_checkpoint(d, "glm", sharded=name == "sharded")
        out[name] = d
    return out


def model_cfg(directory: str, engine: dict | None = None, **model):
    return config_from_dict({"engine": {"max_seq_len": 128, **(engine or {})},
                             "model": {"checkpoint": directory, **model}}).model


def hf_tensors(directory: str) -> dict[str, torch.Tensor]:
    with CheckpointStore(directory) as store:
        return {n: store.read(n).clone() for n in store.names()}


class Flat(torch.nn.Module):
    """A model whose state dict is ``tensors`` (megatron's dotted names, no modules)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.tensors = tensors

    def state_dict(self, *args, keep_vars: bool = False, **kwargs):
        return dict(self.tensors)


def load(cfg, layout: Layout = Layout(1, 1, 1), rank: int = 0) -> dict[str, torch.Tensor]:
    """The local tensors of ``rank`` of ``layout``, read by the loader (megatron names)."""
    n_local = cfg.num_experts // layout.ep
    local = {}
    for name, shape in tensor_shapes(cfg).items():
        rule = shard_rule(name, layout, rank, n_local)
        if rule is not None:
            meta = rule.apply(torch.empty(shape, device="meta"))
            local[rule.local] = torch.full(meta.shape, float("nan"))
    load_checkpoint(Flat(local), cfg, layout, rank)
    return local


# ---------------------------------------------------------------------- config.json
def test_config_json_declares_the_mtp_layer(ckpt, tmp_path):
    import transformers as tf

    assert tf.AutoConfig.from_pretrained(ckpt["glm46"]).num_mtp_layers == 1  # the alias
    arch = hf_architecture(ckpt["glm46"])
    assert arch.sources["mtp_num_layers"] == "num_nextn_predict_layers"
    assert model_cfg(ckpt["glm46"]).mtp_num_layers == 1
    d = tmp_path / "c"
    d.mkdir()
    shutil.copy(os.path.join(ckpt["glm46"], "config.json"), d)
    edit_config(str(d), num_nextn_predict_layers=None, num_mtp_layers=1)  # transformers 5's
    assert hf_architecture(d).fields["mtp_num_layers"] == 1
    assert hf_architecture(d).sources["mtp_num_layers"] == "num_mtp_layers"
    edit_config(str(d), num_mtp_layers=None)  # absent: none
    assert hf_architecture(d).fields["mtp_num_layers"] == 0


@pytest.mark.parametrize("changes,problem", [
    ({"num_nextn_predict_layers": 2},
     "num_nextn_predict_layers: 2 MTP layers: at most 1 is supported"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers: -1: expected a count >= 0"),
    ({"num_nextn_predict_layers": None, "num_mtp_layers": 3}, "num_mtp_layers: 3 MTP layers"),
    ({"num_mtp_layers": 0}, "num_mtp_layers: 0 contradicts num_nextn_predict_layers 1"),
])
def test_unsupported_mtp_count_is_one_line_naming_config_json_and_key(ckpt, tmp_path, changes,
                                                                      problem):
    d = tmp_path / "c"
    d.mkdir()
    shutil.copy(os.path.join(ckpt["glm46"], "config.json"), d)
    edit_config(str(d), **changes)
    with pytest.raises(ConfigError) as e:
        model_cfg(str(d))
    msg = str(e.value)
    assert "\n" not in msg and e.value.key == "model.checkpoint"
    assert f"{d / 'config.json'}: {problem}" in msg, msg


# ---------------------------------------------------------------------- import
@pytest.mark.parametrize("style", ["glm45", "glm46"])
def test_loaded_mtp_tensors_are_the_checkpoints(ckpt, style):
    cfg = model_cfg(ckpt[style])
    check_checkpoint(cfg)
    sd, hf, shapes = load(cfg), hf_tensors(ckpt[style]), tensor_shapes(cfg)
    names = [n for n in shapes if n.startswith("mtp.layers.0.")]
    assert "mtp.layers.0.mtp_model_layer.mlp.router.expert_bias" in names  # a MoE layer
    assert len(names) == 4 + sum(n.startswith(f"decoder.layers.{L - 1}.") for n in shapes)
    for n in names:
        assert tuple(sd[n].shape) == shapes[n], n
        rest = n[len("mtp.layers.0."):]
        if rest in OWN:
            want = hf[MTP + OWN[rest]]
        else:  # the decoder layer: twice layer 2's tensor of the same megatron name
            want = 2 * sd[f"decoder.layers.{L - 1}." + rest[len("mtp_model_layer."):]]
        assert torch.equal(sd[n], want), n
    # spelled out for a few kinds of tensor
    e5 = "mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.5."
    assert torch.equal(sd[e5 + "linear_fc1.weight"],
                       torch.cat([hf[MTP + "mlp.experts.5.gate_proj.weight"],
                                  hf[MTP + "mlp.experts.5.up_proj.weight"]]))
    assert torch.equal(sd[e5 + "linear_fc2.weight"], hf[MTP + "mlp.experts.5.down_proj.weight"])
    assert torch.equal(sd["mtp.layers.0.mtp_model_layer.mlp.shared_experts.linear_fc2.weight"],
                       hf[MTP + "mlp.shared_experts.down_proj.weight"])


def test_tp2_ranks_read_their_slices_of_the_mtp_layer(ckpt):
    cfg = model_cfg(ckpt["glm45"])
    full = load(cfg)
    layout = Layout(2, 1, 1)  # attention TP 2, experts ETP 2
    parts = [load(cfg, layout, r) for r in range(2)]
    for name, whole in full.items():
        if not name.startswith("mtp."):
            continue
        rule = shard_rule(name, layout, 0, cfg.num_experts)
        a, b = (p[rule.local] for p in parts)
        got = {"full": lambda: a, "rows": lambda: torch.cat([a, b]),
               "cols": lambda: torch.cat([a, b], dim=1),
               "glu": lambda: torch.cat([*torch.chunk(a, 2)[:1], *torch.chunk(b, 2)[:1],
                                         *torch.chunk(a, 2)[1:], *torch.chunk(b, 2)[1:]])}
        assert torch.equal(got[rule.kind](), whole), (name, rule.kind)
        if rule.kind == "full":
            assert torch.equal(b, whole), name
    assert shard_rule("mtp.layers.0.eh_proj.weight", layout, 1, 8).kind == "rows"
    assert torch.equal(parts[1]["mtp.layers.0.eh_proj.weight"],
                       full["mtp.layers.0.eh_proj.weight"][32:])


@pytest.mark.parametrize("name", ["eh_proj.weight", "shared_head.norm.weight",
                                  "mlp.experts.7.up_proj.weight", "self_attn.k_norm.weight"])
def test_a_declared_mtp_layer_missing_a_tensor_is_refused_naming_it(ckpt, tmp_path, name):
    d = str(tmp_path / "m")
    shutil.copytree(ckpt["glm46"], d)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    del tensors[MTP + name]
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(model_cfg(d))
    msg = str(e.value)
    assert e.value.name == MTP + name and "\n" not in msg
    assert f"{d}: {MTP}{name}: missing" in msg, msg
    assert "num_nextn_predict_layers = 1 declares the MTP layer" in msg, msg


def test_duplicates_are_optional_but_shaped(ckpt, tmp_path):
    d = str(tmp_path / "m")
    shutil.copytree(ckpt["glm46"], d)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    tensors[MTP + "shared_head.head.weight"] = torch.zeros(255, 64)
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{MTP}shared_head\.head\.weight: shape "
                                              r"\[255, 64\], expected \[256, 64\]"):
        check_checkpoint(model_cfg(d))


def test_a_model_section_without_mtp_ignores_the_layer_but_not_beyond(ckpt, tmp_path):
    d = str(tmp_path / "m")
    shutil.copytree(ckpt["glm46"], d)
    cfg = model_cfg(d, mtp_num_layers=0)  # the YAML may lower it: serve without MTP
    assert cfg.mtp_num_layers == 0 and hf_architecture(d).extra_layers == 1
    check_checkpoint(cfg)
    assert not any(n.startswith("mtp.") for n in load(cfg))
    tensors = load_file(os.path.join(d, "model.safetensors"))
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(2)
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.eh_proj\.weight: "
                                              "unexpected tensor"):
        check_checkpoint(cfg)
    edit_config(d, num_nextn_predict_layers=0)  # but not raise it
    with pytest.raises(ConfigError, match=r"model\.mtp_num_layers: 1 contradicts config\.json "
                                          r"num_nextn_predict_layers = 0"):
        model_cfg(d, mtp_num_layers=1)


# ---------------------------------------------------------------------- what is stored decides
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_a_transformers_saved_checkpoint_loads_without_the_mtp_layer(saved, tmp_path, layout):
    import transformers as tf

    d = saved[layout]
    with open(os.path.join(d, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1  # declared
    with CheckpointStore(d) as store:
        names = store.names()
    assert not any(n.startswith(MTP) for n in names)  # not stored
    assert stored_tensor_names(d) == frozenset(names)  # the store's names, without torch
    assert hf_architecture(d).fields["mtp_num_layers"] == 1  # config.json alone
    cfg = model_cfg(d)
    assert cfg.mtp_num_layers == 0  # not an error: transformers ignores those layers too
    assert check_checkpoint(cfg).fields["mtp_num_layers"] == 0
    sd = load(cfg)
    assert not any(n.startswith("mtp.") for n in sd)
    # the same config and tensors as before: config.json declaring no MTP layer, or the
    # YAML's model.mtp_num_layers: 0
    none = str(tmp_path / "none")
    shutil.copytree(d, none)
    edit_config(none, num_nextn_predict_layers=0)
    for other in (model_cfg(none), model_cfg(d, mtp_num_layers=0)):
        assert {**vars(other), "checkpoint": None} == {**vars(cfg), "checkpoint": None}
        before = load(other)
        assert sorted(before) == sorted(sd)
        assert [n for n in sd if not torch.equal(sd[n], before[n])] == []
    # transformers loads it whole, nothing missing or left over
    _, info = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                      output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_a_transformers_saved_checkpoint_exports_without_the_mtp_layer(saved, tmp_path):
    d = saved["single"]
    cfg = model_cfg(d)
    out = str(tmp_path / "out")
    export_checkpoint(Flat(load(cfg)), cfg, out)
    src, back = hf_tensors(d), hf_tensors(out)
    assert sorted(back) == sorted(src)
    assert [n for n in src if not torch.equal(src[n], back[n])] == []
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 0  # what was written
    assert model_cfg(out).mtp_num_layers == 0


def test_an_export_in_another_family_than_its_source_or_dtype_is_refused(saved, tmp_path):
    """config.json is the source checkpoint's: another family's tensor names beside it loaded
    as random weights in transformers (found by probing); an unknown dtype was a KeyError.
    Nothing is written."""
    cfg = model_cfg(saved["single"])
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"export: family 'Qwen2MoeForCausalLM' is not the "
                                         r"source checkpoint's \(Glm4MoeForCausalLM, "):
        export_checkpoint(Flat(load(cfg)), cfg, out, family="Qwen2MoeForCausalLM")
    with pytest.raises(ValueError, match=r"export: dtype 'fp16': choose one of "):
        export_checkpoint(Flat(load(cfg)), cfg, out, dtype="fp16")
    assert not out.exists()
    export_checkpoint(Flat(load(cfg)), cfg, out, family="Glm4MoeForCausalLM")  # its own: fine


def test_asking_for_an_mtp_layer_a_checkpoint_does_not_store_is_one_line(saved):
    d = saved["single"]
    with pytest.raises(ConfigError) as e:  # the YAML's 1
        model_cfg(d, mtp_num_layers=1)
    msg = str(e.value)
    assert e.value.key == "model.mtp_num_layers" and "\n" not in msg
    assert ("model.mtp_num_layers: 1 contradicts the checkpoint, which stores no MTP layer "
            "(config.json num_nextn_predict_layers = 1 declares one, but no tensor is stored "
            f"under {MTP}") in msg, msg
    assert os.path.join(d, "config.json") in msg
    with pytest.raises(ConfigError) as e:  # drafting with it
        model_cfg(d, engine={"mtp": True})
    assert e.value.key == "engine.mtp" and "model.mtp_num_layers is 0" in str(e.value)
    # a hand-built model section with the layer: the first of its tensors is named
    wrong = dataclasses.replace(model_cfg(d), mtp_num_layers=1)
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(wrong)
    msg = str(e.value)
    assert e.value.name == MTP + "enorm.weight" and "\n" not in msg
    assert f"{d}: {MTP}enorm.weight: missing" in msg and "stores no MTP layer" in msg, msg


@pytest.mark.parametrize("kept", ["eh_proj.weight", "mlp.experts.7.up_proj.weight",
                                  "embed_tokens.weight"])  # even a duplicate alone is a part
def test_a_checkpoint_holding_part_of_the_mtp_layer_is_refused_naming_a_missing_tensor(
        ckpt, tmp_path, kept):
    d = str(tmp_path / "m")
    shutil.copytree(ckpt["glm46"], d)
    path = os.path.join(d, "model.safetensors")
    tensors = {n: t for n, t in load_file(path).items() if not n.startswith(MTP)}
    tensors[MTP + kept] = hf_tensors(ckpt["glm45"])[MTP + kept]
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = model_cfg(d)
    assert cfg.mtp_num_layers == 1  # some of it is stored: the declared layer stands
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(cfg)
    msg, name = str(e.value), e.value.name
    assert name.startswith(MTP) and name != MTP + kept and "\n" not in msg
    assert f"{d}: {name}: missing" in msg, msg
    assert "num_nextn_predict_layers = 1 declares the MTP layer" in msg, msg
    cfg = model_cfg(d, mtp_num_layers=0)  # the YAML may still ignore what is there
    check_checkpoint(cfg)
    assert not any(n.startswith("mtp.") for n in load(cfg))


@pytest.mark.parametrize("style", ["glm45", "glm46"])
def test_a_checkpoint_holding_the_whole_mtp_layer_loads_it(ckpt, style):
    assert stored_tensor_names(ckpt[style]) == frozenset(hf_tensors(ckpt[style]))
    cfg = model_cfg(ckpt[style])
    assert cfg.mtp_num_layers == 1
    assert check_checkpoint(cfg).fields["mtp_num_layers"] == 1
    mtp = [n for n in tensor_shapes(cfg) if n.startswith("mtp.layers.0.")]
    sd = load(cfg)
    assert mtp and all(not sd[n].isnan().any() for n in mtp)


def test_weights_that_cannot_be_listed_leave_the_declared_layer_to_the_store(ckpt, tmp_path):
    # config loading lists the names without torch; where it cannot, config.json's count
    # stands and the store names the problem when the checkpoint is checked
    d = tmp_path / "m"
    shutil.copytree(ckpt["glm46"], d)
    (d / "model.safetensors").write_bytes(b"\xff" * 16)  # not safetensors
    assert stored_tensor_names(d) is None
    cfg = model_cfg(str(d))
    assert cfg.mtp_num_layers == 1
    with pytest.raises(CheckpointError, match="model.safetensors: cannot open as safetensors"):
        check_checkpoint(cfg)
    (d / "model.safetensors").unlink()
    assert stored_tensor_names(d) is None
    with pytest.raises(CheckpointError, match="no weights"):
        check_checkpoint(model_cfg(str(d)))


# ---------------------------------------------------------------------- export
@pytest.mark.parametrize("style", ["glm45", "glm46"])
def test_export_round_trip_is_bit_exact(ckpt, tmp_path, style):
    cfg = model_cfg(ckpt[style])
    sd = load(cfg)
    out = str(tmp_path / "out")
    export_checkpoint(Flat(sd), cfg, out)
    src, back = hf_tensors(ckpt[style]), hf_tensors(out)
    dups = {MTP + "embed_tokens.weight": "model.embed_tokens.weight",
            MTP + "shared_head.head.weight": "lm_head.weight"}
    assert sorted(back) == sorted(set(src) | set(dups))  # GLM-4.6's gain the duplicates
    assert [n for n in src if not torch.equal(src[n], back[n])] == []
    for dup, main in dups.items():
        assert torch.equal(back[dup], src[main])
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    again = load(model_cfg(out))
    assert sorted(again) == sorted(sd)
    assert [n for n in sd if not torch.equal(sd[n], again[n])] == []


def test_a_model_without_its_mtp_layer_exports_a_checkpoint_without_one(ckpt, tmp_path):
    cfg = model_cfg(ckpt["glm45"])
    sd = {n: t for n, t in load(cfg).items() if not n.startswith("mtp.")}
    out = str(tmp_path / "out")
    export_checkpoint(Flat(sd), cfg, out)
    assert not any(n.startswith(MTP) for n in hf_tensors(out))
    back = model_cfg(out)
    assert back.mtp_num_layers == 0
    check_checkpoint(back)


def test_generated_config_json_declares_the_mtp_layer(ckpt):
    cfg = dataclasses.replace(model_cfg(ckpt["glm46"]), checkpoint=None)
    assert hf_config_dict(cfg, GLM4)["num_nextn_predict_layers"] == 1
    assert hf_config_dict(dataclasses.replace(cfg, mtp_num_layers=0),
                          GLM4)["num_nextn_predict_layers"] == 0
    qwen = dataclasses.replace(cfg, router_score="softmax", router_expert_bias=False,
                               router_num_groups=None, router_group_topk=None,
                               shared_expert_ffn_hidden_size=None, first_k_dense=0,
                               ffn_hidden_size=None, router_scaling_factor=1.0, qkv_bias=False,
                               rotary_percent=1.0)
    with pytest.raises(ValueError, match="mtp_num_layers = 1 would be 0"):
        hf_config_dict(qwen, QWEN3)


def test_transformers_mtp_model_reads_each_exported_tensor_where_we_put_it(ckpt, tmp_path):
    # transformers 5's MtpModel (generate(use_mtp=True)) loads the exported layer through its
    # own renaming: its enorm / hnorm / eh_proj / post_norm are our megatron tensors, and its
    # decoder block is twice the main model's layer 2, as our mtp_model_layer is
    import transformers as tf
    from transformers.modeling_layers import MtpModel

    cfg = model_cfg(ckpt["glm46"])
    sd = load(cfg)
    out = str(tmp_path / "out")
    export_checkpoint(Flat(sd), cfg, out)
    main = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    # the class's pattern names GLM-4.5's layer 92 / Air's 46; the tiny model's is layer 3
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L}\..*"]
    layer = MtpModel.from_pretrained(main).layers[0]  # raises if any MTP weight is missing
    for ours, theirs in (("enorm", layer.enorm), ("hnorm", layer.hnorm),
                         ("eh_proj", layer.eh_proj), ("final_layernorm", layer.post_norm)):
        assert torch.equal(theirs.weight, sd[f"mtp.layers.0.{ours}.weight"]), ours
    block, last = layer.mtp_block.state_dict(), main.model.layers[L - 1].state_dict()
    assert sorted(block) == sorted(last)
    assert [k for k in last if not torch.equal(block[k], 2 * last[k])] == []
