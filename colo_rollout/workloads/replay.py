"""Trace replay: release multi-turn trajectories with their dependencies and client waits.

Owns the driver loop (run on every rank, SPMD) and the metrics of one run. Rank 0 owns the
clock: it submits turn 0 of a conversation at its arrival time and turn i+1 ``wait_s`` after
turn i's last token (the wait vector may be scaled). Every rank steps the engine together; all
ranks see the same finished requests (replicated engine state), so all stop together.

Each turn is a request of session ``conv``: its prompt holds only the turn's new tokens; the
engine keeps the trajectory's context in KV across turns when capacity allows and re-prefills it
when it was evicted (``Scheduler.evictions``). Token ids come from a seeded generator per
(conversation, turn); outputs have the trace's fixed length (EOS ignored), so every mode does
identical work.

Metrics (seconds, rank 0's clock): makespan (first release -> last token), requests/s,
p50/p99 request completion (submit -> last token), p50/p99 trajectory completion (first
release -> last turn's last token, waits included), p99 TTFT, mean D wait (P time that held a
ready D iteration back), evictions, preemptions (engine.kv_reservation on_demand).
"""

from __future__ import annotations

import hashlib
import heapq
import time
from dataclasses import asdict, dataclass

import numpy as np

from colo_rollout.engine.engine import Engine
from colo_rollout.sched.request import Request, SamplingParams
from colo_rollout.workloads.trace import Trace

IDLE_SLEEP_S = 0.0005  # nothing to run and the next release is in the future


@dataclass
class ReplayMetrics:
    requests: int
    conversations: int
    makespan_s: float
    requests_per_s: float
    request_p50_s: float
    request_p99_s: float
    trajectory_p50_s: float
    trajectory_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    mean_d_wait_ms: float
    mean_span: float  # PD: mean boundaries permitted per D round inside a P epoch (0: none)
    d_iterations: int
    evictions: int
    output_tokens: int
    preemptions: int = 0  # engine.kv_reservation on_demand: running rows preempted

    def to_json(self) -> dict:
        return asdict(self)


def turn_tokens(conv: str, turn: int, n: int, vocab: int) -> tuple[int, ...]:
    """Deterministic token ids of a turn's prompt increment (same on every rank and run)."""
    seed = int.from_bytes(hashlib.sha256(f"{conv}/{turn}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in rng.integers(1, vocab, size=n))


def replay(engine: Engine, trace: Trace, *, wait_scale: float = 1.0,
           on_finish=None) -> tuple[ReplayMetrics, dict]:
    """Replay ``trace`` on ``engine`` (collective). Returns the metrics and raw per-request
    records (rank 0's clock)."""
    trace = trace.scaled_waits(wait_scale) if wait_scale != 1.0 else trace
    vocab = engine.cfg.model.vocab_size
    convs = {c.conv: c for c in trace.conversations}
    total = trace.num_requests
    leader = engine.groups.rank == 0
    # release heap (time, conv, turn) -- only rank 0 acts on it
    pending = [(c.arrival_s, c.conv, 0) for c in trace.conversations]
    heapq.heapify(pending)
    t0 = time.perf_counter()
    submit_at: dict[str, float] = {}
    first_release = {c.conv: None for c in trace.conversations}
    done_at: dict[str, float] = {}
    finished = 0
    while finished < total:
        now = time.perf_counter() - t0
        if leader:
            while pending and pending[0][0] <= now:
                _, conv, turn = heapq.heappop(pending)
                t = convs[conv].turns[turn]
                rid = f"{conv}#{turn}"
                prompt = t.prompt or turn_tokens(conv, turn, t.prompt_tokens, vocab)
                engine.submit(Request(rid, prompt, SamplingParams(
                    max_tokens=t.output_tokens, ignore_eos=True), session=conv))
                submit_at[rid] = now
                if first_release[conv] is None:
                    first_release[conv] = now
        idle = not engine.busy() and not engine.has_unsent()
        for out in engine.step():
            finished += 1
            conv, turn = out.request_id.rsplit("#", 1)
            turn = int(turn)
            end = time.perf_counter() - t0
            done_at[out.request_id] = end
            if on_finish is not None:
                on_finish(out)
            if turn + 1 < len(convs[conv].turns):
                nxt = convs[conv].turns[turn + 1]
                heapq.heappush(pending, (end + nxt.wait_s, conv, turn + 1))
            else:
                engine.close_session(conv)
        if idle:
            time.sleep(IDLE_SLEEP_S)
    # the last sessions' closes (every rank made the same ones: the finished outputs are
    # replicated), so the engine ends idle with nothing unsent and its KV free
    while engine.busy() or engine.has_unsent():
        engine.step()
    return _metrics(engine, trace, t0, submit_at, first_release, done_at), {
        "submit": submit_at, "done": done_at}


def _metrics(engine: Engine, trace: Trace, t0: float, submit_at, first_release,
             done_at) -> ReplayMetrics:
    sched = engine.scheduler
    outs = {rid: sched.by_id[rid] for rid in done_at}
    # request completion and TTFT from the engine's own timestamps (same clock as t0)
    req_lat = [o.finish_time - o.submit_time for o in outs.values()]
    ttft = [o.first_token_time - o.submit_time for o in outs.values()]
    traj = []
    for c in trace.conversations:
        last = f"{c.conv}#{len(c.turns) - 1}"
        if engine.groups.rank == 0:
            traj.append(done_at[last] - first_release[c.conv])
        else:  # other ranks have no release clock: use the engine's timestamps
            first = sched.by_id[f"{c.conv}#0"]
            traj.append(sched.by_id[last].finish_time - first.submit_time)
    d_iters = [h for h in engine.history if h.d_rows > 0]
    spans = [h.span for h in engine.history if h.span > 0]
    # first release -> last token: a trace whose first arrival is past 0 s does not count the
    # idle time before it (the engine's own timestamps, the same on every rank's clock)
    makespan = (max(o.finish_time for o in outs.values())
                - min(o.submit_time for o in outs.values()))
    return ReplayMetrics(
        requests=len(outs), conversations=len(trace.conversations), makespan_s=makespan,
        requests_per_s=len(outs) / makespan,
        request_p50_s=float(np.percentile(req_lat, 50)),
        request_p99_s=float(np.percentile(req_lat, 99)),
        trajectory_p50_s=float(np.percentile(traj, 50)),
        trajectory_p99_s=float(np.percentile(traj, 99)),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        mean_d_wait_ms=1e3 * float(np.mean([h.d_wait_s for h in d_iters])) if d_iters else 0.0,
        mean_span=float(np.mean(spans)) if spans else 0.0,
        d_iterations=len(d_iters), evictions=sched.evictions,
        output_tokens=sum(len(o.tokens) for o in outs.values()),
        preemptions=sched.preemptions,
    )
