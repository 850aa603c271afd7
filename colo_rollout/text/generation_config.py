"""A checkpoint's generation_config.json as default sampling parameters.

Owns reading the sampling defaults a model ships (Qwen3: ``do_sample: true, temperature: 0.6,
top_p: 0.95, top_k: 20``) the way transformers' ``generate()`` applies them: with ``do_sample``
false, null or absent the model decodes greedily whatever its temperature says; with it true,
an unset temperature is 1.0. Whenever the run samples (the file's do_sample, or a temperature
given on the command line, as ``generate(do_sample=True, ...)``), its top_k and top_p apply,
unset ones GenerationConfig's 50 and 1.0. ``max_new_tokens`` becomes the default completion
length (``max_length`` counts the prompt too and is not used). Keys that change transformers'
output and that the engine cannot honour (repetition_penalty, min_p, beams, min_new_tokens,
...) are reported as ``ignored``, for the caller to say so; they are not an error, since a
user can still want the model's other defaults. Without the file the engine's own defaults
hold: greedy, top_k and top_p off.

A value of the wrong type or out of range is a TokenizerError naming the file and the key --
a top_k or top_p of a file that does not sample only when the run samples (transformers
ignores them otherwise).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colo_rollout.text.tokenizer import TokenizerError, _read_json, _short

# keys that change transformers' output and that the engine does not implement, with the
# value at which each is a no-op (a file that states the no-op is not reported)
_UNSUPPORTED = {"repetition_penalty": 1.0, "min_p": None, "typical_p": 1.0,
                "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "num_beams": 1,
                "no_repeat_ngram_size": 0, "presence_penalty": None,
                "frequency_penalty": None, "penalty_alpha": None, "min_new_tokens": 0,
                "min_length": 0, "bad_words_ids": None, "suppress_tokens": None,
                "begin_suppress_tokens": None, "forced_bos_token_id": None,
                "forced_eos_token_id": None, "sequence_bias": None,
                "exponential_decay_length_penalty": None, "top_h": None,
                "guidance_scale": 1.0, "num_return_sequences": 1, "max_length": None}
# transformers' GenerationConfig defaults for a sampling run's unset keys
_SAMPLE_TEMPERATURE, _SAMPLE_TOP_K, _SAMPLE_TOP_P = 1.0, 50, 1.0


@dataclass(frozen=True)
class GenerationDefaults:
    """Default sampling parameters of a checkpoint: ``temperature`` (0: greedy), and the
    ``top_k`` / ``top_p`` a sampling run takes. ``max_tokens`` None: the file sets no
    max_new_tokens. ``source``: the file they came from (None: no file)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int | None = None
    ignored: tuple[str, ...] = ()
    source: Path | None = None
    # (key, its error): a top_k / top_p out of range in a file that does not sample --
    # transformers' generate ignores them unless the run samples (``--temperature``), and then
    # refuses them; ``sampling_params`` raises the error only for such a run
    deferred: tuple[tuple[str, TokenizerError], ...] = ()

    @property
    def sampling(self) -> bool:
        return self.temperature > 0


def _number(path: Path, key: str, value: Any, *, integer: bool, low: float,
            high: float = math.inf, open_low: bool = False) -> float | int:
    kind = "an int" if integer else "a number"
    ok = (isinstance(value, int) if integer else isinstance(value, (int, float)))
    # (an int is finite: math.isfinite of one past float's range raises OverflowError -- found
    # by probing: a traceback for temperature / top_k / max_new_tokens of 400 digits)
    if not ok or isinstance(value, bool) or (isinstance(value, float)
                                             and not math.isfinite(value)):
        raise TokenizerError(path, f"{key} must be {kind}, got {_short(value)}")
    if value < low or value > high or (open_low and value == low):  # exact, also for big ints
        bound = f"> {low}" if open_low else f">= {low}"
        span = bound if high == math.inf else f"in ({low}, {high}]" if open_low else \
            f"in [{low}, {high}]"
        raise TokenizerError(path, f"{key} must be {span}, got {_short(value)}")
    if not integer and value > sys.float_info.max:  # an int float() cannot hold
        raise TokenizerError(path, f"{key} must be a number within float's range, got "
                             f"{_short(value)}")
    return value


def read_generation_defaults(directory: str | Path) -> GenerationDefaults:
    """The sampling defaults of the checkpoint in ``directory`` (the engine's own -- greedy,
    top_k and top_p off -- when it has no generation_config.json)."""
    path = Path(directory) / "generation_config.json"
    data = _read_json(path)
    if data is None:
        return GenerationDefaults()
    do_sample = data.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise TokenizerError(path, f"do_sample must be true, false or null, got {do_sample!r}")
    keys = [("top_k", True, 0, math.inf, False), ("top_p", False, 0.0, 1.0, True),
            ("max_new_tokens", True, 1, math.inf, False)]
    if do_sample:  # transformers reads the temperature of a sampling run only
        keys.insert(0, ("temperature", False, 0.0, math.inf, False))
    checked: dict[str, Any] = {}
    deferred = []
    for key, integer, low, high, open_low in keys:
        value = data.get(key)
        if value is not None:
            try:
                checked[key] = _number(path, key, value, integer=integer, low=low, high=high,
                                       open_low=open_low)
            except TokenizerError as e:
                # a greedy file's top_k / top_p: refused only by a run that samples (found by
                # probing: {"do_sample": false, "top_p": 2.0} was refused, transformers runs it)
                if do_sample or key not in ("top_k", "top_p"):
                    raise
                deferred.append((key, e))
    ignored = tuple(f"{k} {data[k]!r}" for k, noop in _UNSUPPORTED.items()
                    if data.get(k) is not None and data[k] != noop)
    temperature = 0.0
    if do_sample:
        temperature = checked.get("temperature", _SAMPLE_TEMPERATURE)
        if temperature == 0:  # transformers refuses it: sampling needs a positive temperature
            raise TokenizerError(path, "temperature must be > 0 when do_sample is true, got 0")
    return GenerationDefaults(temperature=float(temperature),
                              # past any vocabulary is the whole one, as transformers'
                              # top-k takes min(top_k, vocab): capped to what the door's
                              # checks take before it clamps (found by probing: 400 digits
                              # were refused there)
                              top_k=min(int(checked.get("top_k", _SAMPLE_TOP_K)), sys.maxsize),
                              top_p=float(checked.get("top_p", _SAMPLE_TOP_P)),
                              max_tokens=checked.get("max_new_tokens"), ignored=ignored,
                              source=path, deferred=tuple(deferred))
