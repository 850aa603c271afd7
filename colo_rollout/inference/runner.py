"""Model runner: turns one ``StepPlan`` into this rank's tensors, runs the model, samples.

Owns the device-side view of a plan (token ids, positions, slot mappings, block tables, padding
to the D bucket) and the KV storage. It reads block tables from the scheduler but never changes
scheduler state; it returns the sampled tokens of its replica (leader only) as plain values.

Every rank runs every non-IDLE plan -- a replica without work still runs the phase with zero
(P) or padding (D) rows -- because the phase's collectives span all ranks.
"""

from __future__ import annotations

import torch

from colo_rollout.inference.attention import AttnMetadata
from colo_rollout.inference.model import DecodeInputs, InferenceGPT, PrefillInputs
from colo_rollout.inference.plan import Phase, StepPlan
from colo_rollout.inference.sampler import sample
from colo_rollout.inference.scheduler import Sampled, Scheduler

PRODUCER = "gather"  # the gather backend's boundary producer (registered layer points)


class ModelRunner:
    def __init__(self, model: InferenceGPT, num_blocks: int, block_size: int, seed: int) -> None:
        self.model = model
        self.groups = model.groups
        self.device = model.output_layer.weight.device
        self.kv = model.new_kv_storage(num_blocks, block_size)
        self.block_size = block_size
        # one random stream per replica: replicas sample different rows, and identical streams
        # would correlate their samples (the same noise for every replica's first row)
        self.generator = torch.Generator(device=self.device).manual_seed(
            seed * 1_000_003 + self.groups.replica)
        self._epoch = None  # the in-flight P epoch's segment generator (PD mode)
        self._epoch_items = ()
        self._at: int | None = None

    def run(self, plan: StepPlan, sched: Scheduler) -> list[Sampled]:
        """Normal mode: the whole plan (one P epoch or one D iteration)."""
        if plan.phase is Phase.IDLE:
            return []
        if plan.phase is Phase.PREFILL:
            logits = self.model.forward_prefill(self._prefill_inputs(plan, sched), self.kv)
            return self._sample(logits, plan.replicas[self.groups.replica].prefill, sched)
        return self.run_decode(plan, sched)

    def run_decode(self, plan: StepPlan, sched: Scheduler) -> list[Sampled]:
        """One D iteration over the plan's D rows (every rank; padding where a replica has
        fewer rows than the bucket)."""
        logits = self.model.forward_decode(self._decode_inputs(plan, sched), self.kv)
        return self._sample(logits, plan.replicas[self.groups.replica].decode, sched)

    # ------------------------------------------------------------------ P epochs (PD mode)
    @property
    def epoch_active(self) -> bool:
        return self._epoch is not None

    def start_epoch(self, plan: StepPlan, sched: Scheduler) -> None:
        """Build the epoch's inputs now (block tables as reserved at admission) and hold P as
        a segment generator; nothing runs until ``advance``."""
        if self._epoch is not None:
            raise RuntimeError("a P epoch is already in flight")
        gen = self.model.prefill_segments(self._prefill_inputs(plan, sched), self.kv)
        self._epoch = gen
        self._epoch_items = plan.replicas[self.groups.replica].prefill
        self._at = None  # boundary P is parked at (its collective not yet issued)

    def advance(self, ctl, sched: Scheduler) -> list[Sampled] | None:
        """Run P until it is parked at its permitted endpoint (returns None) or the epoch is
        complete (returns the sampled first tokens; leader ranks only have values)."""
        if self._at is None:
            self._at = next(self._epoch)  # compute up to boundary 0
            ctl.publish(ctl.epoch, self._at, PRODUCER)
        while ctl.may_cross(self._at):
            try:
                nxt = next(self._epoch)  # issue the collective after self._at, compute on
            except StopIteration as done:
                ctl.complete(ctl.epoch)
                items, self._epoch, self._epoch_items = self._epoch_items, None, ()
                live = [p for p in items if p.lifetime in sched.seqs]  # cancelled: discarded
                keep = [i for i, p in enumerate(items) if p.lifetime in sched.seqs]
                return self._sample(done.value[keep], live, sched)
            ctl.publish(ctl.epoch, nxt, PRODUCER)
            self._at = nxt
        return None

    def _sample(self, logits: torch.Tensor, items, sched: Scheduler) -> list[Sampled]:
        lifetimes = [it.lifetime for it in items]
        if not self.groups.is_replica_leader or not lifetimes:
            return []
        params = [sched.seqs[lt].request.params for lt in lifetimes]
        tokens, logprobs = sample(logits[: len(lifetimes)], params, self.generator)
        return [Sampled(lt, t, lp) for lt, t, lp in zip(lifetimes, tokens, logprobs)]

    def _slots(self, table: list[int], positions: range) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in positions]

    def _tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in tables), default=1)
        sink = self.kv.sink_block
        padded = [t + [sink] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.int64, device=self.device)

    def _prefill_inputs(self, plan: StepPlan, sched: Scheduler) -> PrefillInputs:
        r = self.groups.replica
        mine = plan.replicas[r].prefill
        ids, pos, slots, tables, ctx, new = [], [], [], [], [], []
        for item in mine:
            table = sched.block_table(r, item.lifetime)
            span = range(item.start, item.start + len(item.tokens))
            ids.extend(item.tokens)
            pos.extend(span)
            slots.extend(self._slots(table, span))
            tables.append(table)
            ctx.append(span.stop)
            new.append(len(item.tokens))
        row_counts = [w.prefill_tokens for w in plan.replicas]
        last_counts = [len(w.prefill) for w in plan.replicas]
        last_rows, off = [], 0
        for w in plan.replicas:
            for p in w.prefill:
                off += len(p.tokens)
                last_rows.append(off - 1)
        dev = self.device
        attn = AttnMetadata(
            is_prefill=True,
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=self._tables(tables) if tables else torch.zeros(0, 1, dtype=torch.int64, device=dev),
            context_lens=torch.tensor(ctx, dtype=torch.int64, device=dev),
            seq_lens_new=new, context_lens_host=ctx,
        )
        return PrefillInputs(
            token_ids=torch.tensor(ids, dtype=torch.int64, device=dev), attn=attn,
            row_counts=row_counts, last_counts=last_counts,
            last_rows=torch.tensor(last_rows, dtype=torch.int64, device=dev),
        )

    def _decode_inputs(self, plan: StepPlan, sched: Scheduler) -> DecodeInputs:
        r = self.groups.replica
        rows = plan.replicas[r].decode
        B = plan.bucket
        sink = self.kv.sink_block
        ids = [d.token for d in rows] + [0] * (B - len(rows))
        pos = [d.position for d in rows] + [0] * (B - len(rows))
        tables = [sched.block_table(r, d.lifetime) for d in rows] + [[sink]] * (B - len(rows))
        slots = [self._slots(t, range(p, p + 1))[0] for t, p in zip(tables, pos)]
        dev = self.device
        attn = AttnMetadata(
            is_prefill=False,
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=self._tables(tables),
            context_lens=torch.tensor([p + 1 for p in pos], dtype=torch.int64, device=dev),
            seq_lens_new=[], context_lens_host=[],
        )
        return DecodeInputs(token_ids=torch.tensor(ids, dtype=torch.int64, device=dev), attn=attn)
