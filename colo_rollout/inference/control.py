"""Host-side control plane: the one per-step exchange that keeps every rank's state identical.

Owns the wire format between ranks. Each step every rank contributes one message -- the requests
and cancels submitted on it since the last step, and (replica leaders only) the tokens it sampled
in the last step -- and receives everyone's, in rank order. Messages are JSON (never pickle: a
peer's bytes are data, not code), sent as uint8 tensors over the gloo control group with two
all_gathers (lengths, then padded payloads). The group's timeout turns a dead or diverged peer
into an exception on every rank instead of a hang.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class ControlError(RuntimeError):
    """A peer sent something that is not a valid control message."""


@dataclass
class Message:
    rank: int
    submits: list[dict] = field(default_factory=list)  # {"id", "prompt", "params", "session"}
    cancels: list[str] = field(default_factory=list)
    closes: list[str] = field(default_factory=list)  # sessions to forget
    sampled: list[list] = field(default_factory=list)  # [lifetime, token, logprob]
    step: int = -1  # sender's step counter: all ranks must agree
    # balanced segment policy: the span that would have balanced the sender's last round
    # (segment_policy.span_hint), None when that round measured nothing
    span_hint: float | None = None
    # PD mode: the sender's first tokens of the P epoch awaiting commit ([lifetime, token,
    # logprob]; empty for a rank that samples none), sent once, when its P GPU work is done;
    # None: not done yet, or no epoch awaits commit
    p_sampled: list | None = None

    def encode(self) -> bytes:
        return json.dumps({"rank": self.rank, "submits": self.submits, "cancels": self.cancels,
                           "closes": self.closes, "sampled": self.sampled, "step": self.step,
                           "span_hint": self.span_hint, "p_sampled": self.p_sampled},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, src: int) -> "Message":
        try:
            d = json.loads(data.decode())
            msg = cls(rank=int(d["rank"]), submits=list(d["submits"]),
                      cancels=[str(c) for c in d["cancels"]],
                      closes=[str(c) for c in d["closes"]], sampled=list(d["sampled"]),
                      step=int(d["step"]),
                      span_hint=None if d["span_hint"] is None else float(d["span_hint"]),
                      p_sampled=None if d["p_sampled"] is None else list(d["p_sampled"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ControlError(f"malformed control message from rank {src}: {e}") from e
        if msg.span_hint is not None and not math.isfinite(msg.span_hint):
            raise ControlError(f"control message from rank {src}: span_hint {msg.span_hint} "
                               "is not finite")
        if msg.rank != src:
            raise ControlError(f"control message from rank {src} claims to be from {msg.rank}")
        return msg


class ControlPlane:
    def __init__(self, group: dist.ProcessGroup, rank: int, world: int,
                 timeout_s: float | None = None) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s  # the group's timeout (for the error message)
        self.exchanges = 0

    def exchange(self, msg: Message) -> list[Message]:
        """All-gather one message per rank; returns them in rank order. Collective. A peer that
        died or stopped stepping makes every other rank raise ControlError (the group's
        timeout) naming this rank and step."""
        self.exchanges += 1
        data = msg.encode()
        if self.world == 1:
            return [Message.decode(data, 0)]
        n = torch.tensor([len(data)], dtype=torch.int64)
        lens = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._all_gather(lens, n, msg.step)
        width = max(int(x) for x in lens)
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world)]
        self._all_gather(outs, buf, msg.step)
        msgs = [Message.decode(o[: int(lens[i])].numpy().tobytes(), i) for i, o in enumerate(outs)]
        steps = {m.step for m in msgs}
        if len(steps) != 1:
            raise ControlError(f"ranks are at different steps: "
                               f"{ {m.rank: m.step for m in msgs} }")
        return msgs

    def _all_gather(self, outs: list[torch.Tensor], t: torch.Tensor, step: int) -> None:
        try:
            dist.all_gather(outs, t, group=self.group)
        except RuntimeError as e:  # gloo: timeout or a closed peer connection
            within = f" within {self.timeout_s:g} s" if self.timeout_s is not None else ""
            raise ControlError(
                f"rank {self.rank}, step {step}: the control exchange did not complete{within}; "
                f"a peer died or stopped stepping (diverged) [{e}]") from e


def all_gather_json(obj, group: dist.ProcessGroup | None = None) -> list:
    """All-gather one JSON-serialisable value per rank (rank order). JSON, never pickle."""
    world = dist.get_world_size(group)
    data = json.dumps(obj).encode()
    n = torch.tensor([len(data)], dtype=torch.int64)
    lens = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lens, n, group=group)
    width = max(int(x) for x in lens)
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(outs, buf, group=group)
    return [json.loads(o[: int(lens[i])].numpy().tobytes()) for i, o in enumerate(outs)]
