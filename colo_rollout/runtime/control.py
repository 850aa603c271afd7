"""Host-side control plane: the one per-step exchange that keeps every rank's state identical.

Owns the wire format between ranks. Each step every rank contributes one message -- the requests
and cancels submitted on it since the last step, and (replica leaders only) the tokens it sampled
in the last step -- and receives everyone's, in rank order. Messages are typed msgpack
(``msgspec``; never pickle: a peer's bytes are data, not code). Two transports:
  * gloo: uint8 tensors over the gloo control group with two all_gathers (lengths, then padded
    payloads); works across hosts. The group's timeout turns a dead or diverged peer into an
    exception on every rank instead of a hang.
  * shared memory (``ShmMailbox``, all ranks on one host): each rank writes its message into
    its own slot and bumps an arrival counter; everyone spins until all have arrived, then
    reads every slot. ~10 us instead of ~0.6 ms per exchange on the 2x H200 host (measured by
    scripts/profile_host.py), and the engine exchanges once per step: in Fine mode that is
    once per turnstile round. A message larger than a slot goes by gloo -- for every rank,
    since every rank sees the same lengths.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from colo_rollout.runtime.shm import arrive_and_wait, open_shared


class ControlError(RuntimeError):
    """A peer sent something that is not a valid control message."""


class ReplicaDivergence(RuntimeError):
    """Raised by ``Engine.step()`` on every rank when the digests the ranks' callers gave
    ``Engine.expect_same`` for that step differ: host logic that must be replicated (an
    environment's step, a reward) decided otherwise on some rank. The step itself completed
    on every rank; ``finished`` holds what it would have returned, ``rank`` the first rank
    that differs from rank 0 and ``key`` the first key that differs (None: the labels)."""

    def __init__(self, message: str, rank: int, key: str | None, finished: list):
        super().__init__(message)
        self.rank, self.key, self.finished = rank, key, finished


def divergence(msgs: list["Message"]) -> tuple[str, int, str | None] | None:
    """The first difference between the ranks' ``agree`` digests in one exchange (rank
    order): (a sentence naming the caller's label, the rank and the key, the rank, the key);
    None if every rank sent the same."""
    first = msgs[0]
    for m in msgs[1:]:
        if (m.agree_what, m.agree) == (first.agree_what, first.agree):
            continue
        what = first.agree_what or m.agree_what
        keys = sorted(set(first.agree) | set(m.agree))
        key = next((k for k in keys if first.agree.get(k) != m.agree.get(k)), None)
        at = ("" if key is None else
              f" at {key}" + (" (absent on rank 0)" if key not in first.agree else
                              " (absent there)" if key not in m.agree else ""))
        return f"{what}: rank {m.rank} decided otherwise than rank 0{at}", m.rank, key
    return None


WIRE_VERSION = 4  # bumped whenever Message's fields change: mixed versions are refused


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """One rank's contribution to a step's exchange. Typed: decoding validates every field's
    type (a peer's bytes are data, checked before use)."""

    rank: int
    submits: list[dict[str, Any]] = []  # {"id", "prompt", "params", "session"}
    cancels: list[str] = []
    closes: list[str] = []  # sessions to forget
    # (lifetime, token, logprob, draft, index): index 0 is a forward's first token of the
    # lifetime (draft: the MTP draft after its last token, -1 none), 1.. its accepted bonus
    # tokens (engine.mtp), in order
    sampled: list[tuple[int, int, float, int, int]] = []
    step: int = -1  # sender's step counter: all ranks must agree
    # balanced segment policy: the span that would have balanced the sender's last round
    # (segment_policy.span_hint), None when that round measured nothing
    span_hint: float | None = None
    # PD mode: the sender's first tokens of the P epoch awaiting commit (rows as ``sampled``;
    # empty for a rank that samples none), sent once, when its P GPU work is done;
    # None: not done yet, or no epoch awaits commit
    p_sampled: list[tuple[int, int, float, int, int]] | None = None
    # the caller's digests that every rank must send alike (Engine.expect_same): key ->
    # digest, under the caller's label
    agree_what: str = ""
    agree: dict[str, str] = {}
    wire: int = WIRE_VERSION

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls, data: bytes, src: int) -> "Message":
        try:
            msg = _DECODER.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ControlError(f"malformed control message from rank {src} (a rank in another "
                               f"collective call sends other bytes): {e}") from e
        if msg.wire != WIRE_VERSION:
            raise ControlError(f"control message from rank {src} has wire version {msg.wire}, "
                               f"this rank {WIRE_VERSION}: every rank must run the same code")
        if msg.span_hint is not None and not math.isfinite(msg.span_hint):
            raise ControlError(f"control message from rank {src}: span_hint {msg.span_hint} "
                               "is not finite")
        if msg.rank != src:
            raise ControlError(f"control message from rank {src} claims to be from {msg.rank}")
        return msg


# msgpack through msgspec: ~9x faster than json + hand validation for a step's message (64
# sampled rows: 15 us against 130 us per encode + decode), and a rank decodes every peer's
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


class ShmMailbox:
    """Same-host message exchange: int64 ``arrive[world]`` (exchanges entered by each rank),
    int64 ``length[2, world]`` and ``slot_bytes`` of payload per (parity, rank). Exchange n
    uses parity n % 2. A rank can be at most one exchange ahead of any peer (it cannot finish
    exchange n + 1 before every peer arrived there, i.e. finished reading n), so its write of
    n + 1 never touches the slots a peer may still be reading. Store order is relied on
    (x86-TSO; numpy stores), as in ShmRendezvous. A length of -1 means "too large for the
    slot": every rank then falls back to the other transport for that exchange."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world: int, timeout_s: float,
                 slot_bytes: int = 1 << 18) -> None:
        self.rank, self.world, self.timeout_s, self.slot_bytes = rank, world, timeout_s, slot_bytes
        head = 8 * world * 3
        self._mm = open_shared(group, rank, head + 2 * world * slot_bytes)
        arr = np.ndarray((world * 3,), dtype=np.int64, buffer=self._mm)
        self._arrive = arr[:world]
        self._length = arr[world:].reshape(2, world)
        self._payload = np.ndarray((2, world, slot_bytes), dtype=np.uint8, buffer=self._mm,
                                   offset=head)
        self._n = 0

    def exchange(self, data: bytes, step: int) -> list[bytes] | None:
        """Every rank's bytes in rank order, or None when some rank's did not fit (all ranks
        return None together). Raises ControlError naming the late ranks after timeout_s."""
        self._n += 1
        n, par = self._n, self._n % 2
        if len(data) <= self.slot_bytes:
            self._payload[par, self.rank, : len(data)] = np.frombuffer(data, dtype=np.uint8)
            self._length[par, self.rank] = len(data)
        else:
            self._length[par, self.rank] = -1
        gone, late = arrive_and_wait(self._arrive, self.rank, n, self.timeout_s)
        if gone:
            raise ControlError(
                f"rank {self.rank}, step {step}: ranks {gone} gave up on the control exchange "
                "(their parallel.timeout_s passed before every rank arrived): the ranks are out "
                "of step and this engine cannot serve on")
        if late:
            raise ControlError(
                f"rank {self.rank}, step {step}: the control exchange did not complete within "
                f"{self.timeout_s:g} s; ranks {late} never arrived (dead or diverged)")
        lens = [int(x) for x in self._length[par]]
        if min(lens) < 0:
            return None
        return [self._payload[par, r, :k].tobytes() for r, k in enumerate(lens)]

    def close(self) -> None:
        self._arrive = self._length = self._payload = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None


class ControlPlane:
    def __init__(self, group: dist.ProcessGroup, rank: int, world: int,
                 timeout_s: float | None = None, shm: bool = False) -> None:
        """``shm``: exchange through a ShmMailbox (collective to set up; every rank of the
        group must be on this host and pass the same value)."""
        self.group = group
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s  # the group's timeout (for the error message)
        self.exchanges = 0
        self.fallbacks = 0  # shm exchanges that went by gloo (a message outgrew its slot)
        self.mailbox = (ShmMailbox(group, rank, world, timeout_s or 600.0)
                        if shm and world > 1 else None)

    def close(self) -> None:
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox = None

    def exchange(self, msg: Message) -> list[Message]:
        """All-gather one message per rank; returns them in rank order. Collective. A peer that
        died or stopped stepping makes every other rank raise ControlError (the timeout) naming
        this rank and step."""
        self.exchanges += 1
        data = msg.encode()
        if self.world == 1:
            return [Message.decode(data, 0)]
        got = self.mailbox.exchange(data, msg.step) if self.mailbox is not None else None
        if got is not None:
            return self._check([Message.decode(b, i) for i, b in enumerate(got)])
        self.fallbacks += self.mailbox is not None
        n = torch.tensor([len(data)], dtype=torch.int64)
        lens = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._all_gather(lens, n, msg.step)
        width = max(int(x) for x in lens)
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world)]
        self._all_gather(outs, buf, msg.step)
        return self._check([Message.decode(o[: int(lens[i])].numpy().tobytes(), i)
                            for i, o in enumerate(outs)])

    @staticmethod
    def _check(msgs: list[Message]) -> list[Message]:
        steps = {m.step for m in msgs}
        if len(steps) != 1:
            raise ControlError(f"ranks are at different steps: "
                               f"{ {m.rank: m.step for m in msgs} }")
        return msgs

    def _all_gather(self, outs: list[torch.Tensor], t: torch.Tensor, step: int) -> None:
        try:
            dist.all_gather(outs, t, group=self.group)
        except RuntimeError as e:  # gloo: timeout or a closed peer connection
            raise ControlError(f"rank {self.rank}, step {step}: the control exchange failed: "
                               f"{transport_problem(e)}") from e


def first_problem(problem, group: dist.ProcessGroup, world: int,
                  what: str = "an exchange between the ranks"):
    """Every rank's verdict before a collective step (None: fine here), agreed: (rank, its
    problem) of the lowest rank that has one, or None -- the same on every rank (one
    all-gather, none on one rank), so a refusal raises everywhere instead of leaving the
    other ranks waiting in the step's collectives. Tagged by ``what`` (``gather_call``): a
    rank in another call is a RuntimeError on every rank (found by fault injection: a load
    on one rank and weights_loaded() on the other both agreed, leaving different weights)."""
    every = [problem] if world == 1 else gather_call(what, problem, group)
    return next(((r, p) for r, p in enumerate(every) if p is not None), None)


def gather_call(what: str, payload, group: dist.ProcessGroup) -> list:
    """Every rank's ``payload`` for the collective call ``what`` (one all-gather, tagged):
    a rank in another collective call at this point -- generate() on one rank, rollout() on
    another -- is a RuntimeError on every rank naming both calls (found by probing: the two
    calls' exchanges paired, and one failed unpacking the other's payload)."""
    every = all_gather_json([what, payload], group, what)
    first: dict[str, int] = {}  # each call seen -> the first rank in it
    for r, item in enumerate(every):
        # (an untagged exchange of another call: any other shape)
        tagged = isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
        first.setdefault(item[0] if tagged else "another collective call", r)
    if len(first) > 1:
        calls = ", ".join(f"rank {r} in {tag}" for tag, r in first.items())
        raise RuntimeError(f"{what}: the ranks are in different collective calls ({calls}): "
                           "every rank calls the same collective operations in the same order")
    return [p for _, p in every]


def first_difference(every: list[dict]) -> tuple[int, str] | None:
    """The first (rank, key) at which a rank's mapping differs from rank 0's (keys in sorted
    order, ranks in order), or None: what the ranks' gathered settings disagree on."""
    for rank, theirs in enumerate(every):
        for key in sorted(set(every[0]) | set(theirs)):
            if theirs.get(key) != every[0].get(key):
                return rank, key
    return None


def all_gather_json(obj, group: dist.ProcessGroup | None = None,
                    what: str = "an exchange between the ranks") -> list:
    """All-gather one JSON-serialisable value per rank (rank order). JSON, never pickle.
    A peer that never joins (a rank not in the same call) fails it within the group's
    timeout: a ControlError naming ``what`` (was the backend's own text, e.g. gloo's
    'Timed out waiting 20000ms for send operation to complete': found by probing)."""
    world = dist.get_world_size(group)
    data = json.dumps(obj).encode()
    n = torch.tensor([len(data)], dtype=torch.int64)
    lens = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    try:
        dist.all_gather(lens, n, group=group)
        width = max(int(x) for x in lens)
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(outs, buf, group=group)
    except RuntimeError as e:
        raise ControlError(f"{what}: {transport_problem(e)}") from e
    every = []
    for r, o in enumerate(outs):
        try:
            every.append(json.loads(o[: int(lens[r])].numpy().tobytes()))
        except ValueError:  # (UnicodeDecodeError, JSONDecodeError): another call's bytes
            raise ControlError(f"{what}: rank {r} sent something else: it is in another "
                               "collective call (every rank calls the same collective "
                               "operations in the same order)") from None
    return every


# what a communication backend's failure reads like (gloo's transport, NCCL's watchdog)
_CLOSED = ("pair closure", "Connection closed", "Connection reset", "Broken pipe")
_TRANSPORT = _CLOSED + ("Timed out waiting", "gloo", "NCCL", "ProcessGroup")


def transport_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective's failure in the backend (a timeout, a closed
    connection), judged by its text: torch raises them as plain RuntimeErrors."""
    return any(k in str(e) for k in _TRANSPORT)


def transport_problem(e: BaseException, group: str = "the control group") -> str:
    """What a failed collective on ``group`` means, from the backend's text: a connection a
    peer closed (it exited, or an earlier failure broke the group: no later exchange can
    succeed) or a peer that did not take part within the timeout (found by fault injection:
    the first read like a timeout worth retrying)."""
    text = " ".join(str(e).split())[:200]
    if any(k in text for k in _CLOSED):
        return (f"{group} is broken (a peer exited, or an earlier failure closed its "
                f"connections): the ranks cannot agree any more; restart them [{text}]")
    return ("not every rank took part within the timeout (is every rank in the same "
            f"collective call?): {text}")
