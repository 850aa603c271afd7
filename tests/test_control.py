"""Unit tests for the control plane's wire format (colo_rollout.runtime.control.Message):
JSON round trip of every field, and a clear ControlError for what a peer must not send."""

from __future__ import annotations

import json

import pytest

from colo_rollout.runtime.control import ControlError, Message


def _full() -> Message:
    return Message(rank=1, submits=[{"id": "a", "prompt": [1, 2], "params": {}, "session": None}],
                   cancels=["b"], closes=["s"], sampled=[[3, 7, -0.5]], step=12, span_hint=4.75)


def test_round_trip_keeps_every_field():
    m = _full()
    assert Message.decode(m.encode(), 1) == m
    blank = Message(rank=0)
    assert Message.decode(blank.encode(), 0) == blank and blank.span_hint is None


def test_rank_mismatch_is_named():
    with pytest.raises(ControlError, match="from rank 0 claims to be from 1"):
        Message.decode(_full().encode(), 0)


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_span_hint_is_refused(bad):
    raw = _full().encode().decode().replace('"span_hint":4.75', f'"span_hint":{bad}')
    with pytest.raises(ControlError, match="span_hint .* not finite"):
        Message.decode(raw.encode(), 1)


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("span_hint"),  # a peer on another wire version
    lambda d: d.update(span_hint="fast"),
    lambda d: d.update(step="x"),
])
def test_malformed_fields_raise_control_error(mutate):
    d = json.loads(_full().encode())
    mutate(d)
    with pytest.raises(ControlError, match="malformed control message from rank 1"):
        Message.decode(json.dumps(d).encode(), 1)


def test_garbage_bytes_raise_control_error():
    with pytest.raises(ControlError, match="rank 2"):
        Message.decode(b"\x80\x04not json", 2)
