"""Errors at the door: a user mistake on the command line is one ``error: FILE[:LINE]: KEY:
problem`` line on stderr and exit code 2, no traceback, before any rank is spawned or
initialised. The CLI's ``main`` runs in this process (as in test_checkpoint_door.py): a case
that got past the door would spawn ranks, and fail here by taking far longer or exiting 0/1."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from colo_rollout.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEMO = str(CONFIGS / "demo_cpu.yaml")
BENCH = str(CONFIGS / "bench_cpu.yaml")
TRAIN = str(CONFIGS / "grpo_cpu.yaml")


def door_error(capsys, *argv: str) -> str:
    """``main(argv)`` exits 2 at the door; its one stderr line (``error: ...``)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and out == ""
    return lines[0]


def at(config: str, key: str) -> str:
    """``CONFIG:LINE`` of a two-level key as an error line names it (the line the shipped
    config writes it on)."""
    section, leaf = key.split(".")
    inside = False
    for i, text in enumerate(Path(config).read_text().splitlines(), start=1):
        if not text.startswith(" ") and text.strip():
            inside = text.startswith(f"{section}:")
        elif inside and text.strip().startswith(f"{leaf}:"):
            return f"{config}:{i}"
    raise AssertionError(f"{config} does not write {key}")


def trace_file(tmp_path: Path, records: list[dict], name: str = "t.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def turn(conv="a", turn=0, **kw) -> dict:
    """A trace record; ``prompt=[ids]`` replaces prompt_tokens (explicit prompt ids)."""
    rec = {"conv": conv, "turn": turn, "prompt_tokens": 10, "output_tokens": 5, "wait_s": 0.0,
           **kw}
    if "prompt" in kw:
        del rec["prompt_tokens"]
    return rec


# --------------------------------------------------------------------------- config errors
def test_bench_config_error_is_one_line(capsys):
    line = door_error(capsys, "bench", BENCH, "--set", "bench.reps=0")
    assert line == f"error: {BENCH}: bench.reps: must be >= 1, got 0"


@pytest.mark.parametrize("cmd, config", [("demo", DEMO), ("train", TRAIN), ("bench", BENCH),
                                         ("bench-decode-overhead", DEMO)])
def test_every_config_command_checks_at_the_door(capsys, cmd, config):
    line = door_error(capsys, cmd, config, "--set", "model.hidden_size=abc")
    assert line == f"error: {config}: model.hidden_size: expected int, got str 'abc'"


@pytest.mark.parametrize("cmd, config", [("demo", DEMO), ("train", TRAIN), ("bench", BENCH)])
def test_a_normalization_the_engine_cannot_serve_is_refused_at_the_door(capsys, cmd, config):
    """(found by probing: LayerNorm passed the config check, then every command failed with
    a traceback on the norms' missing biases)"""
    line = door_error(capsys, cmd, config, "--set", "model.normalization=LayerNorm")
    assert line == (f"error: {config}: model.normalization: 'LayerNorm' is not served by the "
                    "engine (its norms, weights and checkpoints are RMSNorm's, as every "
                    "supported family's): use RMSNorm")


def test_use_te_on_is_refused_at_the_door(capsys):
    """model.use_te 'on' on a host without CUDA (this one), and with the trainer (its local
    spec cannot take the sync into TE's layers): one line naming the key."""
    line = door_error(capsys, "demo", DEMO, "--set", "model.use_te='on'")
    assert line == (f"error: {DEMO}: model.use_te: 'on' builds Transformer Engine's layers, and "
                    "this host has no CUDA device; set model.use_te: auto or off")
    from colo_rollout.config import Config, ConfigError, ModelConfig
    from colo_rollout.door import check_train

    with pytest.raises(ConfigError, match="model.use_te: 'on' builds Transformer Engine's "
                       "layers in the engine, but the trainer builds megatron's local spec"):
        check_train(Config(model=ModelConfig(use_te="on")), "c.yaml")


@pytest.mark.parametrize("cmd, config", [("demo", DEMO), ("train", TRAIN)])
def test_fp8_is_refused_at_the_door_naming_the_key(capsys, cmd, config):
    """model.fp8 on a host without an FP8 GPU (this one has no CUDA): one line naming the key,
    before any rank starts."""
    line = door_error(capsys, cmd, config, "--set", "model.fp8=hybrid", "--set",
                      "model.use_te=auto")
    assert line.startswith(f"error: {config}: model.fp8: 'hybrid' ") and "model.fp8: null" in line
    line = door_error(capsys, cmd, config, "--set", "model.fp8=e4m3", "--set",
                      "model.params_dtype=bfloat16")
    assert line == (f"error: {config}: model.fp8: 'e4m3' needs a CUDA GPU with FP8 tensor cores "
                    "(sm89 or later), and this host has no CUDA device; set model.fp8: null")


def test_config_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"model:\n  hidden_size: 64 # \xe9\n")
    line = door_error(capsys, "demo", str(path))
    assert line.startswith(f"error: {path}:2: not valid UTF-8: byte 0xe9 at column 21")


def test_set_value_that_is_not_yaml_names_the_key(capsys):
    line = door_error(capsys, "demo", DEMO, "--set", "workload.num_requests=[8")
    assert line.startswith("error: --set workload.num_requests: the value '[8' is not valid "
                           "YAML at column 3")
    line = door_error(capsys, "train", TRAIN, "--set", "rl.steps")
    assert line.startswith("error: --set rl.steps: expected KEY=VALUE")


def test_generate_set_value_that_is_not_yaml(capsys, tmp_path):
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--set", "engine.mode=[x", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set engine.mode: the value '[x' is not valid YAML")
    assert len(err.strip().splitlines()) == 1


def test_duplicate_section_names_both_lines(tmp_path, capsys):
    path = tmp_path / "dup.yaml"
    path.write_text("engine:\n  mode: fine\nmodel:\n  hidden_size: 64\nengine:\n"
                    "  max_batch_size: 4\n")
    line = door_error(capsys, "demo", str(path))
    assert line == (f"error: {path}:5: engine: duplicate key (first at line 1); YAML would "
                    "silently keep only this last one")


@pytest.mark.parametrize("value, fragment", [
    (".inf", "parallel.timeout_s: must be a finite number, got inf"),
    (".nan", "parallel.timeout_s: must be a finite number, got nan"),
    ("1.0e+9", "parallel.timeout_s: must be a number of seconds in [0.5, 86400]"),
])
def test_timeouts_that_would_crash_every_rank(capsys, value, fragment):
    line = door_error(capsys, "demo", DEMO, "--set", f"parallel.timeout_s={value}")
    assert line == f"error: {DEMO}: {fragment}" or line.startswith(f"error: {DEMO}: {fragment}")


@pytest.mark.parametrize("cmd, config, key, value, named", [
    # found by probing: each ended in an allocator traceback inside the ranks, or a hang
    ("demo", DEMO, "model.vocab_size", "10000000000000", "model.vocab_size"),
    ("demo", DEMO, "model.num_experts", "100000000", "model.num_experts"),
    ("demo", DEMO, "model.num_layers", "100000000", "model.num_experts"),  # most of the layers
    ("demo", DEMO, "engine.num_kv_blocks", "1000000000000", "engine.num_kv_blocks"),
    ("train", TRAIN, "model.num_experts", "100000000", "model.num_experts"),
    ("bench-speed", str(CONFIGS / "bench_speed_cpu.yaml"), "model.vocab_size", "10000000000000",
     "model.vocab_size"),
])
def test_a_run_that_cannot_fit_in_memory_names_its_largest_part(capsys, cmd, config, key,
                                                                 value, named):
    line = door_error(capsys, cmd, config, "--set", f"{key}={value}")
    # the named key's line where the file writes it (not the overridden key's own: the
    # file's line would show a value that is not the one refused)
    where = config if named == key else at(config, named)
    assert line.startswith(f"error: {where}: {named}: the run needs at least "), line
    assert "GiB), more than this host's" in line, line


def test_the_memory_need_counts_each_ranks_share():
    """memory_need: the rank's share of each part (the embedding over attention TP, the
    experts over every rank), the whole model once more where random weights are drawn."""
    from colo_rollout.config import load_config
    from colo_rollout.config.tensor_shapes import parameter_counts, tensor_shapes
    from colo_rollout.door import memory_need

    cfg = load_config(DEMO, {"model.num_layers": 3, "model.first_k_dense": 1,
                             "model.mtp_num_layers": 1})
    n = parameter_counts(cfg.model)
    assert n.total == sum(math.prod(s) for s in tensor_shapes(cfg.model).values())
    b, lay = 4, cfg.parallel
    need = memory_need(cfg)
    assert need["model.vocab_size"] == n.vocab * b // lay.atp
    assert need["model.num_experts"] == n.experts * b // lay.world_size
    drawn = memory_need(cfg, drawn_whole=True)
    assert sum(drawn.values()) - sum(need.values()) == pytest.approx(n.total * b, abs=8)


def test_the_routing_record_counts_in_the_memory_need(capsys):
    """With engine.record_routing each rank holds the routing record, sized by P's token
    budget and the largest decode bucket (found by probing: a bucket of 10^12 passed the door
    and failed in each rank's allocator)."""
    from colo_rollout.config import load_config
    from colo_rollout.door import memory_need

    cfg = load_config(DEMO, {"engine.record_routing": True})
    need = memory_need(cfg)  # int16 ids x 2 MoE layers x top-2 x 2 replicas a row
    assert need["engine.max_prefill_tokens"] == 2 * 2 * 2 * 2 * 512
    assert need["engine.decode_buckets"] == 2 * 2 * 2 * 2 * 16
    assert "engine.decode_buckets" not in memory_need(load_config(DEMO))
    line = door_error(capsys, "demo", DEMO, "--set", "engine.record_routing=true", "--set",
                      "engine.decode_buckets=[1, 2, 4, 8, 16, 1000000000000]")
    assert line.startswith(f"error: {DEMO}: engine.decode_buckets: the run needs at least "
                           "2.98e+04 GiB (2 ranks x "), line
    assert "decode_buckets 1.49e+04 GiB), more than this host's" in line, line


def test_a_training_step_that_cannot_fit_names_its_size(capsys):
    line = door_error(capsys, "train", TRAIN, "--set", "rl.prompts_per_step=100000", "--set",
                      "rl.samples_per_prompt=100000")
    assert line.startswith(f"error: {TRAIN}: rl.prompts_per_step: 100000 prompts x "
                           "rl.samples_per_prompt 100000 = 10000000000 trajectories"), line


def test_an_mtp_model_under_a_tensor_parallel_trainer_is_refused(capsys):
    line = door_error(capsys, "train", TRAIN, "--set", "model.mtp_num_layers=1", "--set",
                      "rl.trainer_tp=2")
    assert line.startswith(f"error: {TRAIN}: rl.trainer_tp: 2 with model.mtp_num_layers 1: "
                           "megatron's MTP layer on the local spec"), line


def test_an_export_the_format_cannot_hold_is_refused_before_training(capsys, tmp_path):
    """(found by probing: refused only after the whole run, then the other rank waited out
    its timeout)"""
    line = door_error(capsys, "train", TRAIN, "--set", "model.mtp_num_layers=1", "--set",
                      f"rl.export_dir={tmp_path / 'x'}")
    assert line.startswith(f"error: {TRAIN}: rl.export_dir: the model cannot be written as a "
                           "MixtralForCausalLM checkpoint: mtp.layers.0.enorm.weight: the "
                           "MixtralForCausalLM format stores no MTP layers"), line


def test_top1_without_pre_softmax(capsys):
    line = door_error(capsys, "demo", DEMO, "--set", "model.moe_router_topk=1")
    assert line.startswith(f"error: {DEMO}: model.router_norm_topk: true with moe_router_topk 1 "
                           "and router_score 'softmax' is refused by megatron")


def test_a_triton_kernel_asked_for_on_cpu_ranks(capsys):
    line = door_error(capsys, "demo", DEMO, "--set", "engine.decode_attention=triton")
    assert line.startswith(f"error: {DEMO}: engine.decode_attention: 'triton' cannot run here: "
                           "the Triton kernels run on GPU ranks, and parallel.backend is 'gloo'")


def test_cudnn_attention_asked_for_on_cpu_ranks(capsys):
    line = door_error(capsys, "demo", DEMO, "--set", "engine.prefill_attention=cudnn")
    assert line.startswith(f"error: {DEMO}: engine.prefill_attention: 'cudnn' cannot run here: "
                           "cuDNN's attention and the Triton kernels run on GPU ranks")


def test_flash_attention_asked_for_on_cpu_ranks(capsys):
    line = door_error(capsys, "demo", DEMO, "--set", "engine.prefill_attention=flash")
    assert line.startswith(f"error: {DEMO}: engine.prefill_attention: 'flash' cannot run here: "
                           "FlashAttention-4 and the Triton kernels run on GPU ranks")


def test_dense_kernel_problems_name_the_config_keys(monkeypatch):
    """On a CUDA host the dense kernels' checks come back in the config's words."""
    import builtins

    import torch

    from colo_rollout import door
    from colo_rollout.config.schema import ModelConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    assert door._dense_kernel_problem("cudnn", ModelConfig(params_dtype="float32")) == (
        "the model is torch.float32 (cuDNN's fused attention takes 16-bit)")
    assert door._dense_kernel_problem("cudnn", ModelConfig(params_dtype="bfloat16",
                                                           head_dim=100)) == (
        "head_dim 100 is not a multiple of 8 up to 128")
    real = builtins.__import__

    def no_flash(name, *args, **kwargs):
        if name.startswith("flash_attn"):
            raise ModuleNotFoundError(f"No module named '{name}'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flash)
    m = ModelConfig(params_dtype="bfloat16", head_dim=128)
    assert door._dense_kernel_problem("flash", m).startswith(
        "flash_attn.cute (FlashAttention-4) does not import: ModuleNotFoundError")
    assert door._dense_kernel_problem("cudnn", m) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert door._dense_kernel_problem("flash", m).startswith("the GPU is sm_80")


def test_output_files_that_are_not_files_are_refused(capsys, tmp_path):
    """A folder where the run writes its report file (found by the last write, after the
    whole run), and a --report that is a device: refused at the door."""
    out = tmp_path / "o"
    (out / "bench_speed.json").mkdir(parents=True)
    line = door_error(capsys, "bench-speed", str(CONFIGS / "bench_speed_cpu.yaml"), "--set",
                      f"bench_speed.out_dir={out}")
    assert line.endswith(f"bench_speed.out_dir: {out}: cannot write here ({out}/"
                         "bench_speed.json exists and is not a regular file (the run writes "
                         "its bench_speed.json there))"), line
    (out / "bench_sync.json").mkdir()
    line = door_error(capsys, "bench-sync", str(CONFIGS / "bench_speed_cpu.yaml"), "--out",
                      str(out))
    assert "bench_sync.json exists and is not a regular file" in line, line
    line = door_error(capsys, "demo", DEMO, "--report", "/dev/full")
    assert line == "error: --report: /dev/full: cannot write here (/dev/full is not a regular " \
        "file)", line


def test_versus_mistakes_name_versus(capsys):
    from colo_rollout.tools.bench_speed import versus_overrides
    from colo_rollout.config import ConfigError

    for text, want in (("engine.mode='fine", "--versus engine.mode='fine: No closing "
                                             "quotation"),
                       ("engine.mode", "--versus engine.mode: expected KEY=VALUE"),
                       ("engine.mode=[", "--versus engine.mode: the value '[' is not valid")):
        with pytest.raises(ConfigError) as e:
            versus_overrides(text)
        assert str(e.value).startswith(want), str(e.value)


def test_the_reverse_tasks_prompts_are_held_to_the_engine(capsys):
    """rl.task reverse: its prompts are rl.reverse_len + 1 tokens whatever rl.prompt_len_max
    says -- the door checks those (it checked prompt_len_max: completions were silently cut
    and every prompt refused at the prefill budget, with exit 0)."""
    base = ["--set", "rl.task=reverse", "--set", "rl.prompt_len_max=2"]
    line = door_error(capsys, "train", TRAIN, *base, "--set", "rl.reverse_len=20",
                      "--set", "rl.max_new_tokens=20", "--set", "engine.max_seq_len=32")
    assert line == (f"error: {TRAIN}: rl.max_new_tokens: 20 tokens after rl.reverse_len 20: "
                    "prompts of 21 tokens exceed engine.max_seq_len 32")
    line = door_error(capsys, "train", TRAIN, *base, "--set", "rl.reverse_len=20",
                      "--set", "rl.max_new_tokens=20", "--set", "engine.max_prefill_tokens=16")
    assert line.startswith(f"error: {TRAIN}: rl.reverse_len: the trainer's longest prompt (21 "
                           "tokens, max_new_tokens 20) would be refused"), line


def test_train_output_paths_that_would_do_harm(capsys, tmp_path):
    """An empty out_dir / export_dir (the working directory: a checkpoint written there, or a
    traceback after the ranks started), an export into the checkpoint the run reads, or onto
    a file the run writes: refused at the door."""
    line = door_error(capsys, "train", TRAIN, "--set", "rl.export_dir=''")
    assert line == f"error: {TRAIN}: rl.export_dir: : cannot write here (an empty path)"
    line = door_error(capsys, "train", TRAIN, "--set", "rl.out_dir=' '")
    assert line.endswith("rl.out_dir:  : cannot write here (an empty path)"), line
    out = tmp_path / "run"
    line = door_error(capsys, "train", TRAIN, "--set", f"rl.out_dir={out}",
                      "--set", f"rl.export_dir={out}/metrics.jsonl")
    assert line.endswith(f"rl.export_dir: {out}/metrics.jsonl: the run writes its own "
                         f"metrics.jsonl there (rl.out_dir {out})"), line
    from colo_rollout.config import ConfigError
    from colo_rollout.door import _check_export_dir
    from colo_rollout.config import load_config
    import dataclasses

    cfg = load_config(TRAIN)
    for export, where in ((tmp_path / "ck", "is model.checkpoint"),
                          (tmp_path / "ck" / "sub", "is inside model.checkpoint")):
        bad = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, checkpoint=str(tmp_path / "ck")), rl=dataclasses.replace(
            cfg.rl, export_dir=str(export)))
        with pytest.raises(ConfigError, match=f"rl.export_dir: {export}: {where}"):
            _check_export_dir(bad, TRAIN)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors",
                                  "model-00001-of-00002.safetensors"])
def test_an_export_dir_holding_a_folder_of_a_name_the_export_writes(capsys, tmp_path, name):
    """(found by probing: the export failed after the whole run, leaving weights beside no
    config)"""
    export = tmp_path / "export"
    (export / name).mkdir(parents=True)
    (export / "notes").mkdir()  # a folder of another name is the user's
    line = door_error(capsys, "train", TRAIN, "--set", f"rl.export_dir={export}")
    assert line == (f"error: {TRAIN}: rl.export_dir: {export}: {name} there is a folder; the "
                    "export writes a file of that name")


def test_a_stray_world_size_is_not_taken_for_torchrun(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    line = door_error(capsys, "demo", DEMO)
    assert line == ("error: WORLD_SIZE is set ('1'), so this process would be a torchrun rank, "
                    "but RANK, LOCAL_RANK not set: launch it with torchrun, or unset "
                    "WORLD_SIZE to run the CPU ranks")
    # one process where the config asks for two: named before the process group exists
    # (one rank without MASTER_ADDR/PORT gets this host's: env:// reads them)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    line = door_error(capsys, "demo", DEMO)
    assert line == (f"error: {DEMO}: parallel.world_size: 2, but torchrun started 1 processes "
                    "(WORLD_SIZE): launch --nproc-per-node 2 or set parallel.world_size 1")
    import os

    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["MASTER_PORT"].isdigit()
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert "but MASTER_ADDR, MASTER_PORT not set" in door_error(capsys, "demo", DEMO)


def test_an_empty_config_path_is_named_as_the_argument(capsys):
    assert door_error(capsys, "demo", "") == ("error: CONFIG: no config file named (the path "
                                              "is empty)")


@pytest.mark.parametrize("env,why", [
    ({"WORLD_SIZE": "1", "RANK": "1"}, "RANK 1 is not below WORLD_SIZE 1"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK 5 is not below WORLD_SIZE 2"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE 0: a run has at least one rank"),
    ({"WORLD_SIZE": "2", "MASTER_PORT": "notaport"}, "MASTER_PORT 'notaport' is not a port"),
    ({"WORLD_SIZE": "1", "MASTER_PORT": "99999"}, "MASTER_PORT '99999' is not a port"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "1", "RANK": "1"},
     "LOCAL_RANK 1 is not below LOCAL_WORLD_SIZE 1"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "nonexistent.invalid"},
     "MASTER_ADDR 'nonexistent.invalid' does not resolve"),
])
def test_a_torchrun_environment_torchrun_never_makes_is_refused(capsys, monkeypatch, env, why):
    """Found by probing: RANK past WORLD_SIZE waited for its peers for ever, WORLD_SIZE 0 was
    taken for a world, a bad MASTER_PORT was a traceback, an unresolvable MASTER_ADDR a
    retry loop that never ended."""
    base = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for key, value in {**base, **env}.items():
        monkeypatch.setenv(key, value)
    line = door_error(capsys, "demo", DEMO)
    assert line.startswith(f"error: torchrun's environment: {why}"), line


def test_unsupported_trainer_width(capsys):
    line = door_error(capsys, "train", TRAIN, "--set", "rl.trainer_tp=3")
    assert line.startswith(f"error: {TRAIN}: rl.trainer_tp: 3 does not divide "
                           "parallel.world_size 2")


def test_trainer_ep_not_a_multiple_of_trainer_tp(capsys):
    line = door_error(capsys, "train", TRAIN, "--set", "parallel.world_size=4",
                      "--set", "rl.trainer_tp=4", "--set", "rl.trainer_ep=2")
    assert line.startswith(f"error: {TRAIN}: rl.trainer_ep: 2 with rl.trainer_tp 4 is not "
                           "supported: with both above 1 trainer_ep must be a multiple of "
                           "trainer_tp")


# --------------------------------------------------------------------------- workloads
def test_demo_workload_over_the_prefill_budget(capsys):
    line = door_error(capsys, "demo", DEMO, "--set", "engine.max_prefill_tokens=32")
    where = at(DEMO, "workload.prompt_len_max")  # the key the check names, where it is written
    assert line == (f"error: {where}: workload.prompt_len_max: the workload's longest request "
                    "(prompt 192 + output_len_max 64 tokens) would be refused: prompt of 192 "
                    "tokens exceeds engine.max_prefill_tokens 32")


def test_only_the_demo_holds_its_workload_to_max_seq_len(capsys):
    """engine.max_seq_len below the workload section's longest request: the demo, which serves
    it, refuses at the door; bench and train, which serve a trace or the rl section, do not
    look at it."""
    from colo_rollout.door import load

    small = {"engine.max_seq_len": 96}  # demo_cpu's workload: 192 + 64
    line = door_error(capsys, "demo", DEMO, "--set", "engine.max_seq_len=96")
    where = at(DEMO, "workload.prompt_len_max")
    assert line == (f"error: {where}: workload.prompt_len_max: the workload's longest request "
                    "(prompt 192 + output_len_max 64 tokens) would be refused: prompt (192) + "
                    "max_tokens (64) = 256 exceeds engine.max_seq_len 96")
    assert load("bench", BENCH, {**small, "workload.prompt_len_max": 192,
                                 "workload.output_len_max": 64}).engine.max_seq_len == 96
    assert load("train", TRAIN, {**small, "workload.prompt_len_max": 192,
                                 "workload.output_len_max": 64}).engine.max_seq_len == 96


def test_demo_workload_over_the_kv_blocks_and_top_k_over_the_vocabulary(capsys):
    line = door_error(capsys, "demo", DEMO, "--set", "engine.num_kv_blocks=4")
    assert "workload.prompt_len_max" in line and "KV blocks, a replica has 4" in line
    line = door_error(capsys, "demo", DEMO, "--set", "workload.top_k=100000")
    assert line.startswith(f"error: {DEMO}: workload.top_k: every request of the workload "
                           "would be refused: top_k 100000 exceeds the vocabulary size")


@pytest.mark.parametrize("n", ["9000000000000000000", "100000000000"])
def test_demo_workload_no_host_can_hold_is_refused(capsys, n):
    """The demo makes its requests up front on every rank (found by probing: 10^20 requests
    grew the ranks silently until they were killed)."""
    line = door_error(capsys, "demo", DEMO, "--set", f"workload.num_requests={n}")
    assert line.startswith(f"error: {DEMO}: workload.num_requests: {n} requests hold at least ")
    assert "GiB on each of 2 rank(s), more than this host's" in line


BIG = "1" + "0" * 400


@pytest.mark.parametrize("cmd,key", [
    ("demo", "model.vocab_size"), ("demo", "engine.num_kv_blocks"),
    ("demo", "model.num_layers"), ("demo", "model.hidden_size"),
    ("demo", "workload.num_requests"), ("train", "rl.prompts_per_step"),
    ("demo", "engine.max_seq_len")])
def test_an_integer_past_64_bits_is_refused_by_the_schema(capsys, cmd, key):
    """Found by probing: a 400-digit count was an OverflowError traceback in the door's float
    arithmetic (the memory, demo and train checks, the rotary fraction); every int setting
    is a 64-bit integer."""
    line = door_error(capsys, cmd, TRAIN if cmd == "train" else DEMO, "--set", f"{key}={BIG}")
    assert line.endswith(f": {key}: 100000000000000000...0000000000000000000 is out of range: a "
                         "setting is a 64-bit integer (at most 2**63 - 1 in size)"), line


def test_the_longest_demo_request_is_refused_before_it_is_made(capsys):
    """Found by probing: the door built the longest request as a tuple of prompt_len_max ints
    before asking whether the engine takes it (10^11 a MemoryError, 10^20 an OverflowError);
    the length it names is the longer of the two (output_len_max 10^11 had been blamed on
    prompt_len_max)."""
    line = door_error(capsys, "demo", DEMO, "--set", "workload.prompt_len_max=100000000000")
    assert line.startswith(f"error: {DEMO}: workload.prompt_len_max: the workload's longest "
                           "request (prompt 100000000000 + output_len_max 64 tokens) would be "
                           "refused: prompt (100000000000) + max_tokens (64) = 100000000064 "
                           "exceeds engine.max_seq_len 512"), line
    line = door_error(capsys, "demo", DEMO, "--set", "workload.output_len_max=100000000000")
    assert line.startswith(f"error: {DEMO}: workload.output_len_max: the workload's longest "
                           "request (prompt 192 + output_len_max 100000000000 tokens)"), line


def test_positions_past_the_rotary_bound_are_refused_at_the_door(capsys):
    """Found by probing: max_position_embeddings 10^20 (with max_seq_len) passed the door and
    failed building the rotary table in every rank."""
    line = door_error(capsys, "demo", DEMO,
                      "--set", "model.max_position_embeddings=100000000000000000",
                      "--set", "engine.max_seq_len=100000000000000000")
    assert line == (f"error: {DEMO}: model.max_position_embeddings: 100000000000000000 "
                    "positions: at most 16777216 (the rotary tables hold a row per position, "
                    "built with the model)")


def test_train_prompts_and_target_that_cannot_work(capsys):
    line = door_error(capsys, "train", TRAIN, "--set", "rl.target_token=64")
    assert line.startswith(f"error: {TRAIN}: rl.target_token: 64 is outside the model's "
                           "vocabulary [0, 64)")
    line = door_error(capsys, "train", TRAIN, "--set", "engine.max_prefill_tokens=4")
    assert line.startswith(f"error: {TRAIN}: rl.prompt_len_max: the trainer's longest prompt")
    assert "exceeds engine.max_prefill_tokens 4" in line
    line = door_error(capsys, "train", TRAIN, "--set", "rl.prompt_len_max=64")
    assert "rl.prompt_len_max 64: prompts of 64 tokens leave no room for a generated token " \
        "in engine.max_seq_len 64" in line


def test_bench_decode_overhead_arguments(capsys):
    line = door_error(capsys, "bench-decode-overhead", DEMO, "--mode", "chunked")
    assert line == ("error: --mode: expected a PD mode (global_complete, global_enqueue, fine) "
                    "to time against Normal; got 'chunked'")
    # normal against itself: both slots wrote one list (a ratio of 1 with exit 0)
    line = door_error(capsys, "bench-decode-overhead", DEMO, "--mode", "normal")
    assert line.endswith("to time against Normal; got 'normal'")
    assert door_error(capsys, "bench-decode-overhead", DEMO, "--reps", "0") == \
        "error: --reps: must be in [1, 10000], got 0"
    # (found by probing: 10^20 repetitions ran on until killed; with max_seq_len 9 there was
    # no D step to time, and the ratio divided by zero after the run)
    assert door_error(capsys, "bench-decode-overhead", DEMO, "--reps", "10001") == \
        "error: --reps: must be in [1, 10000], got 10001"
    line = door_error(capsys, "bench-decode-overhead", DEMO, "--set", "engine.max_seq_len=9",
                      "--set", "workload.prompt_len_min=1", "--set", "workload.prompt_len_max=4",
                      "--set", "workload.output_len_min=1", "--set", "workload.output_len_max=4")
    assert "engine.max_seq_len must be >= 10 (8 prompt tokens + at least 2 generated" in line


def test_bench_mtp_and_bench_sync_counts_are_bounded(capsys):
    """Found by probing: bench-mtp's --prompt-len 10^20 was an OverflowError traceback at the
    door (10^10 a MemoryError), and 10^14 repetitions, 10^11 distillation sequences or 10^23
    bench-sync iterations ran until killed."""
    cfg = str(CONFIGS / "bench_speed_cpu.yaml")
    line = door_error(capsys, "bench-mtp", cfg, "--batches", "1", "--prompt-len",
                      "100000000000000000000")
    assert "--prompt-len 100000000000000000000 + --new-tokens 128) would not all be served: " \
           "prompt (100000000000000000000) + max_tokens (128) = 100000000000000000128 " \
           "exceeds engine.max_seq_len" in line, line
    for flag, value, want in (("--reps", "100000000000000",
                               "--reps: must be at most 10000, got 100000000000000"),
                              ("--distill-seqs", "100000000000",
                               "--distill-seqs: must be at most 10000, got 100000000000"),
                              ("--distill-batch", "1000", "--distill-batch: 1000 sequences a "
                               "step, more than the 128 --distill-seqs there are")):
        assert arg_error(capsys, "bench-mtp", cfg, flag, value) == f"error: {want}"
    assert arg_error(capsys, "bench-sync", cfg, "--iters", "99999999999999999999999") == \
        "error: --iters: must be in [1, 10000], got 99999999999999999999999"


def arg_error(capsys, *argv: str) -> str:
    """``main(argv)`` returns 2 for a flag it refuses itself; its one stderr line."""
    capsys.readouterr()
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


# --------------------------------------------------------------------------- the bench's trace
def test_missing_trace_file(tmp_path, capsys):
    path = tmp_path / "absent.jsonl"
    line = door_error(capsys, "bench", BENCH, "--set", f"bench.trace={path}")
    assert line == (f"error: {path}: file: cannot read trace file: No such file or directory "
                    f"(bench.trace of {BENCH})")


def test_bad_trace_line_is_named_once_not_per_rank(tmp_path, capsys):
    path = trace_file(tmp_path, [turn(), turn("a", 1, wait_s=-1.0)])
    line = door_error(capsys, "bench", BENCH, "--set", f"bench.trace={path}")
    assert line == f"error: {path}:2: wait_s: must be >= 0, got -1.0 (bench.trace of {BENCH})"


@pytest.mark.parametrize("record, fragment", [
    (turn(prompt_tokens=10**30), ":1: prompt_tokens: must be at most 10,000,000 tokens"),
    (turn(arrival_s=1e9), ":1: arrival_s: must be at most 86400 s"),
])
def test_absurd_trace_numbers(tmp_path, capsys, record, fragment):
    path = trace_file(tmp_path, [record])
    line = door_error(capsys, "bench", BENCH, "--set", f"bench.trace={path}")
    assert line.startswith(f"error: {path}{fragment}")


def _ids(n: int) -> list[int]:
    return list(range(1, n + 1))


def test_explicit_prompt_ids_the_bench_can_never_run(tmp_path, capsys):
    one = ["--set", "bench.length_scale=1.0"]
    # ids outside the vocabulary (bench_cpu: vocab_size 512)
    path = trace_file(tmp_path, [turn(prompt=[1, 2, 600])])
    line = door_error(capsys, "bench", BENCH, "--set", f"bench.trace={path}", *one)
    assert line == (f"error: {path}:1: prompt: token id 600 is outside the model's vocabulary "
                    f"[0, 512) (model.vocab_size of {BENCH})")
    # a prompt longer than one turn may hold (bench_cpu: max_seq_len 512)
    recs = [turn(), turn("b", 0, prompt=_ids(510), output_tokens=5)]
    path = trace_file(tmp_path, recs)
    line = door_error(capsys, "bench", BENCH, "--set", f"bench.trace={path}", *one)
    assert line.startswith(f"error: {path}:2: prompt: 510 prompt ids + 5 output tokens exceed "
                           "the 512 tokens one turn may hold here")
    # explicit ids cannot be rescaled (bench_cpu: length_scale 0.03)
    path = trace_file(tmp_path, [turn(prompt=[1, 2])])
    line = door_error(capsys, "bench", BENCH, "--set", f"bench.trace={path}")
    assert line.startswith(f"error: {at(BENCH, 'bench.length_scale')}: bench.length_scale: 0.03 "
                           "cannot rescale the "
                           f"explicit prompt ids of {path}:1")


def test_a_replay_scheduled_past_the_runs_limit(tmp_path, capsys):
    """Arrivals in ms read as seconds, or waits scaled into hours: refused at the door, not a
    replay sitting at 0% until the run's limit tears it down."""
    # (an arrival past the limit is the trace's own: found by probing, it was blamed on
    # bench.wait_scales, which cannot move it)
    path = trace_file(tmp_path, [dict(turn(), arrival_s=80_000)])
    line = door_error(capsys, "bench", BENCH, "--set", f"bench.trace={path}")
    assert line == (f"error: {path}: arrival_s: conversation 'a' arrives at 80000 s, past the "
                    "3600 s a replay may take (a trace in milliseconds read as seconds?) "
                    f"(bench.trace of {BENCH})")
    path = trace_file(tmp_path, [dict(turn(), arrival_s=3000),
                                 dict(turn(turn=1), wait_s=1000.0)], name="w.jsonl")
    line = door_error(capsys, "bench", BENCH, "--set", f"bench.trace={path}",
                      "--set", "bench.wait_scales=[1.0]")
    assert line.startswith(f"error: {BENCH}: bench.wait_scales: conversation 'a' of {path} is "
                           "scheduled over 4000 s (arrival 3000 s + its waits x 1)"), line
    line = door_error(capsys, "bench", BENCH, "--set", "bench.wait_scales=[1000.0]")
    assert "past the 3600 s a replay may take" in line


def test_replays_that_add_up_past_the_runs_limit(tmp_path, capsys, monkeypatch):
    """Each replay fits the limit, but the warm-up and every cell together do not: refused at
    the door (a spawned run's limit tore it down after an hour, with a traceback); torchrun's
    ranks have no limit on the whole run."""
    path = trace_file(tmp_path, [dict(turn(), arrival_s=1000)])
    sets = ["--set", f"bench.trace={path}", "--set", "bench.modes=[normal]",
            "--set", "bench.reps=3"]
    line = door_error(capsys, "bench", BENCH, *sets)
    assert line.startswith(f"error: {BENCH}: bench.reps: the replays are scheduled over 4000 s "
                           "at least (the warm-up and 1 wait scale(s) x 1 variant(s) x 3 "
                           "rep(s)"), line
    from colo_rollout.config import load_config
    from colo_rollout.door import bench_trace_offered

    cfg = load_config(BENCH, {"bench.trace": path, "bench.modes": ["normal"], "bench.reps": 2})
    bench_trace_offered(cfg, BENCH)  # 3000 s: within the limit
    cfg = load_config(BENCH, {"bench.trace": path, "bench.modes": ["normal"], "bench.reps": 3})
    monkeypatch.setenv("WORLD_SIZE", "1")
    bench_trace_offered(cfg, BENCH)  # under torchrun: each replay alone is held to it


@pytest.mark.parametrize("value, line", [
    ("1000000000", "bench.reps: must be at most 10000, got 1000000000"),
])
def test_bench_repeats_are_bounded(capsys, value, line):
    assert door_error(capsys, "bench", BENCH, "--set", f"bench.reps={value}") \
        == f"error: {BENCH}: {line}"


@pytest.mark.parametrize("key, value, line", [
    ("bench.modes", "[normal,normal]", "lists a mode twice: ['normal', 'normal']"),
    ("bench.spans", "[1,2,1]", "lists a span twice: [1, 2, 1]"),
    # (no mode at all was reported as "unknown mode(s) []")
    ("bench.modes", "[]", "must list at least one mode, from ['normal', 'global_complete', "
                          "'global_enqueue', 'fine']"),
])
def test_a_variant_listed_twice_is_refused(capsys, key, value, line):
    """(it ran twice and the table pooled both runs as one variant's reps); and none listed"""
    assert door_error(capsys, "bench", BENCH, "--set", f"{key}={value}") \
        == f"error: {BENCH}: {key}: {line}"


@pytest.mark.parametrize("value", ["nan", "inf", "-Infinity"])
def test_a_float_setting_of_nan_or_inf_is_not_taken_for_an_exponent(capsys, value):
    line = door_error(capsys, "demo", DEMO, "--set", f"workload.temperature={value}")
    assert line == (f"error: {DEMO}: workload.temperature: must be a finite number, got "
                    f"{value!r}")


def test_a_temperature_past_float32_names_the_temperature(capsys):
    line = door_error(capsys, "demo", DEMO, "--set", "workload.temperature=1.0e+39")
    assert line.startswith(f"error: {DEMO}: workload.temperature: every request of the "
                           "workload would be refused: temperature 1e+39 is past float32's "
                           "largest value"), line


@pytest.mark.parametrize("key,value", [("bench.length_scale", "1.0e+308"),
                                       ("bench.wait_scales", "[1.0e+300]")])
def test_scales_past_any_run_are_refused(capsys, key, value):
    line = door_error(capsys, "bench", BENCH, "--set", f"{key}={value}")
    assert line.startswith(f"error: {BENCH}: {key}: must be "), line
    assert len(line) < 300


@pytest.mark.parametrize("section", ["model", "workload"])
def test_a_seed_past_32_bits(capsys, section):
    line = door_error(capsys, "demo", DEMO, "--set", f"{section}.seed=100000000000000")
    assert line == (f"error: {DEMO}: {section}.seed: must be in [0, 4294967295], got "
                    f"100000000000000")


def test_a_mooncake_format_file_by_path(tmp_path):
    """bench.trace 'mooncake:PATH': a user's Mooncake-format file (ms timestamps; a request
    whose blocks extend an earlier one's continues its conversation)."""
    from colo_rollout.config import load_config
    from colo_rollout.door import bench_trace

    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"timestamp": 0, "input_length": 200, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 500, "input_length": 300, "output_length": 5, "hash_ids": [7]})))
    cfg = load_config(BENCH, {"bench.trace": f"mooncake:{path}", "bench.length_scale": 1.0})
    trace = bench_trace(cfg, BENCH)
    assert trace.num_requests == 2 and trace.conversations[1].arrival_s == 0.5


def test_a_trace_with_no_turn_that_fits(tmp_path, capsys):
    path = trace_file(tmp_path, [turn(prompt_tokens=100_000, output_tokens=10)])
    line = door_error(capsys, "bench", BENCH, "--set", f"bench.trace={path}")
    assert line.startswith(f"error: {BENCH}: bench.trace: no turn of {path} fits the engine")


def test_bench_trace_keeps_what_fits(tmp_path):
    """What passes the door is what the ranks replay: explicit ids at length_scale 1 are kept
    as they are; turns past the engine's cap are dropped with the rest of their conversation
    (the cap includes one replica's KV blocks)."""
    from colo_rollout.config import load_config
    from colo_rollout.door import bench_trace

    recs = [turn(prompt=[3, 4, 5]),
            turn("a", 1, prompt_tokens=40, output_tokens=10, wait_s=1.0),
            turn("b", 0, prompt_tokens=20, output_tokens=10)]
    path = trace_file(tmp_path, recs)
    cfg = load_config(BENCH, {"bench.trace": path, "bench.length_scale": 1.0,
                              "engine.num_kv_blocks": 4, "engine.kv_block_size": 16})
    t = bench_trace(cfg, BENCH)  # cap 64: a's turn 1 needs 8 + 50 = 58, fits; b fits
    assert [(c.conv, len(c.turns)) for c in t.conversations] == [("a", 2), ("b", 1)]
    assert t.conversations[0].turns[0].prompt == (3, 4, 5)
    cfg = load_config(BENCH, {"bench.trace": path, "bench.length_scale": 1.0,
                              "engine.num_kv_blocks": 3, "engine.kv_block_size": 16})
    t = bench_trace(cfg, BENCH)  # cap 48: a's turn 1 dropped
    assert [(c.conv, len(c.turns)) for c in t.conversations] == [("a", 1), ("b", 1)]
    # what was offered before the drop: the bench says how many turns it dropped
    from colo_rollout.door import bench_trace_offered, turn_cap

    offered, kept = bench_trace_offered(cfg, BENCH)
    assert (offered.num_requests, kept.num_requests, turn_cap(cfg.engine)) == (3, 2, 48)


# --------------------------------------------------------------------------- argument commands
@pytest.mark.parametrize("argv, line", [
    (["stress-turnstile", "--ranks", "0"], "error: --ranks: must be >= 1, got 0"),
    (["stress-turnstile", "--span", "0"],
     "error: --span: must be >= 1 (boundaries per turnstile round), got 0"),
    (["stress-turnstile", "--cycles", "0"], "error: --cycles: must be >= 1, got 0"),
    (["stress-turnstile", "--max-skew-ms", "1e9"],
     "error: --max-skew-ms: must be in [0, 10000] (a skewed rank must meet its peers within "
     "the 30 s rendezvous timeout), got 1e+09"),
    (["stress-turnstile", "--max-skew-ms", "nan"],
     "error: --max-skew-ms: must be in [0, 10000] (a skewed rank must meet its peers within "
     "the 30 s rendezvous timeout), got nan"),
    (["bench-rendezvous", "--rounds", "0"], "error: --rounds: must be >= 1, got 0"),
    (["bench-rendezvous", "--ranks", "2", "0"],
     "error: --ranks: every rank count must be >= 1, got 0"),
    # bounded above too: --ranks 100000 would have started that many processes
    (["stress-turnstile", "--ranks", "100000"],
     "error: --ranks: must be at most 64 (one process each on this host), got 100000"),
    (["stress-turnstile", "--seeds", "1000000000"],
     "error: --seeds: must be at most 1000000, got 1000000000"),
    (["stress-turnstile", "--cycles", "1000000000"],
     "error: --cycles: must be at most 1000000, got 1000000000"),
    (["bench-rendezvous", "--ranks", "2", "100000"],
     "error: --ranks: every rank count must be at most 64 (one process each on this host), "
     "got 100000"),
    (["bench-rendezvous", "--rounds", "1000000000000"],
     "error: --rounds: must be at most 1000000, got 1000000000000"),
])
def test_argument_checks(capsys, argv, line):
    assert door_error(capsys, *argv) == line


# --------------------------------------------------------------------------- megatron's rules
def test_schema_accepts_only_router_settings_megatron_builds():
    """Every router/MoE combination the schema accepts builds megatron's TransformerConfig
    (megatron_config), so no accepted config crashes every rank there; the one combination
    megatron refuses (softmax top-1 without pre-softmax) is refused by the schema first."""
    pytest.importorskip("megatron.core")
    from colo_rollout.config import ConfigError, ModelConfig
    from colo_rollout.model.model import megatron_config

    accepted = 0
    for score, norm, topk, groups, bias, scale, shared, dense in itertools.product(
            ("softmax", "sigmoid"), (True, False), (1, 2, 4), (None, (4, 2), (2, 1)),
            (False, True), (1.0, 2.5), (None, 32), (0, 1)):
        kw = dict(router_score=score, router_norm_topk=norm, moe_router_topk=topk,
                  router_expert_bias=bias, router_scaling_factor=scale,
                  shared_expert_ffn_hidden_size=shared, first_k_dense=dense)
        if groups:
            kw.update(router_num_groups=groups[0], router_group_topk=groups[1])
        try:
            cfg = ModelConfig(**kw)
        except ConfigError:
            continue
        megatron_config(cfg, init=False)  # raises if megatron refuses it
        accepted += 1
    assert accepted > 100
    cfg = ModelConfig(moe_router_topk=1, router_norm_topk=False)
    megatron_config(cfg, init=False)
    with pytest.raises(ValueError, match="pre-softmax"):  # what the schema's rule mirrors
        megatron_config(_unchecked(cfg, router_norm_topk=True), init=False)


def _unchecked(cfg, **changes):
    """``cfg`` with ``changes`` applied without the schema's checks (to ask megatron)."""
    import copy

    out = copy.copy(cfg)
    for k, v in changes.items():
        object.__setattr__(out, k, v)
    return out


# --------------------------------------------------------------------------- found by probing
def test_a_value_of_nested_aliases_is_quoted_short(tmp_path, capsys):
    """Six levels of ten YAML aliases: a 1 KB file whose full repr is 52 MB; the message
    quotes a bounded repr of it."""
    value = "[x, x, x, x, x, x, x, x, x, x]"
    for i in range(1, 7):
        value = f"[&a{i} {value}" + f", *a{i}" * 9 + "]"
    path = tmp_path / "laughs.yaml"
    path.write_text(Path(DEMO).read_text().replace("seed: 0", f"seed: {value}"))
    line = door_error(capsys, "demo", str(path))
    at = Path(DEMO).read_text().splitlines().index(next(
        x for x in Path(DEMO).read_text().splitlines() if x.strip().startswith("seed: 0")))
    assert line.startswith(f"error: {path}:{at + 1}: workload.seed: expected int, got list [[")
    assert len(line) < 1000


def test_a_deeply_nested_trace_line(tmp_path, capsys):
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100000 + "]" * 100000 + "\n")
    line = door_error(capsys, "bench", BENCH, "--set", f"bench.trace={path}")
    assert line == (f"error: {path}:1: record: malformed JSON: nested too deeply "
                    f"(bench.trace of {BENCH})")


def test_nccl_ranks_on_a_host_without_cuda(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = door_error(capsys, "demo", DEMO, "--set", "parallel.backend=nccl")
    assert line == (f"error: {DEMO}: parallel.backend: 'nccl' runs a rank per GPU, and this "
                    "host has no CUDA device; use 'gloo' for CPU ranks")


def test_nccl_ranks_past_the_gpus(capsys, monkeypatch):
    import torch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    line = door_error(capsys, "demo", DEMO, "--set", "parallel.backend=nccl")
    assert line.endswith("parallel.world_size 2 ranks need as many GPUs, this host has 1; "
                         "use 'gloo' for CPU ranks")


@pytest.mark.parametrize("cmd, config, key", [("train", TRAIN, "rl.out_dir"),
                                              ("train", TRAIN, "rl.export_dir"),
                                              ("bench", BENCH, "bench.out_dir")])
def test_an_output_folder_under_a_file(tmp_path, capsys, cmd, config, key):
    afile = tmp_path / "afile"
    afile.write_text("")
    line = door_error(capsys, cmd, config, "--set", f"{key}={afile}/out")
    assert line == (f"error: {config}: {key}: {afile}/out: cannot write here ({afile} is not "
                    "a directory)")


def test_a_report_path_that_cannot_be_written(tmp_path, capsys):
    assert door_error(capsys, "demo", DEMO, "--report", str(tmp_path)) == (
        f"error: --report: {tmp_path}: cannot write here ({tmp_path} is a directory)")
    afile = tmp_path / "afile"
    afile.write_text("")
    assert door_error(capsys, "demo", DEMO, "--report", f"{afile}/r.json") == (
        f"error: --report: {afile}/r.json: cannot write here ({afile} is not a directory)")


def test_a_link_to_nowhere_is_refused_as_an_output(tmp_path, capsys):
    """exists() follows a link and says no: the run would have made its folder or file there
    and failed after the whole run (found by probing)."""
    gone = tmp_path / "gone"
    gone.symlink_to("/nonexistent/zz")
    why = f"{gone} is a link to /nonexistent/zz, which does not exist"
    assert door_error(capsys, "demo", DEMO, "--report", str(gone)) == (
        f"error: --report: {gone}: cannot write here ({why})")
    line = door_error(capsys, "bench", BENCH, "--set", f"bench.out_dir={gone}/sub")
    assert line == f"error: {BENCH}: bench.out_dir: {gone}/sub: cannot write here ({why})"


def test_unwritable_paths():
    from colo_rollout.door import unwritable

    assert unwritable("/tmp/colo-surely-absent/a/b") is None  # made when missing
    assert unwritable("/tmp") is None and unwritable("/tmp/x.json", file=True) is None
    assert unwritable("/proc/version/x") == "/proc/version is not a directory"


def test_rl_settings_that_would_train_nothing_or_be_cut(capsys):
    line = door_error(capsys, "train", TRAIN, "--set", "rl.samples_per_prompt=1")
    assert line == (f"error: {TRAIN}: rl.samples_per_prompt: must be >= 2 for algorithm grpo "
                    f"(its advantages compare a prompt's samples), got 1")
    line = door_error(capsys, "train", TRAIN, "--set", "rl.max_new_tokens=100000")
    assert "rl.max_new_tokens: 100000 tokens after rl.prompt_len_max" in line


def test_an_output_folder_no_file_can_be_made_in(capsys):
    """Permissions pass root in /proc, where no file can be made: a file is tried."""
    line = door_error(capsys, "train", TRAIN, "--set", "rl.export_dir=/proc/colo-export")
    assert line.startswith(f"error: {TRAIN}: rl.export_dir: /proc/colo-export: cannot write "
                           "here (no file can be made in /proc")


def test_argument_mistakes_are_one_line(capsys):
    """argparse's own refusals (a flag's type, a missing argument, an unknown command) are
    one error line too -- argparse printed its usage block first."""
    for argv, want in ((["bench-sync", BENCH, "--iters", "x"],
                        "error: --iters: invalid int value: 'x'"),
                       (["bench-sync"], "error: the following arguments are required: config"),
                       (["nope"], "error: cmd: invalid choice: 'nope'")):
        line = door_error(capsys, *argv)
        assert line.startswith(want) and line.endswith("--help: the usage)"), line
