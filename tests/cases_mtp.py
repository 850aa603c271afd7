"""Per-rank bodies of the MTP tests (tests/test_mtp.py), run by the spawned worker group."""

from __future__ import annotations

import torch

from colo_rollout.engine.engine import Engine
from colo_rollout.model.megatron_gpt import (
    build_reference,
    reference_mtp_logprobs,
    singleton_pg_collection,
)
from colo_rollout.model.weights import random_state_dict
from colo_rollout.runtime.cpu_compat import install_cpu_compat
from colo_rollout.model.mtp_oracle import oracle_state_dict
from colo_rollout.runtime.parallel import init_parallel
from tests.cases_engine import compare_with_reference, mixed_requests, tiny_config

# a draft is "the reference's argmax" when its reference logprob is within this of the max
# (fp32 CPU: the engine and megatron differ by ~1e-6)
DRAFT_TOL = 1e-4


def record_drafts(engine) -> dict[str, list]:
    """Every draft the engine's MTP proposes from now on: request id -> [(tokens emitted so
    far, draft)] (the scheduler's apply step wrapped; lifetime-free)."""
    drafts: dict[str, list] = {}
    sched = engine.scheduler
    apply = sched._apply

    def recording_apply(step, r, item, by_lt, now, finished):
        seq = sched.seqs.get(item.lifetime)
        apply(step, r, item, by_lt, now, finished)
        if seq is not None and item.lifetime in sched.seqs:
            out = sched.by_id[seq.request.request_id]
            drafts.setdefault(seq.request.request_id, []).append(
                (len(out.tokens), by_lt[item.lifetime].draft))

    sched._apply = recording_apply
    return drafts


def draft_rows(ref, requests, outs, drafts):
    """Each recorded draft beside megatron's MTP log-softmax row it must be the argmax of
    (teacher-forced over the final sequence, ``reference_mtp_logprobs``): yields (request id,
    tokens emitted, draft, row)."""
    for req in requests:
        full = list(req.prompt) + outs[req.request_id].tokens
        mtp_lp = reference_mtp_logprobs(ref, full)
        for emitted, draft in drafts.get(req.request_id, []):
            last = len(req.prompt) + emitted - 1  # the last emitted token's position
            yield req.request_id, emitted, draft, mtp_lp[last - 1]  # (h at last - 1, its token)


def mtp_tokens(rank: int, world: int, adp: int, ep: int, mode: str = "normal", mtp: bool = True,
               weights: str = "random", span: int = 1, n_requests: int = 12,
               check_reference: bool = False, dispatch: str = "gather") -> dict:
    """Serve the same greedy requests with a model that has an MTP layer, drafting with it
    (``mtp``) or not; report tokens, logprobs, D iterations, the drafts proposed (lifetime-free:
    per request, (tokens emitted so far, draft)) and the scheduler's acceptance counts. With
    ``check_reference`` (rank 0): logprobs against megatron's GPTModel and every draft against
    megatron's MTP block (teacher-forced over the final sequence). ``dispatch``:
    model.moe_dispatch."""
    model_kw = {"mtp_num_layers": 1, "norm_epsilon": 1e-6, "moe_dispatch": dispatch}
    cfg = tiny_config(world, adp, ep, max_batch_size=3, decode_buckets=[1, 2, 4], mode=mode,
                      segment_span=span, mtp=mtp, model_kw=model_kw)
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    sd = oracle_state_dict(cfg.model) if weights == "oracle" else random_state_dict(cfg.model)
    engine = Engine(cfg, groups, sd)
    drafts = record_drafts(engine)
    sched = engine.scheduler
    requests = mixed_requests(n_requests, 0, cfg.model.vocab_size)
    outs = engine.generate(requests)
    engine.check_integrity()
    for kv in sched.kv:
        kv.assert_empty()
    res = {"tokens": {r.request_id: outs[r.request_id].tokens for r in requests},
           "logprobs": {r.request_id: outs[r.request_id].logprobs for r in requests},
           "d_iterations": sum(1 for h in engine.history if h.d_rows > 0),
           "verified": sched.drafts_verified, "accepted": sched.drafts_accepted,
           "drafts": drafts, "layout": groups.layout.name,
           "p_boundaries": engine.worker.model.boundaries_per_prefill}
    pgc = singleton_pg_collection() if check_reference else None  # collective: every rank
    if check_reference and rank == 0:
        ref = build_reference(cfg.model, sd, pgc, torch.device("cpu"))
        res.update(compare_with_reference(ref, requests, outs))
        bad, checked = [], 0
        for rid, emitted, draft, row in draft_rows(ref, requests, outs, drafts):
            checked += 1
            if not 0 <= draft < row.shape[0] or float(row[draft]) < float(row.max()) - DRAFT_TOL:
                bad.append((rid, emitted, draft, int(row.argmax())))
        res["draft_mismatches"], res["drafts_checked"] = bad, checked
    return res


def mtp_sampling_marginals(rank: int, world: int, adp: int, ep: int, mtp: bool = True,
                           n: int = 600, temperature: float = 0.15, max_tokens: int = 3,
                           prompt: int = 5) -> dict:
    """Sampled rows with MTP drafting against the exact distribution. On the oracle weights the
    model is a Markov chain over tokens (model/mtp_oracle.py: the logits at a position depend
    on its token alone), so the exact marginal of the k-th output token is e_prompt P^(k+1),
    P[t] = softmax(logits(t) / T) read from megatron's GPTModel one token at a time. The engine
    serves ``n`` copies of the one-token prompt; returns each position's empirical
    distribution, the exact marginals, and the acceptance rate."""
    from colo_rollout.model.megatron_gpt import reference_logprobs
    from colo_rollout.sched.request import Request, SamplingParams

    cfg = tiny_config(world, adp, ep, max_batch_size=8, decode_buckets=[1, 2, 4, 8],
                      mtp=mtp, model_kw={"mtp_num_layers": 1, "norm_epsilon": 1e-6})
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    sd = oracle_state_dict(cfg.model)
    engine = Engine(cfg, groups, sd)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    outs = engine.generate([Request(f"s{i}", (prompt,), params) for i in range(n)])
    V = cfg.model.vocab_size
    counts = torch.zeros(max_tokens, V)
    for o in outs.values():
        for k, t in enumerate(o.tokens):
            counts[k, t] += 1
    res = {"empirical": (counts / n).tolist(),
           "acceptance": engine.scheduler.drafts_accepted / max(engine.scheduler.drafts_verified, 1)}
    pgc = singleton_pg_collection()
    if rank == 0:
        ref = build_reference(cfg.model, sd, pgc, torch.device("cpu"))
        logits = torch.stack([reference_logprobs(ref, [t])[0] for t in range(V)])  # [V, V]
        P = torch.softmax(logits.double() / temperature, dim=-1)
        dist = torch.zeros(V, dtype=torch.float64)
        dist[prompt] = 1.0
        exact = []
        for _ in range(max_tokens):
            dist = dist @ P
            exact.append(dist.tolist())
        res["exact"] = exact
    return res
