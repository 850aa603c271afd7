"""The trace data model: Turn, Conversation, Trace (frozen, invariants checked), TraceStats,
TraceError, and the paper's target statistics.

Must not go in here: file formats (jsonl.py, mooncake.py), generation (generator.py), replay
timing, engine objects, torch. Only the standard library and numpy."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from types import MappingProxyType
from typing import Any

import numpy as np

from colo_rollout.config.files import FileProblem, read_regular_file

# The main-campaign trace of the AInfer-PD paper (Workload and protocol; Figure 6 text). Keys are
# the flat names of TraceStats.flat(). The paper's "input tokens" (6,574,104) count the whole
# context re-sent with every turn, i.e. our input_tokens_with_context, not the sum of increments.
PAPER_TARGETS: Mapping[str, float] = MappingProxyType(
    {
        "conversations": 128,
        "requests": 1265,
        "continuations": 1137,
        "max_turns": 10,
        "input_tokens_with_context": 6_574_104,
        "output_tokens": 220_862,
        "prompt_increment_p50": 292,
        "prompt_increment_p99": 3062,
        "output_p50": 88,
        "output_p99": 1057,
        "retained_context_p50": 4716,
        "retained_context_p99": 12_507,
        "client_wait_p50": 3.10,
        "client_wait_p99": 15.30,
    }
)

# Standard normal quantile of 0.99; a lognormal with median m and p99 q has sigma = ln(q/m)/Z99.
_Z99 = NormalDist().inv_cdf(0.99)  # 2.3263...


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


class TraceError(ValueError):
    """An invalid trace file.

    The message is ``<path>:<line>: <field>: <detail>`` with a 1-based line number (``<path>:
    <field>: <detail>`` when ``line`` is None: the file cannot be read); ``field`` is a record
    key, or ``record`` for problems with the line as a whole (malformed JSON, not an object) and
    ``file`` for problems with the file as a whole (unreadable, no records). All three are also
    kept as attributes.
    """

    def __init__(self, path: str, line: int | None, field_name: str, detail: str):
        where = path if line is None else f"{path}:{line}"
        super().__init__(f"{where}: {field_name}: {detail}")
        self.path = path
        self.line = line
        self.field = field_name
        self.detail = detail

    def __reduce__(self):
        # Keep the structured parts across pickling (errors may cross process boundaries).
        return (TraceError, (self.path, self.line, self.field, self.detail))


# the largest trace file read (a real agentic trace of thousands of conversations is MBs)
MAX_TRACE_BYTES = 1 << 30


def read_trace_bytes(path: str | os.PathLike[str]) -> bytes:
    """A trace file's bytes (a leading UTF-8 byte-order mark, which some editors write,
    dropped), or TraceError (``<path>: file: ...``) for a path that is empty, unreadable, not
    a regular file (a directory, a FIFO or a device would block or never end) or larger than
    MAX_TRACE_BYTES (config/files.py)."""
    name = os.fspath(path)
    try:
        data = read_regular_file(name, MAX_TRACE_BYTES, "trace file", "a trace is a JSONL file")
    except FileProblem as e:
        raise TraceError(name or "<empty path>", None, "file", str(e)) from None
    return data[3:] if data.startswith(b"\xef\xbb\xbf") else data


# --------------------------------------------------------------------------- #
# Data model
# --------------------------------------------------------------------------- #


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Turn:
    """One request of a conversation.

    Invariants (checked on construction):
      * ``conv`` is a non-empty str; ``turn >= 0``.
      * ``prompt_tokens >= 1`` is the prompt *increment*: for turn 0 the whole first prompt, for
        later turns the tokens appended after the previous turn's output.
      * ``output_tokens >= 1`` is the fixed output length used by replay.
      * ``wait_s`` is finite and ``>= 0``: the client wait before this turn is released, counted
        from the previous turn's last token. Turn 0 has no previous turn, so its wait is 0.0.
      * ``prompt`` (token ids of the increment), when given, has exactly ``prompt_tokens`` ids,
        each an int ``>= 0``.

    ``line``: the 1-based line of the trace file the turn was read from (None when it was not
    read from a file); provenance for error messages only, not part of equality.
    """

    conv: str
    turn: int
    prompt_tokens: int
    output_tokens: int
    wait_s: float
    prompt: tuple[int, ...] | None = None
    line: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.conv, str) or not self.conv:
            raise ValueError(f"Turn.conv: expected a non-empty str, got {self.conv!r}")
        where = f"Turn {self.conv!r}/{self.turn!r}"
        if not _is_int(self.turn) or self.turn < 0:
            raise ValueError(f"{where}: turn must be an int >= 0")
        if not _is_int(self.prompt_tokens) or self.prompt_tokens < 1:
            raise ValueError(f"{where}: prompt_tokens must be an int >= 1, "
                             f"got {self.prompt_tokens!r}")
        if not _is_int(self.output_tokens) or self.output_tokens < 1:
            raise ValueError(f"{where}: output_tokens must be an int >= 1, "
                             f"got {self.output_tokens!r}")
        if not _is_real(self.wait_s) or not math.isfinite(self.wait_s) or self.wait_s < 0:
            raise ValueError(f"{where}: wait_s must be a finite number >= 0, got {self.wait_s!r}")
        object.__setattr__(self, "wait_s", float(self.wait_s))
        if self.turn == 0 and self.wait_s != 0.0:
            raise ValueError(f"{where}: turn 0 has no previous turn; its wait_s must be 0.0")
        if self.prompt is not None:
            ids = tuple(self.prompt)
            if len(ids) != self.prompt_tokens:
                raise ValueError(
                    f"{where}: len(prompt)={len(ids)} != prompt_tokens={self.prompt_tokens}")
            if not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"{where}: prompt ids must be ints >= 0")
            object.__setattr__(self, "prompt", ids)


@dataclass(frozen=True)
class Conversation:
    """A chain of causally dependent turns: turn i+1 is released ``wait_s`` after turn i ends.

    Invariants: at least one turn; ``turns[i].turn == i`` and ``turns[i].conv == conv``;
    ``arrival_s`` (release time of turn 0 from the start of the replay) is finite and ``>= 0``.
    """

    conv: str
    arrival_s: float
    turns: tuple[Turn, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "turns", tuple(self.turns))
        if not self.turns:
            raise ValueError(f"Conversation {self.conv!r}: has no turns")
        for i, t in enumerate(self.turns):
            if not isinstance(t, Turn):
                raise ValueError(f"Conversation {self.conv!r}: turns[{i}] is not a Turn")
            if t.turn != i or t.conv != self.conv:
                raise ValueError(
                    f"Conversation {self.conv!r}: turns[{i}] is turn {t.turn} of {t.conv!r}; "
                    f"turns must be numbered 0, 1, ... and belong to the conversation"
                )
        if not _is_real(self.arrival_s) or not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"Conversation {self.conv!r}: arrival_s must be finite and >= 0")
        object.__setattr__(self, "arrival_s", float(self.arrival_s))

    def retained_context(self, i: int) -> int:
        """Tokens in context before turn ``i``'s new prompt: sum over turns < i of prompt+output.

        ``i`` may be ``len(turns)`` (the context after the last turn, == ``total_tokens``).
        """
        if not 0 <= i <= len(self.turns):
            raise IndexError(f"Conversation {self.conv!r}: turn index {i} out of range")
        return sum(t.prompt_tokens + t.output_tokens for t in self.turns[:i])

    @property
    def total_tokens(self) -> int:
        """Context length after the last turn's output: every increment and output."""
        return self.retained_context(len(self.turns))


@dataclass(frozen=True)
class TraceStats:
    """Statistics of a trace in the paper's terms.

    Percentiles use numpy's default (linear interpolation). ``prompt_increment`` and ``output``
    are over all turns; ``retained_context`` (context before the turn's new prompt) and
    ``client_wait`` are over continuations (turns >= 1) only. A percentile over an empty set is
    nan. ``input_tokens`` sums the prompt increments; ``input_tokens_with_context`` sums, over
    turns, retained context + increment (the whole context re-sent each turn: the paper's count).
    """

    conversations: int
    requests: int
    continuations: int
    max_turns: int
    input_tokens: int
    input_tokens_with_context: int
    output_tokens: int
    prompt_increment: dict[str, float]
    output: dict[str, float]
    retained_context: dict[str, float]
    client_wait: dict[str, float]

    def flat(self) -> dict[str, float]:
        """One level of keys, e.g. ``retained_context_p99``: the keys of ``PAPER_TARGETS``."""
        out: dict[str, float] = {}
        for name in ("conversations", "requests", "continuations", "max_turns", "input_tokens",
                     "input_tokens_with_context", "output_tokens"):
            out[name] = getattr(self, name)
        for name in ("prompt_increment", "output", "retained_context", "client_wait"):
            for q, v in getattr(self, name).items():
                out[f"{name}_{q}"] = v
        return out


def _percentiles(values: list[float] | np.ndarray) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"p50": math.nan, "p99": math.nan}
    p50, p99 = np.percentile(arr, [50.0, 99.0])
    return {"p50": float(p50), "p99": float(p99)}


def id_clash(turns: dict[str, int]) -> tuple[str, str, int] | None:
    """A conversation id that is also a request id of the replay, or None. ``turns``: each
    conversation's turn count. The replay names turn t of conversation c ``"c#t"`` and makes c
    its session; the engine keeps request and session ids apart, so a conversation "a#0"
    beside a conversation "a" would meet "a"'s first request (found by probing: the replay
    stopped after parallel.timeout_s). Returns (that id, the other conversation, the turn)."""
    for conv in turns:
        base, sep, n = conv.rpartition("#")
        if sep and n.isdigit() and n == str(int(n)) and int(n) < turns.get(base, 0):
            return conv, base, int(n)
    return None


@dataclass(frozen=True)
class Trace:
    """A replayable workload: conversations in release order.

    Invariants: conversation ids are unique; conversations are in release order, i.e.
    ``arrival_s`` is non-decreasing along the tuple, and among equal arrival times the tuple order
    is the release order (this is what makes ``load_trace(dump_trace(t)) == t`` hold: the loader
    orders by (arrival_s, first line)). ``source`` says where the trace came from (file path,
    generator seed); it is provenance only and does not take part in equality.
    """

    conversations: tuple[Conversation, ...]
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "conversations", tuple(self.conversations))
        seen: set[str] = set()
        for c in self.conversations:
            if not isinstance(c, Conversation):
                raise ValueError("Trace.conversations must hold Conversation objects")
            if c.conv in seen:
                raise ValueError(f"Trace: duplicate conversation id {c.conv!r}")
            seen.add(c.conv)
        clash = id_clash({c.conv: len(c.turns) for c in self.conversations})
        if clash is not None:
            conv, base, turn = clash
            raise ValueError(f"Trace: conversation id {conv!r} is also the request id of turn "
                             f"{turn} of conversation {base!r} (requests are named CONV#TURN)")
        for prev, c in zip(self.conversations, self.conversations[1:]):
            if c.arrival_s < prev.arrival_s:
                raise ValueError(
                    f"Trace: conversations must be in release order; {c.conv!r} "
                    f"(arrival {c.arrival_s!r}) comes after {prev.conv!r} "
                    f"(arrival {prev.arrival_s!r})"
                )

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def iter_turns(self) -> Iterator[Turn]:
        """Every turn, conversation by conversation (trace order), each in turn order."""
        for c in self.conversations:
            yield from c.turns

    # -- transforms (each returns a new Trace; self is never changed) ---------------------- #

    def scaled_waits(self, factor: float) -> Trace:
        """Every client wait multiplied by ``factor >= 0`` (0 gives the no-wait trace).

        Each new wait is exactly ``old * factor`` (one float multiplication), as in the paper's
        RQ5, which multiplies the trace-derived wait vector by 0, 0.01, 0.03 and 0.10.
        """
        if not _is_real(factor) or not math.isfinite(factor) or factor < 0:
            raise ValueError(f"scaled_waits: factor must be a finite number >= 0, got {factor!r}")
        convs = tuple(
            replace(c, turns=tuple(replace(t, wait_s=t.wait_s * factor) for t in c.turns))
            for c in self.conversations
        )
        return Trace(convs, source=f"{self.source} waits*{factor!r}")

    def truncated(self, max_context: int) -> Trace:
        """Drop each turn whose retained context + prompt + output exceeds ``max_context`` and
        every later turn of its conversation (a later turn depends on it); drop conversations
        left empty."""
        if not _is_int(max_context) or max_context < 1:
            raise ValueError(f"truncated: max_context must be an int >= 1, got {max_context!r}")
        convs = []
        for c in self.conversations:
            kept: list[Turn] = []
            context = 0  # retained context before turn len(kept)
            for t in c.turns:
                if context + t.prompt_tokens + t.output_tokens > max_context:
                    break
                kept.append(t)
                context += t.prompt_tokens + t.output_tokens
            if kept:
                convs.append(replace(c, turns=tuple(kept)))
        return Trace(tuple(convs), source=f"{self.source} max_context={max_context}")

    def scaled_lengths(self, factor: float) -> Trace:
        """Prompt increments and outputs multiplied by ``factor > 0``, rounded half up, at least 1.

        Used to shrink the paper-sized trace for small CPU models. Turns that carry explicit
        prompt ids cannot be rescaled (their content is fixed) and raise ValueError.
        """
        if not _is_real(factor) or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"scaled_lengths: factor must be a finite number > 0, got {factor!r}")

        def scale(n: int) -> int:
            return max(1, math.floor(n * factor + 0.5))

        convs = []
        for c in self.conversations:
            turns = []
            for t in c.turns:
                if t.prompt is not None:
                    raise ValueError(
                        f"scaled_lengths: turn {t.turn} of {c.conv!r} has explicit prompt ids"
                    )
                turns.append(replace(t, prompt_tokens=scale(t.prompt_tokens),
                                     output_tokens=scale(t.output_tokens)))
            convs.append(replace(c, turns=tuple(turns)))
        return Trace(tuple(convs), source=f"{self.source} lengths*{factor!r}")

    # -- statistics ------------------------------------------------------------------------- #

    def stats(self) -> TraceStats:
        increments: list[int] = []
        outputs: list[int] = []
        contexts: list[int] = []  # retained context before each continuation
        waits: list[float] = []  # client wait of each continuation
        with_context = 0
        for c in self.conversations:
            context = 0  # invariant: == c.retained_context(t.turn) at the top of the loop body
            for t in c.turns:
                increments.append(t.prompt_tokens)
                outputs.append(t.output_tokens)
                with_context += context + t.prompt_tokens
                if t.turn >= 1:
                    contexts.append(context)
                    waits.append(t.wait_s)
                context += t.prompt_tokens + t.output_tokens
        return TraceStats(
            conversations=len(self.conversations),
            requests=len(increments),
            continuations=len(contexts),
            max_turns=max((len(c.turns) for c in self.conversations), default=0),
            input_tokens=sum(increments),
            input_tokens_with_context=with_context,
            output_tokens=sum(outputs),
            prompt_increment=_percentiles(increments),
            output=_percentiles(outputs),
            retained_context=_percentiles(contexts),
            client_wait=_percentiles(waits),
        )
