"""Text in, text out over the engine: `generate_text()` for in-process callers and the
`colo-rollout generate` command.

Owns turning text prompts into requests (chat template, encode), serving them in one collective
``engine.generate`` call, and turning the generated ids back into text (cut at the tokenizer's
eos ids, decoded without special tokens). The engine and rollout() stay token-in/token-out.

The command validates everything it can before any rank starts (tokenizer, config, vocabulary,
sampling parameters, prompt lengths), each problem one ``error:`` line with exit code 2; then
it serves the prompts on ``parallel.world_size`` ranks the way the other commands do
(``launch._launch``: in-process under torchrun, otherwise spawned CPU ranks).

Nothing heavy is imported at module import: the CLI's parser reads this module.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from colo_rollout.sched.request import Request, RequestError, SamplingParams, valid_unicode
from colo_rollout.text.generation_config import GenerationDefaults, read_generation_defaults
from colo_rollout.text.tokenizer import Tokenizer, TokenizerError

# kv_block_size of the default config (the engine's own default)
_BLOCK = 16
# most decode rows of the default config (the engine's default decode_buckets end at 32)
_MAX_ROWS = 32
# --max-tokens where neither the command line nor generation_config.json sets it
_MAX_TOKENS = 64
# the engine's default prefill budget; raised to the longest prompt when that is longer
_PREFILL_TOKENS = 2048


class GenerateError(ValueError):
    """A problem found at the door of `colo-rollout generate`; the message is one line."""


# --------------------------------------------------------------------------- in-process API
def _cut_at_eos(tokens: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """``tokens`` up to (without) the first of ``eos_ids``."""
    stop = set(eos_ids)
    for i, t in enumerate(tokens):
        if t in stop:
            return list(tokens[:i])
    return list(tokens)


class PromptErrors(RequestError):
    """Some prompts of a ``generate_text`` call were refused; every other prompt was served.
    ``texts``: each prompt's completion in order, None where refused; ``errors``: {prompt
    index: one-line reason}. The message names the first refused prompt and the count."""

    def __init__(self, texts: list[str | None], errors: dict[int, str]) -> None:
        first = min(errors)
        more = f" (and {len(errors) - 1} more refused)" if len(errors) > 1 else ""
        super().__init__(f"{errors[first]}{more}; the other {len(texts) - len(errors)} "
                         "prompts were served (PromptErrors.texts)")
        self.texts = texts
        self.errors = errors


def generate_text(engine: Any, tokenizer: Tokenizer, prompts: Sequence[str],
                  params: SamplingParams, chat: bool | None = None) -> list[str]:
    """The completion of each text prompt, in order (collective: every rank calls it with the
    same arguments and gets the same texts).

    Each prompt goes through the chat template when the tokenizer has one and ``chat`` is None
    (``chat=False``: encoded as plain text; ``chat=True``: template required). All prompts are
    served in one ``engine.generate`` call. A completion ends at the first of the tokenizer's
    eos ids (unless ``params.ignore_eos``): the engine itself stops on ``engine.eos_token_id``
    only (one id), a completion that hits another eos id is cut there. Text is decoded without
    special tokens.

    A prompt the engine can never serve (not text, a template that refuses it, too long for
    engine.max_seq_len / max_prefill_tokens, bad sampling parameters) is refused on every rank
    alike without stopping the others: they are served, then PromptErrors (a RequestError)
    carries every completion and every refusal."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise RequestError(f"generate_text: prompts must be a list of strings, got "
                           f"{type(prompts).__name__} (a single prompt: [prompt])")
    if not isinstance(params, SamplingParams):  # (found by probing: an AttributeError late)
        raise RequestError(f"generate_text: params must be SamplingParams, got "
                           f"{type(params).__name__}")
    if chat is not None and not isinstance(chat, bool):
        raise RequestError(f"generate_text: chat must be True, False or None, got {chat!r:.60}")
    # every check is deterministic on replicated state, so every rank refuses the same
    # prompts before any collective (generate() would report a refusal on rank 0 only)
    if not prompts:
        return []
    errors: dict[int, str] = {}
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            errors[i] = f"prompt {i}: expected a str, got {type(p).__name__}"
        elif not valid_unicode(p):
            errors[i] = f"prompt {i}: not valid Unicode text (a lone surrogate)"
    requests: dict[int, Request] = {}
    texts: list[str | None] = [None] * len(prompts)
    if len(errors) == len(prompts):
        raise PromptErrors(texts, errors)
    sched = engine.scheduler
    # ids unique over the engine's life, identical on every rank: the step counter is
    # replicated state, and every generate() call advances it; a control character first, so
    # that no id a caller would choose matches (found by probing: a caller's own pending
    # "text0-0" was refused as our duplicate id's original, and its output returned as ours)
    base = f"\x1ftext{sched.step_no}"
    for i, p in enumerate(prompts):
        if i in errors:
            continue
        try:
            ids = tuple(tokenizer.encode_prompt(p, chat=chat))
        except TokenizerError as e:  # the chat template's raise_exception, say
            errors[i] = f"prompt {i}: {e}"
            continue
        try:
            req = Request(f"{base}-{i}", ids, params)
            sched.validate(req)
        except RequestError as e:
            errors[i] = f"prompt {i} ({len(ids)} tokens): {e}"
            continue
        requests[i] = req
    outs = engine.generate(list(requests.values())) if requests else {}
    eos = () if params.ignore_eos else tokenizer.eos_token_ids
    for i, req in requests.items():
        out = outs[req.request_id]
        if out.error is not None:  # not expected after validate(); never hide it
            errors[i] = f"prompt {i}: {out.error}"
            continue
        texts[i] = tokenizer.decode(_cut_at_eos(out.tokens, eos), skip_special_tokens=True)
    if errors:
        raise PromptErrors(texts, errors)
    return texts


# --------------------------------------------------------------------------- rank function
def run_generate(rank: int, world: int, config_path: str, overrides: dict | None,
                 prompts: list[str], params: dict, chat: bool | None) -> list[str]:
    """One rank of `colo-rollout generate`: build the engine from the (door-validated) config,
    serve the prompts, return the completions (the same on every rank)."""
    from colo_rollout.config import load_config
    from colo_rollout.quiet import quiet_known_warnings

    quiet_known_warnings()
    from colo_rollout.engine.engine import Engine
    from colo_rollout.runtime.parallel import init_parallel

    cfg = load_config(config_path, overrides)
    tokenizer = Tokenizer.from_dir(cfg.model.checkpoint)
    groups = init_parallel(cfg.parallel)
    engine = Engine(cfg, groups)  # loads model.checkpoint, each rank its slices
    try:
        return generate_text(engine, tokenizer, prompts, SamplingParams.from_json(params), chat)
    finally:
        engine.close()  # D graphs hold NCCL collectives: drop them before the groups go away


# --------------------------------------------------------------------------- the command
def _default_config(model_dir: str, overrides: Mapping[str, Any], prompt_lens: list[int],
                    max_tokens: int, eos: int | None, mt: str = ""):
    """The config without --config: one rank, fp32 on CPU (bf16 with CUDA), engine limits sized
    to the prompts; ``overrides`` (--set) win over all of it."""
    import torch

    from colo_rollout.config import config_from_dict
    from colo_rollout.config.loader import _apply_overrides

    source = f"{model_dir} (generate's default config)"

    def build(engine: dict):
        data = {"parallel": {"world_size": 1},
                "model": {"checkpoint": model_dir,
                          "params_dtype": "bfloat16" if torch.cuda.is_available() else "float32"},
                "engine": engine}
        _apply_overrides(data, {**overrides, "model.checkpoint": model_dir})
        return config_from_dict(data, source=source)

    # first the model alone (the architecture read from config.json), to size the engine by
    model = build({"max_seq_len": 2}).model
    longest = max(prompt_lens)
    need = longest + max_tokens
    if need > model.max_position_embeddings:
        i = prompt_lens.index(longest)
        raise GenerateError(f"prompt {i}: {longest} tokens; with "
                            f"{mt or f'max_tokens {max_tokens}'} that is {need}, over the "
                            f"model's max_position_embeddings {model.max_position_embeddings}")
    rows = min(len(prompt_lens), _MAX_ROWS)
    engine = {"max_seq_len": need, "max_prefill_tokens": max(_PREFILL_TOKENS, longest),
              "kv_block_size": _BLOCK, "max_batch_size": rows,
              "num_kv_blocks": rows * -(-need // _BLOCK), "eos_token_id": eos}
    return build(engine)


def _check_fits(cfg, prompt_lens: list[int], max_tokens: int, mt: str = "") -> None:
    """Every prompt fits the engine's limits (a --config may set them small)."""
    e = cfg.engine
    for i, n in enumerate(prompt_lens):
        if n + max_tokens > e.max_seq_len:
            raise GenerateError(f"prompt {i}: {n} tokens; with "
                                f"{mt or f'max_tokens {max_tokens}'} that is {n + max_tokens}, "
                                f"over engine.max_seq_len {e.max_seq_len}")
        if n > e.max_prefill_tokens:
            raise GenerateError(f"prompt {i}: {n} tokens, over engine.max_prefill_tokens "
                                f"{e.max_prefill_tokens}")
        blocks = -(-(n + max_tokens) // e.kv_block_size)
        if blocks > e.num_kv_blocks:
            raise GenerateError(f"prompt {i}: needs {blocks} KV blocks, a replica has "
                                f"engine.num_kv_blocks {e.num_kv_blocks}")


def _check_params(params: SamplingParams, vocab: int | None,
                  origins: Mapping[str, str] | None = None) -> None:
    """``params`` as the engine will check them against ``vocab``; None: the vocabulary is
    not known yet -- every rule but top_k's bound (found by probing: a top_k past 2**63 was
    said to exceed a vocabulary of 9223372036854775807)."""
    if vocab is None:
        k = params.top_k
        if isinstance(k, int) and not isinstance(k, bool) and k >= 0:
            params = dataclasses.replace(params, top_k=0)
        vocab = sys.maxsize
    try:
        params.validate("generate", vocab)
    except RequestError as e:  # "request 'generate': what" -> "sampling parameters: what"
        what = str(e).split(': ', 1)[-1]
        key = next((k for k in ("max_tokens", "temperature", "top_p", "top_k")
                    if what.startswith(k)), None)
        flag = None if key is None else f"--{key.replace('_', '-')}"
        if key is not None and key in (origins or {}):  # the file chose it
            raise GenerateError(f"sampling parameters: {what} (from {origins[key]}; {flag} "
                                "sets it)") from None
        # a flag's value: named as the flag (found by probing: "sampling parameters: ...")
        raise GenerateError(f"{flag or 'sampling parameters'}: {what}") from None


def _yaml_sections(config_path: str) -> dict[str, dict]:
    """The config file's own sections that are mappings, read by the door's reader (a
    ConfigError where the file cannot be read; found by probing: an open() of its own hung on
    a FIFO, and a nesting bomb was a RecursionError traceback, before load_config looked)."""
    from colo_rollout.config.loader import read_config_file

    return {k: v for k, v in read_config_file(config_path).items() if isinstance(v, dict)}


# the engine limits generate sizes to the prompts where neither --config nor --set gives them
_SIZED = ("max_seq_len", "max_prefill_tokens", "kv_block_size", "max_batch_size",
          "num_kv_blocks")


def prepare(model_dir: str, config_path: str | None, overrides: Mapping[str, Any],
            prompts: Sequence[str], params: SamplingParams, chat: bool | None,
            origins: Mapping[str, str] | None = None):
    """Everything `generate` checks before ranks start. Returns (config, tokenizer, params);
    raises GenerateError, ConfigError, TokenizerError or RequestError with a one-line message.
    ``origins``: the parameters generation_config.json chose ('FILE key'): a top_k of the file
    past the vocabulary is the whole vocabulary (transformers clamps it), and the messages
    name the file."""
    from colo_rollout.config import ConfigError, load_config
    from colo_rollout.config.loader import located

    origins = origins or {}
    lines: dict[str, int] = {}  # each key's line in --config: the checks below name it too
    given_overrides: Mapping[str, Any] = overrides
    mt = f"max_tokens {params.max_tokens}" + (
        f" ({origins['max_tokens']}; --max-tokens sets it)" if "max_tokens" in origins else "")

    other = overrides.get("model.checkpoint")
    if other is not None and os.path.realpath(str(other)) != os.path.realpath(model_dir):
        raise GenerateError(f"--set model.checkpoint={other}: generate serves --model "
                            f"{model_dir}; give the checkpoint once")
    if not model_dir.strip():  # (found by probing: the line began "error: : ")
        raise GenerateError("--model: no checkpoint folder named (the path is empty)")
    if not Tokenizer.available(model_dir):
        raise GenerateError(f"{model_dir}: no tokenizer.json (generate needs the checkpoint's "
                            "tokenizer; rollout() itself is token-in/token-out)")
    tokenizer = Tokenizer.from_dir(model_dir)
    if not prompts:
        raise GenerateError("no prompt given")
    for i, p in enumerate(prompts):  # argv bytes that are not UTF-8 arrive as surrogates
        if not valid_unicode(p):
            raise GenerateError(f"prompt {i}: not valid UTF-8 text (the shell passed bytes "
                                "the locale could not decode)")
    lens = [len(tokenizer.encode_prompt(p, chat=chat)) for p in prompts]
    if 0 in lens:
        raise GenerateError(f"prompt {lens.index(0)} encodes to no tokens")
    _check_params(params, None, origins)  # before the engine is sized by max_tokens
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    if config_path is None:
        cfg = _default_config(model_dir, overrides, lens, params.max_tokens, eos, mt)
    else:
        # limits the file leaves unset are sized to the prompts, as without --config (found
        # by probing: the engine's defaults outgrew a small model's positions, and the error
        # named a key the file never set)
        sections = _yaml_sections(config_path)
        mine = sections.get("engine") or {}
        sized = _default_config(model_dir, overrides, lens, params.max_tokens, eos, mt).engine
        fill = {f"engine.{k}": getattr(sized, k) for k in _SIZED
                if k not in mine and f"engine.{k}" not in overrides}
        given_overrides = {**fill, **overrides, "model.checkpoint": model_dir}
        cfg = load_config(config_path, given_overrides, lines)
        given = (sections.get("model") or {}).get("checkpoint")  # load_config checked the file
        if given is not None and os.path.realpath(str(given)) != os.path.realpath(model_dir):
            at = f":{lines['model.checkpoint']}" if "model.checkpoint" in lines else ""
            raise GenerateError(f"{config_path}{at}: model.checkpoint: {given!r} is not --model "
                                f"{model_dir!r}; give the checkpoint once")
        if cfg.engine.eos_token_id is None and eos is not None:  # not set: the tokenizer's
            cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine,
                                                                      eos_token_id=eos))
    if not cfg.engine.stop_token_ids and len(tokenizer.eos_token_ids) > 1:
        # every eos id stops the engine, as transformers' generate stops on any of them
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(
            cfg.engine, stop_token_ids=[i for i in tokenizer.eos_token_ids
                                        if i != cfg.engine.eos_token_id]))
    vocab = cfg.model.vocab_size
    if tokenizer.vocab_size > vocab:
        raise GenerateError(f"{model_dir}: the tokenizer has {tokenizer.vocab_size} ids, more "
                            f"than the model's vocab_size {vocab}")
    bad = [i for i in tokenizer.eos_token_ids if i >= vocab]
    if bad:
        raise GenerateError(f"{model_dir}: eos token id {bad[0]} is outside the model's "
                            f"vocab_size {vocab}")
    if "top_k" in origins and params.top_k > vocab:
        params = dataclasses.replace(params, top_k=vocab)
    _check_params(params, vocab, origins)
    _check_fits(cfg, lens, params.max_tokens, mt)
    from colo_rollout.door import check_engine

    # the door's checks of the engine, naming the user's source (the launch's own door
    # reads a temporary file: found by probing, model.fp8 on a CPU host named it) and the
    # line of the key in --config (found by probing: none was named)
    source = config_path or f"{model_dir} (generate's default config)"
    try:
        check_engine(cfg, source)
    except ConfigError as err:
        raise located(err, source, lines, given_overrides) from err
    return cfg, tokenizer, params


def sampling_params(defaults: GenerationDefaults, *, max_tokens: int | None = None,
                    temperature: float | None = None, top_p: float | None = None,
                    top_k: int | None = None) -> SamplingParams:
    """The command's sampling parameters: each flag given wins, each one not given is the
    checkpoint's generation_config.json default (greedy where the file does not sample), and
    --max-tokens without a file max_new_tokens is 64."""
    if max_tokens is None:
        max_tokens = defaults.max_tokens if defaults.max_tokens is not None else _MAX_TOKENS
    if temperature is None:
        temperature = defaults.temperature
    # a sampling run takes the file's top_k / top_p (or transformers' 50 / 1.0), also where
    # only the command line samples: generate(do_sample=True, temperature=...) does the same
    sampling = isinstance(temperature, (int, float)) and temperature > 0
    given = {"top_k": top_k, "top_p": top_p}
    for key, problem in defaults.deferred:  # the file's value this run would sample with
        if sampling and given[key] is None:
            raise problem
    if top_k is None:
        top_k = defaults.top_k if sampling else 0
    if top_p is None:
        top_p = defaults.top_p if sampling else 1.0
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k)


def file_origins(defaults: GenerationDefaults, params: SamplingParams, args) -> dict[str, str]:
    """param -> 'FILE key' for each parameter generation_config.json chose (no flag given)."""
    if defaults.source is None:
        return {}
    out = {}
    if args.max_tokens is None and defaults.max_tokens is not None:
        out["max_tokens"] = f"{defaults.source} max_new_tokens"
    if not params.greedy:
        if args.temperature is None:
            out["temperature"] = f"{defaults.source} temperature"
        for key in ("top_k", "top_p"):
            if getattr(args, key) is None:
                out[key] = f"{defaults.source} {key}"
    return out


def _say_defaults(defaults: GenerationDefaults, params: SamplingParams,
                  origins: dict[str, str]) -> None:
    """One note line on stderr when generation_config.json chose how to sample (the output is
    then not transformers' greedy text), and one for keys it holds that the engine ignores."""
    taken = [f"{k} {getattr(params, k)}" for k in ("temperature", "top_k", "top_p")
             if k in origins]
    if taken:
        print(f"note: {defaults.source}: sampling with {', '.join(taken)} (--temperature 0: "
              "greedy)", file=sys.stderr)
    if defaults.ignored:
        print(f"note: {defaults.source}: not applied (the engine has no such sampling): "
              f"{', '.join(defaults.ignored)}", file=sys.stderr)


def main(args) -> int:
    """`colo-rollout generate` (args from cli.py's parser). Exit code 0, or 2 for a problem
    found at the door (one ``error:`` line on stderr)."""
    from colo_rollout.launch import _launch, _overrides
    from colo_rollout.config import ConfigError, dump_config

    chat = False if args.no_chat else None
    try:
        overrides = _overrides(args.set)
    except ConfigError as e:  # --set without '=', or a value that is not valid YAML
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    try:
        if not args.model.strip():  # (before its files are looked for: "" is the cwd)
            raise GenerateError("--model: no checkpoint folder named (the path is empty)")
        defaults = read_generation_defaults(args.model)
        params = sampling_params(defaults, max_tokens=args.max_tokens,
                                 temperature=args.temperature, top_p=args.top_p,
                                 top_k=args.top_k)
        origins = file_origins(defaults, params, args)
        cfg, _, params = prepare(args.model, args.config, overrides, args.prompts, params, chat,
                                 origins)
    except (GenerateError, ConfigError, TokenizerError, RequestError) as e:
        # one line, as the door's (found by probing: a key or path holding a newline, and
        # PyYAML's own texts, came out over two)
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    if "WORLD_SIZE" not in os.environ or os.environ.get("RANK") == "0":
        _say_defaults(defaults, params, origins)
    # the ranks read exactly the validated config (sizing and eos included) from a file
    fd, path = tempfile.mkstemp(prefix="colo_rollout_generate_", suffix=".yaml")
    os.close(fd)
    try:
        dump_config(cfg, path)
        texts = _launch("colo_rollout.tools.generate:run_generate", path, {},
                        prompts=list(args.prompts), params=params.to_json(), chat=chat)[0]
    finally:
        Path(path).unlink(missing_ok=True)
    if "WORLD_SIZE" in os.environ and os.environ.get("RANK") != "0":  # torchrun: rank 0 prints
        return 0
    for i, text in enumerate(texts):
        print(f"[{i}] {text}", flush=True)
    return 0
