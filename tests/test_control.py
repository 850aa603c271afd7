"""Unit tests for the control plane's wire format (colo_rollout.runtime.control.Message):
msgpack round trip of every field, and a clear ControlError for what a peer must not send."""

from __future__ import annotations

import msgspec
import pytest
import torch

from colo_rollout.runtime.control import WIRE_VERSION, ControlError, Message


def _full() -> Message:
    return Message(rank=1, submits=[{"id": "a", "prompt": [1, 2], "params": {}, "session": None}],
                   cancels=["b"], closes=["s"], sampled=[(3, 7, -0.5, 8, 0), (3, 8, -0.25, -1, 1)], step=12,
                   span_hint=4.75, p_sampled=[(4, 9, -1.25, -1, 0)])


def _raw(m: Message) -> dict:
    """The message as a peer's plain map, to be mutated and re-sent."""
    return msgspec.msgpack.decode(m.encode())


def test_round_trip_keeps_every_field():
    m = _full()
    assert Message.decode(m.encode(), 1) == m
    blank = Message(rank=0)
    assert Message.decode(blank.encode(), 0) == blank and blank.span_hint is None


def test_rank_mismatch_is_named():
    with pytest.raises(ControlError, match="from rank 0 claims to be from 1"):
        Message.decode(_full().encode(), 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_span_hint_is_refused(bad):
    d = _raw(_full())
    d["span_hint"] = bad
    with pytest.raises(ControlError, match="span_hint .* not finite"):
        Message.decode(msgspec.msgpack.encode(d), 1)


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(speculative=[1, 2]),  # a field this rank does not know
    lambda d: d.update(span_hint="fast"),
    lambda d: d.update(step="x"),
    lambda d: d.pop("rank"),
    # a sampled row is (lifetime, token, logprob, draft, index)
    lambda d: d.update(sampled=[[1, 2]]),
    lambda d: d.update(sampled=[[1, 2, 0.0]]),  # wire 2's row
    lambda d: d.update(sampled=[[1, "tok", 0.0, -1, 0]]),
    lambda d: d.update(cancels=[3]),
])
def test_malformed_fields_raise_control_error(mutate):
    d = _raw(_full())
    mutate(d)
    with pytest.raises(ControlError, match="malformed control message from rank 1"):
        Message.decode(msgspec.msgpack.encode(d), 1)


def test_a_peer_on_another_wire_version_is_named():
    d = _raw(_full())
    d["wire"] = WIRE_VERSION - 1
    with pytest.raises(ControlError, match=f"rank 1 has wire version {WIRE_VERSION - 1}"):
        Message.decode(msgspec.msgpack.encode(d), 1)


def test_garbage_bytes_raise_control_error():
    with pytest.raises(ControlError, match="rank 2"):
        Message.decode(b"\xc1\x04not msgpack", 2)


def _gather_fails(monkeypatch, text: str):
    """dist.all_gather on 2 'ranks' failing as gloo does, with ``text``."""
    from colo_rollout.runtime import control

    def fail(*args, **kwargs):
        raise RuntimeError(text)

    monkeypatch.setattr(control.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(control.dist, "all_gather", fail)
    return control


def test_an_exchange_a_peer_never_joins_names_the_call(monkeypatch):
    """all_gather_json over a group whose peer is in another call (or none): the backend's
    timeout comes back as a ControlError naming the call (was gloo's bare text: found by
    probing)."""
    control = _gather_fails(monkeypatch, "[gloo/transport/tcp/unbound_buffer.cc:129] Timed out "
                            "waiting 20000ms for send operation to complete")
    with pytest.raises(ControlError) as e:
        control.gather_call("generate()", [None, False, None], group=None)
    assert str(e.value).startswith("generate(): not every rank took part within the timeout "
                                   "(is every rank in the same collective call?): [gloo")


def test_a_peer_in_an_untagged_exchange_is_named_too(monkeypatch):
    """gather_call beside another call's untagged all-gather (weights_loaded's verdict, say):
    a RuntimeError naming both, never an unpacking error."""
    from colo_rollout.runtime import control

    monkeypatch.setattr(control, "all_gather_json",
                        lambda obj, group=None, what="": [obj, None])
    with pytest.raises(RuntimeError) as e:
        control.gather_call("generate()", [None, False, None], group=None)
    assert "(rank 0 in generate(), rank 1 in another collective call)" in str(e.value)


def _gathered(monkeypatch, peer: bytes):
    """dist.all_gather on 2 'ranks' whose peer (rank 1) sent ``peer``."""
    from colo_rollout.runtime import control

    def fake(outs, t, group=None):
        if t.numel() == 1 and t.dtype == torch.int64:  # the lengths
            outs[0].copy_(t)
            outs[1].fill_(len(peer))
            return
        width = outs[0].numel()
        outs[0].copy_(t)
        outs[1].zero_()
        outs[1][: len(peer)] = torch.frombuffer(bytearray(peer), dtype=torch.uint8)[:width]

    monkeypatch.setattr(control.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(control.dist, "all_gather", fake)
    return control


def test_a_peer_in_another_calls_binary_exchange_is_named(monkeypatch):
    """A JSON exchange paired with another call's binary one (the step's msgpack message on
    the gloo transport): a ControlError naming the rank and what it means, not a
    UnicodeDecodeError (found by fault injection)."""
    control = _gathered(monkeypatch, b"\x89\xa4wire\x01\xff\xfe")
    with pytest.raises(ControlError) as e:
        control.all_gather_json({"a": 1}, None, "generate()")
    assert str(e.value).startswith("generate(): rank 1 sent something else: it is in another "
                                   "collective call"), str(e.value)


def test_a_broken_control_group_says_so(monkeypatch):
    """After a peer exited or an earlier timeout closed its connections, gloo fails at once:
    the error says the group is broken -- not a timeout worth retrying (fault injection)."""
    control = _gather_fails(monkeypatch, "[gloo/transport/tcp/pair.cc:598] Connection closed by "
                            "peer [127.0.0.1]:12345")
    with pytest.raises(ControlError) as e:
        control.gather_call("rollout()", None, group=None)
    assert str(e.value).startswith("rollout(): the control group is broken (a peer exited"), \
        str(e.value)


def test_divergence_names_the_rank_and_the_first_key_that_differs():
    from colo_rollout.runtime.control import divergence

    def msg(rank, agree, what="rollout()"):
        return Message(rank=rank, step=3, agree_what=what, agree=agree)

    same = {"a": "1", "b": "2"}
    assert divergence([msg(0, same), msg(1, dict(same))]) is None
    assert divergence([msg(0, {}, ""), msg(1, {}, "")]) is None
    text, rank, key = divergence([msg(0, same), msg(1, same), msg(2, {"a": "1", "b": "3"})])
    assert (rank, key) == (2, "b") and text == "rollout(): rank 2 decided otherwise than rank 0 at b"
    _, rank, key = divergence([msg(0, same), msg(1, {"a": "1"})])
    assert (rank, key) == (1, "b")
    text, _, key = divergence([msg(0, {"a": "1"}), msg(1, {"a": "1", "c": "0"})])
    assert key == "c" and text.endswith("(absent on rank 0)")
    # the digests survive the wire
    m = msg(1, {"x-0-1": "completed 0 1.0 5 ab"})
    assert Message.decode(m.encode(), 1).agree == m.agree
