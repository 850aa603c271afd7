"""Turnstile controller: per-rank bookkeeping of how far a P epoch may run before D goes next.

Pure Python (no torch, no torch.distributed): the engine calls it around the rendezvous, the
P path calls ``publish`` at every safe boundary. DESIGN.md item 7 and paper section 4.

State per rank: epoch ``e``, largest reached boundary ``r`` (-1 at the start of an epoch),
permitted endpoint ``p``, positive span ``K``, task state. One turnstile round is

    PreDRendezvous -> every rank enqueues one D iteration, same order -> PostDRendezvous
    -> post_d(): p <- p + K  (active ranks; idle/completed ranks take the matched no-op path)

Rules (each violation raises ``TurnstileError`` naming rank, epoch and boundary -- never a hang):
  * ``begin``: p = 0 initially so ready D enters the device before P (D goes first); p = K when
    D is already enqueued. Stale or duplicate epochs (e <= last epoch) are rejected, and so is an
    epoch begun while another is active or without a registered boundary producer.
  * ``publish``: exactly one producer (the backend that registered) may publish; boundary ids of
    an epoch are strictly increasing from 0 (non-monotone or skipped ids are rejected); a
    boundary beyond the permit is rejected (P ran past its endpoint).
  * ``complete``: the final segment reports completion at the last published boundary.

Boundary semantics: boundary i is the point just before the epoch's i-th registered collective.
Reaching i == p means P must stop there until the next post-D permit; i < p may be crossed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class TurnstileError(RuntimeError):
    """A turnstile protocol violation (raised on the rank that detects it)."""


class TaskState(str, Enum):
    IDLE = "idle"  # no P epoch on this rank (never started, or the last one completed)
    ACTIVE = "active"  # a P epoch is in flight


@dataclass(frozen=True)
class Event:
    kind: str  # "begin" | "publish" | "post_d" | "complete"
    epoch: int
    boundary: int  # reached boundary (begin: -1), or the new permit for post_d


@dataclass
class TurnstileController:
    rank: int = 0
    record: bool = False  # keep an event log (stress tests compare logs across ranks)
    producer: str | None = None
    epoch: int = -1
    reached: int = -1
    permit: int = 0
    span: int = 1
    state: TaskState = TaskState.IDLE
    log: list[Event] = field(default_factory=list)

    # ------------------------------------------------------------------ set-up
    def register_producer(self, name: str) -> None:
        """The one backend that publishes boundaries (gather: layer points; dispatch: post-
        notification). Registering a second, different producer is an error."""
        if self.producer is not None and self.producer != name:
            raise self._error(f"boundary producer {name!r} registered while {self.producer!r} "
                              "already publishes; exactly one producer per rank")
        self.producer = name

    def set_span(self, span: int) -> None:
        if not isinstance(span, int) or isinstance(span, bool) or span < 1:
            raise self._error(f"span must be an int >= 1, got {span!r}")
        self.span = span

    # ------------------------------------------------------------------ epoch lifecycle
    def begin(self, epoch: int, *, d_enqueued: bool, span: int | None = None) -> int:
        """Start P epoch ``epoch``; returns the initial permit (0, or K if D is enqueued)."""
        if self.producer is None:
            raise self._error(f"epoch {epoch} begun with no registered boundary producer",
                              epoch)
        if self.state is TaskState.ACTIVE:
            raise self._error(f"epoch {epoch} begun while epoch {self.epoch} is still active",
                              epoch)
        if epoch <= self.epoch:
            what = "duplicate" if epoch == self.epoch else "stale"
            raise self._error(f"{what} epoch {epoch} (last epoch was {self.epoch})", epoch)
        if span is not None:
            self.set_span(span)
        self.epoch, self.reached, self.state = epoch, -1, TaskState.ACTIVE
        self.permit = self.span if d_enqueued else 0
        self._note("begin", -1)
        return self.permit

    def publish(self, epoch: int, boundary: int, producer: str) -> bool:
        """P reached ``boundary``. Returns True when P must stop here (boundary == permit)."""
        if producer != self.producer:
            who = "no producer is registered" if self.producer is None else \
                f"the registered producer is {self.producer!r}"
            raise self._error(f"boundary {boundary} published by {producer!r}, but {who}",
                              epoch, boundary)
        if self.state is not TaskState.ACTIVE or epoch != self.epoch:
            raise self._error(f"boundary {boundary} of stale epoch {epoch} (active: "
                              f"{self.epoch if self.state is TaskState.ACTIVE else 'none'})",
                              epoch, boundary)
        if boundary != self.reached + 1:
            raise self._error(f"non-monotone boundary {boundary} after {self.reached} "
                              "(ids must increase by one)", epoch, boundary)
        if boundary > self.permit:
            raise self._error(f"boundary {boundary} is beyond the permit {self.permit}",
                              epoch, boundary)
        self.reached = boundary
        self._note("publish", boundary)
        return boundary == self.permit

    def may_cross(self, boundary: int) -> bool:
        """Whether P may issue the collective after ``boundary`` now."""
        return self.state is TaskState.ACTIVE and boundary < self.permit

    def post_d(self) -> int:
        """After PostDRendezvous: active ranks extend the permit by K; idle ranks no-op."""
        if self.state is TaskState.ACTIVE:
            self.permit += self.span
            self._note("post_d", self.permit)
        return self.permit

    def complete(self, epoch: int) -> None:
        """The final segment of ``epoch`` finished issuing its work."""
        if self.state is not TaskState.ACTIVE or epoch != self.epoch:
            raise self._error(f"completion of epoch {epoch}, which is not active", epoch)
        self.state = TaskState.IDLE
        self._note("complete", self.reached)

    # ------------------------------------------------------------------ views
    @property
    def active(self) -> bool:
        return self.state is TaskState.ACTIVE

    @property
    def at_endpoint(self) -> bool:
        """P is parked at its permitted endpoint and needs a D round to go on."""
        return self.active and self.reached == self.permit

    def _note(self, kind: str, boundary: int) -> None:
        if self.record:
            self.log.append(Event(kind, self.epoch, boundary))

    def _error(self, msg: str, epoch: int | None = None, boundary: int | None = None):
        e = self.epoch if epoch is None else epoch
        b = self.reached if boundary is None else boundary
        return TurnstileError(f"rank {self.rank}, epoch {e}, boundary {b}: {msg}")
