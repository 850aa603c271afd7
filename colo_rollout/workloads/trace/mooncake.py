"""Importer for the public Mooncake (FAST'25) conversation trace: sessions rebuilt from chained
prefix-block hashes (see ../shared/traces/README.md)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from colo_rollout.workloads.trace.model import (
    Conversation,
    Trace,
    TraceError,
    Turn,
    _is_int,
    _is_real,
    read_trace_bytes,
)
from colo_rollout.workloads.trace.jsonl import (_MOONCAKE_KEYS, MAX_SECONDS, MAX_TURN_TOKENS,
                                                _DuplicateKey, _key_field,
                                                _reject_duplicate_keys)

MAX_TIMESTAMP_MS = 1000.0 * MAX_SECONDS  # one day of replay, as the JSONL reader's


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

# Mooncake conversation trace: the README's session rule and block size (its record keys:
# jsonl._MOONCAKE_KEYS, which the JSONL reader names in its hint).
_MOONCAKE_SUCCESSOR_LIMIT = 8  # a shared block with more distinct successors is a global prompt

# --------------------------------------------------------------------------- #
# Mooncake FAST'25 conversation trace
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class _MooncakeRecord:
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _parse_mooncake(path: str) -> list[_MooncakeRecord]:
    records = []
    data = read_trace_bytes(path)
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise TraceError(path, line, "record", f"not valid UTF-8 ({e.reason})") from None
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
        except _DuplicateKey as e:
            raise TraceError(path, lineno, _key_field(e.args[0]), "duplicate key in the "
                             "record") from None
        except json.JSONDecodeError as e:
            raise TraceError(path, lineno, "record", f"malformed JSON: {e.msg}") from None
        except RecursionError:
            raise TraceError(path, lineno, "record", "malformed JSON: nested too "
                             "deeply") from None
        except ValueError as e:  # an integer of more digits than Python converts
            raise TraceError(path, lineno, "record", f"number too large: {e}") from None
        if not isinstance(obj, dict):
            raise TraceError(path, lineno, "record", "expected a JSON object")
        for key in _MOONCAKE_KEYS:
            if key not in obj:
                raise TraceError(path, lineno, key, "missing key")
        ts, inp, out, ids = (obj[k] for k in _MOONCAKE_KEYS)
        # (an exact comparison first: an int too large for a float is out of range too)
        if not _is_real(ts) or not 0 <= ts <= MAX_TIMESTAMP_MS or not math.isfinite(ts):
            raise TraceError(path, lineno, "timestamp", f"expected a number of ms in [0, "
                             f"{MAX_TIMESTAMP_MS:g}] (one day), got {_short(ts)}")
        for key, n in (("input_length", inp), ("output_length", out)):
            if not _is_int(n) or not 1 <= n <= MAX_TURN_TOKENS:
                raise TraceError(path, lineno, key, f"expected an int in [1, "
                                 f"{MAX_TURN_TOKENS}], got {_short(n)}")
        if not isinstance(ids, list) or not all(_is_int(h) and h >= 0 for h in ids):
            raise TraceError(path, lineno, "hash_ids", "expected a list of ints >= 0")
        records.append(_MooncakeRecord(lineno, float(ts), inp, out, tuple(ids)))
    if not records:
        raise TraceError(path, 1, "file", "no records")
    return records


def load_mooncake(path: str | os.PathLike[str], max_requests: int | None = None) -> Trace:
    """Sessions rebuilt from the Mooncake FAST'25 conversation trace (see docs/traces.md).

    Rule (``/work/shared/traces/README.md``): requests are taken in arrival order; a request's
    shared prefix is its leading run of hash ids already seen (ids are chained prefix hashes, so
    this is the longest seen prefix). If it shares at least one block and the last shared block
    has at most 8 distinct successor blocks in the *whole file* (more means a global system
    prompt), the request continues the conversation of the request that introduced that block;
    otherwise it starts a new conversation.

    Per turn: ``output_tokens = output_length``; the increment is
    ``max(1, input_length - (previous turn's input_length + output_length))`` -- exact for
    append-only follow-ups (~83% of them), an underestimate when the client edited or dropped
    context; ``wait_s`` is the arrival gap to the previous turn in seconds. The file has no
    completion times, so that gap *includes the previous turn's decode time* (and the ~3 s
    timestamp quantisation): it is an upper bound on the client wait. ``arrival_s`` of a
    conversation is its first timestamp in seconds.

    ``max_requests`` keeps the first N requests in arrival order; successor counts still come
    from the whole file, so the sessions are a prefix of the full file's sessions.
    """
    name = os.fspath(path)
    if max_requests is not None and (not _is_int(max_requests) or max_requests < 1):
        raise ValueError(f"load_mooncake: max_requests must be an int >= 1, got {max_requests!r}")
    records = _parse_mooncake(name)
    # Successor sets over the whole file, kept as counts capped just above the limit.
    successors: dict[int, set[int]] = {}
    for r in records:
        ids = r.hash_ids
        for a, b in zip(ids, ids[1:]):
            s = successors.get(a)
            if s is None:
                successors[a] = {b}
            elif len(s) <= _MOONCAKE_SUCCESSOR_LIMIT:  # once over the limit the exact count is moot
                s.add(b)
    order = sorted(records, key=lambda r: (r.timestamp_ms, r.line))  # stable: ties keep file order
    if max_requests is not None:
        order = order[:max_requests]

    introduced_by: dict[int, int] = {}  # block id -> index of the conversation that first sent it
    sessions: list[list[_MooncakeRecord]] = []
    for r in order:
        ids = r.hash_ids
        k = 0
        while k < len(ids) and ids[k] in introduced_by:
            k += 1
        target = None
        if k > 0 and len(successors.get(ids[k - 1], ())) <= _MOONCAKE_SUCCESSOR_LIMIT:
            target = introduced_by[ids[k - 1]]
        if target is None:
            target = len(sessions)
            sessions.append([])
        sessions[target].append(r)
        for h in ids[k:]:
            introduced_by.setdefault(h, target)

    convs = []
    for s in sessions:
        cid = f"mooncake-L{s[0].line:05d}"
        turns = []
        for i, r in enumerate(s):
            if i == 0:
                turns.append(Turn(cid, 0, r.input_length, r.output_length, 0.0))
                continue
            parent = s[i - 1]
            incr = max(1, r.input_length - (parent.input_length + parent.output_length))
            wait = max(0.0, (r.timestamp_ms - parent.timestamp_ms) / 1000.0)
            turns.append(Turn(cid, i, incr, r.output_length, wait))
        convs.append(Conversation(cid, s[0].timestamp_ms / 1000.0, tuple(turns)))
    # Sessions were opened in arrival order, so this is already (arrival_s, first line) order.
    return Trace(tuple(convs), source=f"mooncake:{name}"
                 + (f" max_requests={max_requests}" if max_requests is not None else ""))
