"""Request lifecycle and KV ownership of every replica: the replicated engine state.

Every rank holds an identical ``Scheduler`` (all replicas, not only its own) and feeds it the
same inputs in the same order -- intake messages and sampled tokens, agreed by the control
plane -- so planning needs no further communication.

Lifecycle: WAITING --admit--> PREFILL (lifetime id, KV reserved for prompt+max_tokens)
--first token--> DECODE --EOS / max_tokens / cancel--> finished (KV freed).
With ``engine.kv_reservation: on_demand`` admission reserves the tokens P writes and each D
row's blocks grow with it before each plan; a replica out of blocks drops idle retained
contexts, then preempts the running row that arrived last (DECODE --preempt--> WAITING at the
queue's front, its KV freed; admitted again, it prefills its prompt and its tokens so far and
its output continues -- vLLM's recompute preemption). A prefill is not split over steps, so a
request whose whole budget (context + prompt + max_tokens) one P step could not prefill again
(engine.max_prefill_tokens) takes that budget at admission, as full reservations do, and is
never preempted; the rest grow and may be preempted. Such whole-budget rows always progress,
and of the others the one that arrived first is preempted only when it alone cannot grow.
A result is applied only if the KV blocks still belong to the lifetime that produced it
(``KVCacheManager.owns``): a stale result from a cancelled lifetime is discarded.

PD mode: a P epoch spans several rounds. Its sequences are PREFILLING (admitted, no token yet);
cancelling one retires its blocks (they drain) until the epoch's work is done, then they are
released -- never reused while P may still write them.

Pure Python: no torch, no torch.distributed.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from colo_rollout.config import EngineConfig
from colo_rollout.sched.kv_cache import KVCacheManager
from colo_rollout.sched.plan import (
    DecodeRow,
    Phase,
    PrefillItem,
    ReplicaWork,
    Sampled,
    StepPlan,
)
from colo_rollout.sched.planner import (
    Admission,
    PlannerLimits,
    ReplicaView,
    WaitingView,
    admission_window,
    admits,
    plan_normal,
    plan_round,
)
from colo_rollout.sched.request import (
    FinishReason,
    Request,
    RequestError,
    RequestOutput,
    checked_request,
)


# the most cancel-ended session ids remembered (scheduler.ended)
MAX_ENDED = 100_000


@dataclass
class _Seq:
    """A request admitted to a replica."""

    request: Request
    replica: int
    lifetime: int
    length: int  # tokens in the KV cache after the last completed forward
    last_token: int | None = None  # input of the next D step
    draft: int = -1  # engine.mtp: the MTP layer's draft of the token after last_token
    context_before: list[int] | None = None  # trajectory context before this turn (sessions)
    p_blocks: tuple[int, ...] = ()  # the reservation P writes into (checked at promotion)
    # engine.kv_reservation on_demand: its blocks grow with it and it may be preempted (else
    # it holds its whole budget: Scheduler._whole_budget, decided at admission)
    grows: bool = False


@dataclass
class _Session:
    """A trajectory between turns. While ``lifetime`` is set its context is cached: the KV
    owner ``lifetime`` on ``replica`` holds the first ``cached`` tokens of ``context`` (all but
    the last output token, which the next turn prefills)."""

    context: list[int]
    replica: int | None = None
    lifetime: int | None = None
    cached: int = 0
    busy: bool = True  # a turn is waiting or running
    last_used: int = 0  # step of the last finished turn (LRU eviction)


class Scheduler:
    def __init__(self, cfg: EngineConfig, num_replicas: int, atp: int, vocab_size: int) -> None:
        self.cfg = cfg
        self.vocab_size = vocab_size
        # the ids that end a sequence: the eos id and any further stop ids
        self._stop_ids = frozenset(cfg.stop_token_ids) | (
            frozenset() if cfg.eos_token_id is None else {cfg.eos_token_id})
        self.kv = [KVCacheManager(cfg.num_kv_blocks, cfg.kv_block_size)
                   for _ in range(num_replicas)]
        self.limits = PlannerLimits(cfg.max_batch_size, cfg.max_prefill_tokens,
                                    tuple(cfg.decode_buckets), atp)
        self.waiting: deque[Request] = deque()
        self._prompt_ids: dict[str, np.ndarray] = {}  # waiting requests' prompts as int64
        self.seqs: dict[int, _Seq] = {}  # lifetime -> admitted sequence
        self.by_id: dict[str, RequestOutput] = {}  # every known request id (incl. finished)
        self.live: dict[str, int | None] = {}  # unfinished request id -> lifetime (None: waiting)
        self.step_no = 0
        self.next_lifetime = 0
        # PD mode: the plan that started the in-flight P epoch (None: no epoch), and lifetimes
        # cancelled while it runs -- their blocks drain until the epoch's work is done.
        self.epoch: StepPlan | None = None
        self.retired: set[int] = set()
        self.sessions: dict[str, _Session] = {}
        # sessions a cancel ended (their context dropped): a later turn under the id would be
        # served as a new conversation without a word -- refused until close_session(id)
        # acknowledges the end (bounded: the oldest are forgotten past MAX_ENDED)
        self.ended: dict[str, str] = {}
        self.evictions = 0  # retained trajectory contexts dropped for capacity (re-prefilled)
        # engine.mtp: D rows that verified a draft, and how many of those drafts were accepted
        self.drafts_verified = 0
        self.drafts_accepted = 0
        # engine.kv_reservation on_demand: blocks as tokens need them, preemption past them
        self.on_demand = cfg.kv_reservation == "on_demand"
        self.preemptions = 0  # running rows preempted (their tokens prefilled again)
        self._arrival: dict[str, int] = {}  # unfinished request id -> its arrival order
        self._arrivals = itertools.count()
        self._resumed: dict[str, tuple[int, ...]] = {}  # preempted, waiting: tokens so far

    # ------------------------------------------------------------------ intake
    def validate(self, req: Request, closing: Iterable[str] = ()) -> None:
        """Raise RequestError if ``req`` can never be served. Same answer on every rank.
        Types first (request.checked_request: a str id, integral token ids), so a wrong type
        is a RequestError too, never a TypeError. ``closing``: sessions a close is pending
        for (the next step applies closes before submits): a turn of one starts a new
        conversation (found by probing: it was checked against the closed context)."""
        self._checked(req, frozenset(closing))

    def _checked(self, req: Request,
                 closing: frozenset = frozenset()) -> tuple[Request, np.ndarray]:
        """``validate``'s checks; returns the checked request (its prompt a tuple of Python
        ints) and its prompt as an int64 array."""
        req = checked_request(req)
        rid = req.request_id
        if rid in self.by_id:
            raise RequestError(f"request {rid!r}: duplicate request id")
        req.params.validate(rid, self.vocab_size)
        n = len(req.prompt)
        if n == 0:
            raise RequestError(f"request {rid!r}: empty prompt")
        ids = _prompt_ids(req.prompt)
        if ids is None:  # an id past int64: outside any vocabulary
            bad = [t for t in req.prompt if not 0 <= t < self.vocab_size]
        else:
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][:1].tolist()
        if bad:
            raise RequestError(
                f"request {rid!r}: token id {bad[0]!r} outside the vocabulary [0, {self.vocab_size})")
        cfg = self.cfg
        # request ids and session ids share one namespace: the routing record and the outputs
        # are keyed by the session where there is one, else by the request id
        if req.session is None and rid in self.sessions:
            raise RequestError(f"request {rid!r}: its id is a session's (a request without a "
                               "session needs an id no session has)")
        if req.session is not None and req.session != rid and req.session in self.live:
            raise RequestError(f"request {rid!r}: session {req.session!r} is the id of a "
                               "request in flight")
        fresh = req.session is None or req.session in closing
        sess = None if fresh else self.sessions.get(req.session)
        if sess is None and not fresh and req.session in self.ended:
            raise RequestError(f"request {rid!r}: session {req.session!r} was ended by the "
                               f"cancel of {self.ended[req.session]!r} (its context is gone); "
                               "close_session() it to reuse the id, or start a new session")
        if sess is not None and sess.busy:
            raise RequestError(f"request {rid!r}: session {req.session!r} already has a turn "
                               "waiting or running")
        ctx = len(sess.context) if sess is not None else 0
        budget = ctx + n + req.params.max_tokens
        if budget > cfg.max_seq_len:
            raise RequestError(
                f"request {rid!r}: context ({ctx}) + prompt ({n}) + max_tokens "
                f"({req.params.max_tokens}) = {budget} exceeds engine.max_seq_len "
                f"{cfg.max_seq_len}" if ctx else
                f"request {rid!r}: prompt ({n}) + max_tokens ({req.params.max_tokens}) = {budget} "
                f"exceeds engine.max_seq_len {cfg.max_seq_len}")
        # the largest P this request may need: a re-prefill of the whole context after eviction
        if ctx + n > cfg.max_prefill_tokens:
            raise RequestError(
                f"request {rid!r}: prompt of {ctx + n} tokens"
                + (f" (with its session's context of {ctx})" if ctx else "")
                + f" exceeds engine.max_prefill_tokens {cfg.max_prefill_tokens}")
        if self.kv[0].blocks_needed(budget) > cfg.num_kv_blocks:
            raise RequestError(
                f"request {rid!r}: needs {self.kv[0].blocks_needed(budget)} KV blocks, a replica "
                f"has {cfg.num_kv_blocks}")
        return req, ids

    def add(self, req: Request, now: float = 0.0) -> None:
        req, ids = self._checked(req)
        # the prompt as the P step's ids, converted here once (PrefillItem.ids); dropped at
        # admission or cancel
        self._prompt_ids[req.request_id] = ids
        self.waiting.append(req)
        self.by_id[req.request_id] = RequestOutput(req.request_id, len(req.prompt),
                                                   submit_time=now)
        self.live[req.request_id] = None
        self._arrival[req.request_id] = next(self._arrivals)
        if req.session is not None:
            self.sessions.setdefault(req.session, _Session(context=[])).busy = True

    def forget(self, request_ids) -> None:
        """Drop these finished requests' outputs (the caller has them): the engine's memory of
        finished requests stays bounded over a long run (an RL job submits millions), and
        their ids may be used again. Requests still in flight are kept. Deterministic: every
        rank forgets the same ids at the same point."""
        for rid in request_ids:
            out = self.by_id.get(rid)
            if out is not None and out.finished and rid not in self.live:
                del self.by_id[rid]

    def cancel(self, request_id: str, now: float = 0.0) -> RequestOutput:
        """Cancel a waiting or running request at a step boundary; its KV is freed at once
        in Normal mode: P work still in flight there (a P step read one step late,
        engine.overlap_prefill) is on the one stream that any later writer of these blocks
        queues behind."""
        if request_id not in self.live:
            state = "already finished" if request_id in self.by_id else "unknown"
            raise RequestError(f"cancel of request {request_id!r}: {state} request id")
        lifetime = self.live.pop(request_id)
        self._arrival.pop(request_id, None)
        self._resumed.pop(request_id, None)
        out = self.by_id[request_id]
        if lifetime is None:
            session = next(r.session for r in self.waiting if r.request_id == request_id)
            self.waiting = deque(r for r in self.waiting if r.request_id != request_id)
            self._prompt_ids.pop(request_id, None)
        else:
            seq = self.seqs.pop(lifetime)
            session = seq.request.session
            if self._in_epoch(lifetime):
                # P work writing these blocks may still be running: they are retired and only
                # reused once the epoch is done (release in commit)
                self.kv[seq.replica].retire(lifetime)
                self.retired.add(lifetime)
            else:
                self.kv[seq.replica].free(lifetime)
        out.finish_reason = FinishReason.CANCELLED
        out.finish_time = now
        if session is not None:  # a cancelled turn ends its trajectory
            self._drop_session(session)
            self.ended[session] = request_id
            if len(self.ended) > MAX_ENDED:
                del self.ended[next(iter(self.ended))]
        return out

    def abandon(self, reason: str, now: float = 0.0) -> list[RequestOutput]:
        """Finish every request in flight as CANCELLED with ``reason`` as its error: the
        engine is closing and no step will serve them (each is ended as ``cancel`` ends it,
        its session with it)."""
        outs = []
        for rid in list(self.live):
            out = self.cancel(rid, now)
            out.error = reason
            outs.append(out)
        return outs

    def close_session(self, session: str) -> None:
        """Forget a finished trajectory and free its retained context (or acknowledge the end
        of one a cancel ended: its id may be used again)."""
        if self.ended.pop(session, None) is not None and session not in self.sessions:
            return
        sess = self.sessions.get(session)
        if sess is None:
            raise RequestError(f"close of unknown session {session!r}")
        if sess.busy:
            raise RequestError(f"close of session {session!r} while a turn is in flight")
        self._drop_session(session)

    def _drop_session(self, session: str) -> None:
        sess = self.sessions.pop(session)
        # a retained (idle) context still owns its blocks; a cancelled turn's blocks were
        # already freed or retired by cancel()
        if sess.lifetime is not None and sess.lifetime not in self.seqs \
                and sess.lifetime in self.kv[sess.replica].owners():
            self.kv[sess.replica].free(sess.lifetime)

    # ------------------------------------------------------------------ planning
    def has_work(self) -> bool:
        return bool(self.waiting or self.seqs)

    def idle_sessions(self) -> list[str]:
        return sorted(sid for sid, s in self.sessions.items() if not s.busy)

    def _in_epoch(self, lifetime: int) -> bool:
        return self.epoch is not None and any(
            p.lifetime == lifetime for w in self.epoch.replicas for p in w.prefill)

    def _views(self) -> list[ReplicaView]:
        views = []
        for i, kv in enumerate(self.kv):
            mine = [s for s in self.seqs.values() if s.replica == i]
            running = [DecodeRow(s.lifetime, s.last_token, s.length, draft=s.draft)
                       for s in mine if s.last_token is not None]
            # (Normal with engine.overlap_prefill: a P step's sequences until its tokens are
            # committed; PD: none -- an epoch is admitted only when none is in flight)
            views.append(ReplicaView(running=running, free_blocks=self._admissible_blocks(i),
                                     block_size=kv.block_size,
                                     awaiting=len(mine) - len(running)))
        return views

    def _admissible_blocks(self, replica: int) -> int:
        """The free blocks a new admission may take on ``replica``: all of them with full
        reservations; on demand, all but one per admitted sequence there that grows (each
        one's next block), so an admission does not preempt a running row at once."""
        free = self.kv[replica].num_free_blocks()
        if not self.on_demand:
            return free
        return max(0, free - sum(1 for s in self.seqs.values()
                                 if s.replica == replica and s.grows))

    def head_admissible(self) -> bool:
        """Whether the next plan could admit the waiting queue's head as things stand (no
        commit in between): a replica with a free batch row and the head's KV blocks free or
        held by retained contexts no sequence uses (``plan`` evicts those). The engine reads a
        P step one step late only then (engine.overlap_prefill): with the head blocked the
        next step would be no P, and the late sequences would miss it."""
        if not self.waiting:
            return False
        views = self._views()
        head = self.waiting[0]
        for _, sid in self._idle_contexts():  # what plan's evictions could free
            sess = self.sessions[sid]
            if sid != head.session:
                views[sess.replica].free_blocks += len(
                    self.kv[sess.replica].block_table(sess.lifetime))
        return admits(self._waiting_view(head), views, self.limits)

    def plan(self, pd: bool = False) -> StepPlan:
        """Normal mode: a PREFILL or DECODE step. PD mode (``pd``): a ROUND with every ready D
        row and, if no P epoch is in flight, a new epoch's P items."""
        if self.on_demand:
            self._grow_running()
        views = self._views()
        # only the queue's first requests a plan can admit are viewed (planner.
        # admission_window: found by probing, a million queued requests made every step
        # rebuild a million views)
        window = admission_window(views, self.limits)
        # retained trajectory contexts are evicted only when the FIFO head lacks KV blocks
        for _ in range(len(self.sessions) + 1):
            waiting = [self._waiting_view(r) for r in itertools.islice(self.waiting, window)]
            if not waiting or not self._blocked_by_kv(waiting[0], views):
                break
            if not self._evict_lru(views, keep=self.waiting[0].session):
                break
        if pd:
            plan, admissions = plan_round(self.step_no, waiting, views, self.limits,
                                          self.next_lifetime, admit=self.epoch is None)
        else:
            plan, admissions = plan_normal(self.step_no, waiting, views, self.limits,
                                           self.next_lifetime)
        for adm in admissions:
            self._admit(adm)
        plan = self._self_contained(plan)
        if pd and plan.has_prefill:
            self.epoch = plan
        self.step_no += 1
        return plan

    def _self_contained(self, plan: StepPlan) -> StepPlan:
        """``plan`` with every item's block table and sampling parameters, and the longest D
        table: all the runner reads (plan.py)."""
        reps = []
        for r, w in enumerate(plan.replicas):
            kv = self.kv[r]
            reps.append(ReplicaWork(
                prefill=tuple(replace(p, table=tuple(kv.block_table(p.lifetime)),
                                      params=self.seqs[p.lifetime].request.params)
                              for p in w.prefill),
                decode=tuple(replace(d, table=tuple(kv.block_table(d.lifetime)),
                                     params=self.seqs[d.lifetime].request.params)
                             for d in w.decode)))
        width = max((len(d.table) for w in reps for d in w.decode), default=1)
        return replace(plan, replicas=tuple(reps), table_blocks=width)

    def _waiting_view(self, req: Request) -> WaitingView:
        sess = self.sessions.get(req.session) if req.session is not None else None
        # a preempted request (on demand) prefills its tokens so far after its prompt
        done = self._resumed.get(req.request_id, ())
        prompt = req.prompt + done if done else req.prompt
        prompt_ids = None if done else self._prompt_ids.get(req.request_id)
        # what the reservation holds: the whole budget, or (on demand) what P writes
        budget = len(req.prompt) + req.params.max_tokens
        lazy = self.on_demand and not self._whole_budget(req)
        if sess is None or not sess.context:
            return WaitingView(req.request_id, prompt, len(prompt) if lazy else budget,
                               ids=prompt_ids)
        if sess.lifetime is None:  # evicted: re-prefill the whole context from its tokens
            tokens = tuple(sess.context) + prompt
            return WaitingView(req.request_id, tokens, len(tokens) if lazy
                               else len(sess.context) + budget)
        # retained: prefill the last output token and the new tokens on top of the cache (the
        # ids: that short tail converted here, the prompt's from submit)
        tail = sess.context[sess.cached:]
        tokens = tuple(tail) + prompt
        ids = (None if prompt_ids is None else
               np.concatenate((np.array(tail, dtype=np.int64), prompt_ids)))
        return WaitingView(req.request_id, tokens,
                           sess.cached + len(tokens) if lazy
                           else len(sess.context) + budget,
                           start=sess.cached, replica=sess.replica, lifetime=sess.lifetime,
                           held_blocks=len(self.kv[sess.replica].block_table(sess.lifetime)),
                           ids=ids)

    def _blocked_by_kv(self, w: WaitingView, views: list[ReplicaView]) -> bool:
        cands = [w.replica] if w.replica is not None else range(len(views))
        return all(views[i].blocks_for(w.budget_tokens) - w.held_blocks > views[i].free_blocks
                   for i in cands)

    def _idle_contexts(self) -> list[tuple[int, str]]:
        """(last used step, session id) of each retained context no running sequence uses --
        what eviction may drop -- least recently used first."""
        return sorted((s.last_used, sid) for sid, s in self.sessions.items()
                      if s.lifetime is not None and s.lifetime not in self.seqs)

    def _grow_running(self) -> None:
        """engine.kv_reservation on_demand, before a plan: every running row's blocks grown
        to hold what its next D step writes (its input token, and its draft's position with
        MTP). Rows are served in arrival order; a replica short of blocks drops an idle
        retained context of its own, else preempts its running row that arrived last (the
        row being grown, if it is that one). Preempted requests go to the queue's front in
        arrival order. Running rows only: a P item's work may be in flight (PD's epoch,
        Normal's step read late), a D row's is done when the next plan is made (as
        ``cancel`` frees them)."""
        preempted: list[Request] = []
        # the rows whose blocks do not hold their next step (one in block_size steps each):
        # the rest need nothing (a plan's host time, every step)
        short: list[list[tuple[_Seq, int]]] = [[] for _ in self.kv]
        for seq in self.seqs.values():
            if seq.last_token is not None:
                need = self._next_need(seq)
                if need > self.kv[seq.replica].capacity(seq.lifetime):
                    short[seq.replica].append((seq, need))
        for r, kv in enumerate(self.kv):
            for seq, need in sorted(short[r], key=lambda x: self._arrived(x[0])):
                if seq.lifetime not in self.seqs:  # preempted for a row before it
                    continue
                while not kv.can_grow(seq.lifetime, need):
                    if self._evict_lru_on(r):
                        continue
                    victims = [s for s in self.seqs.values()
                               if s.replica == r and s.last_token is not None and s.grows]
                    if not victims:  # (cannot be: seq itself is one -- a whole-budget row
                        # never needs a block)
                        raise RuntimeError(f"lifetime {seq.lifetime}: no KV block to grow "
                                           "into and no row that can be preempted")
                    victim = max(victims, key=self._arrived)
                    self._preempt(victim)
                    preempted.append(victim.request)
                    if victim is seq:
                        break
                else:
                    kv.grow(seq.lifetime, need)
        self.waiting.extendleft(sorted(preempted, key=self._arrived_request, reverse=True))

    def _whole_budget(self, req: Request) -> bool:
        """On demand: whether ``req`` takes its whole budget at admission -- one P step
        (engine.max_prefill_tokens; P is not split over steps) could not prefill its context,
        prompt and every token it may generate again, so it must never be preempted, and so
        never need a block it was not given. (Its context is its session's, fixed while the
        turn is in flight.)"""
        sess = self.sessions.get(req.session) if req.session is not None else None
        ctx = len(sess.context) if sess is not None else 0
        return ctx + len(req.prompt) + req.params.max_tokens > self.cfg.max_prefill_tokens

    def _next_need(self, seq: _Seq) -> int:
        """The tokens ``seq``'s blocks must hold for its next D step: its input token and, with
        a draft, the draft's position (a whole-budget row holds them already)."""
        return seq.length + 1 + (seq.draft >= 0)

    def _arrived(self, seq: _Seq) -> int:
        return self._arrival[seq.request.request_id]

    def _arrived_request(self, req: Request) -> int:
        return self._arrival[req.request_id]

    def _preempt(self, seq: _Seq) -> None:
        """A running row back to waiting (the caller queues it): its blocks freed, its
        tokens so far kept for the prefill that resumes it; a session's context it held is
        dropped with it (the resumed turn prefills the whole context)."""
        rid = seq.request.request_id
        del self.seqs[seq.lifetime]
        self.kv[seq.replica].free(seq.lifetime)
        self.live[rid] = None
        self._resumed[rid] = tuple(self.by_id[rid].tokens)
        sess = self.sessions.get(seq.request.session) if seq.request.session else None
        if sess is not None and sess.lifetime == seq.lifetime:
            sess.lifetime = sess.replica = None
            sess.cached = 0
        self.preemptions += 1

    def _evict_lru_on(self, replica: int) -> bool:
        """Drop the least recently used retained context on ``replica`` that no running
        request uses; False when there is none."""
        idle = [sid for _, sid in self._idle_contexts()
                if self.sessions[sid].replica == replica]
        if not idle:
            return False
        self._evict(self.sessions[idle[0]])
        return True

    def _evict(self, sess: _Session) -> int:
        """Free a retained context's blocks (its next turn re-prefills it); returns the
        replica that held them."""
        replica = sess.replica
        self.kv[replica].free(sess.lifetime)
        sess.lifetime = sess.replica = None
        sess.cached = 0
        self.evictions += 1
        return replica

    def _evict_lru(self, views: list[ReplicaView], keep: str | None) -> bool:
        """Drop the least recently used retained context that no running request uses (other
        than ``keep``'s if any other exists); returns False when there is none. A session
        whose next turn waits is evictable too: that turn re-prefills its context (with only
        idle sessions evictable, the waiting turns of two sessions could each hold the blocks
        the other needs, and the engine stepped idle for ever)."""
        idle = self._idle_contexts()
        others = [x for x in idle if x[1] != keep]
        pick = (others or idle)
        if not pick:
            return False
        replica = self._evict(self.sessions[pick[0][1]])
        views[replica].free_blocks = self._admissible_blocks(replica)
        return True

    def idle_session_state(self) -> tuple[dict[str, list[int]], dict[str, str]]:
        """Every session's context and the ends a cancel left (``ended``), for the engine a
        worker is handed to (``adopt_sessions``). Idle scheduler only: no turn in flight."""
        busy = [sid for sid, s in self.sessions.items() if s.busy]
        if busy:
            raise RuntimeError(f"sessions {busy[:3]} have a turn in flight")
        return {sid: list(s.context) for sid, s in self.sessions.items()}, dict(self.ended)

    def adopt_sessions(self, contexts: Mapping[str, list[int]], ended: Mapping[str, str]) -> None:
        """Take another scheduler's sessions (``idle_session_state``), uncached: each one's
        next turn prefills its whole context into this scheduler's KV."""
        for sid, context in contexts.items():
            self.sessions[sid] = _Session(context=list(context), busy=False)
        self.ended.update(ended)

    def evict_retained(self) -> int:
        """Drop every idle retained context (their next turn re-prefills); returns how many.
        For a KV release between phases: no retained block may outlive the storage."""
        n = 0
        for sess in self.sessions.values():
            if not sess.busy and sess.lifetime is not None:
                self.kv[sess.replica].free(sess.lifetime)
                sess.lifetime = sess.replica = None
                sess.cached = 0
                n += 1
        return n

    def _admit(self, adm: Admission) -> None:
        req = self.waiting.popleft()
        assert req.request_id == adm.request_id, "planner admits in FIFO order"
        self._prompt_ids.pop(req.request_id, None)
        sess = self.sessions.get(req.session) if req.session is not None else None
        context = list(sess.context) if sess is not None else []
        total = len(context) + len(req.prompt) + req.params.max_tokens
        grows = self.on_demand and not self._whole_budget(req)
        if grows:  # what P writes: the context, the prompt, any tokens so far
            total = len(context) + len(req.prompt) + len(self._resumed.pop(req.request_id, ()))
        if adm.new:
            self.kv[adm.replica].reserve(adm.lifetime, total)
            start = 0
            self.next_lifetime = adm.lifetime + 1
        else:  # a retained context grows by this turn's prompt and output budget
            self.kv[adm.replica].grow(adm.lifetime, total)
            start = sess.cached
        self.seqs[adm.lifetime] = _Seq(
            req, adm.replica, adm.lifetime, length=start,
            context_before=context if sess is not None else None,
            p_blocks=tuple(self.kv[adm.replica].block_table(adm.lifetime)), grows=grows)
        if sess is not None:
            sess.lifetime, sess.replica = adm.lifetime, adm.replica
        self.live[req.request_id] = adm.lifetime
        self.by_id[req.request_id].replica = adm.replica

    def block_table(self, replica: int, lifetime: int) -> list[int]:
        return self.kv[replica].block_table(lifetime)

    # ------------------------------------------------------------------ results
    def commit(self, plan: StepPlan | None, sampled: list[Sampled], now: float = 0.0,
               epoch_done: StepPlan | None = None) -> list[RequestOutput]:
        """Apply the agreed sampled tokens: D rows of ``plan`` (or its P items for a Normal
        PREFILL step) and, when a PD epoch finished, the P items of ``epoch_done`` (promotion
        P -> D). Returns the requests finished by them."""
        by_lt = {s.lifetime: s for s in sampled}
        finished: list[RequestOutput] = []
        if plan is not None:
            for r, work in enumerate(plan.replicas):
                items = work.prefill if plan.phase is Phase.PREFILL else work.decode
                for item in items:
                    self._apply(plan.step, r, item, by_lt, now, finished)
        if epoch_done is not None:
            for r, work in enumerate(epoch_done.replicas):
                for item in work.prefill:
                    if item.lifetime in self.retired:  # cancelled mid-P: its work has drained
                        self.kv[r].release_drained(item.lifetime)
                        self.retired.discard(item.lifetime)
                        continue
                    self._apply(epoch_done.step, r, item, by_lt, now, finished)
            self.epoch = None
        return finished

    def _apply(self, step: int, r: int, item, by_lt: dict, now: float,
               finished: list[RequestOutput]) -> None:
        seq = self.seqs.get(item.lifetime)
        if seq is None:
            return  # stale: the lifetime was cancelled while its work ran
        if isinstance(item, PrefillItem) and not self.kv[r].owns(item.lifetime,
                                                                 list(seq.p_blocks)):
            # promotion P -> D: the blocks P wrote must still belong to this lifetime
            raise RuntimeError(f"step {step}: lifetime {item.lifetime} lost its KV reservation")
        s = by_lt.get(item.lifetime)
        if s is None:
            raise RuntimeError(f"step {step}: no sampled token for lifetime {item.lifetime}")
        out = self.by_id[seq.request.request_id]
        if out.first_token_time is None:
            out.first_token_time = now
        if isinstance(item, DecodeRow) and item.draft >= 0:
            self.drafts_verified += 1
            self.drafts_accepted += len(s.more)
        # the forward wrote the KV of the item's tokens (P) or of its input token (D) and,
        # for each accepted draft, of the draft's position: one position per token emitted.
        # Tokens after a stop are dropped (their KV, if written, is never counted).
        seq.length += len(item.tokens) - 1 if isinstance(item, PrefillItem) else 0
        for token, logprob in ((s.token, s.logprob), *s.more):
            if logprob != logprob:  # NaN: the logits were not finite -- NaN or inf weights
                # (a sync of a diverged trainer, weights never written): never served as a
                # token; the request ends with the reason, the engine serves the rest
                out.error = (f"request {seq.request.request_id!r}: the model's logits are not "
                             f"finite at output token {len(out.tokens)} (NaN or inf weights?)")
                self._finish(seq, out, FinishReason.ERROR, now)
                finished.append(out)
                return
            seq.length += 1
            out.tokens.append(token)
            out.logprobs.append(logprob)
            seq.last_token = token
            reason = self._stop_reason(seq, out)
            if reason is not None:
                self._finish(seq, out, reason, now)
                finished.append(out)
                return
        seq.draft = s.draft

    def _stop_reason(self, seq: _Seq, out: RequestOutput) -> FinishReason | None:
        p = seq.request.params
        if not p.ignore_eos and out.tokens[-1] in self._stop_ids:
            return FinishReason.STOP
        if len(out.tokens) >= p.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: _Seq, out: RequestOutput, reason: FinishReason, now: float) -> None:
        sess = self.sessions.get(seq.request.session) if seq.request.session else None
        if sess is not None:  # keep the context cached for the next turn (until evicted)
            sess.context = seq.context_before + list(seq.request.prompt) + out.tokens
            sess.cached = seq.length  # every token but the last output is in the cache
            sess.busy = False
            sess.last_used = self.step_no
        else:
            self.kv[seq.replica].free(seq.lifetime)
        del self.seqs[seq.lifetime]
        del self.live[seq.request.request_id]
        self._arrival.pop(seq.request.request_id, None)
        out.finish_reason = reason
        out.finish_time = now

    def check_integrity(self) -> None:
        for kv in self.kv:
            kv.check_integrity()
        owners = {lt for kv in self.kv for lt in kv.owners()}
        retained = {s.lifetime for s in self.sessions.values() if s.lifetime is not None}
        if owners != set(self.seqs) | retained:
            raise AssertionError(f"KV owners {sorted(owners)} != admitted {sorted(self.seqs)} "
                                 f"+ retained contexts {sorted(retained)}")
        draining = {lt for kv in self.kv for lt in kv.draining()}
        if draining != self.retired:
            raise AssertionError(f"KV draining {sorted(draining)} != retired {sorted(self.retired)}")


def _prompt_ids(prompt) -> np.ndarray | None:
    """A checked prompt (Python ints) as int64, or None where an id does not fit."""
    try:
        return np.fromiter(prompt, dtype=np.int64, count=len(prompt))
    except OverflowError:
        return None
