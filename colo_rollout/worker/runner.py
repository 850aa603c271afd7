"""Model runner: turns one ``StepPlan`` into this rank's tensors, runs the model, samples.

Owns the device-side view of a plan (token ids, positions, slot mappings, block tables, padding
to the D bucket) and the KV storage. Everything it needs comes in the plan (block tables and
sampling parameters included: plan.py); it never reads the scheduler. It returns the sampled
tokens of its replica (leader only) as plain values.

Every rank runs every non-IDLE plan -- a replica without work still runs the phase with zero
(P) or padding (D) rows -- because the phase's collectives span all ranks.

On a GPU in PD modes, P is enqueued under the route's P stream and D under its D stream; the
sampled tokens come back as ``PendingSampled`` so that neither phase's host enqueue waits for
the other's GPU work (the engine resolves them at the end of its step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from colo_rollout.model.dense_prefill import dense_calls, varlen_call
from colo_rollout.model.attention import AttnMetadata, prefill_buckets
from colo_rollout.worker.decode_graph import DecodeGraphs, graphs_supported
from colo_rollout.model.model import DecodeInputs, InferenceGPT, PrefillInputs
from colo_rollout.sched.plan import Phase, Sampled, StepPlan
from colo_rollout.worker.prefill_graph import PrefillMoEGraphs
from colo_rollout.worker.sampler import Draw, draw_for, sample_tensors
from colo_rollout.worker.speculate import ROWS_PER_SEQUENCE, verify_and_draft
from colo_rollout.runtime.device import Pending, PinnedStage, h2d, h2d_packed, wait_event
from colo_rollout.multiplex.stream_route import StreamRoute



def _nothing() -> None:
    pass


def _marker(device: torch.device) -> torch.cuda.Event | None:
    """A CUDA event at the current stream's end (None on CPU: work there is already done)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


@dataclass
class RoutingRows:
    """A phase run's recorded expert ids (model/routing_record.py) on their way to the host,
    and whose they are: ``rows`` (lifetime, first position, count, first buffer row) -- every
    replica's rows, on every rank (the gather backend routes them all everywhere); with a
    dispatch backend the rank's own (``ModelRunner._record_span``). ``stamp``: the run's plan
    step + 1, the same on every rank (the routing store keeps the latest per position)."""

    pending: Pending
    rows: list[tuple[int, int, int, int]]
    stamp: int = 1

    def resolve(self, timeout_s: float | None = None):
        """[(lifetime, first position, ids [count, MoE layers, k] int16)]."""
        ids = self.pending.tensors(timeout_s, "recorded routing")[0]  # [L, rows, k]
        return [(lt, pos, ids[:, b : b + n].transpose(0, 1)) for lt, pos, n, b in self.rows]


class PendingSampled:
    """Sampled tokens of one phase run, their device->host copy in flight. A rank without
    tokens to return (not a replica leader, or no rows) holds a CUDA event at the end of the
    run instead, so ``done``/``wait`` still tell when its GPU work finished. ``routing``: the
    run's recorded expert ids (engine.record_routing), on every rank."""

    # the pending copy's layouts: "plain" (tokens [n], logprobs [n]); packed in one float64
    # tensor: "greedy" [2, n] (a D graph's greedy rows), "mtp_p" [3, n] (tokens, logprobs,
    # drafts: an MTP-drafting P), "mtp_d" [6, n] (worker/speculate.py)
    LAYOUTS = ("plain", "greedy", "mtp_p", "mtp_d")

    def __init__(self, lifetimes: list[int] = (), pending: Pending | None = None,
                 marker: torch.cuda.Event | None = None, packed: bool | str = False,
                 routing: RoutingRows | None = None) -> None:
        self.lifetimes = list(lifetimes)
        self._pending = pending
        self._layout = packed if isinstance(packed, str) else ("greedy" if packed else "plain")
        if self._layout not in self.LAYOUTS:
            raise ValueError(f"unknown sampled layout {packed!r}")
        self._marker = marker
        self.routing = routing

    def done(self) -> bool:
        if self._pending is not None:
            return self._pending.done()
        return self._marker is None or self._marker.query()

    def wait(self, timeout_s: float | None = None, what: str = "sampled tokens") -> None:
        """Block until the run's GPU work (and its token copy) finished; values stay put.
        ``timeout_s`` bounds the wait (DeviceStall, naming ``what``)."""
        if self._pending is not None:
            self._pending.wait(timeout_s, what)
        elif self._marker is not None:
            wait_event(self._marker, timeout_s, what)

    def resolve(self, timeout_s: float | None = None,
                what: str = "sampled tokens") -> list[Sampled]:
        if self._pending is None:
            return []
        got = self._pending.get(timeout_s, what)
        lts = self.lifetimes
        if self._layout == "mtp_p":
            tokens, logprobs, drafts = got[0]
            return [Sampled(lt, int(t), lp, (), int(d))
                    for lt, t, lp, d in zip(lts, tokens, logprobs, drafts)]
        if self._layout == "mtp_d":
            y0, lp0, y1, lp1, acc, drafts = got[0]
            return [Sampled(lt, int(a), la, ((int(b), lb),) if ok else (), int(d))
                    for lt, a, la, b, lb, ok, d in zip(lts, y0, lp0, y1, lp1, acc, drafts)]
        tokens, logprobs = got[0] if self._layout == "greedy" else got
        return [Sampled(lt, int(t), lp) for lt, t, lp in zip(lts, tokens, logprobs)]


def prefill_index(items, block_size: int, sink: int):
    """Host index arrays of one replica's P items (numpy int64, no per-token Python loop):
    token ids [T], positions [T] (item i's tokens at start_i, start_i + 1, ...), KV slots [T]
    (``table[p // block_size] * block_size + p % block_size``) and the block tables [S, W]
    padded with ``sink`` to the longest (W >= 1; [0, 1] without items)."""
    S = len(items)
    news = np.fromiter((len(it.tokens) for it in items), dtype=np.int64, count=S)
    T = int(news.sum())
    # per item: the ids the scheduler converted at submit (``PrefillItem.ids``), else fromiter
    # over the tuple with its count -- the cheapest conversion of Python ints, 0.16 ms per 4k
    # on the 2-core machine, on the step's critical path
    parts = [it.ids if it.ids is not None
             else np.fromiter(it.tokens, dtype=np.int64, count=len(it.tokens)) for it in items]
    ids = parts[0] if S == 1 else np.concatenate(parts) if S else np.zeros(0, np.int64)
    lens = np.fromiter((len(it.table) for it in items), dtype=np.int64, count=S)
    W = max(int(lens.max()) if S else 1, 1)
    tables = np.full((S, W), sink, dtype=np.int64)
    for s, it in enumerate(items):  # (fromiter: ~4x faster than a slice set from a tuple)
        tables[s, : lens[s]] = np.fromiter(it.table, dtype=np.int64, count=lens[s])
    ends = np.cumsum(news)  # each item's rows end here
    pos = np.arange(T, dtype=np.int64)
    if S == 1:  # (one item, the long-prompt case: no per-row offsets to gather)
        pos += items[0].start
    elif S:
        starts = np.fromiter((it.start for it in items), dtype=np.int64, count=S)
        pos += np.repeat(starts - (ends - news), news)
    if block_size & (block_size - 1) == 0:  # a power of two: shifts and masks
        blk = pos >> (int(block_size).bit_length() - 1)
        off = pos & (block_size - 1)
    else:
        blk = pos // block_size
        off = pos - blk * block_size
    # positions rise within an item, so its last row holds its largest block; checked
    # against the item's own table (past it, a slot would come from the sink padding)
    past = (news > 0) & (blk[ends - 1] >= lens) if T else np.zeros(S, dtype=bool)
    if past.any():
        s = int(past.argmax())
        raise IndexError(f"a P item's position {int(pos[ends[s] - 1])} is past its block "
                         f"table ({int(lens[s])} blocks of {block_size})")
    # through the flat table: cheaper than 2-D fancy indexing
    rows = tables[0][blk] if S == 1 else tables.ravel()[np.repeat(np.arange(S) * W, news) + blk]
    slots = rows * block_size + off
    return ids, pos, slots, tables


class ModelRunner:
    def __init__(self, model: InferenceGPT, num_blocks: int, block_size: int, seed: int,
                 route: StreamRoute | None = None, graphs_max_blocks: int = 0,
                 prefill_merge_pairs: int = 0, prefill_graph_tokens: int = 0) -> None:
        self.model = model
        self.prefill_merge_pairs = prefill_merge_pairs  # see attention.prefill_buckets
        self.route = route or StreamRoute(model.device, active=False,
                                          route_p_collective=False)
        model.comm.route = self.route
        self.groups = model.groups
        self.device = model.device
        self.kv = model.new_kv_storage(num_blocks, block_size)
        self.block_size = block_size
        # one random stream per replica: replicas sample different rows, and identical streams
        # would correlate their samples (the same noise for every replica's first row); renew()
        # re-seeds it the same way
        self.generator = torch.Generator(device=self.device).manual_seed(
            seed * 1_000_003 + self.groups.replica)
        self.num_blocks = num_blocks
        self._p_stage = PinnedStage()  # P inputs' pinned buffer (runtime/device.py)
        # D by CUDA-graph replay (graphs_max_blocks > 0, CUDA, host-sync-free experts)
        self.graphs_max_blocks = graphs_max_blocks
        self._capture_stream = (torch.cuda.Stream(self.device)
                                if self.device.type == "cuda" else None)
        self.graphs = self._new_graphs()
        # P's MoE blocks by CUDA-graph replay: wherever D graphs are, for P steps of up to
        # prefill_graph_tokens tokens over all replicas (0: off)
        self.prefill_graph_tokens = prefill_graph_tokens
        self.prefill_graphs = self._new_prefill_graphs()
        self._epoch = None  # the in-flight P epoch's segment generator (PD mode)
        self._epoch_plan = None
        self._epoch_items = ()
        self._at: int | None = None

    def renew(self, route: StreamRoute, seed: int, prefill_merge_pairs: int,
              prefill_graph_tokens: int) -> None:
        """Serve a new engine on the worker (idle only): its streams, a re-seeded sampler, its P
        settings. The KV storage and the D and P graphs stay (graphs replay on the current
        stream)."""
        if self._epoch is not None:
            raise RuntimeError("renew() with a P epoch in flight")
        self.route = route
        self.model.comm.route = route
        self.generator.manual_seed(seed * 1_000_003 + self.groups.replica)
        self.prefill_merge_pairs = prefill_merge_pairs
        if prefill_graph_tokens != self.prefill_graph_tokens:  # another capacity, or off
            if self.prefill_graphs is not None:
                self.prefill_graphs.release()
            self.prefill_graph_tokens = prefill_graph_tokens
            self.prefill_graphs = self._new_prefill_graphs()

    def _new_graphs(self) -> DecodeGraphs | None:
        if self.graphs_max_blocks > 0 and graphs_supported(self.model):
            return DecodeGraphs(self.model, self.kv, self.graphs_max_blocks,
                                self._capture_stream, self.generator)
        return None

    def _new_prefill_graphs(self) -> PrefillMoEGraphs | None:
        if self.graphs is not None and self.prefill_graph_tokens > 0:
            return PrefillMoEGraphs(self.model, self.prefill_graph_tokens, self._capture_stream)
        return None

    def check_weights(self) -> None:
        """Idle engine only: drop every graph that captured a replaced parameter's address
        (both phases' graphs read the same parameters). model.fp8: a replaced parameter's FP8
        copy is re-quantised first (InferenceGPT.check_fp8)."""
        self.model.check_fp8()
        if self.graphs is not None and self.graphs.check_weights():
            if self.prefill_graphs is not None:
                self.prefill_graphs.release()

    def release_graphs(self) -> None:
        """Drop the D and P graphs (D's hold NCCL collectives: before groups are destroyed)."""
        for g in (self.graphs, self.prefill_graphs):
            if g is not None:
                g.release()

    def release_kv(self) -> None:
        """Drop the KV storage and the graphs (D's point into it; P's and their buffers are
        memory too) -- memory release."""
        self.release_graphs()
        self.graphs = self.prefill_graphs = None
        self.kv = None

    def resume_kv(self) -> None:
        self.kv = self.model.new_kv_storage(self.num_blocks, self.block_size)
        self.graphs = self._new_graphs()
        self.prefill_graphs = self._new_prefill_graphs()

    def _moe_block(self):
        """How P computes its MoE blocks: graph replay where there are P graphs and the step
        fits them, else the modules (None)."""
        return self.prefill_graphs

    def run(self, plan: StepPlan) -> PendingSampled:
        """Normal mode: the whole plan (one P epoch or one D iteration)."""
        if plan.phase is Phase.IDLE:
            return PendingSampled()
        if plan.phase is Phase.PREFILL:
            with self.route.mark("P"):
                items = plan.replicas[self.groups.replica].prefill
                got = self.model.forward_prefill(self._prefill_inputs(plan), self.kv,
                                                 self._moe_block(), self._p_sampler(items))
                out = self._prefill_out(got, items)
                out.routing = self._p_routing(plan)
                return out
        return self.run_decode(plan)

    def _p_sampler(self, items):
        """What an MTP-drafting P samples its first tokens with, inside the forward (the MTP
        pass reads them): every rank of the replica samples alike -- the full-vocabulary
        logits and the replica's generator are the same on each -- so every rank holds the
        tokens its MTP pass embeds. None without MTP (the leader samples after P)."""
        if not self.model.mtp_draft:
            return None
        params = [it.params for it in items]
        return lambda logits: sample_tensors(logits[: len(params)], params, self.generator)

    def _prefill_out(self, got, items) -> PendingSampled:
        """P's result as the pending tokens: logits sampled now (the leader), or an MTP P's
        (tokens, logprobs, draft logits)."""
        if not self.model.mtp_draft:
            return self._sample(got, items)
        tokens, logprobs, draft_logits = got
        lifetimes = [it.lifetime for it in items]
        if not self.groups.is_replica_leader or not lifetimes:
            return PendingSampled(marker=_marker(self.device))
        packed = torch.stack([tokens.double(), logprobs.double(),
                              draft_logits.argmax(dim=-1).double()])
        return PendingSampled(lifetimes, Pending(packed), packed="mtp_p")

    def _p_routing(self, plan: StepPlan) -> RoutingRows | None:
        """P's recorded ids: every replica's items, their tokens in the order P's rows hold
        them (replica by replica) -- or only the rows this rank routed where the record holds
        a rank's own rows (a dispatch backend: ``InferenceGPT.records_own_rows``)."""
        rec = self.model.routing
        if rec is None:
            return None
        counts = [w.prefill_tokens for w in plan.replicas]
        lo, hi = self._record_span(counts)
        rows, off = [], 0
        for w in plan.replicas:
            for p in w.prefill:
                a, b = max(off, lo), min(off + len(p.tokens), hi)
                if b > a:
                    rows.append((p.lifetime, p.start + a - off, b - a, a))
                off += len(p.tokens)
        return RoutingRows(rec.read("P", off), rows, plan.step + 1)

    def _d_routing(self, plan: StepPlan) -> RoutingRows | None:
        """D's recorded ids: replica r's rows sit at [r * bucket, r * bucket + rows) (only
        the rows this rank routed, as for P, with a dispatch backend)."""
        rec = self.model.routing
        if rec is None:
            return None
        # engine.mtp: each sequence's two verify rows, positions n and n + 1 (a rejected
        # draft's n + 1 is recomputed, and re-recorded, by the next iteration)
        per = ROWS_PER_SEQUENCE if self.model.mtp_draft else 1
        B = per * plan.bucket
        lo, hi = self._record_span([B] * len(plan.replicas))
        rows = []
        for r, w in enumerate(plan.replicas):
            for j, d in enumerate(w.decode):
                first = r * B + per * j
                a, b = max(first, lo), min(first + per, hi)
                if b > a:
                    rows.append((d.lifetime, d.position + a - first, b - a, a))
        return RoutingRows(rec.read("D", B * len(plan.replicas)), rows, plan.step + 1)

    def _record_span(self, counts: list[int]) -> tuple[int, int]:
        """The record rows [lo, hi) this rank's routers wrote, of a phase run whose replicas
        hold ``counts`` rows each, replica by replica: all of them with the gather backend;
        with a dispatch backend its replica's, split over attention TP as the dispatchers
        split them (model.py: ``_dispatch_prefill_moe``, ``_dispatch_decode_moe``)."""
        if not self.model.records_own_rows:
            return 0, sum(counts)
        r = self.groups.replica
        atp, a = self.groups.layout.atp, self.groups.atp_rank
        off, n = sum(counts[:r]), counts[r]
        return off + n * a // atp, off + n * (a + 1) // atp

    def run_decode(self, plan: StepPlan, epoch: int = -1) -> PendingSampled:
        """One D iteration over the plan's D rows (every rank; padding where a replica has
        fewer rows than the bucket), enqueued on D's stream."""
        with self.route.d(), self.route.mark("D", epoch):
            host = self._decode_host(plan)
            rows = plan.replicas[self.groups.replica].decode
            if self.model.mtp_draft:
                out = self._run_mtp_decode(plan, host, rows)
                out.routing = self._d_routing(plan)
                return out
            if self.graphs is None:
                logits = self.model.forward_decode(self._decode_inputs(*host), self.kv)
                out = self._sample_decode(logits, rows)
            else:
                g = self.graphs.run(*host, plan.table_blocks)
                draw = draw_for(d.params for d in rows)
                if not self.groups.is_replica_leader or not rows:
                    out = PendingSampled(marker=_marker(self.device))
                else:  # sampled inside a graph: one copy brings the rows back
                    packed = (g.packed if draw is Draw.GREEDY else
                              self.graphs.draw(g, [d.params for d in rows], draw))
                    out = PendingSampled([d.lifetime for d in rows],
                                         Pending(packed[:, : len(rows)]), packed=True)
            out.routing = self._d_routing(plan)
            return out

    def _sample_decode(self, logits: torch.Tensor, rows) -> PendingSampled:
        """A D iteration's rows sampled eagerly (leader only), as the graphs would: over the
        whole bucket (``logits`` [bucket, V], padding rows greedy) by the draw graphs' ops,
        so a seed gives the same tokens with and without graphs."""
        if not self.groups.is_replica_leader or not rows:
            return PendingSampled(marker=_marker(self.device))
        n = len(rows)
        tokens, logprobs = sample_tensors(logits, [d.params for d in rows], self.generator)
        return PendingSampled([d.lifetime for d in rows], Pending(tokens[:n], logprobs[:n]))

    def _run_mtp_decode(self, plan: StepPlan, host, rows) -> PendingSampled:
        """One MTP D iteration (worker/speculate.py): the verify forward over 2 rows per
        sequence and the MTP draft -- with graphs, one replay when every row of every replica
        is greedy (sampled inside it), else the replay and its draw graph (temperature or
        truncated rows: the draw, the verify and the MTP pass); without graphs the same ops
        eagerly. The draw is decided over every replica's rows: the MTP pass after it has
        collectives over the world, so every rank must take the same path. Every rank samples
        (the MTP pass embeds the tokens)."""
        n = len(rows)
        draw = draw_for(d.params for w in plan.replicas for d in w.decode)
        if self.graphs is not None:
            g = self.graphs.run(*host, plan.table_blocks)
            if draw is Draw.GREEDY:
                packed = g.packed
            else:
                packed = self.graphs.draw(g, [d.params for d in rows
                                              for _ in range(ROWS_PER_SEQUENCE)], draw)
        else:
            inputs = self._decode_inputs(*host)
            logits, hidden = self.model.forward_decode(inputs, self.kv, hidden=True)
            packed = self._verify_eagerly(inputs, logits, hidden, rows, draw)
        if not self.groups.is_replica_leader or not rows:
            return PendingSampled(marker=_marker(self.device))
        return PendingSampled([d.lifetime for d in rows], Pending(packed[:, :n]),
                              packed="mtp_d")

    def _verify_eagerly(self, inputs, logits, hidden, rows, draw: Draw) -> torch.Tensor:
        """Sample every verify row with its sequence's parameters (``draw``: the world's, as
        ``_run_mtp_decode`` decides it, so the random stream advances as the draw graphs'
        would), then verify + draft."""
        params = [d.params for d in rows for _ in range(ROWS_PER_SEQUENCE)]
        tokens, logprobs = sample_tensors(logits, params, self.generator, draw)
        return verify_and_draft(self.model, self.kv, inputs, logits, hidden, tokens, logprobs)

    # ------------------------------------------------------------------ P epochs (PD mode)
    @property
    def epoch_active(self) -> bool:
        return self._epoch is not None

    def start_epoch(self, plan: StepPlan) -> None:
        """Build the epoch's inputs now (block tables as reserved at admission) and hold P as
        a segment generator; nothing runs until ``advance``."""
        if self._epoch is not None:
            raise RuntimeError("a P epoch is already in flight")
        with self.route.p():
            inputs = self._prefill_inputs(plan)
        gen = self.model.prefill_segments(inputs, self.kv, self._moe_block(),
                                          self._p_sampler(plan.replicas[self.groups.replica]
                                                          .prefill))
        self._epoch = gen
        self._epoch_plan = plan
        self._epoch_items = plan.replicas[self.groups.replica].prefill
        self._at = None  # boundary P is parked at (its collective not yet issued)

    def advance(self, ctl, on_boundary=None) -> PendingSampled | None:
        """Run P until it is parked at its permitted endpoint (returns None) or the epoch is
        complete (returns the sampled first tokens; leader ranks only have values). P's
        kernels go on P's stream (its routed collectives on D's). ``on_boundary()`` is called
        after each boundary's work is enqueued (the engine's D-wait clock)."""
        with self.route.p(), self.route.mark("P", ctl.epoch):
            return self._advance(ctl, on_boundary or _nothing)

    def _advance(self, ctl, on_boundary) -> PendingSampled | None:
        if self._at is None:
            self._at = next(self._epoch)  # compute up to boundary 0
            ctl.publish(ctl.epoch, self._at, self.model.boundary_producer)
            on_boundary()
        while ctl.may_cross(self._at):
            try:
                nxt = next(self._epoch)  # issue the collective after self._at, compute on
                on_boundary()
            except StopIteration as done:
                ctl.complete(ctl.epoch)
                items, self._epoch, self._epoch_items = self._epoch_items, None, ()
                # items cancelled during the epoch are sampled too: the scheduler's commit
                # discards a result whose lifetime is no longer live
                out = self._prefill_out(done.value, items)
                out.routing = self._p_routing(self._epoch_plan)
                self._epoch_plan = None
                return out
            ctl.publish(ctl.epoch, nxt, self.model.boundary_producer)
            self._at = nxt
        return None

    def _sample(self, logits: torch.Tensor, items) -> PendingSampled:
        lifetimes = [it.lifetime for it in items]
        if not self.groups.is_replica_leader or not lifetimes:
            return PendingSampled(marker=_marker(self.device))
        params = [it.params for it in items]
        tokens, logprobs = sample_tensors(logits[: len(lifetimes)], params, self.generator)
        return PendingSampled(lifetimes, Pending(tokens, logprobs))

    def _slots(self, table, positions: range) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in positions]

    def _tables(self, tables) -> torch.Tensor:
        width = max((len(t) for t in tables), default=1)
        sink = self.kv.sink_block
        padded = [[*t, *[sink] * (width - len(t))] for t in tables]
        return h2d(padded, torch.int64, self.device)

    def _prefill_inputs(self, plan: StepPlan) -> PrefillInputs:
        r = self.groups.replica
        mine = plan.replicas[r].prefill
        new = [len(item.tokens) for item in mine]
        ctx = [item.start + n for item, n in zip(mine, new)]
        ids, pos, slots, tables = prefill_index(mine, self.block_size, self.kv.sink_block)
        row_counts = [w.prefill_tokens for w in plan.replicas]
        last_counts = [len(w.prefill) for w in plan.replicas]
        last_rows, off = [], 0
        for w in plan.replicas:
            for p in w.prefill:
                off += len(p.tokens)
                last_rows.append(off - 1)
        dev = self.device
        # the attention kernels' plan rides the same copy (int32 tables as int64 words)
        plan = self.model.prefill_plan(new, ctx) if mine else None
        # the dense calls' sequences: the kernel plan's (GQA), else MLA's own
        held = plan.dense if plan is not None else self.model.dense_prefill(new, ctx)
        dense = frozenset(s for s, _, _ in held)
        ids_d, pos_d, slots_d, tables_d, ctx_d, last_d, *plan_d = h2d_packed(
            [ids, pos, slots, tables, ctx, last_rows]
            + ([plan.packed()] if plan is not None else []), dev, self._p_stage)
        attn = AttnMetadata(
            is_prefill=True,
            positions=pos_d,
            slot_mapping=slots_d,
            block_tables=tables_d,
            context_lens=ctx_d,
            seq_lens_new=new, context_lens_host=ctx,
            # the bucketed SDPA path's batches (but the dense calls' sequences); the Triton
            # kernel makes its own launch plan
            buckets=(prefill_buckets(new, ctx, self.block_size, lambda v, t: h2d(v, t, dev),
                                     self.prefill_merge_pairs,
                                     skip=dense)
                     if self.model.bucketed_prefill else []),
            dense_calls=dense_calls(held, dev),
        )
        if plan is not None:
            attn.prefill_plan = plan.on_device(plan_d[0])
        rest = tuple(s for s in range(len(mine)) if s not in dense)
        if self.model.varlen_prefill and rest:
            attn.varlen = varlen_call(rest, new, ctx, tables_d, self.block_size,
                                      lambda v, t: h2d(v, t, dev))
        return PrefillInputs(
            token_ids=ids_d, attn=attn,
            row_counts=row_counts, last_counts=last_counts,
            last_rows=last_d,
        )

    def _decode_host(self, plan: StepPlan):
        """Host values of one D iteration, padded to the bucket with sink rows:
        (ids, positions, slots, context lengths, block tables)."""
        r = self.groups.replica
        rows = plan.replicas[r].decode
        B = plan.bucket
        sink = self.kv.sink_block
        if self.model.mtp_draft:  # the verify rows: (token, n) and (draft, n + 1) per sequence
            ids = [t for d in rows for t in (d.token, max(d.draft, 0))]
            pos = [p for d in rows for p in (d.position, d.position + 1)]
            tables = [d.table for d in rows for _ in range(ROWS_PER_SEQUENCE)]
            pad = ROWS_PER_SEQUENCE * (B - len(rows))
        else:
            ids = [d.token for d in rows]
            pos = [d.position for d in rows]
            tables = [d.table for d in rows]
            pad = B - len(rows)
        ids, pos = ids + [0] * pad, pos + [0] * pad
        tables = tables + [(sink,)] * pad
        slots = [self._slots(t, range(p, p + 1))[0] for t, p in zip(tables, pos)]
        return ids, pos, slots, [p + 1 for p in pos], tables

    def _decode_inputs(self, ids, pos, slots, ctx, tables) -> DecodeInputs:
        dev, i64 = self.device, torch.int64
        attn = AttnMetadata(
            is_prefill=False,
            positions=h2d(pos, i64, dev),
            slot_mapping=h2d(slots, i64, dev),
            block_tables=self._tables(tables),
            context_lens=h2d(ctx, i64, dev),
            seq_lens_new=[], context_lens_host=[],
        )
        return DecodeInputs(token_ids=h2d(ids, i64, dev), attn=attn)
