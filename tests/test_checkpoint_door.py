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


def _family(directory, family):
    pytest.importorskip("transformers")
    from tests.cases_hf import save_tiny_checkpoint

    save_tiny_checkpoint(directory, family)
    return directory


def _edit(directory, drop=(), **keys):
    config = directory / "config.json"
    data = json.loads(config.read_text())
    for k in drop:
        data.pop(k, None)
    data.update(keys)
    config.write_text(json.dumps(data))


@pytest.mark.parametrize("family, keys, want", [
    # 0 kept groups: transformers masks every expert (degenerate routing), the door took
    # plain top-k -- logprobs 8-10 apart
    ("glm", {"n_group": 1, "topk_group": 0}, "topk_group: 0: expected 1 to n_group 1 groups kept"),
    ("dots", {"n_group": 1, "topk_group": 0}, "topk_group: 0: expected 1 to n_group 1"),
    ("glm_lite", {"n_group": 1, "topk_group": 0}, "topk_group: 0: expected 1 to n_group 1"),
    ("deepseek2", {"topk_method": "group_limited_greedy", "n_group": 1, "topk_group": 0},
     "topk_group: 0: expected 1 to n_group 1"),
    # every group kept read as plain top-k without the groups' own checks: transformers'
    # forward fails on each
    ("glm", {"n_group": 0, "topk_group": 0}, "n_group: 0: expected at least 1 group"),
    ("glm", {"n_group": 3, "topk_group": 3}, "n_group: 3: 8 experts do not split evenly"),
    ("dots", {"n_group": 8, "topk_group": 8}, "n_group: 8: 1 expert(s) per group; a group is "
                                              "scored by its top 2"),
    ("deepseek2", {"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 3},
     "n_group: 3: 8 experts do not split evenly"),
    # a model_type naming another supported family: transformers builds that one
    ("dots", {"model_type": "glm4_moe"}, "model_type: 'glm4_moe' is Glm4MoeForCausalLM's, but "
                                         "architectures names Dots1ForCausalLM"),
    # an explicit layer_types: Qwen2-MoE builds it as given (the door never read it)
    ("qwen2", {"layer_types": ["full_attention"]}, "layer_types: 1 entries for "
                                                   "num_hidden_layers 2"),
    ("qwen2", {"layer_types": ["sliding_attention", "full_attention"]},
     "layer_types: sliding-window attention is not supported"),
    # Dots1Config's sliding_window is 4096 where absent: layers from max_window_layers slide
    ("dots", {"max_window_layers": 1, "_drop": ["layer_types", "sliding_window"]},
     "sliding_window: 4096 from layer max_window_layers 1: sliding-window attention is not "
     "supported"),
    ("dots", {"sliding_window": 4, "max_window_layers": None, "_drop": ["layer_types"]},
     "max_window_layers: null beside sliding_window 4"),
    ("deepseek2", {"topk_method": None}, "topk_method: null: expected 'greedy' or "
                                         "'group_limited_greedy'"),
    ("glm", {"routed_scaling_factor": None}, "routed_scaling_factor: null: expected a value"),
    ("qwen2", {"decoder_sparse_step": None}, "decoder_sparse_step: null: expected an int"),
    ("qwen2", {"hidden_act": None}, "hidden_act: null: expected a value"),
    ("deepseek2", {"num_key_value_heads": 2}, "num_key_value_heads: 2: DeepSeek-V2's attention "
                                              "has one key/value head per query head"),
])
def test_what_transformers_builds_otherwise_is_refused(tmp_path, capsys, family, keys, want):
    """Found by probing the other families' config.json: each was served (some with other
    tokens than transformers'; transformers failed on the rest)."""
    _family(tmp_path, family)
    keys = dict(keys)
    _edit(tmp_path, drop=keys.pop("_drop", ()), **keys)
    line = _ckpt_error(capsys, tmp_path)
    assert line.startswith(f"error: {CKPT_YAML}: model.checkpoint: {tmp_path}/config.json: "
                           f"{want}"), line


@pytest.mark.parametrize("family, alias", [("glm", "num_local_experts"),
                                           ("dots", "num_local_experts"),
                                           ("deepseek2", "num_experts")])
def test_the_expert_count_under_transformers_alias_is_read(tmp_path, family, alias):
    """transformers' attribute_map reads num_local_experts (num_experts for DeepSeek-V2) as
    n_routed_experts: the door refused it ("n_routed_experts: missing") or took the class
    default (64 experts for DeepSeek-V2)."""
    from colo_rollout.config.hf_config import hf_architecture

    _family(tmp_path, family)
    n = json.loads((tmp_path / "config.json").read_text())["n_routed_experts"]
    _edit(tmp_path, drop=["n_routed_experts"], **{alias: n})
    arch = hf_architecture(tmp_path)
    assert arch.fields["num_experts"] == n and arch.sources["num_experts"] == alias


def test_an_output_over_what_the_run_reads_is_refused(tmp_path, capsys):
    """Found by probing: `demo --report` wrote its JSON over the config file and over the
    checkpoint's config.json, bench.out_dir / bench_speed.out_dir / rl.out_dir / bench-sync's
    --out filled the checkpoint's folder, and bench wrote its partial runs over its own trace
    (runs_partial.jsonl in the trace's folder) -- each silently, exit 0. And a file where
    train writes its tensorboard folder failed the run after ~2 minutes."""
    ckpt = _qwen3(tmp_path / "ckpt")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(open(CKPT_YAML).read())
    with_ckpt = ("--set", f"model.checkpoint={ckpt}")
    line = _door_error(capsys, "demo", str(cfg), *with_ckpt, "--report", str(cfg))
    assert line == (f"error: --report: {cfg}: is the config file {cfg}, which the run reads; "
                    "write elsewhere")
    line = _door_error(capsys, "demo", str(cfg), *with_ckpt, "--report",
                       str(ckpt / "config.json"))
    assert line == (f"error: --report: {ckpt / 'config.json'}: is inside model.checkpoint "
                    f"{ckpt}, which the run reads; write elsewhere")
    line = _door_error(capsys, "train", str(cfg), *with_ckpt, "--set", f"rl.out_dir={ckpt}")
    assert line.startswith(f"error: {cfg}: rl.out_dir: {ckpt}: is model.checkpoint {ckpt}, "
                           "which the run reads"), line
    line = _door_error(capsys, "bench-sync", str(cfg), *with_ckpt, "--out", str(ckpt / "x"))
    assert line.startswith(f"error: --out: {ckpt / 'x'}: is inside model.checkpoint"), line
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tb").write_text("")
    line = _door_error(capsys, "train", str(cfg), *with_ckpt, "--set",
                       f"rl.out_dir={tmp_path / 'out'}")
    assert line.startswith(f"error: {cfg}: rl.out_dir: {tmp_path / 'out'}: cannot write here "
                           f"({tmp_path / 'out' / 'tb'} exists and is not a folder"), line


def test_bench_never_writes_over_its_trace(tmp_path, capsys):
    from tests.test_door import BENCH, trace_file, turn

    trace = trace_file(tmp_path, [turn()], name="runs_partial.jsonl")
    line = _door_error(capsys, "bench", BENCH, "--set", f"bench.trace={trace}", "--set",
                       f"bench.out_dir={tmp_path}")
    assert line.startswith(f"error: {BENCH}: bench.out_dir: {tmp_path}: the run would "
                           f"overwrite bench.trace {trace} (its runs_partial.jsonl there)"), line


def test_bench_mtp_names_a_checkpoint_without_an_mtp_layer(tmp_path, capsys):
    """Found by probing: the error named model.mtp_num_layers -- which bench-mtp sets itself,
    never the user -- and said to drop it."""
    ckpt = _qwen3(tmp_path / "ckpt")
    line = _door_error(capsys, "bench-mtp", CKPT_YAML, "--set", f"model.checkpoint={ckpt}",
                       "--set", "parallel.world_size=1", "--out", str(tmp_path / "o"))
    assert line == (f"error: {CKPT_YAML}: model.checkpoint: bench-mtp measures the model's MTP "
                    "layer, and the checkpoint has none (its config.json gives no "
                    "num_nextn_predict_layers / mtp layers)"), line
