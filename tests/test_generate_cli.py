"""`colo-rollout generate` and `generate_text()`: text in, text out over a Hugging Face checkpoint.

A tiny random Qwen3-MoE saved by transformers' own save_pretrained, with the tiny ChatML
tokenizer beside it. The reference for every completion is transformers' greedy
``model.generate`` on the same chat-templated ids (fp32), decoded by our Tokenizer, stopping on
the same eos id. Error paths: one ``error:`` line, exit code 2, no traceback, no rank started.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.tiny_tokenizer import save_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CASE = "tests.test_generate_cli"
PROMPTS = ["hello there", "What is 2 + 2?"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(checkpoint dir, {prompt: HF greedy text with the chat template}, {prompt: without})."""
    transformers = pytest.importorskip("transformers")
    import torch

    from colo_rollout.text.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("qwen3moe")
    vocab = save_tiny_tokenizer(d)
    tok = Tokenizer.from_dir(d)
    (eos,) = tok.eos_token_ids  # <|im_end|>, from tokenizer_config.json
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab + vocab % 2, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, eos_token_id=eos, pad_token_id=tok.encode("<|endoftext|>")[0],
        bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()  # fp32
    model.save_pretrained(d)  # config.json, model.safetensors, generation_config.json (eos)

    def greedy(ids: list[int]) -> str:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=eos, pad_token_id=config.pad_token_id)
        return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)

    chat = {p: greedy(tok.encode_prompt(p)) for p in PROMPTS}
    plain = {p: greedy(tok.encode_prompt(p, chat=False)) for p in PROMPTS}
    assert all(chat.values()), chat  # a non-empty completion to compare
    return d, chat, plain


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # CPU ranks (the default config is then fp32, the precision of the reference)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "colo_rollout.cli", "generate", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_cli_generates_on_one_rank(ckpt):
    d, chat, _ = ckpt
    r = _cli("--model", str(d), "--max-tokens", str(MAX_TOKENS), PROMPTS[0])
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    # the prompt's index, then its completion: transformers' own greedy text
    assert r.stdout == f"[0] {chat[PROMPTS[0]]}\n"


def _generate_case(rank: int, world: int, model_dir: str) -> dict:
    """In-process use, as a rollout() caller would: config with model.checkpoint, Engine loads
    the weights, generate_text (collective) -- twice on one engine, with and without chat."""
    from colo_rollout.config import config_from_dict
    from colo_rollout.engine.engine import Engine
    from colo_rollout.runtime.parallel import init_parallel
    from colo_rollout.sched.request import SamplingParams
    from colo_rollout.tools.generate import PromptErrors, generate_text
    from colo_rollout.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    cfg = config_from_dict({"model": {"checkpoint": model_dir, "params_dtype": "float32"},
                            "engine": {"max_seq_len": 128,
                                       "eos_token_id": tok.eos_token_ids[0]}})
    engine = Engine(cfg, init_parallel(cfg.parallel))
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS)
        chat = generate_text(engine, tok, PROMPTS, params)
        plain = generate_text(engine, tok, PROMPTS, params, chat=False)  # fresh request ids
        # a prompt over engine.max_seq_len and one that is not text between two good ones:
        # both refused, the good ones served as if alone, and the engine serves on after it
        try:
            generate_text(engine, tok, [PROMPTS[0], "word " * 200, 7, PROMPTS[1]], params)
            mixed = None
        except PromptErrors as e:
            mixed = {"texts": e.texts, "errors": e.errors, "message": str(e)}
        after = generate_text(engine, tok, PROMPTS, params)
    finally:
        engine.close()
    return {"chat": chat, "plain": plain, "mixed": mixed, "after": after}


def test_generate_text_matches_transformers_greedy(ckpt):
    from colo_rollout.runtime.spawn import WorkerGroup

    d, chat, plain = ckpt
    # a CPU rank also where CUDA is present (on a gloo rank megatron would still put some
    # weights on the GPU)
    with WorkerGroup(1, env={"CUDA_VISIBLE_DEVICES": ""}) as group:
        (res,) = group.run(f"{CASE}:_generate_case", timeout=120, model_dir=str(d))
    assert res["chat"] == [chat[p] for p in PROMPTS]
    assert res["plain"] == [plain[p] for p in PROMPTS]
    mixed = res["mixed"]
    assert mixed is not None, "a refused prompt did not raise"
    assert mixed["texts"] == [chat[PROMPTS[0]], None, None, chat[PROMPTS[1]]]
    assert sorted(mixed["errors"]) == [1, 2]
    assert "max_seq_len" in mixed["errors"][1] and "tokens)" in mixed["errors"][1]
    assert mixed["errors"][2] == "prompt 2: expected a str, got int"
    assert mixed["message"].startswith("prompt 1 (") and "1 more refused" in mixed["message"]
    assert res["after"] == res["chat"]


def test_completion_stops_at_any_eos_id(ckpt):
    # the engine stops on one eos id (engine.eos_token_id); generate_text cuts at every
    # tokenizer eos id, unless ignore_eos
    from colo_rollout.sched.request import FinishReason, RequestOutput, SamplingParams
    from colo_rollout.tools.generate import generate_text
    from colo_rollout.text.tokenizer import Tokenizer

    d, _, _ = ckpt
    tok = Tokenizer.from_dir(d)
    a, b = tok.encode("the cat"), tok.encode("dog")
    end = tok.encode("<|endoftext|>")[0]
    tok.eos_token_ids = (tok.eos_token_ids[0], end)

    class Engine:  # what generate_text uses of the engine
        scheduler = SimpleNamespace(step_no=3, validate=lambda req: None)

        def generate(self, requests):
            out = RequestOutput(requests[0].request_id, len(requests[0].prompt),
                                tokens=[*a, end, *b], finish_reason=FinishReason.LENGTH)
            return {out.request_id: out}

    assert generate_text(Engine(), tok, ["hi"], SamplingParams(max_tokens=9)) == ["the cat"]
    # its ids start with a control character: no id a caller picks ("text3-0", say) is one
    # (found by probing: a caller's pending "text0-0" was taken for generate_text's own)
    seen = []
    Engine.generate = lambda self, reqs, _g=Engine.generate: seen.extend(
        r.request_id for r in reqs) or _g(self, reqs)
    generate_text(Engine(), tok, ["hi"], SamplingParams(max_tokens=9))
    assert seen == ["\x1ftext3-0"]
    kept = generate_text(Engine(), tok, ["hi"], SamplingParams(max_tokens=9, ignore_eos=True))
    assert kept == ["the catdog"]  # special tokens are dropped from the text, not cut at


def test_every_eos_id_stops_the_engine(ckpt):
    """A checkpoint with two eos ids: the first is engine.eos_token_id, the other an
    engine.stop_token_ids entry -- a sequence that samples it finishes (STOP) there."""
    from colo_rollout.config.schema import EngineConfig
    from colo_rollout.sched.request import FinishReason, Request, SamplingParams
    from colo_rollout.sched.scheduler import Scheduler
    from colo_rollout.tools.generate import prepare

    d, _, _ = ckpt
    g = d / "generation_config.json"
    saved = g.read_text() if g.is_file() else None
    try:
        g.write_text(json.dumps({"eos_token_id": [3, 7]}))
        cfg, _, _ = prepare(str(d), None, {}, ["hi"], SamplingParams(max_tokens=4), None)
    finally:
        g.unlink() if saved is None else g.write_text(saved)
    assert cfg.engine.eos_token_id == 3 and cfg.engine.stop_token_ids == [7]
    sched = Scheduler(EngineConfig(stop_token_ids=[7]), 1, 1, 100)
    seq = SimpleNamespace(request=Request("r", [1], SamplingParams(max_tokens=9)))
    assert sched._stop_reason(seq, SimpleNamespace(tokens=[5, 7])) is FinishReason.STOP
    assert sched._stop_reason(seq, SimpleNamespace(tokens=[5, 6])) is None
    seq.request = Request("r", [1], SamplingParams(max_tokens=9, ignore_eos=True))
    assert sched._stop_reason(seq, SimpleNamespace(tokens=[5, 7])) is None


def _one_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert r.stdout == ""
    return lines[0]


def test_error_no_tokenizer(ckpt, tmp_path):
    d, _, _ = ckpt
    for name in ("config.json", "model.safetensors"):  # weights only
        shutil.copy(d / name, tmp_path / name)
    line = _one_error(_cli("--model", str(tmp_path), "hi"))
    assert line == (f"error: {tmp_path}: no tokenizer.json (generate needs the checkpoint's "
                    "tokenizer; rollout() itself is token-in/token-out)")


def test_a_weight_that_is_not_finite_is_one_error_line_naming_it(ckpt, tmp_path):
    """Found past the door (the door reads headers only): the rank's CheckpointError is the
    command's one line, exit code 1 (was a traceback, the logits' NaN refused per prompt)."""
    import torch
    from safetensors.torch import load_file, save_file

    d, _, _ = ckpt
    shutil.copytree(d, tmp_path / "c")
    path = tmp_path / "c" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"][3] = float("nan")
    tensors["model.layers.1.mlp.gate.weight"][0, :2] = torch.inf
    save_file(tensors, path, metadata={"format": "pt"})
    r = _cli("--model", str(tmp_path / "c"), "hi")
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: "), r.stderr
    assert "not finite (NaN or inf)" in lines[0], lines[0]


def test_a_config_file_without_engine_limits_is_sized_to_the_prompts(ckpt, tmp_path):
    """--config naming only the layout: the engine limits it leaves unset are sized to the
    prompts as without --config (found by probing: the engine's default max_seq_len outgrew
    a model of few positions and the error named a key the file never set)."""
    d, chat, _ = ckpt
    shutil.copytree(d, tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "run.yaml").write_text("parallel: {world_size: 1}\n")
    r = _cli("--model", str(tmp_path / "c"), "--config", str(tmp_path / "run.yaml"),
             "--max-tokens", str(MAX_TOKENS), PROMPTS[0])
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"[0] {chat[PROMPTS[0]]}\n"


def test_error_bad_set_value(ckpt):
    d, _, _ = ckpt
    line = _one_error(_cli("--model", str(d), "--set", "engine.max_batch_size=abc", "hi"))
    assert "engine.max_batch_size" in line and "abc" in line


def test_door_checks_in_process(ckpt, tmp_path, capsys):
    # the rest of the door, through cli.main (no ranks start: each fails before the launch)
    from colo_rollout.cli import main

    d, _, _ = ckpt
    small = tmp_path / "small_vocab"
    small.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(d / name, small / name)
    config = json.loads((d / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    other_cfg = tmp_path / "other.yaml"
    other_cfg.write_text(f"model: {{checkpoint: {small}}}\n")
    fp8_cfg = tmp_path / "fp8.yaml"
    fp8_cfg.write_text("model:\n  fp8: e4m3\n")
    nl_cfg = tmp_path / "nl.yaml"
    nl_cfg.write_text('engine: {"a\\nb": 1}\n')
    yaml_cfg = tmp_path / "short.yaml"
    yaml_cfg.write_text("engine: {max_seq_len: 16}\nworkload: {prompt_len_max: 8, "
                        "output_len_max: 8}\n")
    # generate reads the file's own sections before load_config: through the door's reader
    # too (an open() of its own blocked on a FIFO; nesting past Python's recursion limit was
    # a RecursionError traceback)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    deep = tmp_path / "deep.yaml"
    deep.write_text("engine: " + "[" * 5000 + "]" * 5000 + "\n")
    cases = {
        ("--model", str(small), "hi"): "the tokenizer has 200 ids, more than the model's "
                                       "vocab_size 100",
        ("--model", str(d), "--set", "engine", "hi"): "--set engine: expected KEY=VALUE",
        ("--model", str(d), "--set", "engine.nope=1", "hi"): "engine.nope: unknown override key",
        ("--model", str(d), "--temperature", "-1", "hi"): "error: --temperature: temperature must",
        # (found by probing: said to exceed a vocabulary of 9223372036854775807)
        ("--model", str(d), "--temperature", "1", "--top-k", "1" + "0" * 20, "hi"):
            f"--top-k: top_k {10**20} exceeds the vocabulary size "
            f"{json.loads((d / 'config.json').read_text())['vocab_size']}\n",
        ("--model", str(d), "--config", str(yaml_cfg), "hi"): "over engine.max_seq_len 16",
        ("--model", str(d), "--max-tokens", "40000", "hi"): "max_position_embeddings 32768",
        ("--model", str(d), "--config", str(tmp_path / "absent.yaml"), "hi"):
            "cannot read config file",
        ("--model", str(d), "--set", f"model.checkpoint={small}", "hi"):
            f"--set model.checkpoint={small}: generate serves --model {d}; give the checkpoint "
            "once",
        ("--model", str(d), "--config", str(other_cfg), "hi"):
            f"{other_cfg}:1: model.checkpoint: '{small}' is not --model '{d}'",
        ("--model", str(d), "caf\udce9"): "prompt 0: not valid UTF-8 text",
        ("--model", "", "hi"): "error: --model: no checkpoint folder named (the path is empty)",
        ("--model", str(d), "--config", str(fifo), "hi"):
            f"{fifo}: not a regular file (a directory, FIFO or device)",
        ("--model", str(d), "--config", str(deep), "hi"): "invalid YAML at column 40: nested more than",
        # the engine's checks name the user's source, not the launch's temporary file
        ("--model", str(d), "--set", "model.fp8=e4m3", "hi"):
            f"error: {d} (generate's default config): model.fp8: 'e4m3' needs a CUDA GPU",
        # ... and the line of the key in --config (found by probing: none was named); an
        # error's text holding a newline (a key, PyYAML's own) is one line
        ("--model", str(d), "--config", str(fp8_cfg), "hi"):
            f"error: {fp8_cfg}:2: model.fp8: 'e4m3' needs a CUDA GPU",
        ("--model", str(d), "--config", str(nl_cfg), "hi"):
            f"error: {nl_cfg}:1: engine.a b: unknown key",
    }
    for argv, want in cases.items():
        assert main(["generate", *argv]) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("error: "), (argv, err)
        assert want in err, (argv, err)


def test_generation_config_sampling_defaults(tmp_path):
    """generation_config.json as transformers' generate reads it: do_sample false, null or
    absent is greedy whatever its temperature says; a sampling run (the file's, or a
    temperature flag's) takes its top_k / top_p, unset ones GenerationConfig's defaults
    (temperature 1, top_k 50, top_p 1); flags win one by one; bad values are one line naming
    the file and key; sampling it has no kernel for is listed, not refused."""
    from colo_rollout.text.generation_config import read_generation_defaults
    from colo_rollout.text.tokenizer import TokenizerError
    from colo_rollout.tools.generate import sampling_params

    g = tmp_path / "generation_config.json"
    assert read_generation_defaults(tmp_path).temperature == 0  # no file: greedy
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
             "eos_token_id": [1, 2]}
    for data, want in (
            (qwen3, (0.6, 20, 0.95, None)),
            ({"do_sample": True}, (1.0, 50, 1.0, None)),
            ({"do_sample": False, "temperature": 0.6, "top_k": 5}, (0.0, 5, 1.0, None)),
            ({"temperature": 0.7, "max_new_tokens": 300}, (0.0, 50, 1.0, 300)),
            ({"do_sample": None, "temperature": "ignored"}, (0.0, 50, 1.0, None)),
            ({"do_sample": True, "top_k": 0, "max_new_tokens": 9}, (1.0, 0, 1.0, 9))):
        g.write_text(json.dumps(data))
        d = read_generation_defaults(tmp_path)
        assert (d.temperature, d.top_k, d.top_p, d.max_tokens) == want, data
    g.write_text(json.dumps({**qwen3, "repetition_penalty": 1.05, "min_p": 0.0,
                             "num_beams": 1}))
    d = read_generation_defaults(tmp_path)
    assert d.ignored == ("repetition_penalty 1.05", "min_p 0.0")
    p = sampling_params(d)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 20, 0.95, 64)
    p = sampling_params(d, temperature=0.0, max_tokens=5)  # greedy by flag
    assert (p.temperature, p.greedy, p.top_k, p.max_tokens) == (0.0, True, 0, 5)
    assert sampling_params(d, top_k=3, top_p=0.5).top_k == 3
    # a greedy file, sampled from the command line: the file's top_k / top_p, as
    # generate(do_sample=True, temperature=...) takes them; greedy: both off
    g.write_text(json.dumps({"top_k": 7, "top_p": 0.8}))
    d = read_generation_defaults(tmp_path)
    p = sampling_params(d, temperature=0.7)
    assert (p.temperature, p.top_k, p.top_p) == (0.7, 7, 0.8)
    assert (sampling_params(d).top_k, sampling_params(d).top_p) == (0, 1.0)
    # ... its top_k / top_p out of range: ignored by a greedy run, as transformers' generate
    # ignores them; refused (naming the file and key) by a run that samples with them
    for data, want in (({"top_p": 2.0}, "top_p must be in (0.0, 1.0], got 2.0"),
                       ({"do_sample": False, "top_k": -1}, "top_k must be >= 0, got -1")):
        g.write_text(json.dumps(data))
        d = read_generation_defaults(tmp_path)
        p = sampling_params(d)
        assert (p.greedy, p.top_k, p.top_p) == (True, 0, 1.0), data
        with pytest.raises(TokenizerError, match=re.escape(f"{g}: {want}")):
            sampling_params(d, temperature=0.7)
        p = sampling_params(d, temperature=0.7, top_k=4, top_p=0.5)  # both flags given
        assert (p.top_k, p.top_p) == (4, 0.5), data
    g.unlink()  # no file: the engine's own defaults (top_k, top_p off) also when sampling
    p = sampling_params(read_generation_defaults(tmp_path), temperature=0.7)
    assert (p.top_k, p.top_p) == (0, 1.0)
    g.write_text(json.dumps({**qwen3, "min_new_tokens": 4, "max_length": 100,
                             "suppress_tokens": [1]}))
    assert read_generation_defaults(tmp_path).ignored == (
        "min_new_tokens 4", "suppress_tokens [1]", "max_length 100")
    for data, want in (({"do_sample": "yes"}, "do_sample must be true, false or null"),
                       ({"do_sample": True, "temperature": 0}, "temperature must be > 0"),
                       ({"do_sample": True, "temperature": "hot"},
                        "temperature must be a number, got 'hot'"),
                       ({"do_sample": True, "top_p": 0}, "top_p must be in (0.0, 1.0], got 0"),
                       ({"do_sample": True, "top_p": 1.5}, "top_p must be in"),
                       ({"do_sample": True, "top_k": 2.5}, "top_k must be an int"),
                       ({"do_sample": True, "top_k": -1}, "top_k must be >= 0"),
                       ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
                       ({"do_sample": True, "temperature": float("nan")},
                        "temperature must be a number"),
                       ([], "expected a JSON object")):
        g.write_text(json.dumps(data))
        with pytest.raises(TokenizerError, match=re.escape(want)) as e:
            read_generation_defaults(tmp_path)
        assert str(e.value).startswith(f"{g}: ") and "\n" not in str(e.value)
    g.unlink()
    g.mkdir()
    with pytest.raises(TokenizerError, match="generation_config.json: not a regular file"):
        read_generation_defaults(tmp_path)


def test_generation_config_numbers_past_floats_range(tmp_path):
    """An int of hundreds of digits in a number key is one error naming the key where it is
    out of range or past float's range, and read as the int where an int may be that large
    (top_k: the door clamps it to the vocabulary). Found by probing: math.isfinite raised
    OverflowError, a traceback at the door."""
    from colo_rollout.text.generation_config import read_generation_defaults
    from colo_rollout.text.tokenizer import TokenizerError

    g = tmp_path / "generation_config.json"
    big = 10 ** 400
    shown = repr(big)[:37] + "..."
    for data, want in (({"do_sample": True, "temperature": big},
                        f"temperature must be a number within float's range, got {shown}"),
                       ({"do_sample": True, "top_p": big}, f"top_p must be in (0.0, 1.0], got {shown}"),
                       ({"do_sample": True, "top_k": -big}, f"top_k must be >= 0, got -{shown[:-4]}...")):
        g.write_text(json.dumps(data))
        with pytest.raises(TokenizerError) as e:
            read_generation_defaults(tmp_path)
        assert str(e.value) == f"{g}: {want}"
    g.write_text(json.dumps({"do_sample": True, "top_k": big, "max_new_tokens": big}))
    d = read_generation_defaults(tmp_path)
    assert (d.top_k, d.max_tokens) == (sys.maxsize, big)  # top_k: past any vocabulary


def test_the_files_top_k_and_length_at_the_door(ckpt, tmp_path):
    """A top_k of the file past the vocabulary is the whole vocabulary (transformers clamps
    it); a max_new_tokens of the file too long for the model is refused naming the file."""
    from colo_rollout.sched.request import SamplingParams
    from colo_rollout.tools.generate import GenerateError, prepare

    d, _, _ = ckpt
    g = str(d / "generation_config.json")
    origins = {"top_k": f"{g} top_k", "max_tokens": f"{g} max_new_tokens"}
    _, _, p = prepare(str(d), None, {}, ["hi"], SamplingParams(max_tokens=4, temperature=0.7,
                                                                top_k=10 ** 6), None, origins)
    from colo_rollout.config.hf_config import hf_architecture

    assert p.top_k == hf_architecture(d).fields["vocab_size"]  # clamped to the vocabulary
    with pytest.raises(GenerateError, match=re.escape(
            f"with max_tokens 1000000000 ({g} max_new_tokens; --max-tokens sets it)")):
        prepare(str(d), None, {}, ["hi"], SamplingParams(max_tokens=10 ** 9), None, origins)
    with pytest.raises(GenerateError, match="top_k 1000000 exceeds the vocabulary size"):
        prepare(str(d), None, {}, ["hi"], SamplingParams(max_tokens=4, temperature=0.7,
                                                         top_k=10 ** 6), None)  # a flag's


def test_cli_takes_the_checkpoints_sampling_defaults(ckpt, tmp_path):
    """A checkpoint whose generation_config.json samples: the command says so in one note
    line and samples; --temperature 0 gives transformers' greedy text and no note."""
    d, chat, _ = ckpt
    model = tmp_path / "sampling"
    shutil.copytree(d, model)
    g = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**g, "do_sample": True, "temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}))
    r = _cli("--model", str(model), "--max-tokens", str(MAX_TOKENS), PROMPTS[0])
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: {model / 'generation_config.json'}: sampling with temperature "
                     "0.6, top_k 20, top_p 1.0 (--temperature 0: greedy)",
                     f"note: {model / 'generation_config.json'}: not applied (the engine has "
                     "no such sampling): repetition_penalty 1.1"]
    assert r.stdout.startswith("[0] ")
    r = _cli("--model", str(model), "--max-tokens", str(MAX_TOKENS), "--temperature", "0",
             PROMPTS[0])
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"[0] {chat[PROMPTS[0]]}\n"
    assert "sampling with" not in r.stderr


def test_generate_text_prompts_must_be_a_list_of_text():
    """Checked before anything is encoded or submitted: a lone str is not served character by
    character, and a prompt that is not text is named (the tokenizer's own TypeError did not)."""
    from colo_rollout.sched.request import RequestError, SamplingParams
    from colo_rollout.tools.generate import generate_text

    assert generate_text(None, None, [], SamplingParams()) == []
    # found by probing: params=None failed late with an AttributeError; chat="yes" was True
    with pytest.raises(RequestError, match="params must be SamplingParams, got NoneType"):
        generate_text(None, None, ["hi"], None)
    with pytest.raises(RequestError, match="chat must be True, False or None, got 'yes'"):
        generate_text(None, None, ["hi"], SamplingParams(), chat="yes")
    for prompts, want in (("hello", "prompts must be a list of strings, got str"),
                          ([b"x"], "prompt 0: expected a str, got bytes"),
                          ([None], "prompt 0: expected a str, got NoneType"),
                          (["a\ud800"], "prompt 0: not valid Unicode text")):
        with pytest.raises(RequestError, match=want):
            generate_text(None, None, prompts, SamplingParams())
