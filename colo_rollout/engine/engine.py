"""The engine: a serving session over a worker, stepped collectively. In-process Python API.

Owns the composition of control plane, scheduler, strategy and recorder for one rank, and the
user-facing calls: ``submit``/``cancel`` (any rank, non-collective), ``step`` and ``generate``
(collective: every rank of the world calls them together). The device state (model, KV
storage, graphs, memory) is the worker's (worker/worker.py).

One step, on every rank (``_step``):
  1. exchange: every rank's new submissions/cancels and the replica leaders' sampled tokens of
     the previous step are all-gathered on the control group (the only host agreement);
  2. apply: commit the previous step's tokens, then intake in rank order (so every rank's
     scheduler sees identical inputs and stays identical);
  3. schedule: the scheduler's self-contained ``StepPlan``;
  4. strategy.run: the mode's round (engine/strategy.py) enqueues the plan's phases -- every
     rank runs them, replicas without work run matched empty/padded work so collectives match;
  5. collect: wait (bounded) for this step's sampled tokens, kept for the next exchange;
  6. record: the step's statistics (engine/recorder.py).

Normal mode with engine.overlap_prefill: a P step while the waiting queue's head could be
admitted next (``Scheduler.head_admissible``) is not waited for in its own step (5.): its
tokens are read in the next step's collect, after that step's work is
enqueued -- the host plans and enqueues P step N + 1 while P step N's kernels run, so the GPU
does not idle through each P step's host head. Its tokens go out with the next step's and both
plans commit at the exchange after (in plan order; their lifetimes are disjoint: a sequence
awaiting its first token is in no plan until then, and its batch row is held meanwhile --
``ReplicaView.awaiting``). Every rank decides alike (the plan and the waiting queue are
replicated state); P and D share the default stream there, so a cancelled sequence's blocks,
reused by the next P, are written in stream order.

PD mode: a P epoch's first tokens are not waited for. When its host enqueue completes, the
epoch awaits commit; each rank sends its P tokens (``Message.p_sampled``) at the first step end
at which its own P GPU work is done, and every rank commits the epoch (promotion P -> D) at the
step whose exchange completes the set -- the same step everywhere. Meanwhile D keeps running:
a long P epoch on the GPU never blocks the host loop.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from colo_rollout.config import Config, ConfigError
from colo_rollout.runtime.control import (ControlError, ControlPlane, Message,
                                          ReplicaDivergence, divergence, first_difference,
                                          first_problem, gather_call, transport_failure,
                                          transport_problem)
from colo_rollout.worker.memory import WEIGHT_POLICIES, MemoryReport
from colo_rollout.runtime.device import fp32_norms
from colo_rollout.runtime.parallel import ParallelGroups
from colo_rollout.sched.plan import Phase, Sampled, StepPlan
from colo_rollout.engine.routing_store import RoutingStore
from colo_rollout.engine.recorder import Recorder
from colo_rollout.sched.planner import pick_bucket
from colo_rollout.worker.prefill_graph import MAX_TOKENS as PREFILL_GRAPH_MAX_TOKENS
from colo_rollout.sched.request import (
    FinishReason,
    Request,
    RequestError,
    RequestOutput,
    SamplingParams,
    SubmissionRefused,
    checked_request,
    plain_str,
)
from colo_rollout.multiplex.rendezvous import RendezvousError, make_rendezvous
from colo_rollout.runtime.shm import same_host
from colo_rollout.worker.runner import PendingSampled
from colo_rollout.engine.strategy import RoundParts, strategy_for
from colo_rollout.multiplex.turnstile import TurnstileController
from colo_rollout.worker.worker import Worker
from colo_rollout.sched.scheduler import Scheduler
from colo_rollout.engine.stall_watch import StallWatch
from colo_rollout.runtime.device import DeviceStall
from colo_rollout.multiplex.stream_route import StreamRoute



# the sections every rank's engine must hold alike: their values shape the collectives (the
# model's and the layout's) and the replicated scheduler's decisions (the engine's)
SHARED_SECTIONS = ("model", "engine", "parallel")
REJECTED_KEPT = 4096  # Engine.rejected keeps the latest this many refusals
# closed sessions whose routing waits to be taken, at most (the oldest is dropped past it;
# far above one rollout() call's trajectories, whose routing is taken at its end)
CLOSED_ROUTES_KEPT = 65536


def check_same_config(cfg: Config, groups: ParallelGroups,
                      sections: tuple[str, ...] = SHARED_SECTIONS, what: str = "Engine()",
                      ) -> None:
    """Raise on every rank, naming the first differing key and a rank, unless every rank's
    ``sections`` are equal: ranks built from different configs would meet in collectives of
    different sizes (gloo aborts one process, NCCL hangs) or plan apart -- the engine's
    ``SHARED_SECTIONS``, and a command's own sections, which its ranks read alike (found by
    probing: a train run whose ranks had different rl.lr trained diverged replicas to exit 0;
    one rank's bench.reps was reported as an engine.mode difference). One all-gather of a
    digest over the control group (bounded by its timeout), tagged ``what`` (the collective
    call); the keys are compared only when the digests differ."""
    if groups.layout.world_size == 1:
        return
    import hashlib

    flat = _flat({s: dataclasses.asdict(getattr(cfg, s)) for s in sections})
    digest = hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()
    # tagged: a rank in another collective call is named (found by fault injection: a peer
    # in generate() made this a TypeError)
    digests = gather_call(what, digest, groups.control)
    if len(set(digests)) == 1:
        return
    mine = {k: repr(v) for k, v in flat.items()}
    every = gather_call(what, mine, groups.control)
    differs = first_difference(every)
    if differs is None:
        raise ConfigError("the ranks' configs differ (digests) though no key does", key=None)
    rank, key = differs
    # every key that differs there, named (found by fault injection: another hidden_size was
    # named by the head_dim derived from it, which sorts first)
    also = [k for k in sorted(set(every[0]) | set(every[rank]))
            if k != key and every[rank].get(k) != every[0].get(k)]
    more = f"; also {', '.join(also[:4])}{' ...' if len(also) > 4 else ''}" if also else ""
    raise ConfigError(f"rank {rank}'s config differs from rank 0's at {key}: "
                      f"{every[rank].get(key)} vs {every[0].get(key)}{more} (every rank "
                      f"runs from one config: {', '.join(sections)})", key=key)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class OnFinishError(RuntimeError):
    """``generate(on_finish=...)``'s callback raised; every request was still served and
    forgotten. ``outputs``: what ``generate`` would have returned."""

    outputs: dict


class Engine:
    """A serving session over a ``Worker`` (worker/worker.py: the model, KV storage and
    graphs). ``worker``: serve on an existing worker, taking it over from the engine serving on
    it (``hand_over``: idle, memory in place); otherwise a new worker is built from ``cfg``
    and ``state_dict`` (full megatron-named weights; None: ``model.checkpoint``, else random
    from ``model.seed``)."""

    def __init__(self, cfg: Config, groups: ParallelGroups,
                 state_dict: dict[str, torch.Tensor] | None = None, *,
                 worker: Worker | None = None) -> None:
        # the arguments' types first (found by probing: AttributeErrors from deep inside)
        for name, value, kind in (("cfg", cfg, Config), ("groups", groups, ParallelGroups)):
            if not isinstance(value, kind):
                raise TypeError(f"Engine({name}=...): expected a {kind.__name__}, got "
                                f"{type(value).__name__}")
        if state_dict is not None and not isinstance(state_dict, Mapping):
            raise TypeError(f"Engine(state_dict=...): expected a mapping of parameter names to "
                            f"tensors (or None), got {type(state_dict).__name__}")
        if worker is not None and not isinstance(worker, Worker):
            raise TypeError(f"Engine(worker=...): expected a Worker (another engine's, from "
                            f"hand_over()), got {type(worker).__name__}")
        self.cfg = cfg
        self.groups = groups
        self._handed_over = False  # set by hand_over(): this engine must not step again
        self._closed = False  # set by close(): its graphs, buffers and control plane are gone
        # the collective call whose caller's code runs now (rl/rollout.py sets "rollout()"
        # around its reward function and environments): a step() or generate() from that
        # code is refused, as its steps would take that call's outputs
        self.driving: str | None = None
        check_same_config(cfg, groups)  # before any collective the sections' values shape
        if worker is None:
            worker = Worker(cfg, groups, state_dict)
        else:
            if state_dict is not None:
                raise ValueError("Engine(worker=...) serves the worker's weights; load new "
                                 "ones with WeightSync or load_full_state_dict")
            worker.check_fits(cfg)
            if worker.engine is not None and not worker.engine._handed_over:
                worker.engine.hand_over()
        before = worker.engine  # (None: a new worker)
        worker.engine = self
        self.worker = worker
        self.model = worker.model
        self.load_stats = worker.load_stats  # checkpoint load time and bytes
        lay = groups.layout
        self.scheduler = Scheduler(cfg.engine, lay.adp, lay.atp, cfg.model.vocab_size)
        if before is not None:
            # the sessions go on here, their contexts re-prefilled into this engine's KV
            # (found by probing: a turn after hand_over() was served as a new conversation)
            self.scheduler.adopt_sessions(*before.scheduler.idle_session_state())
        # the model's count of weight writes when the cached contexts were last valid
        self._weights_seen = getattr(self.model, "weight_epoch", 0)
        self.paused = False  # pause() .. resume(): submits refused (a weight update)
        m = cfg.model
        self.routes = (RoutingStore(sum(1 for i in range(m.num_layers) if m.is_moe_layer(i)),
                                    m.moe_router_topk, m.num_experts)
                       if cfg.engine.record_routing else None)
        # the mode, typed (engine/strategy.py): what differs between the ladder's rungs
        self.strategy = strategy_for(cfg.engine, self.model.boundaries_per_prefill)
        self.pd = self.strategy.pd
        p_graph_tokens = self._prefill_graph_tokens()
        self.route = StreamRoute.for_layout(groups.device, self.pd, lay.adp, lay.atp,
                                            cfg.engine.stream_route, cfg.engine.cuda_timing,
                                            cfg.engine.stream_priority,
                                            p_graphs=p_graph_tokens > 0)
        e = cfg.engine
        # the worker's KV storage and captured graphs stay; this engine's streams, sampler
        # seed and P settings are set on it
        self.runner = worker.runner
        self.runner.renew(self.route, cfg.model.seed, e.prefill_merge_pairs, p_graph_tokens)
        self.route.synchronize()  # KV storage was zeroed on the default stream
        self.memory = worker.memory  # the worker's device memory (release/resume)
        # what a weight sync asks before it writes (rl/weight_sync.py): whether this engine
        # serves anything -- parameters change only on an idle engine
        self.model.serving = self.busy
        # and whether its memory is released (its parameters' storage gone or on the host: a
        # load then writes nowhere; found by probing, it was refused as the caller's shapes)
        self.model.released = lambda: self.memory.released not in (None, "keep")
        # host agreement (control exchange, PreD/PostD): shared memory when every rank is on
        # this host (engine.rendezvous "auto"), else gloo; decided once, the same on all ranks
        agree = cfg.engine.rendezvous
        if agree == "auto":
            agree = ("shm" if lay.world_size > 1 and same_host(groups.control, lay.world_size)
                     else "gloo")
        self.control = ControlPlane(groups.control, groups.rank, lay.world_size,
                                    cfg.parallel.timeout_s, shm=agree == "shm")
        self.turnstile = TurnstileController(rank=groups.rank)
        self.turnstile.register_producer(self.model.boundary_producer)
        self.rendezvous = (make_rendezvous(groups.control, groups.rank, lay.world_size,
                                           cfg.parallel.timeout_s, agree)
                           if self.pd else None)
        self.policy = self.strategy.policy  # Fine's span policy (None otherwise)
        # PD: the epoch whose host enqueue completed, until every rank sent its P tokens
        self._p_epoch: StepPlan | None = None
        self._p_out: PendingSampled | None = None  # this rank's P tokens, until sent
        self._p_got: dict[int, list] = {}  # rank -> the P tokens it sent for _p_epoch
        self._outbox = Message(rank=groups.rank)
        self._pending_ids: set[str] = set()
        # every host wait for this engine's GPU work is bounded by the groups' timeout: D's
        # collectives are graph-captured, which NCCL's watchdog does not watch
        self._wait_s = cfg.parallel.timeout_s
        self._wedged = False  # a step raised DeviceStall: the device cannot be drained
        # engine.stall_dump_s: a step outlasting it prints this rank's stack (diagnosis)
        self._stall_watch = (StallWatch(cfg.engine.stall_dump_s)
                             if cfg.engine.stall_dump_s > 0 else None)
        # the plans whose tokens the next exchange sends and commits, in plan order (two: a
        # P step read one step late, then the step after it), and those tokens
        self._last_plans: list[StepPlan] = []
        self._last_sampled: list[Sampled] = []
        # engine.overlap_prefill: the P step whose tokens are still on the GPU, read in the
        # next step's collect (its plan and pending tokens)
        self._deferred: tuple[StepPlan, list[PendingSampled]] | None = None
        # engine.overlap_prefill, resolved: whether a P step may be read one step late (set
        # alike on every rank; switching it between steps is safe -- bench-speed's A/B)
        over = e.overlap_prefill
        self.overlap_prefill = self.strategy.overlaps_p and (
            over == "always" or (over == "auto" and groups.device.type == "cuda"))
        # the refusals seen on this rank, in order: the latest REJECTED_KEPT (a long run's
        # memory stays bounded)
        self.rejected: collections.deque[RequestOutput] = collections.deque(
            maxlen=REJECTED_KEPT)
        self._refused_here: list[RequestOutput] = []  # this rank's, refused at the exchange
        # the last exchange's expect_same difference: (sentence, rank, key), or None
        self._diverged: tuple[str, int, str | None] | None = None
        # the last step's exchange refusals of every rank, as (submitting rank, output): the
        # same list on every rank (the exchange and the checks are replicated)
        self.exchange_refusals: list[tuple[int, RequestOutput]] = []
        # sessions closed since the last collective call began whose routing nobody took:
        # dropped when the next one begins (agree_ready), so the store stays bounded
        self._closed_routes: collections.OrderedDict[str, None] = collections.OrderedDict()
        # step statistics, the P/D timeline, host seconds by part (engine/recorder.py)
        self.recorder = Recorder()
        self.history = self.recorder.history
        self.timeline = self.recorder.timeline
        self.parts = RoundParts(self.runner, self.turnstile, self.rendezvous, self.route,
                                self.scheduler, self.recorder, self._wait_s, e.max_batch_size,
                                e.max_prefill_tokens, self.model.boundaries_per_prefill)

    # ------------------------------------------------------------------ non-collective API
    def submit(self, request: Request) -> None:
        """Queue a request on this rank; it enters every rank's scheduler at the next step.
        Raises RequestError at once for a request that can never be served (token ids may be
        any integral type: numpy integers are taken as ints), and while the engine is paused.
        What only the next step's exchange can show -- the same id submitted on a lower rank
        in the same step, say -- is raised to this rank by that ``step()``
        (SubmissionRefused)."""
        self._check_open()
        request = checked_request(request)  # types first: never a TypeError below
        why = self.submit_refusal(request.request_id)
        if why is not None:
            raise RequestError(why)
        if request.request_id in self._pending_ids:
            raise RequestError(f"request {request.request_id!r}: duplicate request id")
        self.scheduler.validate(request, closing=self._outbox.closes)
        self._outbox.submits.append({"id": request.request_id, "prompt": list(request.prompt),
                                     "params": request.params.to_json(),
                                     "session": request.session})
        self._pending_ids.add(request.request_id)

    def _step_past_refusals(self) -> tuple[list[RequestOutput], list[RequestOutput]]:
        """``step()`` for the collective calls that serve on past this rank's refused
        submissions (already in ``self.rejected``): (finished, this rank's refused)."""
        try:
            return self._step_once(), []
        except SubmissionRefused as e:
            return e.finished, e.refused

    def submit_refusal(self, request_id: str) -> str | None:
        """Why ``submit`` would refuse any request now for the engine's own state (paused,
        memory released or weights not loaded), or None: replicated state, the same on every
        rank -- what rollout() asks on every rank beside the leader's submit."""
        if self.paused:
            return (f"request {request_id!r}: the engine is paused (a weight update is in "
                    "progress); submit after resume()")
        try:
            self.memory.check_ready()
        except RuntimeError as e:
            return f"request {request_id!r}: {e}"
        return None

    def pause(self) -> dict[str, RequestOutput]:
        """Collective, at a weight update: cancel every request in flight (rank 0 sends the
        cancels; each rank cancels its own submissions not yet sent), serve until idle, and
        refuse submits until ``resume()``. Returns every output that finished during the
        pause: the cancelled requests' tokens and logprobs so far (a partial rollout resumes
        them as prompts under the new weights: rl/rollout.py), and any that ended on their
        own in its steps -- none is lost to a ``step()`` loop around it."""
        self._check_open()
        out = self._outbox
        idle = not (self.busy() or self._pending_ids or out.submits or out.cancels or out.closes
                    or out.sampled or out.agree)
        if self.groups.layout.world_size > 1:
            # tagged first: a rank in another collective call (generate(), a step() loop) is
            # named on every rank (found by probing: it read as a peer dead or diverged)
            idle = all(gather_call("pause()", idle, self.groups.control))
        if idle:  # nothing anywhere to cancel or serve: no step (found by probing: an idle
            # pause() between resume_memory() and weights_loaded() stepped into the
            # discarded weights' refusal)
            self.paused = True
            return {}
        if self.groups.rank == 0:
            for rid in list(self.scheduler.live):
                self.cancel(rid)
        for rid in list(self._pending_ids):  # submitted here, not yet sent: never started
            self._outbox.cancels.append(rid)
        outs: dict[str, RequestOutput] = {}

        # (a refused submission must not abort one rank's pause: the others pause on)
        for out in self._step_past_refusals()[0]:
            outs[out.request_id] = out
        while self.busy():
            for out in self._step_past_refusals()[0]:
                outs[out.request_id] = out
        self.paused = True
        self.forget(outs)  # handed back, as generate()'s (found by probing: kept for good)
        return outs

    def resume(self) -> None:
        """Accept submits again after ``pause()``."""
        self._check_open()
        self.paused = False

    def cancel(self, request_id: str) -> None:
        self._check_open()
        if not isinstance(request_id, str):
            raise RequestError(f"cancel: request id must be a string, got {request_id!r}")
        request_id = plain_str(request_id)  # (a str subclass: the wire takes exact str)
        if request_id not in self.scheduler.live and request_id not in self._pending_ids:
            state = "already finished" if request_id in self.scheduler.by_id else "unknown"
            raise RequestError(f"cancel of request {request_id!r}: {state} request id")
        self._outbox.cancels.append(request_id)

    def close_session(self, session: str) -> None:
        """Forget a trajectory between turns (its retained KV is freed at the next step), or
        acknowledge one a cancel ended (its id may then start a new conversation)."""
        self._check_open()
        if not isinstance(session, str):
            raise RequestError(f"close of session {session!r}: a session id is a string")
        session = plain_str(session)
        if any(s.get("session") == session for s in self._outbox.submits):
            raise RequestError(f"close of session {session!r}: a turn of it was submitted on "
                               "this rank and not yet sent; close it after that turn")
        if session in self.scheduler.ended and session not in self.scheduler.sessions:
            self._outbox.closes.append(session)
            return
        sess = self.scheduler.sessions.get(session)
        if sess is None or sess.busy:
            state = "unknown" if sess is None else "busy (a turn is in flight)"
            raise RequestError(f"close of session {session!r}: {state}")
        self._outbox.closes.append(session)

    def expect_same(self, what: str, digests: dict[str, str]) -> None:
        """Non-collective: the next step's exchange carries ``digests`` (key -> digest of what
        this rank's caller decided from replicated inputs since the last step, e.g. each
        environment step) under the label ``what``, and every rank compares them. A
        difference makes that ``step()`` raise ReplicaDivergence on every rank, naming the
        first key that differs -- the divergence caught at the step it happens, not later as
        the ranks' mismatched collectives (found by probing: an environment that ended an
        episode on one rank only left the ranks in different calls until a timeout)."""
        if self.groups.layout.world_size > 1:
            self._outbox.agree_what = what
            self._outbox.agree = dict(digests)

    def has_unsent(self) -> bool:
        """Submissions, cancels or closes made on this rank that the next step will send."""
        o = self._outbox
        return bool(o.submits or o.cancels or o.closes)

    def output(self, request_id: str) -> RequestOutput:
        """The output of a request this engine holds (in flight, or finished and not yet
        forgotten); RequestError for any other id."""
        try:
            return self.scheduler.by_id[request_id]
        except (KeyError, TypeError):
            raise RequestError(f"output of request {request_id!r}: unknown request id (never "
                               "submitted, or already handed back and forgotten)") from None

    def forget(self, request_ids) -> None:
        """Drop finished requests' outputs the caller has taken (from ``step()``): what
        ``generate()`` and ``rollout()`` do with theirs. Keeps the engine's memory bounded in a
        long run of ``step()`` loops; a forgotten id may be used again. Call it alike on every
        rank (the outputs are replicated state); requests still in flight are kept."""
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable):
            raise RequestError(f"forget: expected request ids (a list or a dict of outputs), "
                               f"got {type(request_ids).__name__} {request_ids!r:.60}")
        ids = list(request_ids)
        bad = next((r for r in ids if not isinstance(r, str)), None)
        if bad is not None:  # (an unhashable one was a TypeError from the lookup)
            raise RequestError(f"forget: request ids are strings, got "
                               f"{type(bad).__name__} {bad!r:.60}")
        self.scheduler.forget(ids)

    # ------------------------------------------------------------------ collective API
    def step(self) -> list[RequestOutput]:
        """One engine iteration (collective). Returns requests that finished in it.

        Raises SubmissionRefused (a RequestError) on a rank whose own submissions were refused
        by every rank when the ranks' submissions met in this step (its ``refused`` and
        ``finished``: the step completed; keep stepping), and ReplicaDivergence on every rank
        when the ranks' ``expect_same`` digests for this step differ."""
        self._check_not_driven("step()")
        return self._step_once()

    def _step_once(self) -> list[RequestOutput]:
        """``step()`` for the engine's own collective calls (generate(), pause()): a pause()
        from a reward function is the weight update's (rollout() reports what it
        cancelled), not a caller's loop taking rollout()'s outputs."""
        watch = self._stall_watch
        if watch is not None:
            watch.arm(f"rank {self.groups.rank} step {self.scheduler.step_no}")
        try:
            self._diverged = None
            finished = self._step()
            refused, self._refused_here = self._refused_here, []
            if self._diverged is not None:
                raise ReplicaDivergence(*self._diverged, finished)
            if refused:
                raise SubmissionRefused(refused, finished)
            return finished
        except DeviceStall as e:  # the waits name what they waited for; the step adds where
            # this rank's device is wedged: nothing may wait on it again (close() skips the
            # drain); the way out is parallel.abort_parallel() and a process exit
            self._wedged = True
            raise DeviceStall(f"rank {self.groups.rank}, step {self.scheduler.step_no}: "
                              f"{e}") from e
        except RuntimeError as e:
            if isinstance(e, (ControlError, RendezvousError, ReplicaDivergence)) \
                    or not transport_failure(e):
                raise
            # a collective of the model's forward (its gloo/NCCL groups) failed: a peer
            # stalled past parallel.timeout_s, exited, or is in another call -- named here
            # with this rank and step (found by fault injection: gloo's text alone)
            raise ControlError(f"rank {self.groups.rank}, step {self.scheduler.step_no}: a "
                               f"collective of the step failed: "
                               f"{transport_problem(e, 'a process group of the model')}") from e
        finally:
            if watch is not None:
                watch.disarm()

    def _step(self) -> list[RequestOutput]:
        """exchange -> apply -> schedule -> strategy.run -> collect -> record."""
        if self._handed_over:
            raise RuntimeError("this engine handed its worker to another engine; step that one")
        self._check_open()
        self.memory.check_ready()
        if not self.busy():
            # a step from idle: the only point where parameters may have been replaced
            self.runner.check_weights()
            epoch = getattr(self.model, "weight_epoch", 0)
            if epoch != self._weights_seen:
                # the retained contexts' KV was computed under the old weights: their next
                # turns re-prefill under the new ones (found by probing: a turn after
                # load_full_state_dict was served on the old weights' KV, two models mixed)
                self.scheduler.evict_retained()
                self._weights_seen = epoch
        rec = self.recorder
        rec.begin_step()
        self._outbox.step = self.scheduler.step_no
        self._outbox.sampled = _to_wire(self._last_sampled)
        with rec.clock("exchange"):
            msgs = self.control.exchange(self._outbox)
        self._outbox = Message(rank=self.groups.rank)
        self._diverged = divergence(msgs)  # raised once the step is done, on every rank
        self._pending_ids.clear()
        finished = self._apply(msgs, time.perf_counter())
        if self.routes is not None:  # a request without a session: its routing goes with it
            # (a session's is keyed by the session: take_routing). A dispatch backend under
            # attention TP leaves each rank a chunk of the rows: only the collective
            # take_routings (rollout()) can assemble them, so a plain output gets none
            chunked = self.model.records_own_rows and self.groups.layout.atp > 1
            for out in finished:
                n = out.prompt_len + len(out.tokens) - 1
                if chunked:
                    self.routes.take_partial(out.request_id, n)
                else:
                    out.routing = self.routes.take(out.request_id, n)
        d_ready = sum(1 for q in self.scheduler.seqs.values() if q.last_token is not None)
        with rec.clock("plan"):
            plan = self.scheduler.plan(pd=self.pd)
        out = self.strategy.run(plan, self.parts, d_ready)
        self._collect(plan, out)
        rec.end_step(plan, p_in_flight=self.runner.epoch_active or self._p_epoch is not None,
                     d_ready=d_ready, read_late=self._deferred is not None)
        return finished

    def _apply(self, msgs: list[Message], now: float) -> list[RequestOutput]:
        """Every rank's messages, in rank order (identical on every rank): span hints, the
        previous step's tokens and a completed P epoch's (committed), then submissions,
        cancels and session closes."""
        self.strategy.observe([m.span_hint for m in msgs])
        finished: list[RequestOutput] = []
        epoch_done = None
        for m in msgs:
            if m.p_sampled is not None:
                if self._p_epoch is None or m.rank in self._p_got:
                    raise ControlError(f"step {self.scheduler.step_no}: rank {m.rank} sent P "
                                       "tokens with no P epoch awaiting them")
                self._p_got[m.rank] = m.p_sampled
        if self._p_epoch is not None and len(self._p_got) == len(msgs):
            epoch_done = self._p_epoch
        if self._last_plans or epoch_done is not None:
            sampled = [s for m in msgs for s in _from_wire(m.sampled)]
            if epoch_done is not None:
                sampled += [s for got in self._p_got.values() for s in _from_wire(got)]
                self._p_epoch, self._p_got = None, {}
            plans = self._last_plans or [None]
            for i, plan in enumerate(plans):
                finished += self.scheduler.commit(
                    plan, sampled, now, epoch_done=epoch_done if i == len(plans) - 1 else None)
        # closes first (every rank's), then submits, then cancels: a session closed and
        # started again in one step is a new conversation (a close applied after the submit
        # found the session busy and was dropped: the new turn continued the old context),
        # and a cancel reaches a request submitted in the same step by any rank
        for m in msgs:
            for sid in m.closes:
                if sid in self.scheduler.sessions and not self.scheduler.sessions[sid].busy \
                        or sid in self.scheduler.ended:
                    known = self._session_inputs(sid)
                    self.scheduler.close_session(sid)
                    if self.routes is not None:
                        if known is not None:  # its routing ends where its inputs do
                            self.routes.trim(sid, known)
                        self._closed_routes[sid] = None
                        if len(self._closed_routes) > CLOSED_ROUTES_KEPT:
                            # a step() loop that never begins a collective call: the
                            # oldest closed conversation's routing goes
                            self.routes.drop(self._closed_routes.popitem(last=False)[0])
        self.exchange_refusals = []
        for m in msgs:
            for s in m.submits:
                req = Request(s["id"], tuple(s["prompt"]), SamplingParams.from_json(s["params"]),
                              session=s.get("session"))
                key = req.session or req.request_id
                fresh = req.session is None or req.session not in self.scheduler.sessions
                try:
                    self.scheduler.add(req, now)
                    if fresh and self.routes is not None:
                        # a new conversation under a used key starts from no routing (found
                        # by probing: a reused session id returned the old one's positions)
                        self.routes.drop(key)
                        self._closed_routes.pop(key, None)
                except RequestError as e:
                    self.rejected.append(_rejected(req, str(e)))
                    self.exchange_refusals.append((m.rank, self.rejected[-1]))
                    if m.rank == self.groups.rank:  # raised to this rank's caller by step()
                        self._refused_here.append(self.rejected[-1])
        for m in msgs:
            for rid in m.cancels:
                if rid in self.scheduler.live:
                    finished.append(self.scheduler.cancel(rid, now))
        return finished

    def _collect(self, plan: StepPlan, out) -> None:
        """The only host wait of a step: this step's sampled tokens, after both phases enqueued
        (PD: D's only -- P's are sent once done, see the module docstring)."""
        if out.p_out is not None:  # the epoch's enqueue completed: it now awaits commit
            self._p_epoch, self._p_out = out.epoch_plan, out.p_out
        if out.span_hint is not None:
            self._outbox.span_hint = out.span_hint
        plans: list[StepPlan] = []
        sampled: list[Sampled] = []
        with self.recorder.clock("resolve"):
            if self._deferred is not None:  # the P step before this one: its GPU work ran
                # while this step's was enqueued (its tokens first: plan order)
                d_plan, d_pending = self._deferred
                self._deferred = None
                sampled += [x for p in d_pending for x in p.resolve(self._wait_s, "P tokens")]
                self._store_routing(d_pending)
                plans.append(d_plan)
            if (self.overlap_prefill and plan.phase is Phase.PREFILL
                    and self.scheduler.head_admissible()):
                # the queue's head fits now, so the next step is P again: read this one's
                # tokens after its enqueue (with the head blocked the next step would be no P
                # -- idle, or a D step these sequences would miss)
                self._deferred = (plan, out.pending)
            else:
                sampled += [x for p in out.pending for x in p.resolve(self._wait_s, "D tokens")]
                self._store_routing(out.pending)
                if plan.phase is not Phase.IDLE:
                    plans.append(plan)
        self._last_plans, self._last_sampled = plans, sampled
        if self._p_out is not None:
            if not out.pending:  # nothing else to do this step: wait for P rather than spin
                self._p_out.wait(self._wait_s, "P epoch")
            if self._p_out.done():
                self._outbox.p_sampled = _to_wire(
                    self._p_out.resolve(self._wait_s, "P epoch"))
                self._store_routing([self._p_out])
                self._p_out = None

    def _store_routing(self, pending) -> None:
        """The runs' recorded expert ids (engine.record_routing) into the routing store, by
        the request's session (else its id); rows of lifetimes no longer admitted (cancelled)
        are dropped."""
        if self.routes is None:
            return
        for p in pending:
            if p.routing is None:
                continue
            for lifetime, first, ids in p.routing.resolve(self._wait_s):
                seq = self.scheduler.seqs.get(lifetime)
                if seq is not None:
                    req = seq.request
                    self.routes.add(req.session or req.request_id, first, ids,
                                    p.routing.stamp)

    def take_routing(self, key: str, inputs: int | None = None):
        """The recorded expert ids of a trajectory (a session id, or the id of a request
        without one): [positions, MoE layers, k] for its positions 0 .. n-1 (every token that
        was an input; engine/routing_store.py), forgotten here; None when nothing was
        recorded (engine.record_routing off, or an unknown key). ``inputs``: the trajectory's
        input count (its length - 1), which bounds what is returned (routing_store.py); an
        idle session's own by default."""
        if self.routes is None:
            return None
        return self.routes.take(key, self._session_inputs(key) if inputs is None else inputs)

    def _session_inputs(self, key: str) -> int | None:
        """An idle session's input count (its context - 1: the last output was never an
        input), else None."""
        sess = self.scheduler.sessions.get(key)
        return None if sess is None or sess.busy else max(len(sess.context) - 1, 0)

    def take_routings(self, keys: list[str], inputs: list[int] | None = None) -> list:
        """``take_routing`` of many keys, the same on every rank. With a dispatch backend a
        rank records only the rows it routed (``InferenceGPT.records_own_rows``: its
        replica's, under attention TP its ATP chunk of them), so a key's ids are spread over
        ranks: collective then (every rank calls it with the same keys, between steps) --
        per position the latest recording wins (its stamp; ties to the lowest rank) and is
        summed over the world from that one owner; a key's ids are its positions from 0 up
        to the first that no rank recorded. Else local."""
        if isinstance(keys, (str, bytes)):  # (found by probing: "abc" read as three keys)
            raise TypeError(f"take_routings: expected a list of keys, got {keys!r:.60}")
        if inputs is not None and len(inputs) != len(keys):  # (zip would drop the rest)
            raise ValueError(f"take_routings: {len(keys)} keys and {len(inputs)} input counts")
        world = self.groups.layout.world_size
        if self.routes is None or world == 1 or not self.model.records_own_rows:
            return [self.take_routing(k, None if inputs is None else n)
                    for k, n in zip(keys, inputs or [None] * len(keys))]
        import torch.distributed as dist

        mine = [self.routes.take_partial(k, self._session_inputs(k) if n is None else n)
                for k, n in zip(keys, inputs or [None] * len(keys))]
        dev, rank = self.groups.device, self.groups.rank
        # each key's positions recorded anywhere (-1: nowhere), then per position the
        # latest stamp, then its lowest-ranked holder (as world - 1 - rank under MAX)
        lengths = torch.tensor([-1 if a is None else a[0].shape[0] for a in mine],
                               dtype=torch.int64, device=dev)
        dist.all_reduce(lengths, op=dist.ReduceOp.MAX)
        lengths = lengths.tolist()
        total = sum(max(n, 0) for n in lengths)
        stamps = np.zeros(total, dtype=np.int64)
        at = 0
        for a, n in zip(mine, lengths):
            if a is not None:
                stamps[at : at + a[1].shape[0]] = a[1]
            at += max(n, 0)
        best = torch.tensor(stamps, device=dev)  # a copy: on CPU from_numpy would alias
        dist.all_reduce(best, op=dist.ReduceOp.MAX)
        best = best.cpu().numpy()
        holder = np.where((stamps == best) & (best > 0), world - 1 - rank, -1)
        owner = torch.from_numpy(holder).to(dev)
        dist.all_reduce(owner, op=dist.ReduceOp.MAX)
        owned = owner.cpu().numpy() == world - 1 - rank
        layers, k = self.routes.shape
        # NCCL has no int16: uint8 ids (<= 256 experts) travel as uint8, others as int32
        dtype = torch.uint8 if self.routes.dtype == np.uint8 else torch.int32
        ids = np.zeros((total, layers, k), dtype=np.int64)
        at = 0
        for a, n in zip(mine, lengths):
            if a is not None:
                m = a[0].shape[0]
                ids[at : at + m] = np.where(owned[at : at + m, None, None], a[0], 0)
            at += max(n, 0)
        buf = torch.from_numpy(ids).to(dtype).to(dev)
        dist.all_reduce(buf)
        host = buf.cpu().numpy().astype(self.routes.dtype)
        out, at = [], 0
        for n in lengths:
            if n < 0:
                out.append(None)
                continue
            unwritten = np.flatnonzero(best[at : at + n] == 0)
            known = int(unwritten[0]) if unwritten.size else n
            out.append(host[at : at + known].copy())
            at += n
        return out

    def host_seconds(self) -> dict[str, float]:
        """Host time of this rank since the engine was made (engine/recorder.py)."""
        return self.recorder.host_seconds(
            self.rendezvous.seconds if self.rendezvous is not None else 0.0)

    def busy(self) -> bool:
        """True while any rank may still have work. Identical on all ranks right after a step
        (the state is replicated); a submission made since then shows up at the next step."""
        return (self.scheduler.has_work() or bool(self._last_plans)
                or self._deferred is not None or self._p_epoch is not None
                or self.runner.epoch_active)

    def generate(self, requests: list[Request] | None = None,
                 on_finish=None) -> dict[str, RequestOutput]:
        """Collective: serve ``requests`` (submitted from rank 0; other ranks' argument is
        ignored) until all finish; every rank returns every output. Requests refused at submit
        come back with finish_reason REJECTED instead of raising, so the rest are served (a
        duplicate of a request of this call or of one still in flight, and a request whose
        id is not a string, is listed in ``self.rejected`` only: the id maps to the original,
        or cannot be a key). The same holds
        for this rank's earlier ``submit()`` calls that the first step's exchange refuses (the
        SubmissionRefused that step() raises is taken here: listed in ``self.rejected``).
        Returns the outputs of every request that finished during the call -- these requests
        and any submitted before it -- and forgets them (``output()`` no longer has them; their
        ids may be used again)."""
        # (rank 0's argument alone is read: its type is checked there, and the verdict is
        # part of the agreement below, so every rank raises together)
        bad = None
        if self.groups.rank == 0 and requests is not None and (
                isinstance(requests, (str, bytes, Request, Mapping))
                or not isinstance(requests, Iterable)):
            bad = f"generate: requests must be a list of Request, got {type(requests).__name__}"
        elif self.groups.rank == 0 and requests is not None:
            # read whole before anything is submitted: an iterator raising partway left its
            # first requests unsent in the outbox, served by the next call (found by probing)
            try:
                requests = list(requests)
            except Exception as e:  # noqa: BLE001 - the caller's iterator: its error, named
                bad = (f"generate: reading the requests raised {type(e).__name__}: "
                       f"{' '.join(str(e).split())[:200]}")
        if on_finish is not None and not callable(on_finish) and bad is None:
            # (found by probing: every request was served first, then the call raised)
            bad = f"generate: on_finish must be callable, got {type(on_finish).__name__}"
        ids: list[str] = []
        rejected: dict[str, RequestOutput] = {}
        done: dict[str, RequestOutput] = {}  # what finishes during this call, on every rank
        self._check_open()
        self._check_not_driven("generate()")
        self.agree_ready("generate()", bad)  # before anything is submitted, on every rank
        if self.groups.rank == 0:
            for req in requests or []:
                try:
                    self.submit(req)
                    ids.append(plain_str(req.request_id))  # (the wire's exact str)
                except RequestError as e:
                    out = _rejected(req, str(e))
                    self.rejected.append(out)
                    rid = out.request_id
                    if isinstance(rid, str):
                        rid = out.request_id = plain_str(rid)
                    # a refused duplicate must not shadow the accepted request's output:
                    # one of this call, or one in flight that finishes in it -- an earlier
                    # request finished and not forgotten never comes back, so the refusal
                    # does (found by probing: the id was missing from the result)
                    held = self.scheduler.by_id.get(rid) if isinstance(rid, str) else None
                    if isinstance(rid, str) and rid not in ids and (
                            held is None or held.finished and rid not in self.scheduler.live):
                        rejected[rid] = out
        if self.groups.layout.world_size > 1:
            # every rank returns every output: rank 0's accepted ids and refusals go to the
            # others (found by probing: a request refused at submit came back on rank 0 only)
            mine = None if self.groups.rank else \
                [ids, {rid: [o.prompt_len, o.error] for rid, o in rejected.items()}]
            ids, told = gather_call("generate()", mine, self.groups.control)[0]
            if self.groups.rank:
                for rid, (n, error) in told.items():
                    rejected[rid] = out = RequestOutput(rid, n, error=error)
                    out.finish_reason = FinishReason.REJECTED

        def step() -> list[RequestOutput]:
            finished = self._step_past_refusals()[0]
            # this call's requests refused at the exchange go back with the rest, on every
            # rank (rank 0 submitted them; another rank's refusal under the same id is of its
            # own earlier submit). Found by probing: two turns of one session in one call --
            # the second refused once the first made the session busy -- came back on rank 0
            # alone.
            for r, out in self.exchange_refusals:
                if r == 0 and out.request_id in ids:
                    rejected[out.request_id] = out
            return finished

        failed = None  # (request id, what on_finish raised): the first
        while True:  # the first step too: a request may finish in it
            for out in step():
                done[out.request_id] = out
                if on_finish is not None and failed is None:
                    # served on regardless: a rank leaving the loop would leave its peers
                    # waiting in the step's collectives (found by probing: the outputs of a
                    # raising callback were neither returned nor forgotten)
                    try:
                        on_finish(out)
                    except Exception as e:
                        failed = (out.request_id, e)
            if not self.busy():
                break
        # handed back: the engine forgets them (bounded memory; their ids free again)
        self.forget(done)
        # a refusal never shadows a served request of its id (found by probing: a bad "x"
        # before a good "x" in one call, or "x" refused as a duplicate of an earlier
        # submit("x") -- the served output was returned as the refusal and lost)
        for rid, out in rejected.items():
            done.setdefault(rid, out)
        if failed is not None:
            rid, e = failed
            err = OnFinishError(f"generate(): on_finish raised on request {rid!r}: "
                                f"{type(e).__name__}: {e}; every request was served (the "
                                "outputs are this error's .outputs; later ones were not "
                                "passed to on_finish)")
            err.outputs = done
            raise err from e
        return done

    def agree_ready(self, what: str, request_problem: str | None = None,
                    idle: bool = False) -> bool:
        """Collective, at the start of a collective call (``generate``, ``rollout``): every
        rank's memory is resident with its weights loaded, and every rank is paused or none
        is. Returns whether the engine is paused. A problem on any rank raises RuntimeError on
        every rank, naming it (one all-gather over the control group): a refusal on one rank
        alone would let the others' call pair with that rank's next one.
        ``request_problem``: this rank's refusal of the call's arguments, raised on every rank
        as a RequestError. ``idle``: the call drives ``step()`` itself and keeps only its own
        outputs (rollout()), so no request may be in flight or unsent on any rank -- another
        caller's outputs would be taken and dropped (found by probing)."""
        self._check_open()  # (found by probing: a closed engine was said to be busy)
        try:
            self.memory.check_ready()
            problem = None
        except RuntimeError as e:
            problem = str(e)
        if problem is None and idle and (self.busy() or self._outbox.submits):
            problem = ("requests submitted outside this call are in flight or unsent; "
                       "serve them first (generate(), or step() until idle) or cancel them")
        if self.routes is not None:
            # the routing of sessions closed before this call that nobody took (generate()
            # with sessions, an interrupted rollout()): a closed conversation's is taken in
            # the call that closed it or the one after, else forgotten here (found by
            # probing: the store grew by every closed session)
            for key in self._closed_routes:
                self.routes.drop(key)
            self._closed_routes.clear()
        mine = [problem, self.paused, request_problem]
        if self.groups.layout.world_size == 1:
            every = [mine]
        else:
            every = gather_call(what, mine, self.groups.control)
        for r, (_, _, p) in enumerate(every):
            if p is not None:
                raise RequestError(p if r == self.groups.rank else f"rank {r}: {p}")
        for r, (p, _, _) in enumerate(every):
            if p is not None:
                raise RuntimeError(f"{what}: rank {r}: {p}")
        paused = {bool(x) for _, x, _ in every}
        if len(paused) > 1:
            ranks = [r for r, (_, x, _) in enumerate(every) if x]
            raise RuntimeError(f"{what}: ranks {ranks} are paused and the others are not "
                               "(pause() and resume() are collective: every rank calls them)")
        return paused.pop()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    # ------------------------------------------------------------------ memory between phases
    def release_memory(self, weights: str = "keep") -> MemoryReport:
        """Give the KV cache, the D graphs and (``offload``/``discard``) the weights back to
        the device while the trainer runs; see worker/memory.py. Idle engine only: its
        retained multi-turn contexts are evicted (their next turn re-prefills)."""
        self._check_open()
        if weights not in WEIGHT_POLICIES:
            raise ValueError(f"release weights={weights!r}: expected one of {WEIGHT_POLICIES}")
        if self.memory.released is None and self.busy():
            raise RuntimeError("release of engine memory while requests are in flight "
                               "(finish or cancel them first)")
        if self.memory.released is None:
            self.memory.evicted += self.scheduler.evict_retained()
        return self.memory.release(weights, drain=self.route.synchronize)

    def resume_memory(self) -> MemoryReport:
        self._check_open()
        return self.memory.resume(drain=self.route.synchronize)

    def weights_loaded(self) -> None:
        """Collective: the caller has written every parameter (weight sync after a discard).
        Checked: ``resume_memory`` after a discard fills the parameters with NaN, so one the
        caller did not write is named here -- on every rank (one all-gather of each rank's
        verdict) -- instead of being served."""
        self._check_open()
        if self.memory.released is not None:
            raise RuntimeError("weights_loaded() before resume_memory()")
        problem = None
        if not self.memory.weights_valid:
            params = [(n, p) for n, p in self.model.named_parameters() if p.numel()]
            norms = fp32_norms([p for _, p in params]) if params else None
            if norms is not None and not bool(torch.isfinite(norms).all()):
                bad = [n for (n, _), v in zip(params, norms.tolist()) if v != v or
                       v in (float("inf"), float("-inf"))]
                problem = (f"weights_loaded(): {bad[0]} (and {len(bad) - 1} more) was not "
                           "written since resume_memory() after a discard: sync or load every "
                           "parameter first")
        self._refuse_together(problem, "weights_loaded()")
        self.model.weights_updated()  # model.fp8: re-quantise what the caller wrote
        self.memory.weights_valid = True

    def _prefill_graph_tokens(self) -> int:
        """Capacity of the P graphs: the most P tokens one step can hold over all replicas, up
        to prefill_graph.MAX_TOKENS (0: no P graphs)."""
        e = self.cfg.engine
        on = e.prefill_graphs == "always" or (e.prefill_graphs == "auto"
                                              and self.strategy.p_graphs_by_default)
        if not (e.cuda_graphs and on):
            return 0
        return min(e.max_prefill_tokens * self.groups.layout.adp, PREFILL_GRAPH_MAX_TOKENS)

    def warmup(self, max_context: int | None = None) -> int:
        """Collective, on an idle engine: capture the D graphs of every decode bucket and block
        -table width needed for contexts up to ``max_context`` tokens (default: max_seq_len)
        and P's MoE graphs of every token bucket, build cuDNN's plans of P's dense attention
        shapes (``engine.prefill_attention`` cudnn), and run one P AllReduce so the P
        communicator exists -- all otherwise happen inside the first requests' latency.
        Returns the graphs captured."""
        self._check_open()
        if max_context is not None and (isinstance(max_context, bool)
                                        or not isinstance(max_context, int) or max_context < 1):
            raise ValueError(f"warmup(max_context=...): an int >= 1 or None, got "
                             f"{max_context!r}")
        self.memory.check_ready()
        n = 0
        if self.runner.graphs is not None:
            e = self.cfg.engine
            ctx = e.max_seq_len if max_context is None else min(max_context, e.max_seq_len)
            lim = self.scheduler.limits  # the row counts the planner can pick
            rows = {pick_bucket(b, lim.decode_buckets, lim.atp)
                    for b in (*lim.decode_buckets, lim.max_batch_size)}
            n = self.runner.graphs.capture_all(sorted(rows), -(-ctx // e.kv_block_size))
        if self.runner.prefill_graphs is not None:
            n += self.runner.prefill_graphs.capture_all()
        e = self.cfg.engine  # cuDNN's plans of the dense P-attention shapes (no collective)
        self.runner.model.warm_prefill_attention(e.max_prefill_tokens, e.max_seq_len)
        if self.groups.layout.world_size > 1:
            probe = torch.zeros(1, device=self.groups.device)
            torch.distributed.all_reduce(probe, group=self.groups.full_p)
        self.route.synchronize()
        return n

    def hand_over(self) -> Worker:
        """Collective, on an idle engine: end this session and return its worker for a new
        engine (``Engine(cfg, groups, worker=...)``: another mode, span or policy on the same
        weights, KV storage and graphs). This engine refuses to step afterwards. RuntimeError
        when busy, or when the worker's memory is released or its weights were discarded."""
        if self._handed_over:
            raise RuntimeError("this engine was already handed over")
        self._check_open()  # (a closed engine's graphs and dispatch buffers are released)
        problem = None
        if self.busy() or self.has_unsent():
            problem = "hand_over() of an engine with requests in flight or unsent"
        elif self.memory.released is not None or not self.memory.weights_valid:
            problem = ("hand_over() of an engine whose memory is released or whose weights "
                       "were discarded")
        # agreed: a refusal on one rank alone (its unsent close_session, say) let the others
        # hand over and build the next engine against a broken control group (found by
        # probing)
        self._refuse_together(problem, "hand_over()")
        self._close_host_agreement()
        self._handed_over = True
        return self.worker

    def _refuse_together(self, problem: str | None, what: str) -> None:
        """This rank's refusal of the collective call ``what`` (or None) agreed over the
        ranks: a RuntimeError on every rank naming the lowest rank that refused."""
        got = first_problem(problem, self.groups.control, self.groups.layout.world_size, what)
        if got is not None:
            r, p = got
            raise RuntimeError(p if p == problem else f"rank {r}: {p}")

    def close(self) -> None:
        """Drop the D graphs (they hold NCCL collectives) and drain both streams: call before
        the process groups are destroyed. After a step raised DeviceStall only the host
        resources are closed: the device cannot be drained (abort the communicators with
        ``parallel.abort_parallel`` and exit the process)."""
        if self._handed_over or self._closed:
            return  # (handed over: the next engine on the worker owns the graphs)
        self._closed = True
        self._end_unserved()
        if not self._wedged:  # releasing graphs drains the device first
            self.runner.release_graphs()
        self._close_host_agreement()
        if not self._wedged:  # the dispatch buffers, once no graph can replay into them
            self.model.close_dispatch()

    def _end_unserved(self) -> None:
        """What close() leaves unserved ends, so ``output()`` answers for it (found by
        probing: a request in flight stayed unfinished for good): a request in flight is
        CANCELLED, a submit no step sent is REJECTED, each naming the close."""
        now = time.perf_counter()
        self.scheduler.abandon("the engine was closed with the request in flight", now)
        for s in self._outbox.submits:
            self.scheduler.by_id.setdefault(s["id"], RequestOutput(
                s["id"], len(s["prompt"]), finish_reason=FinishReason.REJECTED,
                error="the engine was closed before the request was sent", submit_time=now,
                finish_time=now))
        self._outbox.submits.clear()

    def _check_not_driven(self, what: str) -> None:
        """``what`` from a reward function or an environment that ``driving``'s call runs
        (on every rank alike: they run on each) is refused."""
        if self.driving is not None:
            raise RuntimeError(f"{what} inside {self.driving} (from a reward function or an "
                               f"environment): its steps would take {self.driving}'s outputs; "
                               "use the engine after it returns")

    def _check_open(self) -> None:
        if self._handed_over:  # (found by probing: a submit was taken, then never served)
            raise RuntimeError("this engine handed its worker to another engine; use that one")
        if self._closed:
            raise RuntimeError("this engine is closed (its graphs, dispatch buffers and "
                               "control plane are released): build a new Engine")

    def _close_host_agreement(self) -> None:
        """Drain both streams, then close the control plane and the rendezvous (their shared
        memory) and the stall watch: what ``close`` and ``hand_over`` both end this engine
        with."""
        if self._stall_watch is not None:
            self._stall_watch.close()
        if not self._wedged:
            self.route.synchronize()
        self.control.close()
        if hasattr(self.rendezvous, "close"):
            self.rendezvous.close()


def _to_wire(samples: list[Sampled]) -> list[tuple[int, int, float, int, int]]:
    """Sampled tokens as the control message carries them: (lifetime, token, logprob, draft,
    index) rows, index 0 the forward's first token (with the draft), 1.. its bonus tokens."""
    rows = []
    for s in samples:  # Python ints/floats
        rows.append((s.lifetime, s.token, s.logprob, s.draft, 0))
        rows.extend((s.lifetime, t, lp, -1, i + 1) for i, (t, lp) in enumerate(s.more))
    return rows


def _from_wire(rows: list[tuple[int, int, float, int, int]]) -> list[Sampled]:
    """A peer's rows (types checked when the message decoded) as ``Sampled``: a bonus row must
    follow its lifetime's first row, else the message is not one this code sent."""
    out: list[Sampled] = []
    for lt, tok, lp, draft, idx in rows:
        if idx == 0:
            out.append(Sampled(lt, tok, lp, (), draft))
            continue
        last = out[-1] if out else None
        if last is None or last.lifetime != lt or len(last.more) + 1 != idx:
            raise ControlError(f"sampled row {(lt, tok, lp, draft, idx)} does not follow its "
                               "lifetime's first token")
        out[-1] = Sampled(lt, last.token, last.logprob, (*last.more, (tok, lp)), last.draft)
    return out


def _rejected(req: Request, error: str) -> RequestOutput:
    """The REJECTED output of ``req`` (which may be malformed: a refusal's output never fails)."""
    rid, prompt = getattr(req, "request_id", None), getattr(req, "prompt", ())
    try:
        n = len(prompt)
    except Exception:  # no length, or a 0-d tensor / array's TypeError (found by probing)
        n = 0
    out = RequestOutput(rid, n, error=error)
    out.finish_reason = FinishReason.REJECTED
    return out
