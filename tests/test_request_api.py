"""The in-process API at the door: what a caller hands ``Engine.submit`` / the scheduler is
refused with a RequestError naming the request -- never a TypeError -- and integral token ids of
any type (numpy integers) are taken as ints. The pure checks run here; the engine's own (submit,
cancel, close_session, generate, a duplicate id across ranks) on two spawned CPU ranks, the rank
body beside the test."""

from __future__ import annotations

import numpy as np
import pytest

from colo_rollout.config import EngineConfig
from colo_rollout.sched.request import (
    Request,
    RequestError,
    SamplingParams,
    SubmissionRefused,
    checked_request,
    token_ids,
)
from colo_rollout.sched.scheduler import Scheduler

VOCAB = 50


def make() -> Scheduler:
    cfg = EngineConfig(max_batch_size=4, max_prefill_tokens=64, kv_block_size=4,
                       num_kv_blocks=32, max_seq_len=64, decode_buckets=[1, 2, 4])
    return Scheduler(cfg, 2, 1, VOCAB)


@pytest.mark.parametrize("prompt", [
    (1, 2, 3), [1, 2, 3], np.array([1, 2, 3]), np.array([1, 2, 3], dtype=np.int32),
    (np.int64(1), np.uint8(2), np.int16(3)), range(1, 4),
])
def test_integral_token_ids_of_any_type_are_ints(prompt):
    ids = token_ids("r", prompt)
    assert ids == (1, 2, 3) and all(type(t) is int for t in ids)
    s = make()
    s.add(Request("r", prompt, SamplingParams(max_tokens=2)))  # not "outside the vocabulary"
    assert s.has_work()


def test_integer_tensors_are_ints_too():
    torch = pytest.importorskip("torch")
    assert token_ids("r", torch.tensor([4, 5])) == (4, 5)
    with pytest.raises(RequestError, match=r"position 0 is a bool"):
        token_ids("r", torch.tensor([True]))


class _Raising:
    """A prompt whose iteration raises something other than a TypeError."""

    def __iter__(self):
        raise RuntimeError("no")

    def __repr__(self):
        return "<_Raising>"


class _BadIndex:
    """A token id whose __index__ overflows (as a huge numpy-like scalar may)."""

    def __index__(self):
        raise OverflowError("too big")

    def __repr__(self):
        return "<_BadIndex>"


@pytest.mark.parametrize("prompt, fragment", [
    ((1, True), "request 'r': token id True at position 1 is a bool, not an integer id"),
    ((np.bool_(False),), "position 0 is a bool"),
    ((1, 2.0), "request 'r': token id 2.0 at position 1 is a float, not an integer id"),
    ((np.float64(3.0),), "position 0 is a float64, not an integer id"),
    ("hello", "prompt must be a sequence of token ids, got str 'hello' (encode text first"),
    (7, "prompt must be a sequence of token ids, got int 7"),
    ((1, None), "token id None at position 1 is a NoneType"),
    # whatever a user's object raises while it is read is the request's refusal
    (_Raising(), "prompt must be a sequence of token ids, got _Raising <_Raising> "
                 "(RuntimeError reading it: RuntimeError('no'))"),
    ((1, _BadIndex()), "token id <_BadIndex> at position 1 (_BadIndex) could not be read as an "
                       "integer id: OverflowError: "),
])
def test_non_integral_token_ids_are_refused_clearly(prompt, fragment):
    s = make()
    with pytest.raises(RequestError) as info:
        s.add(Request("r", prompt, SamplingParams(max_tokens=2)))
    assert fragment in str(info.value)
    assert not s.has_work()


def test_out_of_vocabulary_is_still_named():
    with pytest.raises(RequestError, match=r"token id 50 outside the vocabulary \[0, 50\)"):
        make().add(Request("r", np.array([1, 50]), SamplingParams(max_tokens=2)))


@pytest.mark.parametrize("request_, fragment", [
    (Request(["a"], (1, 2)), "request id must be a non-empty string, got ['a']"),
    (Request({"a": 1}, (1, 2)), "request id must be a non-empty string"),
    (Request("a", (1, 2), session=["s"]), "request 'a': session must be a non-empty string or "
                                          "None, got list ['s']"),
    (Request("a", (1, 2), params={"max_tokens": 2}), "params must be SamplingParams, got dict"),
    (("a", (1, 2)), "expected a Request, got tuple"),
    # ids and sessions cross between ranks as UTF-8: a lone surrogate would stop every step
    (Request("a\ud800", (1, 2)), "is not valid Unicode text (a lone surrogate)"),
    (Request("a", (1, 2), session="s\udfff"), "request 'a': session 's\\udfff' is not valid "
                                               "Unicode text"),
    ({"a": 1, "b": 2}, "expected a Request, got dict"),
    (Request("a", {1: 0, 2: 0}), "request 'a': prompt must be a sequence of token ids, got "
                                 "dict"),
    (Request("a", {1, 2}), "prompt must be a sequence of token ids, got set"),
])
def test_wrong_types_are_request_errors_not_type_errors(request_, fragment):
    with pytest.raises(RequestError) as info:
        make().validate(request_)
    assert fragment in str(info.value)
    with pytest.raises(RequestError):
        checked_request(request_)


def test_submission_refused_is_a_request_error_that_pickles():
    import pickle

    from colo_rollout.sched.request import FinishReason, RequestOutput

    out = RequestOutput("x", 3, error="request 'x': duplicate request id")
    out.finish_reason = FinishReason.REJECTED
    err = SubmissionRefused([out], [])
    assert isinstance(err, RequestError)
    assert str(err).startswith("request 'x': duplicate request id (refused when the ranks'")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.refused[0].request_id == "x" and back.finished == []


# --------------------------------------------------------------------------- on two ranks
def api_on_two_ranks(rank: int, world: int) -> dict:
    """Rank body: wrong types at submit/cancel/close_session; numpy prompts served like ints;
    generate() with a malformed request; a duplicate id across ranks through generate()."""
    from tests.cases_engine import _engine

    cfg, groups, sd, engine = _engine(world, 2, 2)
    errors = {}
    calls = {
        "submit list id": lambda: engine.submit(Request(["a"], (1, 2))),
        "submit float id": lambda: engine.submit(Request("f", (1, 2.5))),
        "submit str prompt": lambda: engine.submit(Request("s", "hi")),
        "cancel list id": lambda: engine.cancel(["a"]),
        "close list session": lambda: engine.close_session(["s"]),
    }
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except RequestError as e:  # a TypeError fails the test (the rank reports it)
            errors[name] = str(e)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    if rank == 1:  # lost to rank 0's "dup" below: generate() keeps serving, lists it
        engine.submit(Request("dup", (9, 9), params))
    outs = engine.generate([
        Request("np", np.array([5, 6, 7, 8]), params),
        Request("py", (5, 6, 7, 8), params),
        Request("np32", tuple(np.int32(x) for x in (5, 6, 7, 8)), params),
        Request(["bad"], (1, 2), params),  # refused, listed in engine.rejected only
        Request("dup", (1, 2, 3), params),
    ])
    engine.close()
    return {"errors": errors,
            "tokens": {rid: outs[rid].tokens for rid in ("np", "py", "np32", "dup")},
            "reasons": sorted({o.finish_reason.value for o in outs.values()}),
            "keys": sorted(outs),
            "rejected": [(repr(o.request_id), o.error) for o in engine.rejected],
            "rejected_kept": engine.rejected.maxlen}


def test_engine_api_refuses_types_and_serves_numpy_ids(worker_groups):
    res = worker_groups(2).run("tests.test_request_api:api_on_two_ranks")
    for r in res:
        assert r["rejected_kept"] == 4096  # the list of refusals is bounded in a long run
        e = r["errors"]
        assert e["submit list id"] == "request id must be a non-empty string, got ['a']"
        assert "token id 2.5 at position 1 is a float" in e["submit float id"]
        assert "prompt must be a sequence of token ids, got str 'hi'" in e["submit str prompt"]
        assert e["cancel list id"] == "cancel: request id must be a string, got ['a']"
        assert "a session id is a string" in e["close list session"]
        t = r["tokens"]
        assert len(t["py"]) == 5 and t["np"] == t["py"] == t["np32"]
        assert r["reasons"] == ["length"] and r["keys"] == ["dup", "np", "np32", "py"]
        assert len(t["dup"]) == 5
    # rank 0 refused the malformed request at submit (only rank 0 submits in generate); both
    # ranks list rank 1's losing "dup" submission
    assert res[0]["rejected"][0] == ("['bad']", "request id must be a non-empty string, got "
                                     "['bad']")
    for r in res:
        assert ("'dup'", "request 'dup': duplicate request id") in r["rejected"]


def test_an_id_past_int64_is_named_outside_the_vocabulary():
    with pytest.raises(RequestError, match=r"token id 1180591620717411303424 outside the "
                                           r"vocabulary"):
        make().add(Request("r", (1, 2**70), SamplingParams(max_tokens=2)))


@pytest.mark.parametrize("params, fragment", [
    (SamplingParams(temperature=10 ** 400), "temperature must be a finite number >= 0, got 1000"),
    # finite, but inf in the sampler's float32 table (top_k 1 then drew uniformly)
    (SamplingParams(temperature=1e39, top_k=1), "temperature 1e+39 is past float32's largest"),
    (SamplingParams(ignore_eos=np.array([True])), "ignore_eos must be a bool, got ndarray"),
    (SamplingParams(ignore_eos="no"), "ignore_eos must be a bool, got str 'no'"),
    (SamplingParams(ignore_eos=None), "ignore_eos must be a bool, got NoneType"),
    (SamplingParams(ignore_eos=1), "ignore_eos must be a bool, got int 1"),
    (SamplingParams(top_p=np.float32("nan")), "top_p must be in (0, 1]"),
    (SamplingParams(max_tokens=np.bool_(True)), "max_tokens must be an int >= 1"),
])
def test_sampling_params_refused_by_value_and_type(params, fragment):
    """Never an OverflowError or a value the ranks' exchange cannot encode (a numpy bool
    ignore_eos used to pass here and stop every later step)."""
    with pytest.raises(RequestError) as info:
        params.validate("r", VOCAB)
    assert str(info.value).startswith("request 'r': ") and fragment in str(info.value)


def test_numpy_numbers_are_sampling_params_and_cross_as_python_values():
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float32(0.9),
                       max_tokens=np.int32(4), ignore_eos=np.bool_(True))
    p.validate("r", VOCAB)
    wire = p.to_json()
    assert [type(v) for v in wire.values()] == [float, int, float, int, bool]
    assert SamplingParams.from_json(wire).to_json() == wire


def test_zero_d_tensors_are_sampling_params_too():
    """As a 0-d bool tensor is an ignore_eos and a 0-d int tensor a token id (found by
    probing: a 0-d float tensor was refused as a temperature)."""
    torch = pytest.importorskip("torch")
    p = SamplingParams(temperature=torch.tensor(0.5), top_k=torch.tensor(3),
                       top_p=torch.tensor(0.9), max_tokens=torch.tensor(4),
                       ignore_eos=torch.tensor(True))
    p.validate("r", VOCAB)
    wire = p.to_json()
    assert [type(v) for v in wire.values()] == [float, int, float, int, bool]
    with pytest.raises(RequestError, match="temperature must be a finite number"):
        SamplingParams(temperature=torch.tensor([0.5])).validate("r", VOCAB)


def test_a_top_p_below_fp32s_range_keeps_the_top_token():
    """top_p 1e-50 is valid (> 0) but 0 in the sampler's fp32 table, which masked every token
    (NaN probabilities, token 0): the table floors it, keeping the top token alone."""
    torch = pytest.importorskip("torch")
    from colo_rollout.worker.sampler import Draw, draw_params, draw_tensors

    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, top_p=1e-50)] * 3
    table = torch.tensor(draw_params(params, 3), dtype=torch.float32).view(3, 3)
    assert bool((table[2] > 0).all())
    tokens, logprobs = draw_tensors(Draw.TRUNCATED, logits, table,
                                    torch.Generator().manual_seed(1))
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert bool(torch.isfinite(logprobs).all())
