"""Tests for colo_rollout.config: shipped YAML files, defaults, round-trip, and every error path."""

import dataclasses
import pickle
import re
import textwrap
from pathlib import Path

import pytest

from colo_rollout.config import (
    ENGINE_MODES,
    Config,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    WorkloadConfig,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def assert_load_error(path: Path, *needles: str, overrides: dict | None = None) -> ConfigError:
    """load_config(path) raises ConfigError naming the file (and the line of a key the file
    writes) and every needle."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    msg = str(info.value)
    assert re.match(rf"{re.escape(str(path))}(:[0-9]+)?: ", msg), msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    assert info.value.source == str(path)
    return info.value


# --------------------------------------------------------------------------- shipped files


def test_tiny_cpu_yaml_is_defaults_with_small_layout():
    cfg = load_config(CONFIGS / "tiny_cpu.yaml")
    expected = Config(
        parallel=ParallelConfig(world_size=2, adp=2, ep=2),
        workload=WorkloadConfig(num_requests=8),
    )
    assert cfg == expected
    assert cfg.parallel.atp == 1 and cfg.parallel.etp == 1


def test_demo_cpu_yaml_values():
    cfg = load_config(CONFIGS / "demo_cpu.yaml")
    assert cfg.parallel == ParallelConfig(world_size=2, adp=2, ep=2, backend="gloo")
    m = cfg.model
    assert (m.vocab_size, m.hidden_size, m.num_layers) == (512, 128, 2)
    assert (m.num_attention_heads, m.num_query_groups) == (4, 2)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (8, 2, 256)
    e = cfg.engine
    assert (e.max_batch_size, e.max_prefill_tokens, e.kv_block_size) == (16, 512, 16)
    assert (e.num_kv_blocks, e.max_seq_len) == (256, 512)
    assert e.decode_buckets == [1, 2, 4, 8, 16]
    assert cfg.workload == WorkloadConfig(
        num_requests=48,
        prompt_len_min=8,
        prompt_len_max=192,
        output_len_min=8,
        output_len_max=64,
        temperature=0.8,
        top_k=50,
        top_p=0.95,
        seed=0,
    )


# --------------------------------------------------------------------------- defaults, round-trip


def test_defaults_valid_and_match_spec():
    cfg = Config()
    assert cfg.parallel.world_size == 1 and cfg.parallel.atp == 1 and cfg.parallel.etp == 1
    assert cfg.parallel.backend == "auto" and cfg.parallel.timeout_s == 120.0
    assert cfg.model.hidden_size == 64 and cfg.model.fp8 is None and cfg.model.head_dim == 16
    assert cfg.engine.decode_buckets == [1, 2, 4, 8, 16, 32]
    assert cfg.engine.eos_token_id is None and cfg.engine.mode == "normal"
    assert ENGINE_MODES == ("normal", "global_complete", "global_enqueue", "fine")
    assert config_from_dict({}) == cfg
    # default_factory: instances do not share the buckets list
    assert EngineConfig().decode_buckets is not EngineConfig().decode_buckets


def test_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel.world_size = 4  # type: ignore[misc]


def test_atp_etp_properties():
    p = ParallelConfig(world_size=8, adp=2, ep=4)
    assert (p.atp, p.etp) == (4, 2)


@pytest.mark.parametrize(
    "cfg",
    [
        Config(),
        Config(
            parallel=ParallelConfig(world_size=4, adp=2, ep=4, backend="nccl", timeout_s=30.5),
            model=ModelConfig(fp8="hybrid", use_te="on", params_dtype="bfloat16", rotary_base=1.0e6),
            engine=EngineConfig(eos_token_id=2, decode_buckets=[3, 40], max_batch_size=40),
            workload=WorkloadConfig(temperature=0.7, top_k=5, top_p=0.9, seed=7),
        ),
    ],
)
def test_round_trip(tmp_path, cfg):
    path = tmp_path / "dumped.yaml"
    dump_config(cfg, path)
    loaded = load_config(path)
    assert loaded == cfg
    assert config_to_dict(loaded) == config_to_dict(cfg)
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_round_trip_shipped(tmp_path):
    for name in ("tiny_cpu.yaml", "demo_cpu.yaml"):
        cfg = load_config(CONFIGS / name)
        dump_config(cfg, tmp_path / name)
        assert load_config(tmp_path / name) == cfg


def test_config_to_dict_shape():
    d = config_to_dict(Config())
    assert set(d) == {"parallel", "model", "engine", "workload", "bench", "bench_speed",
                      "rl"}
    assert d["parallel"]["adp"] == 1 and d["engine"]["decode_buckets"] == [1, 2, 4, 8, 16, 32]


# --------------------------------------------------------------------------- overrides, coercion


def test_overrides_apply(tmp_path):
    path = write(tmp_path, "parallel:\n  world_size: 2\n")
    cfg = load_config(
        path,
        {"parallel.world_size": 4, "parallel.adp": 2, "engine.decode_buckets": [8, 32], "model.fp8": "e4m3"},
    )
    assert cfg.parallel.world_size == 4 and cfg.parallel.adp == 2 and cfg.parallel.atp == 2
    assert cfg.engine.decode_buckets == [8, 32]
    assert cfg.model.fp8 == "e4m3"
    # a section absent from the file is created by the override
    assert cfg.workload.num_requests == 32
    cfg2 = load_config(path, {"workload.num_requests": 3})
    assert cfg2.workload.num_requests == 3


def test_override_is_validated(tmp_path):
    path = write(tmp_path, "parallel:\n  world_size: 2\n")
    assert_load_error(path, "parallel.adp", "not divisible", overrides={"parallel.adp": 4})


def test_unknown_override_key(tmp_path):
    path = write(tmp_path, "parallel:\n  world_size: 2\n")
    err = assert_load_error(path, "parallel.wrld_size", "world_size", overrides={"parallel.wrld_size": 4})
    assert err.key == "parallel.wrld_size"
    assert_load_error(path, "bogus.x", overrides={"bogus.x": 1})
    assert_load_error(path, "parallel.adp.x", overrides={"parallel.adp.x": 1})


def test_float_field_accepts_int(tmp_path):
    path = write(
        tmp_path,
        """
        parallel: {timeout_s: 30}
        model: {rotary_base: 500000}
        workload: {temperature: 1, top_p: 1}
        """,
    )
    cfg = load_config(path)
    assert cfg.parallel.timeout_s == 30.0 and isinstance(cfg.parallel.timeout_s, float)
    assert isinstance(cfg.model.rotary_base, float) and cfg.model.rotary_base == 500000.0
    assert isinstance(cfg.workload.temperature, float) and isinstance(cfg.workload.top_p, float)


# --------------------------------------------------------------------------- error paths


def test_unknown_top_level_key(tmp_path):
    path = write(tmp_path, "paralel:\n  world_size: 2\n")
    err = assert_load_error(path, "paralel", "parallel, model, engine, workload")
    assert err.key == "paralel"


def test_unknown_nested_key(tmp_path):
    path = write(tmp_path, "model:\n  hidden: 64\n")
    err = assert_load_error(path, "model.hidden", "hidden_size")
    assert err.key == "model.hidden"


def test_lines_are_counted_as_editors_count_them(tmp_path):
    """Found by probing: a character YAML refuses (a BEL) named a stream "<unicode string>"
    and a character offset instead of the line; PyYAML counts U+2028 inside a quoted value as
    a line break (the key below would have been named on line 4); a CR-only file's bad UTF-8
    byte was counted on line 1; a key the mapping writes itself was named on the line of a
    merge that it overrides; a top-level key a tag cannot read had an empty KEY."""
    def msg(data: bytes) -> str:
        path = tmp_path / "cfg.yaml"
        path.write_bytes(data)
        with pytest.raises(ConfigError) as info:
            load_config(path)
        return str(info.value).removeprefix(f"{path}")

    assert msg(b"engine:\n  mode: a\x07b\n") == (
        ":2: invalid YAML at column 10: unacceptable character #x0007: special "
        "characters are not allowed")
    assert msg("bench:\n  out_dir: 'a\u2028b'\nengine:\n  max_batch_size: 0\n"
               .encode()).startswith(":4: engine.max_batch_size: must be >= 1")
    assert msg(b"engine:\r  mode: normal\r  max_batch_size: \xff\r") == (
        ":3: not valid UTF-8: byte 0xff at column 19 (invalid start byte); config files are "
        "read as UTF-8")
    assert msg(b"engine:\n  <<: {max_batch_size: 16}\n  max_batch_size: 0\n").startswith(
        ":3: engine.max_batch_size: must be >= 1")
    assert msg(b"engine:\n  <<: {max_batch_size: 0}\n").startswith(
        ":2: engine.max_batch_size: must be >= 1")  # (the merge's own line where it gives it)
    assert msg(b"!!bool maybe: 1\n") == ":1: maybe: 'maybe' cannot be read as !!bool"
    # a key under an alias takes the line the anchored node writes it on
    assert msg(b"bench:\n  wait_scales: &w [0.0, 0.5]\n  spans: *w\n") == (
        ":2: bench.spans[0]: expected int, got float 0.0")


def test_an_alias_bomb_is_read_in_bounded_time(tmp_path):
    """Nested aliases multiply the paths under them: the lines they give are a courtesy,
    walked for at most MAX_YAML_NODES paths."""
    import time

    rows = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    rows += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    path = write(tmp_path, "bench:\n  spans: [1]\nx:\n" + "".join(f"  {r}\n" for r in rows))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="x: unknown key"):
        load_config(path)
    assert time.monotonic() - t0 < 5


def test_an_error_names_the_line_of_the_key_the_file_writes(tmp_path):
    """``FILE:LINE: KEY: problem`` where the file writes the key (nested, or a section
    header); no line for a key the file leaves to its default (a cross-key check), nor for a
    key an override set -- or one under a section an override gave: the file's line would
    point at a value that is not the one refused."""
    text = ("parallel:\n  world_size: 1\n\nengine:\n  # the batch\n"
            "  max_batch_size: 0\n  kv_block_size: 16\nworkload: 3\n")
    path = write(tmp_path, text)
    err = assert_load_error(path, "engine.max_batch_size")
    assert str(err).startswith(f"{path}:6: engine.max_batch_size: must be >= 1, got 0")
    err = assert_load_error(path, overrides={"engine.max_batch_size": 4})
    assert str(err).startswith(f"{path}:8: workload: expected a mapping"), str(err)
    # a section holding a key an override set: the section's line is not the refused value's
    err = assert_load_error(path, overrides={"engine.max_batch_size": 4, "workload.seed": 1})
    assert str(err).startswith(f"{path}: workload: expected a mapping"), str(err)
    # written in the file, then overridden: the override's value is the one refused, so the
    # file's line is not given
    err = assert_load_error(write(tmp_path, "engine:\n  max_batch_size: 4\n"),
                            overrides={"engine.max_batch_size": -1})
    assert str(err) == f"{path}: engine.max_batch_size: must be >= 1, got -1"
    err = assert_load_error(write(tmp_path, "rl:\n  steps: 1\n"),
                            overrides={"rl": {"steps": 0}})
    assert str(err).startswith(f"{path}: rl.steps: "), str(err)
    # a section given as a mapping sets the keys it holds: the file's others keep their lines
    # (found by probing: they had lost them)
    err = assert_load_error(write(tmp_path, "rl:\n  steps: 1\n  prompts_per_step: 0\n"),
                            overrides={"rl": {"steps": 2}})
    assert str(err).startswith(f"{path}:3: rl.prompts_per_step: "), str(err)
    # a cross-key check naming a key the file does not write (its default): no line
    err = assert_load_error(write(tmp_path, "model:\n  num_attention_heads: 6\n"))
    assert err.key == "model.hidden_size", str(err)
    assert str(err).startswith(f"{path}: model.hidden_size: 64 is not divisible"), str(err)
    err = assert_load_error(write(tmp_path, "parallel:\n  world_size: 4\n  adp: 3\n"))
    assert str(err).startswith(f"{path}:3: parallel.adp: "), str(err)


def test_wrong_type_str_for_int(tmp_path):
    path = write(tmp_path, "model:\n  hidden_size: abc\n")
    err = assert_load_error(path, "model.hidden_size: expected int, got str 'abc'")
    # the key's line in the file (line 2)
    assert str(err) == f"{path}:2: model.hidden_size: expected int, got str 'abc'"


def test_wrong_type_bool_for_int(tmp_path):
    path = write(tmp_path, "parallel:\n  world_size: true\n")
    assert_load_error(path, "parallel.world_size", "expected int", "bool True")


def test_wrong_type_bool_for_float(tmp_path):
    path = write(tmp_path, "workload:\n  temperature: false\n")
    assert_load_error(path, "workload.temperature", "expected float", "bool")


def test_wrong_type_list_item(tmp_path):
    path = write(tmp_path, "engine:\n  decode_buckets: [1, two, 32]\n")
    assert_load_error(path, "engine.decode_buckets[1]", "expected int", "'two'")


def test_wrong_type_list(tmp_path):
    path = write(tmp_path, "engine:\n  decode_buckets: 32\n")
    assert_load_error(path, "engine.decode_buckets", "expected list of int")


def test_optional_str_accepts_null_rejects_int(tmp_path):
    assert load_config(write(tmp_path, "model:\n  fp8: null\n", "a.yaml")).model.fp8 is None
    assert_load_error(write(tmp_path, "model:\n  fp8: 8\n", "b.yaml"), "model.fp8", "str or null")


def test_a_section_override_of_null_is_refused(tmp_path):
    err = assert_load_error(write(tmp_path, "workload:\n  seed: 3\n"),
                            overrides={"workload": None})
    assert str(err) == (f"{tmp_path / 'cfg.yaml'}: workload: a section is set key by key "
                        "(--set workload.KEY=VALUE) or as a mapping (--set 'workload={KEY: "
                        "VALUE}'), not null")


def test_a_key_yaml_reads_as_a_boolean_or_null_says_so(tmp_path):
    err = assert_load_error(write(tmp_path, "engine:\n  on: 4\n"), "engine.True: unknown key "
                            "(YAML reads an unquoted yes/no/on/off/true/false key as a boolean")
    assert str(err).startswith(f"{tmp_path / 'cfg.yaml'}:2: "), str(err)
    assert_load_error(write(tmp_path, "~: 1\n"), "None: unknown key (YAML reads")
    err = assert_load_error(write(tmp_path, 'engine: {}\n"": 5\n'), '"": unknown key; allowed')
    assert str(err).startswith(f"{tmp_path / 'cfg.yaml'}:2: "), str(err)


def test_section_not_a_mapping(tmp_path):
    path = write(tmp_path, "engine: 5\n")
    assert_load_error(path, "engine", "expected a mapping")


def test_a_section_header_alone_takes_the_sections_defaults(tmp_path):
    """``bench:`` with nothing under it is YAML's null: the section's defaults (it was
    refused as "expected a mapping, got NoneType")."""
    path = write(tmp_path, "engine:\nbench:\n")
    cfg = load_config(path)
    assert cfg.engine == load_config(write(tmp_path, "{}\n", "b.yaml")).engine
    assert cfg.bench.reps == 3
    # an override of such a section's key applies (not dropped into the null)
    cfg = load_config(path, {"engine.max_seq_len": 128, "bench": {"reps": 2}})
    assert (cfg.engine.max_seq_len, cfg.bench.reps) == (128, 2)


def test_non_divisible_adp(tmp_path):
    path = write(tmp_path, "parallel:\n  world_size: 6\n  adp: 4\n")
    assert_load_error(path, "parallel.adp: world_size 6 is not divisible by adp 4")


def test_non_divisible_ep(tmp_path):
    path = write(tmp_path, "parallel:\n  world_size: 4\n  ep: 3\n")
    assert_load_error(path, "parallel.ep", "not divisible by ep 3")


def test_heads_not_divisible_by_atp(tmp_path):
    # atp = 3: query groups (2) and heads (4) cannot be sharded 3 ways
    path = write(
        tmp_path,
        """
        parallel: {world_size: 3, adp: 1, ep: 1}
        model: {num_attention_heads: 4, num_query_groups: 2, hidden_size: 64, vocab_size: 255}
        """,
    )
    assert_load_error(path, "model.num_attention_heads", "parallel.atp 3")


def test_query_groups_not_divisible_by_atp(tmp_path):
    path = write(
        tmp_path,
        """
        parallel: {world_size: 4, adp: 1, ep: 1}
        model: {num_attention_heads: 8, num_query_groups: 2}
        """,
    )
    assert_load_error(path, "model.num_query_groups", "parallel.atp 4")


def test_vocab_not_divisible_by_atp(tmp_path):
    path = write(tmp_path, "parallel: {world_size: 2, adp: 1}\nmodel: {vocab_size: 255}\n")
    assert_load_error(path, "model.vocab_size", "parallel.atp 2")


def test_experts_not_divisible_by_ep(tmp_path):
    path = write(tmp_path, "parallel: {world_size: 4, adp: 4, ep: 4}\nmodel: {num_experts: 6}\n")
    assert_load_error(path, "model.num_experts", "parallel.ep 4")


@pytest.mark.parametrize("value", ["-1.0", ".inf", ".nan"])
def test_stall_dump_must_be_finite_and_not_negative(tmp_path, value):
    path = write(tmp_path, f"engine:\n  stall_dump_s: {value}\n")
    assert_load_error(path, "engine.stall_dump_s", "finite number")


@pytest.mark.parametrize("key", ["parallel.timeout_s", "model.rotary_base", "workload.temperature",
                                 "bench.length_scale", "rl.lr"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 10**400])
def test_float_settings_must_be_finite(tmp_path, key, value):
    """No float setting means inf or nan (YAML .inf/.nan): refused here instead of crashing
    every rank later (an infinite parallel.timeout_s overflowed torch's timedelta)."""
    path = write(tmp_path, "{}\n")
    assert_load_error(path, key, "must be a finite number", overrides={key: value})


@pytest.mark.parametrize("key,value,words", [
    ("rl.lr", 1e39, "past float32's range"), ("rl.kl_coef", 1e300, "past float32's range"),
    ("rl.vf_coef", 1e300, "past float32's range"),
    ("rl.mtp_loss_scale", 1e300, "past float32's range"),
    ("rl.is_cap", 1e39, "past float32's range"),
    ("rl.temperature", 1e-50, "below float32's smallest normal"),
])
def test_rl_coefficients_float32_cannot_hold_are_refused(tmp_path, key, value, words):
    """The trainer computes in float32: a coefficient it cannot hold is refused at the door
    (found by probing: Adam's overflow or a NaN first loss, as a traceback)."""
    path = write(tmp_path, "{}\n")
    assert_load_error(path, key, words, overrides={key: value})


@pytest.mark.parametrize("value", [0.5, 1.0, -3.0, 1e39])
def test_dual_clip_is_off_or_above_one(tmp_path, value):
    path = write(tmp_path, "{}\n")
    assert_load_error(path, "rl.dual_clip", "0 (off) or a finite number > 1",
                      overrides={"rl.dual_clip": value})
    assert load_config(path, {"rl.dual_clip": 3.0}).rl.dual_clip == 3.0
    assert load_config(path).rl.dual_clip == 0.0


@pytest.mark.parametrize("value", [86_400.5, 1e9])
def test_timeout_is_bounded_by_a_day(tmp_path, value):
    path = write(tmp_path, f"parallel:\n  timeout_s: {value!r}\n")
    assert_load_error(path, "parallel.timeout_s", "[0.5, 86400]", repr(value))
    assert load_config(path, {"parallel.timeout_s": 86_400.0}).parallel.timeout_s == 86_400.0


def test_top1_softmax_with_renormalisation_is_refused_like_megatron(tmp_path):
    path = write(tmp_path, "model:\n  moe_router_topk: 1\n")
    err = assert_load_error(path, "model.router_norm_topk", "moe_router_topk 1",
                            "refused by megatron", "set router_norm_topk: false")
    assert err.key == "model.router_norm_topk"
    for ok in ({"model.router_norm_topk": False}, {"model.router_score": "sigmoid"}):
        assert load_config(path, ok).model.moe_router_topk == 1


def test_trainer_tp_widths_and_tp_with_ep_are_refused_with_the_reason(tmp_path):
    path = write(tmp_path, "parallel:\n  world_size: 4\n  adp: 4\n  ep: 4\n"
                           "model:\n  num_experts: 4\nrl:\n  trainer_tp: 2\n")
    assert load_config(path).rl.trainer_tp == 2  # TP x DP under sequence parallelism
    for ep in (2, 4):  # TP x EP: the experts whole (ETP 1), EP a multiple of TP
        assert load_config(path, {"rl.trainer_ep": ep}).rl.trainer_ep == ep
    assert_load_error(path, "rl.trainer_ep", "2 with rl.trainer_tp 4 is not supported",
                      "a multiple of trainer_tp",
                      overrides={"rl.trainer_tp": 4, "rl.trainer_ep": 2})
    assert_load_error(path, "rl.trainer_tp", "2 does not divide", "model.num_query_groups 3",
                      overrides={"model.num_attention_heads": 6, "model.num_query_groups": 3,
                                 "model.hidden_size": 96})
    # the experts' FFN width is TP-split only at EP 1 (with EP: expert TP 1)
    odd = {"model.moe_ffn_hidden_size": 65}
    assert_load_error(path, "rl.trainer_tp", "model.moe_ffn_hidden_size 65", overrides=odd)
    assert load_config(path, {**odd, "rl.trainer_ep": 2}).rl.trainer_ep == 2


def test_export_with_an_expert_parallel_trainer_is_accepted(tmp_path):
    path = write(tmp_path, "parallel:\n  world_size: 2\n  adp: 2\n  ep: 2\n"
                           "model:\n  num_experts: 4\nrl:\n  export_dir: out\n")
    assert load_config(path, {"rl.trainer_ep": 2}).rl.export_dir == "out"


def test_rl_prompt_len_max_must_leave_the_drawn_range(tmp_path):
    path = write(tmp_path, "rl:\n  prompt_len_max: 1\n")
    assert_load_error(path, "rl.prompt_len_max", "must be >= 2", "[2, prompt_len_max]")


# --------------------------------------------------------------------------- YAML at the door


@pytest.mark.parametrize("text, line, first, key", [
    ("parallel:\n  world_size: 2\nmodel:\n  hidden_size: 64\nparallel:\n  adp: 2\n",
     5, 1, "parallel"),
    ("model:\n  hidden_size: 64\n  num_layers: 2\n  hidden_size: 32\n", 4, 2,
     "model.hidden_size"),
    ("engine: {mode: fine, mode: normal}\n", 1, 1, "engine.mode"),
])
def test_duplicate_keys_are_refused_with_their_lines(tmp_path, text, line, first, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}:{line}: {key}: duplicate key (first at line {first}); "
                               "YAML would silently keep only this last one")
    assert info.value.key == key and info.value.source == str(path)


def test_safe_load_semantics_are_kept_apart_from_duplicates(tmp_path):
    """Anchors, aliases and merge keys (a merged key may be overridden) load as safe_load
    reads them; the same key in two different mappings is no duplicate."""
    import yaml

    from colo_rollout.config.loader import UniqueKeyLoader

    text = ("base: &b {mode: fine, segment_span: 2}\nengine:\n  <<: *b\n  mode: normal\n"
            "other: {mode: fine}\nlist: [{a: 1}, {a: 2}]\nnum: 1.0e+3\nflag: off\n")
    assert yaml.load(text, Loader=UniqueKeyLoader) == yaml.safe_load(text)
    with pytest.raises(yaml.YAMLError):  # safe: no python tags
        yaml.load("x: !!python/object/apply:os.system ['true']\n", Loader=UniqueKeyLoader)


def test_config_that_is_not_utf8_names_line_and_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("# configuration\nmodel:\n  # gr\u00f6\u00dfe\n  hidden_size: 64\n"
                     .encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}:3: not valid UTF-8: byte 0xf6 at column 7 (invalid "
                               "start byte); config files are read as UTF-8")


@pytest.mark.parametrize("pair, fragments", [
    ("model.vocab_size=[1", ["--set model.vocab_size: the value '[1' is not valid YAML at "
                             "column 3"]),
    ("engine.mode=: x", ["--set engine.mode: the value ': x' is not valid YAML"]),
    ("workload={a: 1, a: 2}", ["--set workload: duplicate key 'a' in the value"]),
    ("engine.mode", ["--set engine.mode: expected KEY=VALUE"]),
    ("=3", ["--set =3: the key before '=' is empty"]),
])
def test_set_values_that_are_not_yaml_name_the_key(pair, fragments):
    from colo_rollout.config.loader import parse_override

    with pytest.raises(ConfigError) as info:
        parse_override(pair)
    for f in fragments:
        assert f in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_an_int_too_long_for_python_is_a_config_error(tmp_path):
    from colo_rollout.config.loader import parse_override

    huge = "1" + "0" * 5000
    path = write(tmp_path, f"model:\n  hidden_size: {huge}\n")
    with pytest.raises(ConfigError) as info:  # the line and the key named
        load_config(path)
    assert str(info.value) == (f"{path}:2: model.hidden_size: an integer of 5001 characters "
                               "(Python converts at most 4300 digits)")
    assert info.value.key == "model.hidden_size"
    with pytest.raises(ConfigError, match=r"^--set model.hidden_size: invalid value"):
        parse_override(f"model.hidden_size={huge}")


def test_yaml_nested_past_the_bound_is_one_line_naming_where(tmp_path):
    """Found by probing: 1000 nested brackets were a RecursionError traceback at the door
    (PyYAML composes one Python frame a level); a file or --set value nested past
    MAX_YAML_DEPTH is an invalid-YAML error at the node that crossed it."""
    from colo_rollout.config.loader import parse_override

    path = write(tmp_path, "rl:\n  steps: " + "[" * 1000 + "]" * 1000 + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}:2: invalid YAML at column 40: nested more than 32 "
                               "levels deep (a config nests three)")
    with pytest.raises(ConfigError, match=r"^--set rl.steps: .* nested more than 32 levels"):
        parse_override("rl.steps=" + "{a: " * 1000 + "1" + "}" * 1000)


def test_yaml_of_too_many_values_is_refused_before_it_is_read_whole(tmp_path):
    """Found by probing: a 20 MB list (under the 64 MB the reader took then) ran past two
    minutes at the door -- PyYAML's pure-Python reader takes ~8 s a MB of dense YAML. A file
    is at most 1 MiB, a document at most MAX_YAML_NODES values."""
    path = write(tmp_path, "rl:\n  steps: [" + ", ".join(["1"] * 20000) + "]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}:2: invalid YAML at column 29996: more than 10000 "
                               "values (a config holds a few hundred)")
    big = tmp_path / "big.yaml"
    big.write_text("rl:\n  steps: 1\n" + "#" * (2**20) + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(big)
    assert str(info.value) == (f"{big}: 1048592 bytes, more than the 1048576 a config file "
                               "may have")


@pytest.mark.parametrize("value, problem", [
    # found by probing: PyYAML's constructors raised KeyError, IndexError and AttributeError
    # (tracebacks at the door) and a ValueError naming neither line nor key
    ("!!bool maybe", "'maybe' cannot be read as !!bool"),
    ("!!int ''", "'' cannot be read as !!int"),
    ("!!timestamp soon", "'soon' cannot be read as !!timestamp"),
    ("!!int abc", "'abc' cannot be read as !!int (invalid literal for int() with base 10: "
     "'abc')"),
])
def test_a_tagged_scalar_yaml_cannot_read_names_line_and_key(tmp_path, value, problem):
    from colo_rollout.config.loader import parse_override

    path = write(tmp_path, f"workload:\n  num_requests: 4\n  seed: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}:3: workload.seed: {problem}"
    assert info.value.key == "workload.seed"
    with pytest.raises(ConfigError) as info:
        parse_override(f"workload.seed={value}")
    assert str(info.value) == f"--set workload.seed: invalid value: {problem}"


def test_a_long_key_is_cut_short_in_the_error_line(tmp_path):
    """Found by probing: an explicit YAML key (``? KEY``, no length bound) of 2 MB was a 2 MB
    error line; keys in messages are cut in the middle past 80 characters, as values are."""
    from colo_rollout.config import RLConfig
    from colo_rollout.config.loader import parse_override

    key = "k" * 200
    short = "k" * 38 + "..." + "k" * 38
    allowed = ", ".join(f.name for f in dataclasses.fields(RLConfig) if f.init)
    path = write(tmp_path, f"rl:\n  ? {key}\n  : 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}:2: rl.{short}: unknown key; allowed keys at rl: {allowed}"
    path = write(tmp_path, f"rl:\n  ? {key}\n  : 1\n  ? {key}\n  : 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}:4: rl.{short}: duplicate key (first at line 2); YAML "
                               "would silently keep only this last one")
    with pytest.raises(ConfigError) as info:
        parse_override(key)
    assert str(info.value) == f"--set {short}: expected KEY=VALUE, e.g. --set engine.mode=fine"
    path = write(tmp_path, "rl: {}\n")
    with pytest.raises(ConfigError) as info:  # (the dotted key cut whole)
        load_config(path, {f"rl.{key}": 1})
    assert str(info.value) == (f"{path}: rl.{'k' * 35}...{'k' * 38}: unknown override key; "
                               f"allowed keys at rl: {allowed}")


def test_a_misspelt_key_names_the_keys_meant(tmp_path):
    """An unknown key, in the file or in --set, names the allowed keys closest to it (a
    truncated name, a typo); a key like none of them gets no hint."""
    path = write(tmp_path, "engine:\n  max_batch_sise: 3\n")
    assert_load_error(path, "engine.max_batch_sise: unknown key (did you mean max_batch_size?)")
    path = write(tmp_path, "engine: {}\n")
    assert_load_error(path, "engine.max_batch: unknown override key (did you mean "
                      "max_batch_size?); allowed", overrides={"engine.max_batch": 2})
    assert_load_error(path, "model.hiden_size: unknown override key (did you mean hidden_size",
                      overrides={"model.hiden_size": 2})
    err = assert_load_error(path, "engine.zzz: unknown override key; allowed",
                            overrides={"engine.zzz": 2})
    assert "did you mean" not in str(err)


def test_the_config_reference_is_current():
    """docs/config.md is generated from schema.py's comments: a key added, removed or
    re-described there without regenerating it fails here."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    got = subprocess.run([sys.executable, str(root / "scripts" / "config_reference.py"),
                          "--check"], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    text = (root / "docs" / "config.md").read_text(encoding="utf-8")
    for key in ("parallel.world_size", "engine.max_seq_len", "rl.algorithm",
                "bench_speed.peak_flops"):
        assert f"| `{key}` |" in text


def test_set_values_parse_as_yaml():
    from colo_rollout.config.loader import parse_override

    assert parse_override("bench.spans=[1, 2]") == ("bench.spans", [1, 2])
    assert parse_override("model.checkpoint=/a=b") == ("model.checkpoint", "/a=b")
    assert parse_override("engine.eos_token_id=null") == ("engine.eos_token_id", None)


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("parallel", "backend", "mpi"),
        ("model", "normalization", "rmsnorm"),
        ("model", "params_dtype", "float64"),
        ("model", "use_te", "always"),
        ("model", "fp8", "e5m2"),
        ("engine", "mode", "chunked"),
        ("engine", "segment_policy", "adaptive"),
        ("engine", "rendezvous", "mpi"),
        ("engine", "stream_priority", "high"),
        ("engine", "prefill_graphs", "sometimes"),
    ],
)
def test_bad_enum(tmp_path, section, key, value):
    path = write(tmp_path, f"{section}:\n  {key}: {value}\n")
    assert_load_error(path, f"{section}.{key}", "expected one of", repr(value))


def test_unquoted_off_is_a_bool_with_hint(tmp_path):
    # YAML 1.1 reads bare `off` as false; the error says to quote it
    assert_load_error(write(tmp_path, "model: {use_te: off}\n"), "model.use_te", "bool False", "quote")
    assert load_config(write(tmp_path, "model: {use_te: 'off'}\n", "q.yaml")).model.use_te == "off"


def test_fp8_needs_bf16_params_not_te(tmp_path):
    """FP8 rollouts are colo_rollout's own GEMMs (model/fp8.py): no Transformer Engine needed
    (the door checks the GPU and the parameters' dtype); the recipe is one of the known ones."""
    ok = load_config(write(tmp_path, "model: {fp8: e4m3, use_te: 'off', params_dtype: "
                                     "bfloat16}\n"))
    assert ok.model.fp8 == "e4m3" and ok.model.fp8_recipe == "rowwise"
    path = write(tmp_path, "model: {fp8: e4m3, params_dtype: bfloat16, fp8_recipe: delayed}\n",
                 "c.yaml")
    assert_load_error(path, "model.fp8_recipe", "expected one of", "'delayed'")


def test_bad_buckets_order(tmp_path):
    path = write(tmp_path, "engine:\n  decode_buckets: [1, 4, 2, 32]\n")
    assert_load_error(path, "engine.decode_buckets", "strictly increasing")
    path = write(tmp_path, "engine:\n  decode_buckets: [1, 2, 2, 32]\n", "dup.yaml")
    assert_load_error(path, "engine.decode_buckets", "strictly increasing")


def test_buckets_too_small(tmp_path):
    path = write(tmp_path, "engine:\n  max_batch_size: 64\n  decode_buckets: [1, 2, 4, 8, 16, 32]\n")
    assert_load_error(path, "engine.decode_buckets", "max_batch_size 64")


def test_buckets_below_one(tmp_path):
    path = write(tmp_path, "engine:\n  decode_buckets: [0, 32]\n")
    assert_load_error(path, "engine.decode_buckets", ">= 1")


def test_max_seq_len_exceeds_positions(tmp_path):
    path = write(tmp_path, "engine: {max_seq_len: 4096}\n")
    assert_load_error(path, "engine.max_seq_len", "model.max_position_embeddings 2048")


def test_the_workload_section_is_not_held_to_the_engine_by_the_loader(tmp_path):
    # only the demo serves it: the door's check_demo refuses it there (tests/test_door.py)
    path = write(tmp_path, "engine: {max_seq_len: 80}\nworkload: {prompt_len_max: 64, output_len_max: 32}\n")
    assert load_config(path).engine.max_seq_len == 80


@pytest.mark.parametrize(
    "text, key",
    [
        ("model: {hidden_size: 0}\n", "model.hidden_size"),
        ("model: {hidden_size: 66}\n", "model.hidden_size"),
        ("model: {num_query_groups: 3}\n", "model.num_query_groups"),
        ("model: {moe_router_topk: 9}\n", "model.moe_router_topk"),
        ("model: {init_method_std: 0}\n", "model.init_method_std"),
        ("parallel: {timeout_s: 0}\n", "parallel.timeout_s"),
        ("workload: {prompt_len_min: 65}\n", "workload.prompt_len_min"),
        ("workload: {output_len_min: 0}\n", "workload.output_len_min"),
        ("workload: {top_p: 0}\n", "workload.top_p"),
        ("workload: {top_p: 1.5}\n", "workload.top_p"),
        ("workload: {temperature: -0.1}\n", "workload.temperature"),
        ("workload: {top_k: -1}\n", "workload.top_k"),
        ("engine: {eos_token_id: 256}\n", "engine.eos_token_id"),
        ("engine: {eos_token_id: -1}\n", "engine.eos_token_id"),
    ],
)
def test_value_range_errors(tmp_path, text, key):
    assert_load_error(write(tmp_path, text), key)


def test_malformed_yaml_reports_line(tmp_path):
    path = write(tmp_path, "parallel:\n  world_size: 2\n  adp: [1, 2\nmodel:\n  hidden_size: 64\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:4: invalid YAML at column ")
    assert "invalid YAML" in msg


def test_malformed_yaml_mapping_values(tmp_path):
    path = write(tmp_path, "model:\n  hidden_size: 64: 3\n")
    err = assert_load_error(path, f"{path}:2: invalid YAML at column ")
    assert err.key is None


def test_top_level_list(tmp_path):
    path = write(tmp_path, "- parallel\n- model\n")
    assert_load_error(path, "expected a mapping at the top level", "list")


def test_empty_file(tmp_path):
    path = write(tmp_path, "# nothing here\n")
    assert_load_error(path, "expected a mapping at the top level", "empty document")


def test_missing_file(tmp_path):
    path = tmp_path / "absent.yaml"
    assert_load_error(path, "cannot read config file")


# --------------------------------------------------------------------------- direct construction


def test_direct_construction_errors_name_key():
    with pytest.raises(ConfigError, match=r"^parallel\.adp: world_size 6 is not divisible by adp 4$"):
        ParallelConfig(world_size=6, adp=4)
    with pytest.raises(ConfigError, match=r"^model\.hidden_size: expected int, got str 'abc'$"):
        ModelConfig(hidden_size="abc")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^parallel: expected ParallelConfig, got dict"):
        Config(parallel={"world_size": 2})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="model.num_experts"):
        Config(parallel=ParallelConfig(world_size=3, adp=3, ep=3))


def test_config_from_dict_names_source():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": {"num_layers": "2"}}, source="job.yaml")
    assert str(info.value) == "job.yaml: model.num_layers: expected int, got str '2'"
    assert info.value.key == "model.num_layers"
    with pytest.raises(ConfigError, match=r"^<dict>: engine\.foo: unknown key"):
        config_from_dict({"engine": {"foo": 1}})


def test_dataclasses_replace_revalidates():
    cfg = Config()
    with pytest.raises(ConfigError, match="parallel.ep"):
        dataclasses.replace(cfg.parallel, ep=3)


def test_config_error_is_value_error_and_pickles():
    err = ConfigError("f.yaml: a.b: bad", key="a.b", source="f.yaml")
    assert isinstance(err, ValueError)
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.key == "a.b" and back.source == "f.yaml"


def test_bench_variants_pick_from_the_ladder(tmp_path):
    path = write(tmp_path, "bench: {modes: [normal, fine], spans: [2, 8]}\n")
    assert load_config(path).bench.ladder() == ["normal", "fine-2", "fine-8", "fine-sel",
                                                "fine-bal"]
    picked = load_config(path, {"bench.variants": ["fine-bal", "normal", "fine-8"]}).bench
    assert picked.ladder() == ["normal", "fine-8", "fine-bal"]  # ladder order, not list order


def test_bench_variant_outside_the_ladder_is_named(tmp_path):
    path = write(tmp_path, "bench: {modes: [normal, fine], spans: [2], variants: [fine-8]}\n")
    assert_load_error(path, "bench.variants", "fine-8", "fine-sel")
    assert_load_error(write(tmp_path, "bench: {modes: [normal], variants: [fine-bal]}\n",
                            "b.yaml"), "bench.variants", "fine-bal")


def test_prefill_merge_pairs_must_not_be_negative(tmp_path):
    assert_load_error(write(tmp_path, "engine: {prefill_merge_pairs: -1}\n"),
                      "engine.prefill_merge_pairs", ">= 0")


def test_a_section_given_whole_in_an_override_sets_only_its_keys(tmp_path):
    """--set 'rl={steps: 1}' sets rl.steps; the file's other rl keys stay (the section was
    replaced: out_dir and the rest silently fell back to their defaults)."""
    path = write(tmp_path, "rl:\n  steps: 5\n  out_dir: here\n  lr: 0.5\n")
    cfg = load_config(path, {"rl": {"steps": 1, "lr": 0.25}})
    assert (cfg.rl.steps, cfg.rl.out_dir, cfg.rl.lr) == (1, "here", 0.25)
    assert load_config(path, {"rl.steps": 2}).rl.out_dir == "here"


def test_a_yaml_base_60_number_is_named(tmp_path):
    """YAML 1.1 reads an unquoted 1:30 as 90: refused naming the line and key, as unquoted
    yes/no are (a quoted "1:30" stays text)."""
    path = write(tmp_path, "rl:\n  steps: 1:30\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (f"{path}:2: rl.steps: 1:30 is a base-60 number in YAML 1.1 (90); "
                            "write the number, or quote the text")
    path = write(tmp_path, "bench:\n  out_dir: '1:30'\n")
    assert load_config(path).bench.out_dir == "1:30"


def test_a_yaml_octal_number_is_named(tmp_path):
    """YAML 1.1 reads an unquoted 010 as 8 (found by probing: a seed or count padded with a
    zero was read silently as another number); 0, 10, 0x10 and a quoted '010' are fine."""
    path = write(tmp_path, "workload:\n  num_requests: 010\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (f"{path}:2: workload.num_requests: 010 is an octal number in YAML "
                            "1.1 (8); write the number without its leading zero, or quote the "
                            "text")
    path = write(tmp_path, "workload:\n  seed: 0\n  num_requests: 10\nbench:\n  out_dir: '010'\n")
    cfg = load_config(path)
    assert (cfg.workload.seed, cfg.workload.num_requests, cfg.bench.out_dir) == (0, 10, "010")
    from colo_rollout.config.loader import parse_override

    with pytest.raises(ConfigError, match="--set workload.seed: .*010 is an octal number"):
        parse_override("workload.seed=010")


def test_a_config_path_that_is_not_a_regular_file_is_refused_at_once(tmp_path):
    """A FIFO (the door waited for a writer for ever) and /dev/zero (read for ever) are
    refused without blocking; so is a directory."""
    import os
    import time

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero", tmp_path):
        start = time.monotonic()
        with pytest.raises(ConfigError, match="not a regular file|Is a directory"):
            load_config(path)
        assert time.monotonic() - start < 5


def test_reports_are_strict_json():
    """NaN and infinities are written as null: Python's bare NaN tokens are refused by strict
    JSON readers (a bench-mtp table of refused requests wrote them)."""
    import json

    from colo_rollout.config.files import strict_json

    text = strict_json({"a": float("nan"), "b": [1.5, float("inf"), {"c": -float("inf")}],
                        "d": (2, "x")})
    assert json.loads(text) == {"a": None, "b": [1.5, None, {"c": None}], "d": [2, "x"]}
    assert "NaN" not in text and "Infinity" not in text


def test_bench_speed_repeat_counts_are_bounded(tmp_path):
    path = write(tmp_path, "bench_speed:\n  iters: 99999999999\n")
    assert_load_error(path, "bench_speed.iters", "at most 10000")



def test_a_report_is_written_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    """Found by probing: on a full disk every report was a traceback and each JSON was left
    truncated or empty. ``write_output`` writes beside the file and renames it over; an
    OSError is OutputError naming the file and what it is, the previous file untouched, no
    temporary file left; the command prints it as one line, exit code 1."""
    import errno

    from colo_rollout.cli import main
    from colo_rollout.config import files

    path = tmp_path / "r.json"
    files.write_output(path, '{"a": 1}', "the report")
    assert path.read_text() == '{"a": 1}'

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "replace", full)
    with pytest.raises(files.OutputError) as info:
        files.write_output(path, '{"a": 2}', "the report")
    assert str(info.value) == f"{path}: cannot write the report: No space left on device"
    assert path.read_text() == '{"a": 1}' and sorted(tmp_path.iterdir()) == [path]
    assert getattr(files.OutputError, "user_facing", False)  # a rank's error: one line too

    def run(argv):
        raise files.OutputError(f"{path}: cannot write the report: No space left on device")

    monkeypatch.setattr("colo_rollout.cli._main", run)
    capsys.readouterr()
    assert main(["demo", "x.yaml"]) == 1
    assert capsys.readouterr().err == (f"error: {path}: cannot write the report: No space left "
                                       "on device\n")
