"""Requests, sampling parameters and outputs: the engine's public value types.

Owns validation of what a user hands the engine (``RequestError`` names the field and the
request) and the shape of what comes back. Pure Python; no torch.
"""

from __future__ import annotations

from typing import Any

import math
import numbers
import operator
from dataclasses import dataclass, field, replace
from enum import Enum

FP32_MAX = 3.4028234663852886e38  # float32's largest finite value (the sampler's tables)


class RequestError(ValueError):
    """A request (or a cancel) the engine refuses; the message names the request id."""

    user_facing = True  # raised on a rank: the command's one error line (runtime/spawn.py)


class SubmissionRefused(RequestError):
    """Raised by ``Engine.step()`` on the rank whose own submissions every rank refused when
    the ranks' submissions met in that step's exchange -- what ``submit()`` could not know on
    its own: the same request id submitted on a lower rank in the same step (that one is
    served), or a second turn of a session that another submission of the step made busy.

    The step itself completed on every rank (the engine keeps serving everything else; keep
    calling ``step()``): ``finished`` holds the outputs ``step()`` would have returned,
    ``refused`` the outputs of this rank's refused requests (finish_reason REJECTED, ``error``
    saying why; they are also in ``engine.rejected`` on every rank)."""

    def __init__(self, refused: list["RequestOutput"], finished: list["RequestOutput"]):
        super().__init__("; ".join(f"{o.error} (refused when the ranks' submissions met; this "
                                   "step's finished outputs are in .finished)"
                                   for o in refused))
        self.refused = refused
        self.finished = finished

    def __reduce__(self):
        return (SubmissionRefused, (self.refused, self.finished))


def _is_bool(value: object) -> bool:
    """bool, numpy.bool_ or a bool tensor: refused as a token id (operator.index takes some)."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def token_ids(request_id: object, prompt: object) -> tuple[int, ...]:
    """``prompt`` as a tuple of Python ints: any sequence of integral ids (int, numpy
    integers, integer 0-d tensors: whatever ``operator.index`` takes), never bools or floats;
    a RequestError naming the request and the first bad item otherwise."""
    def bad(msg: str) -> RequestError:
        return RequestError(f"request {request_id!r}: {msg}")

    if isinstance(prompt, (str, bytes)):
        raise bad(f"prompt must be a sequence of token ids, got {type(prompt).__name__} "
                  f"{prompt[:40]!r} (encode text first, e.g. colo_rollout.text.tokenizer)")
    if isinstance(prompt, (dict, set, frozenset)):  # iterable, but not a sequence in order
        raise bad(f"prompt must be a sequence of token ids, got {type(prompt).__name__}")
    # any error a user's object raises while it is read is this request's refusal (found by
    # probing: a meta-device tensor's RuntimeError, an __index__'s OverflowError escaped
    # generate() and dropped the rest of its batch)
    try:
        items = list(prompt)  # type: ignore[call-overload]
    except TypeError:
        raise bad(f"prompt must be a sequence of token ids, got {type(prompt).__name__} "
                  f"{prompt!r}") from None
    except Exception as e:
        raise bad(f"prompt must be a sequence of token ids, got {type(prompt).__name__} "
                  f"{_short(prompt)} ({type(e).__name__} reading it: {_short(e)})") from None
    if all(type(t) is int for t in items):
        # the common case (and what the ranks' exchange carries): Python ints, bools
        # excluded by the exact type -- one pass, ~6x faster than the checks below, which
        # cost ~1 ms per 4k-token prompt on the step's host path (each prompt is checked at
        # submit and again when every rank adds it)
        return tuple(items)
    out = []
    for i, t in enumerate(items):
        if _is_bool(t):
            raise bad(f"token id {t!r} at position {i} is a bool, not an integer id")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise bad(f"token id {t!r} at position {i} is a {type(t).__name__}, not an "
                      "integer id") from None
        except Exception as e:
            raise bad(f"token id {_short(t)} at position {i} ({type(t).__name__}) could not be "
                      f"read as an integer id: {type(e).__name__}: {_short(e)}") from None
    return tuple(out)


def _short(v: object, limit: int = 80) -> str:
    """repr(v) cut to ``limit`` characters (a user's object may repr to anything, or raise)."""
    try:
        r = repr(v)
    except Exception:
        return f"<{type(v).__name__}>"
    return r if len(r) <= limit else r[: limit - 3] + "..."



def checked_request(req: object) -> "Request":
    """``req`` with its types checked -- a Request, a non-empty str id, a str session or
    None, SamplingParams, integral token ids (``token_ids``) -- and its prompt as a tuple of
    Python ints; a RequestError otherwise (never a TypeError: an unhashable id is refused
    here, before it is looked up)."""
    if not isinstance(req, Request):
        raise RequestError(f"expected a Request, got {type(req).__name__} {req!r}")
    rid = req.request_id
    if not isinstance(rid, str) or not rid:
        raise RequestError(f"request id must be a non-empty string, got {rid!r}")
    # a str subclass (numpy.str_, a user's class) as the plain str of its text: the ranks
    # exchange ids through msgspec, which encodes exact str only (found by probing: a
    # numpy.str_ id raised inside the step, every later step too)
    rid = plain_str(rid)
    if isinstance(req.session, str):
        req = replace(req, session=plain_str(req.session))
    if not valid_unicode(rid):  # the ranks exchange ids as UTF-8: a lone surrogate cannot cross
        raise RequestError(f"request id {rid!r} is not valid Unicode text (a lone surrogate)")
    if req.session is not None and (not isinstance(req.session, str) or not req.session):
        raise RequestError(f"request {rid!r}: session must be a non-empty string or None, got "
                           f"{type(req.session).__name__} {req.session!r}")
    if req.session is not None and not valid_unicode(req.session):
        raise RequestError(f"request {rid!r}: session {req.session!r} is not valid Unicode "
                           "text (a lone surrogate)")
    if not isinstance(req.params, SamplingParams):
        raise RequestError(f"request {rid!r}: params must be SamplingParams, got "
                           f"{type(req.params).__name__}")
    return replace(req, request_id=rid, prompt=token_ids(rid, req.prompt))


def plain_str(text: str) -> str:
    """``text`` (a str, or an instance of a str subclass) as an exact ``str`` of the same
    characters -- never its class's own ``__str__``."""
    return text if type(text) is str else str.__str__(text)


def valid_unicode(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogate -- a JSON escape, or argv bytes
    the locale could not decode): what ids and prompts must be to cross between ranks."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _scalar(value: object) -> object:
    """A 0-d tensor or array as its Python number (as ``ignore_eos`` takes a 0-d bool
    tensor; found by probing: a 0-d float tensor was refused as a temperature)."""
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)) \
            and not _is_bool(value):
        return value.item()
    return value


def _real(value: object) -> float | None:
    """``value`` as a float where it is a real number (int, float, numpy scalars, 0-d
    tensors), never a bool; None otherwise (also for an int too large for a float)."""
    value = _scalar(value)
    if _is_bool(value) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _integer(value: object) -> int | None:
    """``value`` as an int where it is integral (int, numpy integers, 0-d integer tensors),
    never a bool."""
    value = _scalar(value)
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_tokens: int = 16  # generated tokens, >= 1
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks, fixed-work replays)
    # logprobs of the distribution the token is drawn from -- log_softmax(logits /
    # temperature), before top-k / top-p -- instead of the model's own (temperature 1). What
    # an RL trainer that divides its logits by the rollout temperature recomputes (the RL
    # loop's rollouts); greedy rows are the model's own either way.
    tempered_logprobs: bool = False

    @property
    def greedy(self) -> bool:
        """Argmax sampling (temperature 0; top-k/top-p then change nothing). The one rule the
        sampler and the D graphs' in-graph sampling both follow."""
        return self.temperature == 0

    def validate(self, request_id: str, vocab_size: int) -> None:
        def bad(msg: str) -> RequestError:
            return RequestError(f"request {request_id!r}: {msg}")

        temperature = _real(self.temperature)
        if temperature is None or not math.isfinite(temperature) or temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if temperature > FP32_MAX:  # drawn in fp32: an inf temperature flattens every row,
            # and top-k / top-p then keep the whole vocabulary (found by probing: top_k 1 at
            # 1e39 drew uniformly)
            raise bad(f"temperature {temperature:g} is past float32's largest value "
                      f"({FP32_MAX:.4g}): the sampler draws in float32")
        top_k = _integer(self.top_k)
        if top_k is None or top_k < 0:
            raise bad(f"top_k must be an int >= 0, got {self.top_k!r}")
        if top_k > vocab_size:
            raise bad(f"top_k {top_k} exceeds the vocabulary size {vocab_size}")
        top_p = _real(self.top_p)
        if top_p is None or not (0.0 < top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        max_tokens = _integer(self.max_tokens)
        if max_tokens is None or max_tokens < 1:
            raise bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        for name in ("ignore_eos", "tempered_logprobs"):
            value = getattr(self, name)
            if not (isinstance(value, bool)
                    or _is_bool(value) and getattr(value, "shape", None) == ()):
                raise bad(f"{name} must be a bool, got {type(value).__name__} {value!r}")

    def to_json(self) -> dict:
        """Plain Python values (what the ranks' control message encodes: numpy scalars that
        pass ``validate`` become floats, ints and bools here)."""
        wire = {"temperature": _real(self.temperature), "top_k": _integer(self.top_k),
                "top_p": _real(self.top_p), "max_tokens": _integer(self.max_tokens),
                "ignore_eos": bool(self.ignore_eos)}
        if self.tempered_logprobs:  # (absent: off -- the wire of every other request as it was)
            wire["tempered_logprobs"] = True
        return wire

    @classmethod
    def from_json(cls, d: dict) -> "SamplingParams":
        return cls(temperature=d["temperature"], top_k=d["top_k"], top_p=d["top_p"],
                   max_tokens=d["max_tokens"], ignore_eos=d["ignore_eos"],
                   tempered_logprobs=d.get("tempered_logprobs", False))

    @property
    def logprob_temperature(self) -> float:
        """The temperature this row's logprob is computed at: its own with
        ``tempered_logprobs`` on a sampled row, else 1 (the model's distribution)."""
        return float(self.temperature) if self.tempered_logprobs and not self.greedy else 1.0


@dataclass(frozen=True)
class Request:
    """``session``: requests sharing a session id form a trajectory (a multi-turn
    conversation). A later request of the session is a continuation: ``prompt`` holds only the
    new tokens (e.g. the environment's observation); the context -- every earlier prompt and
    output of the session -- is kept in the KV cache between turns when capacity allows, and
    re-prefilled from its tokens when it was evicted. Nothing is re-tokenised."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    session: str | None = None


class FinishReason(str, Enum):
    STOP = "stop"  # sampled EOS
    LENGTH = "length"  # max_tokens (or the sequence cap) reached
    CANCELLED = "cancelled"
    REJECTED = "rejected"  # never admitted; ``error`` says why
    ERROR = "error"  # ended by the engine mid-generation (non-finite logits); ``error`` says why


@dataclass
class RequestOutput:
    request_id: str
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    # log p(token) under the model at T = 1 (SamplingParams.tempered_logprobs: at its T)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    replica: int = -1
    # engine-clock timestamps (seconds, time.perf_counter on the rank that records them)
    submit_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    # engine.record_routing, a request without a session: its input tokens' experts
    # [positions, MoE layers, k] (engine/routing_store.py); a session's: Engine.take_routing
    routing: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
