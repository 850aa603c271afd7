"""``engine.kv_reservation: on_demand`` in the scheduler (pure Python: no processes, no torch):
blocks held as tokens need them, idle retained contexts dropped and then the running row that
arrived last preempted when a replica runs out, the preempted request prefilled again from its
prompt and its tokens so far.

A deterministic stand-in for the model picks each next token from the whole sequence before it
(prompt and tokens so far), so a run's outputs do not depend on how it was scheduled: every
on-demand run below -- preempting or not, Normal steps or PD rounds, with MTP-style drafts and
multi-turn sessions -- must give the outputs of a run with full reservations and ample blocks.
Each step checks the scheduler's integrity and that every D row's table holds the positions
its forward writes."""

from __future__ import annotations

import random

import pytest

from colo_rollout.config import EngineConfig
from colo_rollout.sched.plan import Phase, PrefillItem, Sampled
from colo_rollout.sched.request import FinishReason, Request, SamplingParams
from colo_rollout.sched.scheduler import Scheduler

VOCAB, EOS, BS = 97, 3, 4


def cfg(**kw) -> EngineConfig:
    base = dict(max_batch_size=8, max_prefill_tokens=256, kv_block_size=BS, num_kv_blocks=24,
                max_seq_len=96, decode_buckets=[1, 2, 4, 8], eos_token_id=EOS,
                kv_reservation="on_demand")
    base.update(kw)
    return EngineConfig(**base)


def next_token(seq: tuple[int, ...]) -> int:
    """The stand-in model: a function of the whole sequence (never EOS unless the sum says)."""
    return (sum(t * (i + 1) for i, t in enumerate(seq)) * 31 + len(seq)) % VOCAB


def requests(n: int, seed: int, max_tokens=(8, 40)) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = tuple(rng.randrange(4, VOCAB) for _ in range(rng.randint(2, 12)))
        out.append(Request(f"r{i}", prompt,
                           SamplingParams(max_tokens=rng.randint(*max_tokens))))
    return out


class Drive:
    """Runs a scheduler to completion with the stand-in model; Normal steps or PD rounds
    (an epoch's P finishes ``epoch_rounds`` rounds after it starts); ``drafts``: every D row
    carries a draft (MTP-style: its forward writes length + 1 too), accepted when it is the
    model's next token."""

    def __init__(self, s: Scheduler, pd: bool = False, epoch_rounds: int = 2,
                 drafts: bool = False) -> None:
        self.s, self.pd, self.epoch_rounds, self.drafts = s, pd, epoch_rounds, drafts
        self.most_running = 0
        self.resumed_items = 0
        self.longest_p = 0

    def seq_of(self, lifetime: int) -> tuple[int, ...]:
        seq = self.s.seqs[lifetime]
        out = self.s.by_id[seq.request.request_id]
        ctx = tuple(seq.context_before or ())
        return ctx + tuple(seq.request.prompt) + tuple(out.tokens)

    def sample_p(self, item: PrefillItem) -> Sampled:
        seq = self.s.seqs[item.lifetime]
        full = tuple(seq.context_before or ()) + tuple(seq.request.prompt) + tuple(
            self.s.by_id[seq.request.request_id].tokens)
        # P writes positions start .. start + len - 1 of this sequence: its tokens are them
        assert full[item.start: item.start + len(item.tokens)] == item.tokens
        assert item.start + len(item.tokens) == len(full)
        if self.s.by_id[seq.request.request_id].tokens:
            self.resumed_items += 1
        self.longest_p = max(self.longest_p, len(item.tokens))
        assert len(item.table) * self.s.cfg.kv_block_size >= len(full)
        tok = next_token(full)
        return Sampled(item.lifetime, tok, -1.0,
                       draft=next_token(full + (tok,)) if self.drafts else -1)

    def sample_d(self, row) -> Sampled:
        full = self.seq_of(row.lifetime)
        writes = row.position + 1 + (row.draft >= 0)  # its input token, and the draft's place
        assert len(row.table) * self.s.cfg.kv_block_size >= writes, (row, writes)
        tok = next_token(full)
        more = ()
        if row.draft >= 0 and row.draft == tok:  # the draft verified: a bonus token
            nxt = next_token(full + (tok,))
            more = ((nxt, -1.0),)
            tok_after = nxt
        else:
            tok_after = tok
        seq_after = full + (tok,) + tuple(t for t, _ in more)
        draft = next_token(seq_after) if self.drafts else -1
        # half the drafts wrong (the stand-in's next token plus one), so both paths run
        if self.drafts and (len(seq_after) % 2):
            draft = (draft + 1) % VOCAB
        del tok_after
        return Sampled(row.lifetime, tok, -1.0, more=more, draft=draft)

    def run(self, reqs: list[Request], arrive_every: int = 1, limit: int = 5000) -> dict:
        s = self.s
        pending = list(reqs)
        epoch, epoch_age = None, 0
        for step in range(limit):
            for _ in range(arrive_every):
                if pending:
                    s.add(pending.pop(0))
            if not pending and not s.has_work() and epoch is None:
                break
            plan = s.plan(pd=self.pd)
            s.check_integrity()
            self.most_running = max(self.most_running, len(s.seqs))
            if self.pd:
                sampled = [self.sample_d(d) for w in plan.replicas for d in w.decode]
                done = None
                if plan.has_prefill:
                    epoch, epoch_age = plan, 0
                if epoch is not None:
                    epoch_age += 1
                    if epoch_age >= self.epoch_rounds:
                        sampled += [self.sample_p(p) for w in epoch.replicas for p in w.prefill
                                    if p.lifetime in s.seqs]
                        done, epoch = epoch, None
                s.commit(plan, sampled, epoch_done=done)
            else:
                if plan.phase is Phase.PREFILL:
                    sampled = [self.sample_p(p) for w in plan.replicas for p in w.prefill]
                else:
                    sampled = [self.sample_d(d) for w in plan.replicas for d in w.decode]
                s.commit(plan, sampled)
            s.check_integrity()
        else:
            raise AssertionError(f"not done after {limit} steps")
        for kv in s.kv:
            if not s.sessions:
                kv.assert_empty()
        return {rid: (tuple(o.tokens), o.finish_reason) for rid, o in s.by_id.items()}


def reference(reqs: list[Request], **kw) -> dict:
    """Full reservations and blocks enough for every request at once."""
    s = Scheduler(cfg(kv_reservation="full", num_kv_blocks=4096, max_batch_size=64,
                      decode_buckets=[1, 2, 4, 8, 16, 32, 64], **kw), 1, 1, VOCAB)
    return Drive(s).run(reqs)


@pytest.mark.parametrize("pd", [False, True])
@pytest.mark.parametrize("replicas", [1, 2])
def test_preempted_rows_resume_and_every_output_is_the_unpreempted_one(pd, replicas):
    reqs = requests(24, seed=replicas + 10 * pd)
    want = reference(reqs)
    s = Scheduler(cfg(), replicas, 1, VOCAB)
    d = Drive(s, pd=pd)
    got = d.run(reqs, arrive_every=3)
    assert got == want
    assert s.preemptions > 0 and d.resumed_items == s.preemptions
    assert all(reason in (FinishReason.STOP, FinishReason.LENGTH) for _, reason in got.values())


def test_on_demand_runs_more_rows_than_full_reservations_on_the_same_blocks():
    reqs = requests(16, seed=3, max_tokens=(60, 70))  # long budgets, short prompts
    full = Scheduler(cfg(kv_reservation="full", num_kv_blocks=40), 1, 1, VOCAB)
    d_full = Drive(full)
    d_full.run(reqs, arrive_every=16)
    lazy = Scheduler(cfg(num_kv_blocks=40), 1, 1, VOCAB)
    d_lazy = Drive(lazy)
    got = d_lazy.run(reqs, arrive_every=16)
    assert got == reference(reqs)
    # full: 40 blocks hold two budgets of ~72 tokens (18 blocks); on demand: the batch
    assert d_full.most_running == 2 and d_lazy.most_running == 8
    assert full.preemptions == 0


def test_drafts_get_their_lookahead_block():
    reqs = requests(12, seed=5)
    want = reference(reqs)
    s = Scheduler(cfg(num_kv_blocks=20), 1, 1, VOCAB)
    assert Drive(s, drafts=True).run(reqs, arrive_every=2) == want
    assert s.preemptions > 0


def test_the_first_arrival_always_progresses_on_the_least_blocks():
    # the blocks of one request's whole budget and no more: rows preempt each other, yet
    # every request finishes
    reqs = requests(6, seed=9, max_tokens=(30, 30))
    most = max(len(r.prompt) + 30 for r in reqs)
    s = Scheduler(cfg(num_kv_blocks=-(-most // BS), max_seq_len=most), 1, 1, VOCAB)
    assert Drive(s).run(reqs, arrive_every=6) == reference(reqs, max_seq_len=most)
    assert s.preemptions > 0


def test_a_preempted_session_turn_prefills_its_context_again():
    s = Scheduler(cfg(num_kv_blocks=16), 1, 1, VOCAB)
    d = Drive(s)
    first = Request("t0", (5, 6, 7, 8), SamplingParams(max_tokens=6), session="conv")
    others = [Request(f"o{i}", (9 + i, 10, 11), SamplingParams(max_tokens=40))
              for i in range(3)]
    d.run([first])
    ctx = tuple(s.sessions["conv"].context)
    assert len(ctx) == 10 and s.sessions["conv"].lifetime is not None
    # the next turn arrives after three long requests: its retained context is dropped and
    # the turn itself preempted as blocks run out, then prefilled from the whole context
    turn = Request("t1", (12, 13), SamplingParams(max_tokens=30), session="conv")
    got = d.run(others + [turn], arrive_every=4)
    assert s.preemptions + s.evictions > 0
    full = ctx + (12, 13) + got["t1"][0]
    # the turn's tokens are the model's continuation of the whole conversation
    seq = ctx + (12, 13)
    for tok in got["t1"][0]:
        assert tok == next_token(seq)
        seq += (tok,)
    assert tuple(s.sessions["conv"].context) == full
    s.close_session("conv")
    for kv in s.kv:
        kv.assert_empty()


def test_two_on_demand_schedulers_fed_the_same_calls_stay_identical():
    reqs = requests(20, seed=21)
    runs = []
    for _ in range(2):
        s = Scheduler(cfg(num_kv_blocks=18), 2, 1, VOCAB)
        runs.append((Drive(s).run(reqs, arrive_every=2), s.preemptions, s.step_no))
    assert runs[0] == runs[1] and runs[0][1] > 0


def test_cancel_of_a_preempted_request_keeps_its_tokens():
    s = Scheduler(cfg(num_kv_blocks=14), 1, 1, VOCAB)
    d = Drive(s)
    reqs = requests(4, seed=2, max_tokens=(40, 40))
    for r in reqs:
        s.add(r)
    for _ in range(200):  # until a request sits preempted in the queue
        plan = s.plan()
        if s._resumed:
            break
        if plan.phase is Phase.PREFILL:
            s.commit(plan, [d.sample_p(p) for w in plan.replicas for p in w.prefill])
        else:
            s.commit(plan, [d.sample_d(r) for w in plan.replicas for r in w.decode])
    rid = next(iter(s._resumed))
    tokens = list(s.by_id[rid].tokens)
    assert tokens and s.live[rid] is None and s.waiting[0].request_id == rid
    out = s.cancel(rid)
    assert out.tokens == tokens and out.finish_reason is FinishReason.CANCELLED
    assert rid not in s._resumed and rid not in s._arrival


@pytest.mark.parametrize("pd", [False, True])
def test_requests_one_prefill_could_not_redo_take_their_whole_budget(pd):
    # P steps of at most 24 tokens: a request whose prompt + max_tokens passes that could not
    # be prefilled again after a preemption, so it reserves its whole budget at admission and
    # is never preempted; the others grow and are; every request finishes, and no P (a
    # resumed one included) is longer than a step holds
    reqs = requests(12, seed=14, max_tokens=(4, 40))
    s = Scheduler(cfg(num_kv_blocks=16, max_prefill_tokens=24), 1, 1, VOCAB)
    whole = {r.request_id for r in reqs if len(r.prompt) + r.params.max_tokens > 24}
    assert whole and len(whole) < len(reqs)
    preempted = []
    inner = s._preempt

    def watched(seq):
        preempted.append(seq.request.request_id)
        inner(seq)

    s._preempt = watched
    d = Drive(s, pd=pd)
    assert d.run(reqs, arrive_every=6) == reference(reqs, max_prefill_tokens=24)
    assert preempted and not whole & set(preempted) and d.longest_p <= 24


def test_two_whole_budget_requests_never_deadlock():
    # found by probing: both past what one P step holds, each budget 8 of the 14 blocks --
    # the second preempted the first, whose resumed P then left no row to preempt
    reqs = [Request("B", tuple(range(4, 19)), SamplingParams(max_tokens=17)),
            Request("A", tuple(range(20, 36)), SamplingParams(max_tokens=16))]
    s = Scheduler(cfg(num_kv_blocks=14, max_prefill_tokens=16, max_seq_len=32), 1, 1, VOCAB)
    got = Drive(s).run(reqs, arrive_every=2)
    assert got == reference(reqs, max_prefill_tokens=16, max_seq_len=32)
    assert s.preemptions == 0


@pytest.mark.parametrize("seed", range(40))
def test_random_configurations_finish_with_the_reference_outputs(seed):
    """Block sizes 1-16, P steps shorter and longer than a sequence, 1-2 replicas, batch
    caps 1-8, Normal / PD rounds, drafts, prompts near the P step's size, KV from one
    budget's blocks to twice that: every run finishes with the ample run's outputs."""
    rng = random.Random(seed)
    bs, mp, seq = rng.choice([1, 2, 4, 16]), rng.choice([8, 16, 24, 40, 256]), rng.choice(
        [24, 48, 96])
    reqs = []
    for i in range(rng.randint(2, 14)):
        top = min(mp, seq - 1)
        n = rng.randint(max(1, top - 3), top) if rng.random() < 0.3 else rng.randint(
            1, min(top, 12))
        reqs.append(Request(f"r{i}", tuple(rng.randrange(4, VOCAB) for _ in range(n)),
                            SamplingParams(max_tokens=rng.randint(1, seq - n))))
    need = max(-(-(len(r.prompt) + r.params.max_tokens) // bs) for r in reqs)
    kw = dict(kv_block_size=bs, max_prefill_tokens=mp, max_seq_len=seq)
    s = Scheduler(cfg(num_kv_blocks=need + rng.randint(0, need),
                      max_batch_size=rng.choice([1, 2, 4, 8]), **kw),
                  rng.choice([1, 2]), 1, VOCAB)
    d = Drive(s, pd=rng.random() < 0.4, drafts=rng.random() < 0.4)
    assert d.run(reqs, arrive_every=rng.choice([1, 3, 100]), limit=20000) == reference(
        reqs, **kw)


def test_kv_reservation_is_checked():
    with pytest.raises(Exception, match="kv_reservation"):
        cfg(kv_reservation="lazy")
