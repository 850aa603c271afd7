"""A checkpoint mistake on the command line is one ``error:`` line and exit code 2, before any
rank starts (the CLI checks config.json and the safetensors headers at the door). The CLI's
``main`` runs in this process: an error at the door spawns nothing."""

from __future__ import annotations

import json
import os

import pytest

from colo_rollout import door
from tests.test_door import door_error as _door_error


def test_missing_checkpoint_is_one_error_line(tmp_path, capsys):
    line = _door_error(capsys, "demo", "configs/checkpoint_cpu.yaml", "--set",
                       f"model.checkpoint={tmp_path}")
    assert "configs/checkpoint_cpu.yaml: model.checkpoint:" in line
    assert f"{tmp_path}/config.json: missing" in line


def test_contradicting_yaml_and_a_missing_tensor_are_named(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512))
    model.save_pretrained(tmp_path)
    # demo_cpu.yaml describes its own toy model: its vocab_size contradicts config.json
    line = _door_error(capsys, "demo", "configs/demo_cpu.yaml", "--set",
                       f"model.checkpoint={tmp_path}")
    assert "model.vocab_size: 512 contradicts config.json vocab_size = 128" in line
    # a tensor missing from the file
    from safetensors.torch import load_file, save_file

    st = tmp_path / "model.safetensors"
    tensors = load_file(st)
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, st, metadata={"format": "pt"})
    line = _door_error(capsys, "train", "configs/checkpoint_cpu.yaml", "--set",
                       f"model.checkpoint={tmp_path}")
    assert "model.layers.0.self_attn.k_proj.weight: missing" in line


# --------------------------------------------------------------------------- found by probing
CKPT_YAML = "configs/checkpoint_cpu.yaml"


def _qwen3(directory, **kw):
    """A tiny Qwen3-MoE checkpoint saved by transformers (``kw``: save_tiny_checkpoint's)."""
    pytest.importorskip("transformers")
    from tests.cases_hf import save_tiny_checkpoint

    save_tiny_checkpoint(directory, "qwen3", **kw)
    return directory


def _ckpt_error(capsys, directory) -> str:
    return _door_error(capsys, "demo", CKPT_YAML, "--set", f"model.checkpoint={directory}")


@pytest.mark.timeout(60)
def test_config_json_that_is_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    # opened for a blocking read, a FIFO waits for a writer for ever: the door hung
    _qwen3(tmp_path)
    (tmp_path / "config.json").unlink()
    os.mkfifo(tmp_path / "config.json")
    line = _ckpt_error(capsys, tmp_path)
    assert line == (f"error: {CKPT_YAML}: model.checkpoint: {tmp_path}/config.json: not a "
                    "regular file (a directory, FIFO or device): a checkpoint's config.json "
                    "and index are JSON files")


def test_generation_config_that_is_not_a_regular_file_is_named(tmp_path, capsys):
    # the eos ids come from generation_config.json where it exists: a folder or FIFO under
    # its name was read as no file (config.json's ids taken instead); transformers fails
    _qwen3(tmp_path)
    target = tmp_path / "generation_config.json"
    target.unlink(missing_ok=True)
    for make, cleanup in ((target.mkdir, target.rmdir), (lambda: os.mkfifo(target),
                                                        target.unlink)):
        make()
        line = _ckpt_error(capsys, tmp_path)
        assert line == (f"error: {CKPT_YAML}: model.checkpoint: {target}: not a regular file "
                        "(a directory, FIFO or device)"), line
        cleanup()


def test_weight_file_that_is_not_a_regular_file_is_named(tmp_path, capsys):
    # was: "DIR: no weights: expected model.safetensors or ... (shards without an index are
    # not accepted)", though model.safetensors is there
    _qwen3(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").mkdir()
    line = _ckpt_error(capsys, tmp_path)
    assert line == (f"error: {tmp_path}/model.safetensors: not a regular file (a directory, "
                    "FIFO, device or a link to nowhere), so the checkpoint has no weights")
    (tmp_path / "model.safetensors").rmdir()
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "nowhere.safetensors")
    assert _ckpt_error(capsys, tmp_path) == line


def test_index_entry_naming_a_folder_is_not_called_missing(tmp_path, capsys):
    _qwen3(tmp_path, sharded=True)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["lm_head.weight"] = "sub"
    (tmp_path / "sub").mkdir()
    index.write_text(json.dumps(data))
    line = _ckpt_error(capsys, tmp_path)
    assert line == (f"error: {tmp_path}/sub: lm_head.weight: not a regular file (a directory, "
                    "FIFO or device) (listed in model.safetensors.index.json)")


def test_tensor_listed_twice_in_the_index_is_named(tmp_path, capsys):
    # JSON keeps the last entry: the error was "not in this file, though
    # model.safetensors.index.json maps it here", naming the wrong shard
    _qwen3(tmp_path, sharded=True)
    index = tmp_path / "model.safetensors.index.json"
    name = "model.layers.0.self_attn.o_proj.weight"
    text = index.read_text()
    home = json.loads(text)["weight_map"][name]
    other = next(p.name for p in sorted(tmp_path.glob("model-*.safetensors")) if p.name != home)
    entry = f'"{name}": "{home}"'
    assert entry in text
    index.write_text(text.replace(entry, f'{entry},\n    "{name}": "{other}"'))
    line = _ckpt_error(capsys, tmp_path)
    assert line == (f"error: {index}: weight_map.{name}: listed 2 times ({home!r}, {other!r}): "
                    "a tensor has one entry")
    # the same shard twice is harmless: the checkpoint passes the door
    index.write_text(text.replace(entry, f"{entry},\n    {entry}"))
    door.load("demo", CKPT_YAML, {"model.checkpoint": str(tmp_path)})


def test_zero_layers_names_num_hidden_layers(tmp_path, capsys):
    # Qwen's dense-layer keys were read against 0 layers first: "mlp_only_layers: every layer
    # dense: not a MoE model", a key the config.json never set
    _qwen3(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace('"num_hidden_layers": 2',
                                                 '"num_hidden_layers": 0'))
    line = _ckpt_error(capsys, tmp_path)
    assert line == (f"error: {CKPT_YAML}: model.checkpoint: {config}: num_hidden_layers: must "
                    "be >= 1, got 0")


def test_yarn_without_factor_is_refused_as_transformers_refuses_it(tmp_path, capsys):
    # transformers requires rope_type yarn's factor (KeyError); read without it, the factor
    # was max_position_embeddings / max_position_embeddings = 1 -- YaRN off, served silently
    _qwen3(tmp_path)
    config = tmp_path / "config.json"
    data = json.loads(config.read_text())
    data.pop("rope_parameters", None)
    data["rope_theta"] = 10000.0
    data["rope_scaling"] = {"rope_type": "yarn", "original_max_position_embeddings": 16}
    config.write_text(json.dumps(data))
    line = _ckpt_error(capsys, tmp_path)
    assert line == (f"error: {CKPT_YAML}: model.checkpoint: {config}: rope_scaling.factor: "
                    "missing: rope_type yarn requires it (null: max_position_embeddings / "
                    "original_max_position_embeddings)")
    # null is transformers' ratio: 512 / 16, as before
    data["rope_scaling"]["factor"] = None
    config.write_text(json.dumps(data))
    cfg = door.load("demo", CKPT_YAML, {"model.checkpoint": str(tmp_path)})
    assert cfg.model.rope_scaling == "yarn" and cfg.model.rope_scaling_factor == 32.0


def test_float_key_holding_an_integer_past_floats_range_is_one_line(tmp_path, capsys):
    # float(10**400) raised OverflowError: a traceback at the door
    _qwen3(tmp_path)
    config = tmp_path / "config.json"
    data = json.loads(config.read_text())
    data["rms_norm_eps"] = 10 ** 400
    config.write_text(json.dumps(data))
    line = _ckpt_error(capsys, tmp_path)
    assert line == (f"error: {CKPT_YAML}: model.checkpoint: {config}: rms_norm_eps: must be a "
                    "finite number, got an integer of 401 digits")


@pytest.mark.parametrize("key, want", [("rope_theta", "a positive number"),
                                       ("factor", "a positive number"),
                                       ("beta_fast", "a number")])
def test_rope_number_past_floats_range_is_one_line(tmp_path, capsys, key, want):
    # float(theta) and math.isfinite(10**400) raised OverflowError: a traceback at the door
    _qwen3(tmp_path)
    config = tmp_path / "config.json"
    data = json.loads(config.read_text())
    data["rope_parameters"][key] = 10 ** 400
    config.write_text(json.dumps(data))
    line = _ckpt_error(capsys, tmp_path)
    assert line.startswith(f"error: {CKPT_YAML}: model.checkpoint: {config}: "
                           f"rope_parameters.{key}: expected {want}, got 1000"), line
