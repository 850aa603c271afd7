"""The JSONL replay format: one record per turn; a validating loader whose every error is a
TraceError naming file, 1-based line and field; and the writer (load(dump(t)) == t).

The loader also bounds the numbers a replay can run: at most MAX_TURN_TOKENS tokens per prompt
increment or output, and at most MAX_SECONDS for a wait or an arrival (a replay runs in real
time)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from colo_rollout.sched.request import valid_unicode
from colo_rollout.workloads.trace.model import (
    Conversation,
    Trace,
    TraceError,
    Turn,
    _is_int,
    _is_real,
    id_clash,
    read_trace_bytes,
)

# Keys of one JSONL record.
_REQUIRED_KEYS = ("conv", "turn", "output_tokens", "wait_s")
_PROMPT_KEYS = ("prompt_tokens", "prompt")  # exactly one of the two
_OPTIONAL_KEYS = ("arrival_s",)
_KNOWN_KEYS = ("conv", "turn", "prompt_tokens", "prompt", "output_tokens", "wait_s", "arrival_s")
# the Mooncake format's keys (workloads/trace/mooncake.py), named in the unknown-key hint
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
# Sane bounds: no model serves a context of 10 million tokens, and a replay (real time) that
# waits more than a day for one release has hung.
MAX_TURN_TOKENS = 10_000_000
MAX_SECONDS = 86_400.0


# --------------------------------------------------------------------------- #
# JSONL format: loader and writer
# --------------------------------------------------------------------------- #


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise _NonFinite(name)


class _DuplicateKey(Exception):
    pass


class _NonFinite(Exception):
    pass


def _big(value: int | float) -> str:
    """A number over a bound, short: 1e+30, or 10^400 for an int too large for a float."""
    try:
        return f"{value:.3g}"
    except OverflowError:  # digits from the bit length: str() of a huge int may be refused
        return f"10^{int(abs(value).bit_length() * math.log10(2))}"


def _key_field(key: str) -> str:
    """A record key of the file as the field of an error: as written when it is short
    printable text, else its repr shortened -- a key holding a newline split the error line,
    one of 100,000 characters made it that long (found by probing)."""
    if key.isprintable() and len(key) <= 40:
        return key
    text = repr(key)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


@dataclass(frozen=True)
class _Record:
    """One validated line of a trace file (before conversations are assembled)."""

    line: int
    conv: str
    turn: int
    prompt_tokens: int
    prompt: tuple[int, ...] | None
    output_tokens: int
    wait_s: float
    arrival_s: float | None  # None when the key is absent


def _parse_record(path: str, line: int, text: str) -> _Record:
    """Validate one non-blank line; every problem is a TraceError naming ``path:line: field``."""

    def fail(field_name: str, detail: str) -> TraceError:
        return TraceError(path, line, field_name, detail)

    try:
        obj = json.loads(text, object_pairs_hook=_reject_duplicate_keys,
                         parse_constant=_reject_constant)
    except _DuplicateKey as e:
        raise fail(_key_field(e.args[0]), "duplicate key in the record") from None
    except _NonFinite as e:
        raise fail("record", f"non-finite number {e.args[0]} is not allowed") from None
    except json.JSONDecodeError as e:
        hint = (" (a trace is JSON Lines: one object per line, not a JSON array)"
                if text.lstrip().startswith("[") else "")
        raise fail("record", f"malformed JSON: {e.msg} (column {e.colno}){hint}") from None
    except RecursionError:
        raise fail("record", "malformed JSON: nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts (4300)
        raise fail("record", f"number too large: {e}") from None
    if not isinstance(obj, dict):
        raise fail("record", f"expected a JSON object, got {type(obj).__name__}")
    for key in obj:
        if key not in _KNOWN_KEYS:
            hint = ("; a Mooncake-format trace (timestamp, input_length, output_length, "
                    "hash_ids) is read with bench.trace: 'mooncake:PATH'"
                    if key in _MOONCAKE_KEYS else "")
            raise fail(_key_field(key), f"unknown key (known keys: {', '.join(_KNOWN_KEYS)})"
                       f"{hint}")
    for key in _REQUIRED_KEYS:
        if key not in obj:
            raise fail(key, "missing key")
    present = [k for k in _PROMPT_KEYS if k in obj]
    if len(present) != 1:
        raise fail(
            "prompt_tokens",
            "exactly one of 'prompt_tokens' and 'prompt' is required, got "
            + ("both" if present else "neither"),
        )

    conv = obj["conv"]
    if not isinstance(conv, str):
        raise fail("conv", f"expected str, got {_describe(conv)}")
    if not conv:
        raise fail("conv", "must be a non-empty string")
    if not valid_unicode(conv):  # ids travel as UTF-8 (a lone surrogate cannot)
        raise fail("conv", f"not valid Unicode: {conv!r}")
    turn = obj["turn"]
    if not _is_int(turn):
        raise fail("turn", f"expected int, got {_describe(turn)}")
    if turn < 0:
        raise fail("turn", f"must be >= 0, got {turn}")

    prompt: tuple[int, ...] | None = None
    if "prompt" in obj:
        ids = obj["prompt"]
        if not isinstance(ids, list):
            raise fail("prompt", f"expected list of int, got {_describe(ids)}")
        for i, tok in enumerate(ids):
            if not _is_int(tok):
                raise fail("prompt", f"item {i}: expected int, got {_describe(tok)}")
            if tok < 0:
                raise fail("prompt", f"item {i}: token ids must be >= 0, got {tok}")
        if not ids:
            raise fail("prompt", "must hold at least 1 token id")
        if len(ids) > MAX_TURN_TOKENS:
            raise fail("prompt", f"must hold at most {MAX_TURN_TOKENS:,} token ids (no model "
                       f"serves more), got {len(ids):,}")
        prompt = tuple(ids)
        prompt_tokens = len(prompt)
    else:
        prompt_tokens = obj["prompt_tokens"]
        if not _is_int(prompt_tokens):
            raise fail("prompt_tokens", f"expected int, got {_describe(prompt_tokens)}")
        if prompt_tokens < 1:
            raise fail("prompt_tokens", f"must be >= 1, got {prompt_tokens}")
        if prompt_tokens > MAX_TURN_TOKENS:
            raise fail("prompt_tokens", f"must be at most {MAX_TURN_TOKENS:,} tokens (no model "
                       f"serves more), got {_big(prompt_tokens)}")

    output_tokens = obj["output_tokens"]
    if not _is_int(output_tokens):
        raise fail("output_tokens", f"expected int, got {_describe(output_tokens)}")
    if output_tokens < 1:
        raise fail("output_tokens", f"must be >= 1, got {output_tokens}")
    if output_tokens > MAX_TURN_TOKENS:
        raise fail("output_tokens", f"must be at most {MAX_TURN_TOKENS:,} tokens (no model "
                   f"serves more), got {_big(output_tokens)}")

    def seconds(key: str) -> float:
        value = obj[key]
        if not _is_real(value):
            raise fail(key, f"expected float, got {_describe(value)}")
        if value < 0:
            raise fail(key, f"must be >= 0, got {float(value)!r}")
        if value > MAX_SECONDS:  # an exact comparison, also for ints too large for a float
            raise fail(key, f"must be at most {MAX_SECONDS:g} s (one day: a replay runs in real "
                       f"time), got {_big(value)}")
        if not math.isfinite(value):  # JSON has no inf/nan (parse_constant); kept for safety
            raise fail(key, f"must be finite, got {value!r}")
        return float(value)

    wait_s = seconds("wait_s")
    arrival_s = seconds("arrival_s") if "arrival_s" in obj else None
    return _Record(line, conv, turn, prompt_tokens, prompt, output_tokens, wait_s, arrival_s)


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Load and validate a JSONL trace (one record per turn).

    Record keys:
      * ``conv`` (str): conversation id.
      * ``turn`` (int >= 0): turns of a conversation are 0, 1, ... with no gap.
      * exactly one of ``prompt_tokens`` (int >= 1) and ``prompt`` (non-empty list of token ids):
        the prompt increment of this turn (turn 0: the whole first prompt).
      * ``output_tokens`` (int >= 1): fixed output length for replay.
      * ``wait_s`` (number >= 0): client wait before the turn is released, counted from the
        previous turn's last token. Required on every line; ignored (stored as 0.0) on turn 0.
      * ``arrival_s`` (optional number >= 0, default 0): release time of turn 0 from the start.
        It may be repeated on later turns only with the same value.

    Blank lines are skipped; lines may come in any order. Conversations are ordered by
    (arrival_s, line of their first record). bool is never accepted as a number.
    """
    name = os.fspath(path)
    data = read_trace_bytes(path)
    raw_lines = data.split(b"\n")
    # conv -> turn -> record; first line of each conv in insertion order of the dict
    convs: dict[str, dict[int, _Record]] = {}
    for lineno, raw in enumerate(raw_lines, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(name, lineno, "record", f"not valid UTF-8 ({e.reason})") from None
        if not text.strip():
            continue
        rec = _parse_record(name, lineno, text)
        turns = convs.setdefault(rec.conv, {})
        if rec.turn in turns:
            raise TraceError(
                name, lineno, "turn",
                f"duplicate turn {rec.turn} of conversation {rec.conv!r} "
                f"(first at line {turns[rec.turn].line})",
            )
        turns[rec.turn] = rec
    if not convs:
        raise TraceError(name, 1, "file", "no trace records (empty trace)")

    clash = id_clash({conv: len(by_turn) for conv, by_turn in convs.items()})
    if clash is not None:
        conv, base, turn = clash
        raise TraceError(
            name, min(r.line for r in convs[conv].values()), "conv",
            f"{conv!r} is also the request id of turn {turn} of conversation {base!r} (the "
            "replay names requests CONV#TURN and sessions CONV): rename one of them")
    built: list[tuple[float, int, Conversation]] = []
    for conv, by_turn in convs.items():
        first_line = min(r.line for r in by_turn.values())
        ordered = [by_turn[k] for k in sorted(by_turn)]
        for expected, rec in enumerate(ordered):
            if rec.turn != expected:
                raise TraceError(
                    name, rec.line, "turn",
                    f"conversation {rec.conv!r} is missing turn {expected} "
                    f"(turns must be consecutive from 0; this line has turn {rec.turn})",
                )
        head = ordered[0]
        arrival = head.arrival_s if head.arrival_s is not None else 0.0
        for rec in ordered[1:]:
            if rec.arrival_s is not None and rec.arrival_s != arrival:
                raise TraceError(
                    name, rec.line, "arrival_s",
                    f"is the release time of turn 0 ({arrival!r} at line {head.line}); "
                    f"turn {rec.turn} repeats it as {rec.arrival_s!r}",
                )
        turns = tuple(
            Turn(conv=r.conv, turn=r.turn, prompt_tokens=r.prompt_tokens,
                 output_tokens=r.output_tokens,
                 wait_s=0.0 if r.turn == 0 else r.wait_s,  # turn 0's wait is ignored
                 prompt=r.prompt, line=r.line)
            for r in ordered
        )
        built.append((arrival, first_line, Conversation(conv, arrival, turns)))
    built.sort(key=lambda item: (item[0], item[1]))
    return Trace(tuple(c for _, _, c in built), source=name)


def _turn_record(c: Conversation, t: Turn) -> dict[str, Any]:
    rec: dict[str, Any] = {"conv": t.conv, "turn": t.turn}
    if t.prompt is not None:
        rec["prompt"] = list(t.prompt)
    else:
        rec["prompt_tokens"] = t.prompt_tokens
    rec["output_tokens"] = t.output_tokens
    rec["wait_s"] = t.wait_s
    if t.turn == 0:
        rec["arrival_s"] = c.arrival_s
    return rec


def dump_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` as JSONL: conversations in trace order, turns in order, ``arrival_s`` on
    turn 0 only. Floats are written with repr precision, so ``load_trace`` gives back an equal
    trace (the conversation order survives: a Trace is in (arrival_s, tuple position) order, and
    the loader sorts by (arrival_s, first line))."""
    with open(path, "w", encoding="utf-8") as f:
        for c in trace.conversations:
            for t in c.turns:
                f.write(json.dumps(_turn_record(c, t), separators=(", ", ": ")))
                f.write("\n")
