"""Tests for colo_rollout.workloads.trace: loader error paths, round trip, transforms, statistics, the
paper-fitted generator and the Mooncake importer."""

import json
import math
import pickle
from pathlib import Path

import pytest

from colo_rollout.workloads.trace import (
    PAPER_TARGETS,
    Conversation,
    GeneratorParams,
    Trace,
    TraceError,
    Turn,
    dump_trace,
    generate_trace,
    load_mooncake,
    load_trace,
    lognormal_from_quantiles,
    write_stats_table,
)

# ../shared beside the checkout (how sessions and CI lay it out)
MOONCAKE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake_conversation_trace.jsonl"


def rec(conv="a", turn=0, **kw):
    """A valid record; ``kw`` overrides keys, a value of ``...`` removes the key."""
    r = {"conv": conv, "turn": turn, "prompt_tokens": 10, "output_tokens": 5, "wait_s": 0.0}
    r.update(kw)
    return {k: v for k, v in r.items() if v is not ...}


def write_lines(tmp_path: Path, lines, name="trace.jsonl") -> Path:
    """Write records (dicts are JSON-encoded, str written verbatim), one per line."""
    path = tmp_path / name
    text = "\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def hand_trace() -> Trace:
    """conv a: (p, o) = (10, 5), (3, 2) after 1.0 s, (4, 4) after 3.0 s; conv b: (20, 1)."""
    a = Conversation("a", 0.0, (
        Turn("a", 0, 10, 5, 0.0),
        Turn("a", 1, 3, 2, 1.0),
        Turn("a", 2, 4, 4, 3.0),
    ))
    b = Conversation("b", 2.5, (Turn("b", 0, 20, 1, 0.0),))
    return Trace((a, b), source="hand")


# --------------------------------------------------------------------------- #
# Loader error paths: each names file, 1-based line and field
# --------------------------------------------------------------------------- #

OK0 = rec("a", 0)
OK1 = rec("a", 1, wait_s=1.5)

# (lines, line of the error, field, fragment of the detail)
ERROR_CASES = {
    "malformed json": ([OK0, '{"conv": "a", "turn": 1,'], 2, "record", "malformed JSON"),
    "not an object": ([OK0, "[1, 2, 3]"], 2, "record", "expected a JSON object, got list"),
    "scalar line": (['"a"'], 1, "record", "expected a JSON object, got str"),
    "nan": (['{"conv": "a", "turn": 0, "prompt_tokens": 1, "output_tokens": 1, "wait_s": NaN}'],
            1, "record", "non-finite"),
    "duplicate key": (['{"conv": "a", "turn": 0, "turn": 1, "prompt_tokens": 1, '
                       '"output_tokens": 1, "wait_s": 0}'], 1, "turn", "duplicate key"),
    "unknown key": ([OK0, rec("a", 1, temperature=0.7)], 2, "temperature", "unknown key"),
    "missing conv": ([rec(conv=...)], 1, "conv", "missing key"),
    "missing turn": ([rec(turn=...)], 1, "turn", "missing key"),
    "missing output_tokens": ([rec(output_tokens=...)], 1, "output_tokens", "missing key"),
    "missing wait_s": ([rec(wait_s=...)], 1, "wait_s", "missing key"),
    "neither prompt": ([OK0, rec("a", 1, prompt_tokens=...)], 2, "prompt_tokens", "got neither"),
    "both prompts": ([rec(prompt=[1, 2])], 1, "prompt_tokens", "got both"),
    "conv not str": ([rec(conv=7)], 1, "conv", "expected str, got int 7"),
    "conv empty": ([rec(conv="")], 1, "conv", "non-empty"),
    "turn str": ([rec(turn="0")], 1, "turn", "expected int, got str '0'"),
    "turn bool": ([rec(turn=False)], 1, "turn", "expected int, got bool False"),
    "turn float": ([rec(turn=0.0)], 1, "turn", "expected int, got float 0.0"),
    "turn negative": ([rec(turn=-1)], 1, "turn", "must be >= 0, got -1"),
    "prompt_tokens bool": ([rec(prompt_tokens=True)], 1, "prompt_tokens", "expected int, got bool"),
    "prompt_tokens float": ([rec(prompt_tokens=2.5)], 1, "prompt_tokens", "expected int"),
    "prompt_tokens zero": ([rec(prompt_tokens=0)], 1, "prompt_tokens", "must be >= 1, got 0"),
    "output_tokens str": ([rec(output_tokens="5")], 1, "output_tokens", "expected int, got str"),
    "output_tokens zero": ([OK0, rec("a", 1, output_tokens=0)], 2, "output_tokens",
                           "must be >= 1, got 0"),
    "wait_s str": ([rec(wait_s="1")], 1, "wait_s", "expected float, got str"),
    "wait_s bool": ([rec(wait_s=True)], 1, "wait_s", "expected float, got bool"),
    "wait_s negative": ([OK0, rec("a", 1, wait_s=-1.0)], 2, "wait_s", "must be >= 0, got -1.0"),
    "wait_s negative turn 0": ([rec(wait_s=-0.5)], 1, "wait_s", "must be >= 0"),
    "arrival_s negative": ([rec(arrival_s=-2)], 1, "arrival_s", "must be >= 0, got -2.0"),
    "arrival_s bool": ([rec(arrival_s=False)], 1, "arrival_s", "expected float, got bool"),
    "arrival_s differs": ([rec(arrival_s=1.0), rec("a", 1, arrival_s=2.0)], 2, "arrival_s",
                          "release time of turn 0"),
    "prompt not list": ([rec(prompt_tokens=..., prompt="abc")], 1, "prompt", "expected list"),
    "prompt item str": ([rec(prompt_tokens=..., prompt=[1, "x"])], 1, "prompt", "item 1"),
    "prompt item bool": ([rec(prompt_tokens=..., prompt=[True])], 1, "prompt", "item 0"),
    "prompt item negative": ([rec(prompt_tokens=..., prompt=[3, -1])], 1, "prompt", ">= 0"),
    "prompt empty": ([rec(prompt_tokens=..., prompt=[])], 1, "prompt", "at least 1"),
    "duplicate turn": ([OK0, OK1, rec("b", 0), rec("a", 1, wait_s=2.0)], 4, "turn",
                       "duplicate turn 1 of conversation 'a' (first at line 2)"),
    "missing middle turn": ([OK0, OK1, rec("a", 3, wait_s=1.0)], 3, "turn",
                            "conversation 'a' is missing turn 2"),
    "missing turn 0": ([rec("b", 0), rec("a", 1, wait_s=1.0)], 2, "turn",
                       "conversation 'a' is missing turn 0"),
    "empty file": ([""], 1, "file", "no trace records"),
    "only blank lines": (["", "   ", "\t"], 1, "file", "no trace records"),
    # absurd numbers: bounded, and the bound is said
    "prompt_tokens 10^30": ([rec(prompt_tokens=10**30)], 1, "prompt_tokens",
                            "at most 10,000,000 tokens (no model serves more), got 1e+30"),
    "output_tokens 10^30": ([rec(output_tokens=10**30)], 1, "output_tokens",
                            "at most 10,000,000 tokens"),
    "arrival_s 1e9": ([rec(arrival_s=1e9)], 1, "arrival_s",
                      "at most 86400 s (one day: a replay runs in real time), got 1e+09"),
    "wait_s 10^400": ([OK0, rec("a", 1, wait_s=10**400)], 2, "wait_s", "got 10^400"),
    "5001 digits": (['{"conv": "a", "turn": 0, "prompt_tokens": 1' + "0" * 5000 + ', '
                     '"output_tokens": 1, "wait_s": 0}'], 1, "record", "number too large"),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_loader_errors_name_file_line_and_field(tmp_path, case):
    lines, line, field, fragment = ERROR_CASES[case]
    path = write_lines(tmp_path, lines)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    err = info.value
    msg = str(err)
    assert msg.startswith(f"{path}:{line}: {field}: "), msg
    assert fragment in msg, msg
    assert (err.path, err.line, err.field) == (str(path), line, field)
    assert isinstance(err, ValueError)


def test_error_message_format_example(tmp_path):
    # Blank lines count: 15 of them after turn 0 put the bad turn on line 17.
    path = write_lines(tmp_path, [OK0] + [""] * 15 + [rec("a", 1, wait_s=-1.0)])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:17: wait_s: must be >= 0, got -1.0"


def test_missing_turn_error_names_line_of_later_turn(tmp_path):
    # Lines out of order: turn 3 on line 1, turns 0 and 1 later; the gap is reported at turn 3.
    path = write_lines(tmp_path, [rec("c", 3, wait_s=1.0), rec("c", 0), rec("c", 1, wait_s=1.0)])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:1: turn: conversation 'c' is missing turn 2")


def test_a_conversation_id_that_is_another_ones_request_id_is_refused(tmp_path):
    """The replay names turn t of conversation c "c#t" and makes c its session: a conversation
    "a#1" beside "a" (two turns) would meet a's second request (found by probing: the bench
    stopped after parallel.timeout_s). "a#2" (a has no turn 2), "a#01" and "b#0" are fine."""
    path = write_lines(tmp_path, [rec("a", 0), rec("a", 1, wait_s=1.0), rec("x", 0),
                                  rec("a#1", 0)])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == (f"{path}:4: conv: 'a#1' is also the request id of turn 1 of "
                               "conversation 'a' (the replay names requests CONV#TURN and "
                               "sessions CONV): rename one of them")
    ok = write_lines(tmp_path, [rec("a", 0), rec("a", 1, wait_s=1.0), rec("a#2", 0),
                                rec("a#01", 0), rec("b#0", 0)], name="ok.jsonl")
    assert load_trace(ok).num_requests == 5
    t = load_trace(ok)
    with pytest.raises(ValueError, match="also the request id of turn 0"):
        Trace(t.conversations + (Conversation("a#2#0", 0.0, (Turn("a#2#0", 0, 3, 2, 0.0),)),))


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_bytes(json.dumps(OK0).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:2: record: not valid UTF-8")


def test_unreadable_trace_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError) as info:
        load_trace(tmp_path / "absent.jsonl")
    assert str(info.value) == (f"{tmp_path / 'absent.jsonl'}: file: cannot read trace file: "
                               "No such file or directory")
    assert info.value.line is None
    with pytest.raises(TraceError, match="cannot read trace file"):
        load_trace(tmp_path)  # a directory


@pytest.mark.parametrize("reader", [load_trace, load_mooncake])
def test_paths_that_are_not_regular_files_are_refused_without_reading(tmp_path, reader):
    """A FIFO would block the door for ever and a device never end: refused before a read."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        with pytest.raises(TraceError) as info:
            reader(path)
        assert str(info.value) == (f"{path}: file: not a regular file (a directory, FIFO or "
                                   "device): a trace is a JSONL file")
    with pytest.raises(TraceError, match=r"^<empty path>: file: no trace file named"):
        reader("")


def test_a_byte_order_mark_is_skipped(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(OK0) + "\n" + json.dumps(OK1)).encode())
    assert load_trace(path).num_requests == 2


def test_a_conversation_id_that_is_not_unicode_is_refused(tmp_path):
    """A lone surrogate (a JSON escape) cannot be encoded: the replay's token ids are drawn
    from the encoded id, on rank 0 only -- the other ranks used to wait out the timeout."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(OK0).replace('"a"', '"\\ud800"') + "\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:1: conv: not valid Unicode"):
        load_trace(path)


def test_other_formats_are_named_in_the_error(tmp_path):
    """A pretty-printed JSON array, a Mooncake-format file, a missing relative path: the one
    line says what the reader expects."""
    path = tmp_path / "array.jsonl"
    path.write_text("[\n" + json.dumps(OK0) + "\n]\n")
    with pytest.raises(TraceError, match="one object per line, not a JSON array"):
        load_trace(path)
    path = write_lines(tmp_path, [{"timestamp": 0, "input_length": 9, "output_length": 2,
                                   "hash_ids": [1]}], name="mc.jsonl")
    with pytest.raises(TraceError, match=r"mc\.jsonl:1: timestamp: unknown key .*"
                                         r"bench\.trace: 'mooncake:PATH'"):
        load_trace(path)
    assert load_mooncake(path).num_requests == 1
    with pytest.raises(TraceError, match=r"relative to the working directory"):
        load_trace("no/such/trace.jsonl")


def test_mooncake_duplicate_keys_are_refused(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 9, "input_length": 12, '
                    '"output_length": 2, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match=r"dup\.jsonl:1: input_length: duplicate key"):
        load_mooncake(path)


def test_a_key_that_is_not_short_text_is_named_by_its_repr(tmp_path):
    """An unknown or duplicate key holding a newline, or 100,000 characters long, is the
    error's field as its repr, shortened: the error stays one short line. Found by probing:
    the key went into the message verbatim (a line break; a 100 kB line)."""
    long = "k" * 100_000
    for reader, head, extra, field, problem in (
            (load_trace, json.dumps(rec())[:-1], ', "x\\ny": 1', "'x\\ny'", "unknown key"),
            (load_trace, json.dumps(rec())[:-1], ', "x\\ny": 1, "x\\ny": 2', "'x\\ny'",
             "duplicate key in the record"),
            (load_mooncake, '{"timestamp": 0, "input_length": 9, "output_length": 2, '
             '"hash_ids": [1]', f', "{long}": 1, "{long}": 2', "'" + "k" * 36 + "...",
             "duplicate key in the record")):
        path = tmp_path / "keys.jsonl"
        path.write_text(head + extra + "}\n", encoding="utf-8")
        with pytest.raises(TraceError) as e:
            reader(path)
        assert (e.value.field, e.value.line) == (field, 1)
        assert str(e.value).startswith(f"{path}:1: {field}: {problem}")
        assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_loaded_turns_know_their_line(tmp_path):
    path = write_lines(tmp_path, [rec("b", 0), "", OK0, OK1])
    t = load_trace(path)
    assert [(x.conv, x.turn, x.line) for x in t.iter_turns()] == [("b", 0, 1), ("a", 0, 3),
                                                                  ("a", 1, 4)]
    assert t == Trace(tuple(Conversation(c.conv, c.arrival_s, tuple(
        Turn(x.conv, x.turn, x.prompt_tokens, x.output_tokens, x.wait_s) for x in c.turns))
        for c in t.conversations))  # provenance only: not part of equality


def test_trace_error_pickles_with_attributes():
    err = TraceError("t.jsonl", 3, "wait_s", "must be >= 0, got -1.0")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) == "t.jsonl:3: wait_s: must be >= 0, got -1.0"
    assert (back.path, back.line, back.field) == ("t.jsonl", 3, "wait_s")


# --------------------------------------------------------------------------- #
# Loading valid files, round trip
# --------------------------------------------------------------------------- #


def test_load_any_order_blank_lines_and_conversation_order(tmp_path):
    path = write_lines(tmp_path, [
        "",
        rec("late", 1, wait_s=2.0),
        rec("x", 0),  # arrival 0, first line 3
        "   ",
        rec("late", 0, arrival_s=5.0, wait_s=9.0),  # turn 0's wait is ignored
        rec("early", 0, prompt_tokens=..., prompt=[4, 5, 6], arrival_s=0.0),  # ties x on arrival
        rec("x", 1, wait_s=0.25, arrival_s=0.0),  # repeating turn 0's arrival is allowed
    ])
    trace = load_trace(path)
    assert [c.conv for c in trace.conversations] == ["x", "early", "late"]
    late = trace.conversations[2]
    assert late.arrival_s == 5.0
    assert [t.wait_s for t in late.turns] == [0.0, 2.0]
    early = trace.conversations[1].turns[0]
    assert early.prompt == (4, 5, 6) and early.prompt_tokens == 3
    assert trace.num_requests == 5
    assert trace.source == str(path)
    assert [(t.conv, t.turn) for t in trace.iter_turns()] == [
        ("x", 0), ("x", 1), ("early", 0), ("late", 0), ("late", 1)]


def test_round_trip_hand_trace(tmp_path):
    t = hand_trace()
    ids = Conversation("ids", 2.5 + 0.1 + 0.2, (
        Turn("ids", 0, 3, 7, 0.0, prompt=(0, 1, 2)),
        Turn("ids", 1, 2, 1, 1 / 3, prompt=(9, 8)),
    ))
    t = Trace(t.conversations + (ids,), source="x")
    path = tmp_path / "out.jsonl"
    dump_trace(t, path)
    back = load_trace(path)
    assert back == t
    assert back.conversations == t.conversations  # order kept as well
    dump_trace(back, tmp_path / "again.jsonl")
    assert (tmp_path / "again.jsonl").read_text() == path.read_text()


def test_round_trip_generated_trace(tmp_path):
    t = generate_trace(3, conversations=20)
    dump_trace(t, tmp_path / "g.jsonl")
    assert load_trace(tmp_path / "g.jsonl") == t


# --------------------------------------------------------------------------- #
# Data model invariants
# --------------------------------------------------------------------------- #


def test_dataclass_invariants():
    with pytest.raises(ValueError, match="wait_s must be 0.0"):
        Turn("a", 0, 1, 1, 1.0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        Turn("a", 1, 0, 1, 1.0)
    with pytest.raises(ValueError, match="len\\(prompt\\)"):
        Turn("a", 0, 2, 1, 0.0, prompt=(1,))
    with pytest.raises(ValueError, match="wait_s"):
        Turn("a", 1, 1, 1, math.inf)
    with pytest.raises(ValueError, match="numbered"):
        Conversation("a", 0.0, (Turn("a", 0, 1, 1, 0.0), Turn("a", 2, 1, 1, 0.0)))
    with pytest.raises(ValueError, match="numbered"):
        Conversation("a", 0.0, (Turn("b", 0, 1, 1, 0.0),))
    with pytest.raises(ValueError, match="no turns"):
        Conversation("a", 0.0, ())
    one = Conversation("a", 0.0, (Turn("a", 0, 1, 1, 0.0),))
    with pytest.raises(ValueError, match="duplicate conversation"):
        Trace((one, one))
    late = Conversation("late", 3.0, (Turn("late", 0, 1, 1, 0.0),))
    with pytest.raises(ValueError, match="release order"):
        Trace((late, one))
    assert Trace((one, late)).num_requests == 2


# --------------------------------------------------------------------------- #
# Transforms
# --------------------------------------------------------------------------- #


def test_scaled_waits_exact_products():
    t = generate_trace(1, conversations=12)
    base = [x.wait_s for x in t.iter_turns()]
    assert any(w > 0 for w in base)
    for factor in (0, 0.0, 0.01, 1, 1.0):
        scaled = t.scaled_waits(factor)
        assert [x.wait_s for x in scaled.iter_turns()] == [w * factor for w in base]
        # everything but the waits is kept
        assert [(x.conv, x.turn, x.prompt_tokens, x.output_tokens) for x in scaled.iter_turns()] \
            == [(x.conv, x.turn, x.prompt_tokens, x.output_tokens) for x in t.iter_turns()]
    assert all(x.wait_s == 0.0 for x in t.scaled_waits(0).iter_turns())
    assert t.scaled_waits(1) == t
    assert [x.wait_s for x in t.iter_turns()] == base  # the original is unchanged
    for bad in (-0.01, -1, math.nan, math.inf, True):
        with pytest.raises(ValueError, match="factor"):
            t.scaled_waits(bad)


def test_truncated():
    t = hand_trace()  # conv a ends at contexts 15, 20, 28; conv b at 21
    assert t.truncated(10_000) == t
    cut = t.truncated(21)
    assert [len(c.turns) for c in cut.conversations] == [2, 1]
    assert cut.conversations[0].turns == t.conversations[0].turns[:2]
    cut = t.truncated(20)  # b (21) is dropped entirely, a keeps 2 turns
    assert [c.conv for c in cut.conversations] == ["a"]
    assert len(cut.conversations[0].turns) == 2
    assert t.truncated(14).conversations == ()
    assert t.truncated(28).conversations[0] == t.conversations[0]
    # a turn that does not fit drops every later turn of its conversation
    c = Conversation("z", 0.0, (Turn("z", 0, 5, 5, 0.0), Turn("z", 1, 50, 5, 1.0),
                                Turn("z", 2, 1, 1, 1.0)))
    assert len(Trace((c,)).truncated(30).conversations[0].turns) == 1
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="max_context"):
            t.truncated(bad)


def test_scaled_lengths():
    t = hand_trace().scaled_lengths(0.5)
    assert [(x.prompt_tokens, x.output_tokens) for x in t.iter_turns()] == [
        (5, 3), (2, 1), (2, 2), (10, 1)]  # half up; never below 1
    assert hand_trace().scaled_lengths(1.0) == hand_trace()
    with_ids = Trace((Conversation("i", 0.0, (Turn("i", 0, 2, 1, 0.0, prompt=(1, 2)),)),))
    with pytest.raises(ValueError, match="explicit prompt ids"):
        with_ids.scaled_lengths(0.5)
    for bad in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match="factor"):
            hand_trace().scaled_lengths(bad)


# --------------------------------------------------------------------------- #
# Statistics
# --------------------------------------------------------------------------- #


def test_retained_context_and_total_tokens():
    a = hand_trace().conversations[0]
    assert [a.retained_context(i) for i in range(4)] == [0, 15, 20, 28]
    assert a.total_tokens == 28
    with pytest.raises(IndexError):
        a.retained_context(4)


def test_stats_hand_computed():
    s = hand_trace().stats()
    assert (s.conversations, s.requests, s.continuations, s.max_turns) == (2, 4, 2, 3)
    assert s.input_tokens == 10 + 3 + 4 + 20
    assert s.input_tokens_with_context == (0 + 10) + (15 + 3) + (20 + 4) + (0 + 20)
    assert s.output_tokens == 5 + 2 + 4 + 1
    # numpy linear percentiles: increments 3,4,10,20; outputs 1,2,4,5; contexts 15,20; waits 1,3
    assert s.prompt_increment == pytest.approx({"p50": 7.0, "p99": 19.7})
    assert s.output == pytest.approx({"p50": 3.0, "p99": 4.97})
    assert s.retained_context == pytest.approx({"p50": 17.5, "p99": 19.95})
    assert s.client_wait == pytest.approx({"p50": 2.0, "p99": 2.98})
    flat = s.flat()
    assert flat["retained_context_p50"] == pytest.approx(17.5)
    assert set(PAPER_TARGETS) <= set(flat)


def test_stats_without_continuations_are_nan():
    s = Trace((Conversation("a", 0.0, (Turn("a", 0, 4, 2, 0.0),)),)).stats()
    assert s.continuations == 0
    assert math.isnan(s.retained_context["p50"]) and math.isnan(s.client_wait["p99"])
    assert "nan" in write_stats_table(Trace(()))


def test_write_stats_table():
    table = write_stats_table(hand_trace(), {"requests": 4, "output_tokens": 24})
    lines = table.strip().splitlines()
    assert lines[0] == "| measure | generated | target | generated vs target |"
    assert "| requests | 4 | 4 | +0.0% |" in lines
    assert "| output tokens | 12 | 24 | -50.0% |" in lines
    assert "| conversations | 2 | - | - |" in lines
    assert "| client wait p50 (s, continuations) | 2.00 | - | - |" in lines
    assert write_stats_table(hand_trace(), label="mooncake").startswith("| measure | mooncake |")


# --------------------------------------------------------------------------- #
# Generator
# --------------------------------------------------------------------------- #


def test_lognormal_from_quantiles():
    mu, sigma = lognormal_from_quantiles(88, 1057)
    assert mu == pytest.approx(math.log(88))
    assert sigma == pytest.approx(math.log(1057 / 88) / 2.326, rel=1e-3)
    with pytest.raises(ValueError):
        lognormal_from_quantiles(10, 5)


@pytest.fixture(scope="module")
def paper_trace():
    return generate_trace(0)


def test_generator_deterministic_per_seed(paper_trace):
    assert generate_trace(0) == paper_trace
    other = generate_trace(1)
    assert other != paper_trace
    assert [x.output_tokens for x in other.iter_turns()] != \
        [x.output_tokens for x in paper_trace.iter_turns()]


def test_generator_exact_counts(paper_trace):
    s = paper_trace.stats()
    assert s.conversations == 128
    assert s.requests == paper_trace.num_requests == 1265
    assert s.continuations == 1137
    assert s.max_turns == 10
    assert all(c.arrival_s == 0.0 for c in paper_trace.conversations)
    for seed in (1, 2):  # exact for every seed, not just the tuned one
        assert generate_trace(seed).num_requests == 1265


@pytest.mark.parametrize("key", sorted(PAPER_TARGETS))
def test_generator_matches_paper_within_20_percent(paper_trace, key):
    value = paper_trace.stats().flat()[key]
    assert value == pytest.approx(PAPER_TARGETS[key], rel=0.20), (key, value)


def test_generator_other_sizes_and_bad_arguments():
    small = generate_trace(5, conversations=16, max_turns=4)
    assert small.num_requests == 64  # the paper's 9.88 turns/conversation, capped at max_turns
    assert max(len(c.turns) for c in small.conversations) == 4
    assert generate_trace(5, conversations=10, max_turns=10, requests=37).num_requests == 37
    assert generate_trace(5, conversations=10, max_turns=1).num_requests == 10
    with pytest.raises(ValueError, match="requests"):
        generate_trace(0, conversations=10, max_turns=3, requests=31)
    with pytest.raises(ValueError, match="conversations"):
        generate_trace(0, conversations=0)
    with pytest.raises(ValueError):
        GeneratorParams(first_prompt_min=10, first_prompt_max=5)
    # the verbosity copula only permutes values: the pooled outputs are the same multiset
    a = generate_trace(7, params=GeneratorParams(conversation_correlation=0.0))
    b = generate_trace(7, params=GeneratorParams(conversation_correlation=0.5))
    assert sorted(x.output_tokens for x in a.iter_turns()) == \
        sorted(x.output_tokens for x in b.iter_turns())


# --------------------------------------------------------------------------- #
# Mooncake importer
# --------------------------------------------------------------------------- #

needs_mooncake = pytest.mark.skipif(not MOONCAKE.exists(), reason=f"{MOONCAKE} not present")


@pytest.fixture(scope="module")
def mooncake_full():
    return load_mooncake(MOONCAKE)


def _mooncake_lines() -> int:
    with open(MOONCAKE, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


@needs_mooncake
def test_mooncake_full_file(mooncake_full):
    t = mooncake_full
    assert t.num_requests == _mooncake_lines()
    multi = [c for c in t.conversations if len(c.turns) > 1]
    assert len(multi) >= 1000
    # The README's measurement with the same rule: 2,262 multi-turn sessions, 6,885 requests.
    assert len(multi) == 2262 and sum(len(c.turns) for c in multi) == 6885
    for c in t.conversations:
        assert [x.turn for x in c.turns] == list(range(len(c.turns)))
        assert all(x.conv == c.conv for x in c.turns)
        assert c.turns[0].wait_s == 0.0 and all(x.wait_s >= 0 for x in c.turns)
    arrivals = [c.arrival_s for c in t.conversations]
    assert arrivals == sorted(arrivals)


@needs_mooncake
@pytest.mark.parametrize("n", [1, 500, 3000, 10**6])
def test_mooncake_max_requests(mooncake_full, n):
    t = load_mooncake(MOONCAKE, max_requests=n)
    assert t.num_requests == min(n, _mooncake_lines())
    # sessions of a prefix of the requests are a prefix of the full file's sessions
    full = {c.conv: c for c in mooncake_full.conversations}
    for c in t.conversations:
        assert c.turns == full[c.conv].turns[: len(c.turns)]


def test_mooncake_errors(tmp_path):
    good = {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}
    path = write_lines(tmp_path, [good, dict(good, output_length=0)], name="mc.jsonl")
    with pytest.raises(TraceError) as info:
        load_mooncake(path)
    assert str(info.value).startswith(f"{path}:2: output_length: ")
    path = write_lines(tmp_path, [good, {"timestamp": 3}], name="mc2.jsonl")
    with pytest.raises(TraceError, match=r"mc2\.jsonl:2: input_length: missing key"):
        load_mooncake(path)
    with pytest.raises(ValueError, match="max_requests"):
        load_mooncake(path, max_requests=0)
    # bounds as the JSONL reader's: one day of ms, tokens per turn, block ids >= 0
    for key, value, what in (("timestamp", 10 ** 400, r"a number of ms in \[0, 8\.64e\+07\]"),
                             ("timestamp", 1e12, "a number of ms"),
                             ("input_length", 2 ** 70, r"an int in \[1, 10000000\]"),
                             ("hash_ids", [1, -2], "a list of ints >= 0")):
        path = write_lines(tmp_path, [good, dict(good, **{key: value})], name="mc3.jsonl")
        with pytest.raises(TraceError, match=rf"mc3\.jsonl:2: {key}: expected {what}"):
            load_mooncake(path)
    path = tmp_path / "mc4.jsonl"
    path.write_bytes(json.dumps(good).encode() + b"\n\xff\n")
    with pytest.raises(TraceError, match=r"mc4\.jsonl:2: record: not valid UTF-8"):
        load_mooncake(path)
    with pytest.raises(TraceError, match="cannot read trace file"):
        load_mooncake(tmp_path)  # a directory


def test_mooncake_session_rule(tmp_path):
    # Block 0 is a global system prompt (9 distinct successors); block 100 is private.
    lines = [{"timestamp": 1000 * i, "input_length": 1024, "output_length": 50,
              "hash_ids": [0, 10 + i]} for i in range(9)]
    lines.append({"timestamp": 20_000, "input_length": 1600, "output_length": 7,
                  "hash_ids": [0, 10, 500, 501]})  # continues request 0 (block 10 has 1 successor)
    lines.append({"timestamp": 21_000, "input_length": 300, "output_length": 5,
                  "hash_ids": [0, 999]})  # shares only the global block: new conversation
    path = write_lines(tmp_path, lines, name="mc.jsonl")
    t = load_mooncake(path)
    assert t.num_requests == 11 and len(t.conversations) == 10
    c = t.conversations[0]
    assert len(c.turns) == 2
    assert c.turns[1].prompt_tokens == 1600 - (1024 + 50)
    assert c.turns[1].wait_s == 20.0
    assert c.turns[1].output_tokens == 7
    assert t.conversations[-1].arrival_s == 21.0
