"""Per-rank bodies of the multi-process engine tests (run by colo_rollout.runtime.spawn.WorkerGroup)."""

from __future__ import annotations

import contextlib
import random

import torch

from colo_rollout.config import Config, EngineConfig, ModelConfig, ParallelConfig
from colo_rollout.runtime.cpu_compat import install_cpu_compat
from colo_rollout.engine.engine import Engine
from colo_rollout.model.weights import random_state_dict
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.model.megatron_gpt import (
    build_reference,
    reference_logprobs,
    singleton_pg_collection,
)
from colo_rollout.sched.request import Request, SamplingParams

# fp32 on CPU: the engine (paged KV, sharded, gathered) and the reference (megatron GPTModel, full
# recompute, TP1) differ only in summation order, ~1e-6 in logprobs; 1e-4 leaves a wide margin
# while any real bug (wrong position, wrong shard, wrong row) moves logprobs by >1e-2.
LOGPROB_TOL = 1e-4


# Family-shaped variants of the architecture surface (head_dim, q/k norms, q/k/v bias, tied
# embeddings, partial rotary and RoPE scaling, softmax/sigmoid routers with and without
# renormalisation, expert bias, routed scaling, group-limited routing, shared experts with and
# without a gate, dense first layers), with values chosen so that a mistake shows: head_dim
# differs from hidden / heads, norm weights and biases are not 1 / 0, the expert bias and the
# routed scaling change which experts win and by how much.
ARCHS = {
    # Qwen3-MoE: head_dim independent of hidden/heads, q/k RMSNorm, eps 1e-6, renormalised
    # top-k; YaRN as Qwen3's long-context config sets it (factor 4, here over 32 positions)
    "qwen3": {"head_dim": 24, "qk_layernorm": True, "norm_epsilon": 1e-6,
              "rope_scaling": "yarn", "rope_scaling_factor": 4.0,
              "yarn_original_max_position_embeddings": 32},
    # Qwen2-MoE: q/k/v bias, softmax top-k without renormalisation, a gated shared expert, a
    # dense layer between MoE ones (Qwen's mlp_only_layers)
    "qwen2": {"qkv_bias": True, "router_norm_topk": False, "shared_expert_ffn_hidden_size": 48,
              "shared_expert_gate": True, "num_layers": 3, "dense_layers": [1],
              "ffn_hidden_size": 96},
    # GLM-4.5 / DeepSeek-V3 routing: sigmoid + score-correction bias, 4 groups pick 2, routed
    # scaling, an ungated shared expert, a dense first layer, partial rotary, q/k/v bias
    "glm": {"router_score": "sigmoid", "router_expert_bias": True, "router_num_groups": 4,
            "router_group_topk": 2, "router_scaling_factor": 2.5,
            "shared_expert_ffn_hidden_size": 32, "first_k_dense": 1, "ffn_hidden_size": 96,
            "num_layers": 3, "rotary_percent": 0.5, "qkv_bias": True, "head_dim": 32},
    # tied embeddings and llama3 RoPE scaling (megatron's rope_scaling)
    "tied": {"tie_embeddings": True, "rope_scaling": "llama3", "rope_scaling_factor": 4.0,
             "rotary_base": 500000.0},
}


# DeepSeek-V3's attention (model.attention mla, attention TP 1): a query bottleneck, a value
# head narrower than the nope head, YaRN whose mscale_all_dim moves the softmax scale, with
# GLM / DeepSeek-V3 routing, a dense first layer and a shared expert
MLA_ARCH = {"attention": "mla", "num_query_groups": 4, "qk_layernorm": True, "q_lora_rank": 32,
            "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 12, "rope_scaling": "yarn", "rope_scaling_factor": 4.0,
            "yarn_original_max_position_embeddings": 32, "yarn_mscale_all_dim": 0.8,
            "router_score": "sigmoid", "router_expert_bias": True, "router_num_groups": 4,
            "router_group_topk": 2, "moe_router_topk": 4, "router_scaling_factor": 2.5,
            "first_k_dense": 1, "ffn_hidden_size": 96, "num_layers": 3,
            "shared_expert_ffn_hidden_size": 64}


def tiny_config(world: int, adp: int, ep: int, timeout_s: float = 60.0,
                model_kw: dict | None = None, **engine) -> Config:
    return Config(
        parallel=ParallelConfig(world_size=world, adp=adp, ep=ep, backend="gloo",
                                timeout_s=timeout_s),
        model=ModelConfig(**{"vocab_size": 256, "hidden_size": 64, "num_layers": 2,
                             "num_attention_heads": 4, "num_query_groups": 2,
                             "moe_ffn_hidden_size": 64, "num_experts": 8, "moe_router_topk": 2,
                             "max_position_embeddings": 512, "init_method_std": 0.1, "seed": 7,
                             **(model_kw or {})}),
        engine=EngineConfig(**{"max_batch_size": 8, "max_prefill_tokens": 256, "kv_block_size": 4,
                               "num_kv_blocks": 128, "max_seq_len": 256,
                               "decode_buckets": [1, 2, 4, 8], **engine}),
    )


def mixed_requests(n: int, seed: int, vocab: int) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        plen = rng.choice([1, 3, 7, 12, 25, 40])
        prompt = tuple(rng.randrange(vocab) for _ in range(plen))
        reqs.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 12),
                                                            ignore_eos=True)))
    return reqs


def compare_with_reference(ref, requests, outs, tol: float = LOGPROB_TOL) -> dict:
    worst, total, mismatches, checked = 0.0, 0.0, [], 0
    for req in requests:
        out = outs[req.request_id]
        full = list(req.prompt) + out.tokens
        ref_lp = reference_logprobs(ref, full[:-1])
        for j, (tok, lp) in enumerate(zip(out.tokens, out.logprobs)):
            row = ref_lp[len(req.prompt) - 1 + j]
            diff = abs(float(row[tok]) - lp)
            worst, total = max(worst, diff), total + diff
            is_argmax = float(row[tok]) >= float(row.max()) - tol
            if not is_argmax:
                mismatches.append((req.request_id, j, tok, int(row.argmax())))
            checked += 1
    return {"max_logprob_diff": worst, "mean_logprob_diff": total / max(checked, 1),
            "mismatches": mismatches, "checked": checked}


def engine_matches_reference(rank: int, world: int, adp: int, ep: int, n_requests: int = 14,
                             seed: int = 0, moe_compute: str = "auto",
                             model_kw: dict | None = None, mode: str = "normal",
                             dense_from: int | None = None, dense_kernel: str = "cudnn") -> dict:
    """``dense_from``: P's fresh sequences of at least this many tokens through the dense
    path of ``dense_kernel`` ("cudnn": the rest on the buckets; "flash": the rest in one
    variable-length call; torch's SDPA in the kernels' place on CPU; model/dense_prefill.py)
    -- MLA models only; the result counts the dense calls."""
    # A batch cap of 3 rows per replica admits requests in waves: later P steps run while other
    # replicas hold D rows, and some replicas take part in a P step with zero rows.
    cfg = tiny_config(world, adp, ep, max_batch_size=3, decode_buckets=[1, 2, 4], mode=mode,
                      model_kw={"moe_compute": moe_compute, **(model_kw or {})})
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    sd = random_state_dict(cfg.model)
    engine = Engine(cfg, groups, sd)
    if dense_from is not None:
        with _dense_mla_prefill(engine, dense_from, dense_kernel) as calls:
            result = _serve_and_compare(rank, cfg, groups, sd, engine, n_requests, seed)
        return {**result, "dense_calls": calls[0]}
    return _serve_and_compare(rank, cfg, groups, sd, engine, n_requests, seed)


def on_demand_matches_reference(rank: int, world: int, adp: int, ep: int,
                                mode: str = "normal") -> dict:
    """engine.kv_reservation on_demand on blocks too few for the requests' budgets at once:
    running rows are preempted and prefilled again, and every token is still megatron's
    greedy continuation with its logprob (the reference recomputes each whole sequence)."""
    cfg = tiny_config(world, adp, ep, mode=mode, kv_reservation="on_demand", num_kv_blocks=24,
                      max_batch_size=8, decode_buckets=[1, 2, 4, 8])
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    sd = random_state_dict(cfg.model)
    engine = Engine(cfg, groups, sd)
    rng = random.Random(5)
    requests = [Request(f"r{i}", tuple(rng.randrange(cfg.model.vocab_size)
                                       for _ in range(rng.choice([3, 7, 12, 25, 40]))),
                        SamplingParams(max_tokens=rng.randint(16, 40), ignore_eos=True))
                for i in range(12)]
    outs = engine.generate(requests)
    engine.check_integrity()
    result = {"preemptions": engine.scheduler.preemptions,
              "owners_left": sum(len(kv.owners()) for kv in engine.scheduler.kv),
              "lengths": {r.request_id: len(outs[r.request_id].tokens) for r in requests},
              "expected": {r.request_id: r.params.max_tokens for r in requests},
              "tokens": {r.request_id: outs[r.request_id].tokens for r in requests}}
    if rank == 0:
        ref = build_reference(cfg.model, sd, singleton_pg_collection(), torch.device("cpu"))
        result.update(compare_with_reference(ref, requests, outs))
    engine.close()
    return result


@contextlib.contextmanager
def _dense_mla_prefill(engine, min_tokens: int, kernel: str = "cudnn"):
    """An MLA engine's P through its dense calls (backend ``kernel``, the SDPA path on CPU)
    from ``min_tokens`` fresh tokens, as a GPU build would pick it; yields [calls made]."""
    from colo_rollout.model import dense_prefill, mla_attention

    model, calls = engine.model, [0]
    inner = mla_attention.dense_mla_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    saved = dense_prefill.MIN_TOKENS, model.prefill_attention
    dense_prefill.MIN_TOKENS, model.prefill_attention = min_tokens, kernel
    mla_attention.dense_mla_attention = counted
    for layer in model._all_layers():
        layer.self_attention.prefill_backend = kernel
    try:
        yield calls
    finally:
        dense_prefill.MIN_TOKENS, model.prefill_attention = saved
        mla_attention.dense_mla_attention = inner
        for layer in model._all_layers():
            layer.self_attention.prefill_backend = saved[1]


def _serve_and_compare(rank, cfg, groups, sd, engine, n_requests: int, seed: int) -> dict:
    warm = engine.warmup()  # collective; must leave the engine serving exactly as before
    grouped = [moe.uses_grouped(torch.zeros(1, device=groups.device))
               for moe in engine.model.moe_layers()]
    requests = mixed_requests(n_requests, seed, cfg.model.vocab_size)
    outs = engine.generate(requests)
    engine.check_integrity()
    pgc = singleton_pg_collection()
    phases = [h.phase.value for h in engine.history]
    result = {"layout": groups.layout.name, "steps": len(engine.history), "grouped": grouped,
              "warmup_graphs": warm,
              "prefill_after_decode": any(a == "decode" and b == "prefill"
                                          for a, b in zip(phases, phases[1:])),
              "owners_left": sum(len(kv.owners()) for kv in engine.scheduler.kv),
              "lengths": {r.request_id: len(outs[r.request_id].tokens) for r in requests},
              "expected": {r.request_id: r.params.max_tokens for r in requests},
              "reasons": {r.request_id: outs[r.request_id].finish_reason.value for r in requests},
              "tokens": {r.request_id: outs[r.request_id].tokens for r in requests}}
    if rank == 0:
        ref = build_reference(cfg.model, sd, pgc, torch.device("cpu"))
        result.update(compare_with_reference(ref, requests, outs))
    return result


def _engine(world: int, adp: int, ep: int, timeout_s: float = 60.0,
            model_kw: dict | None = None, **engine_kw):
    cfg = tiny_config(world, adp, ep, timeout_s=timeout_s, model_kw=model_kw, **engine_kw)
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    sd = random_state_dict(cfg.model)
    return cfg, groups, sd, Engine(cfg, groups, sd)


def _raising_requests():
    """A caller's request iterator that fails after its first request."""
    yield Request("g0", (1, 2), SamplingParams(max_tokens=2))
    raise ValueError("the dataset ran dry")


def bad_input_isolated(rank: int, world: int, adp: int, ep: int) -> dict:
    """Bad requests get a clear error for that request; the rest finish; KV stays intact."""
    from colo_rollout.sched.request import RequestError

    cfg, groups, sd, engine = _engine(world, adp, ep)
    good = mixed_requests(6, seed=3, vocab=cfg.model.vocab_size)
    bad = [
        Request("too-long", tuple([1] * 250), SamplingParams(max_tokens=10)),
        Request("empty", (), SamplingParams(max_tokens=4)),
        Request("bad-temp", (1, 2, 3), SamplingParams(temperature=-1.0)),
        Request("bad-topp", (1, 2, 3), SamplingParams(top_p=0.0)),
        Request("oov", (1, 999), SamplingParams(max_tokens=2)),
        Request(good[0].request_id, (5, 6), SamplingParams(max_tokens=2)),  # duplicate id
    ]
    outs = engine.generate(good[:1] + bad + good[1:])
    errors = {}
    try:
        engine.cancel("never-submitted")
    except RequestError as e:
        errors["cancel_unknown"] = str(e)
    try:
        engine.cancel(good[1].request_id)
    except RequestError as e:
        errors["cancel_finished"] = str(e)
    # the API's other entry points, called wrongly: a RequestError naming the misuse
    for name, call in (("output_unknown", lambda: engine.output("nope")),
                       ("forget_none", lambda: engine.forget(None)),
                       ("forget_str", lambda: engine.forget("abc")),
                       ("generate_str", lambda: engine.generate("abc")),
                       ("generate_raising", lambda: engine.generate(_raising_requests()))):
        try:
            call()
        except RequestError as e:
            errors[name] = str(e)
    # nothing of the iterator that raised was submitted: the next call serves nothing of it
    errors["after_raising"] = sorted(engine.generate([]))
    engine.check_integrity()
    for kv in engine.scheduler.kv:
        kv.assert_empty()
    # two turns of one session in one call: the second is refused at the step's exchange (the
    # first made the session busy), and every rank returns that refusal too
    turns = engine.generate([
        Request("s-t1", (1, 2, 3), SamplingParams(max_tokens=2), session="sess"),
        Request("s-t2", (4, 5), SamplingParams(max_tokens=2), session="sess")])
    res = {"session_turns": {rid: (o.finish_reason.value, o.error)
                             for rid, o in sorted(turns.items())}}
    # a refusal never takes the place of a served request of its id: a bad "x" before a good
    # "x" in one call, and "y" refused as a duplicate of an earlier submit("y") that is served
    shadow = engine.generate([Request("x", (1, 2, 3), SamplingParams(top_p=0.0)),
                              Request("x", (1, 2, 3), SamplingParams(max_tokens=3))])
    if rank == 0:
        engine.submit(Request("y", (4, 5), SamplingParams(max_tokens=2)))
    shadow.update(engine.generate([Request("y", (4, 5), SamplingParams(max_tokens=2)),
                                   Request("z", (6,), SamplingParams(max_tokens=1))]))
    res["shadow"] = {rid: (o.finish_reason.value, len(o.tokens), o.error)
                     for rid, o in sorted(shadow.items())}
    # found by probing: a str-subclass id or session (numpy.str_) raised inside the step's
    # exchange -- every later step too, and a peer rank waited out its timeout -- and a 0-d
    # prompt tensor aborted the call, the good requests before it left queued
    import numpy as np

    odd = engine.generate([
        Request(np.str_("np-id"), (1, 2), SamplingParams(max_tokens=2),
                session=np.str_("np-sess")),
        Request("zero-d", torch.tensor(5), SamplingParams(max_tokens=2)),
        Request("after", (3, 4), SamplingParams(max_tokens=2))])
    res["odd"] = {rid: (o.finish_reason.value, type(rid).__name__, len(o.tokens))
                  for rid, o in sorted(odd.items())}
    engine.close_session(np.str_("np-sess"))
    for name, call in (("forget_unhashable", lambda: engine.forget([["x"]])),
                       ("on_finish_not_callable",
                        lambda: engine.generate([Request("f", (1,), SamplingParams())],
                                                on_finish=5))):
        try:
            call()
        except RequestError as e:
            errors[name] = str(e)
    errors["after_on_finish"] = sorted(engine.generate([]))  # "f" was never submitted
    try:
        engine.take_routings("abc")
    except TypeError as e:
        errors["take_routings_str"] = str(e)
    res["errors"] = errors
    res["good"] = {r.request_id: (outs[r.request_id].finish_reason.value,
                                  len(outs[r.request_id].tokens), r.params.max_tokens)
                   for r in good}
    # every rank returns every output, the refused ones too (rank 0 alone did)
    res["bad_here"] = {r.request_id: (outs[r.request_id].finish_reason.value,
                                      outs[r.request_id].prompt_len, outs[r.request_id].error)
                       for r in bad[:-1] if r.request_id in outs}
    if rank == 0:
        res["bad"] = {r.request_id: (outs[r.request_id].finish_reason.value,
                                     outs[r.request_id].error) for r in bad[:-1]}
        dups = [o for o in engine.rejected if o.request_id == good[0].request_id]
        res["bad"]["dup"] = (dups[0].finish_reason.value, dups[0].error)
        # the duplicate was rejected at submit: the original finished normally
        res["dup_original"] = outs[good[0].request_id].finish_reason.value
        ref = build_reference(cfg.model, sd, singleton_pg_collection(), torch.device("cpu"))
        res.update(compare_with_reference(ref, good, outs))
    else:
        singleton_pg_collection()  # collective: keep ranks matched
    # a closed engine hands nothing over (its graphs and dispatch buffers are released)
    engine.close()
    for name, call in (("hand_over_closed", engine.hand_over), ("resume_closed", engine.resume)):
        try:
            call()
        except RuntimeError as e:
            errors[name] = str(e)
    return res


def cancel_and_cross_rank_duplicates(rank: int, world: int, adp: int, ep: int) -> dict:
    """Cancel a running and a waiting request mid-flight; two ranks submit the same id."""
    cfg, groups, sd, engine = _engine(world, adp, ep, max_batch_size=2, decode_buckets=[1, 2])
    reqs = [Request(f"c{i}", tuple(range(1, 6 + i)), SamplingParams(max_tokens=20, ignore_eos=True))
            for i in range(6)]
    if rank == 0:
        for r in reqs:
            engine.submit(r)
    # every rank submits "same": only the first (lowest rank) is accepted after the exchange;
    # the step raises the refusal on the rank whose submission lost, and has completed
    from colo_rollout.sched.request import RequestError, SubmissionRefused

    engine.submit(Request("same", (9, 8, 7), SamplingParams(max_tokens=3)))
    refused_here = None
    try:
        first = engine.step()
    except SubmissionRefused as e:
        refused_here = {"refused": [(o.request_id, o.finish_reason.value, o.error)
                                    for o in e.refused],
                        "is_request_error": isinstance(e, RequestError), "message": str(e)}
        first = e.finished
    assert first == []  # nothing can finish in the first step
    for _ in range(4):
        engine.step()
    states = {r.request_id: engine.scheduler.live.get(r.request_id, "gone") for r in reqs}
    if rank == 0:
        engine.cancel("c0")  # running
        engine.cancel("c5")  # still waiting (batch is full)
    while engine.busy():
        engine.step()
    engine.check_integrity()
    for kv in engine.scheduler.kv:
        kv.assert_empty()
    out = {r.request_id: (engine.output(r.request_id).finish_reason.value,
                          len(engine.output(r.request_id).tokens)) for r in reqs}
    out["same"] = (engine.output("same").finish_reason.value, len(engine.output("same").tokens))
    return {"states_before_cancel": states, "outputs": out,
            "rejected": [(o.request_id, o.error) for o in engine.rejected],
            "refused_here": refused_here}


def cancel_a_p_step_read_late(rank: int, world: int, adp: int, ep: int) -> dict:
    """engine.overlap_prefill: cancel the requests of a P step whose tokens are still unread
    (``Engine._deferred``), and a session turn among them; record routing throughout. The
    cancelled end with no tokens, their blocks serve the next P, the rest is served whole and
    alike on every rank, with each output's recorded routing covering its tokens."""
    cfg, groups, sd, engine = _engine(world, adp, ep, max_batch_size=4, decode_buckets=[1, 2, 4],
                                      max_prefill_tokens=16, overlap_prefill="always",
                                      record_routing=True)
    reqs = [Request(f"o{i}", tuple(range(1 + i, 12 + i)), SamplingParams(max_tokens=5,
                                                                          ignore_eos=True),
                    session="s3" if i == 3 else None) for i in range(10)]
    if rank == 0:
        for r in reqs:
            engine.submit(r)
    outs, cancelled, late_p = {}, [], 0
    while engine.busy() or not outs:
        for o in engine.step():
            outs[o.request_id] = o
        late = engine._deferred
        if late is not None:
            late_p += 1
            if not cancelled:  # the first P step read late: cancel every request in it
                lts = {it.lifetime for w in late[0].replicas for it in w.prefill}
                cancelled = sorted(engine.scheduler.seqs[lt].request.request_id for lt in lts)
                if rank == 0:
                    for rid in cancelled:
                        engine.cancel(rid)
    if rank == 0:
        engine.close_session("s3")
    engine.step()
    engine.check_integrity()
    for kv in engine.scheduler.kv:
        kv.assert_empty()
    routed = {rid: (None if o.routing is None else len(o.routing)) for rid, o in outs.items()}
    return {"late_p": late_p, "cancelled": cancelled,
            "outputs": {rid: (o.finish_reason.value, o.tokens) for rid, o in outs.items()},
            "routed": routed,
            "plens": {r.request_id: len(r.prompt) for r in reqs}}


def tp_reference_matches_tp1(rank: int, world: int) -> dict:
    """megatron GPTModel at TP=world (our TP-sharded load) computes what the TP1 model does."""
    import torch.distributed as dist

    from colo_rollout.model.megatron_gpt import tp_pg_collection

    install_cpu_compat()
    cfg = tiny_config(world, 1, 1)
    sd = random_state_dict(cfg.model)
    tp_group = dist.new_group(list(range(world)))
    ref_tp = build_reference(cfg.model, sd, tp_pg_collection(tp_group), torch.device("cpu"))
    ref_1 = build_reference(cfg.model, sd, singleton_pg_collection(), torch.device("cpu"))
    tokens = [int(t) for t in torch.randint(0, cfg.model.vocab_size, (37,), generator=torch.Generator().manual_seed(5))]
    a = reference_logprobs(ref_tp, tokens)
    b = reference_logprobs(ref_1, tokens)
    return {"max_diff": float((a - b).abs().max()), "spread": float(b.std())}


def engine_loads_megatron_gptmodel_state_dict(rank: int, world: int, adp: int, ep: int) -> dict:
    """Weights initialised by megatron itself (GPTModel's own init, its state_dict() with
    _extra_state entries) load into the sharded engine, which then matches that GPTModel."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from colo_rollout.model.model import megatron_config

    cfg = tiny_config(world, adp, ep, max_batch_size=3, decode_buckets=[1, 2, 4])
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    pgc = singleton_pg_collection()
    torch.manual_seed(1234)  # megatron's CPU init draws from torch's RNG: same on every rank
    tcfg = megatron_config(cfg.model, init=True)
    spec = get_gpt_layer_local_spec(num_experts=cfg.model.num_experts, moe_grouped_gemm=False,
                                    normalization=cfg.model.normalization)
    trained = GPTModel(tcfg, spec, vocab_size=cfg.model.vocab_size,
                       max_sequence_length=cfg.model.max_position_embeddings,
                       position_embedding_type="rope", parallel_output=False,
                       pg_collection=pgc)
    sd = trained.state_dict()
    engine = Engine(cfg, groups, sd)
    requests = mixed_requests(8, 4, cfg.model.vocab_size)
    outs = engine.generate(requests)
    engine.check_integrity()
    res = {"extra_state_keys": sum(k.endswith("_extra_state") for k in sd)}
    if rank == 0:
        res.update(compare_with_reference(trained.eval(), requests, outs))
    return res


def prefill_segments_with_decode_between(rank: int, world: int, adp: int, ep: int) -> dict:
    """P as segments with a full D iteration of other sequences at every boundary computes the
    same P logits as P run straight through, and the D iterations are unaffected by P."""
    from colo_rollout.runtime.control import Message
    from colo_rollout.sched.plan import DecodeRow, Phase, ReplicaWork, StepPlan
    from colo_rollout.sched.planner import pick_bucket

    cfg, groups, sd, engine = _engine(world, adp, ep)
    sched, runner, model = engine.scheduler, engine.runner, engine.model
    if rank == 0:
        for r in mixed_requests(6, seed=11, vocab=cfg.model.vocab_size):
            engine.submit(r)
    engine.step()  # P of the A requests
    engine.step()  # commits their first tokens, runs one D
    engine.step()  # commits, runs another D: A rows are decoding now
    # a hand-built D plan: self-contained (each row's block table and sampling parameters)
    rows = [[DecodeRow(s.lifetime, s.last_token, s.length,
                       table=tuple(sched.block_table(i, s.lifetime)), params=s.request.params)
             for s in sched.seqs.values() if s.replica == i and s.last_token is not None]
            for i in range(adp)]
    bucket = pick_bucket(max(len(x) for x in rows), tuple(cfg.engine.decode_buckets),
                         groups.layout.atp)
    d_plan = StepPlan(step=-1, phase=Phase.DECODE,
                      replicas=tuple(ReplicaWork(decode=tuple(x)) for x in rows), bucket=bucket,
                      table_blocks=max(len(d.table) for x in rows for d in x))
    d_in = runner._decode_inputs(*runner._decode_host(d_plan))
    if rank == 0:
        for i in range(4):
            engine.submit(Request(f"b{i}", tuple(range(3, 40 + 7 * i)),
                                  SamplingParams(max_tokens=2)))
    # agree on the new requests (the engine's exchange, without running its plan)
    msgs = engine.control.exchange(Message(rank=rank, step=sched.step_no,
                                           submits=engine._outbox.submits))
    for m in msgs:
        for s in m.submits:
            sched.add(Request(s["id"], tuple(s["prompt"]), SamplingParams.from_json(s["params"])))
    engine._outbox.submits.clear()
    p_plan = sched.plan()
    assert p_plan.phase is Phase.PREFILL
    p_in = runner._prefill_inputs(p_plan)

    d_ref = model.forward_decode(d_in, runner.kv).clone()
    gen = model.prefill_segments(p_in, runner.kv)
    boundaries, d_same = [], True
    while True:
        try:
            boundaries.append(next(gen))
        except StopIteration as stop:
            p_seg = stop.value
            break
        d = model.forward_decode(d_in, runner.kv)  # D goes first at every boundary (K = 1)
        d_same = d_same and torch.equal(d, d_ref)
    p_straight = model.forward_prefill(p_in, runner.kv)
    return {"boundaries": boundaries, "expected": model.boundaries_per_prefill,
            "p_equal": bool(torch.equal(p_seg, p_straight)), "d_equal": bool(d_same),
            "p_rows": int(p_seg.shape[0]), "d_rows": sum(len(x) for x in rows)}


def engine_mode_tokens(rank: int, world: int, adp: int, ep: int, mode: str,
                       span: int = 1, n_requests: int = 14, model_kw: dict | None = None,
                       policy: str = "fixed", overlap: str = "auto", max_batch_size: int = 3,
                       max_prefill_tokens: int = 256) -> dict:
    """Serve the same greedy requests in ``mode``; report tokens, logprobs, how often D ran
    while a P epoch was in flight, the turnstile's permits (post_d events), and the P steps
    whose tokens were read one step late (engine.overlap_prefill)."""
    cfg, groups, sd, engine = _engine(world, adp, ep, max_batch_size=max_batch_size,
                                      decode_buckets=[1, 2, 4] if max_batch_size <= 4 else [1, 2, 4, 8],
                                      mode=mode, segment_span=span,
                                      segment_policy=policy, model_kw=model_kw,
                                      overlap_prefill=overlap,
                                      max_prefill_tokens=max_prefill_tokens)
    engine.turnstile.record = True
    requests = mixed_requests(n_requests, 0, cfg.model.vocab_size)
    outs = engine.generate(requests)
    engine.check_integrity()
    for kv in engine.scheduler.kv:
        kv.assert_empty()
    hist = engine.history
    return {"tokens": {r.request_id: outs[r.request_id].tokens for r in requests},
            "logprobs": {r.request_id: outs[r.request_id].logprobs for r in requests},
            "d_during_p": sum(1 for h in hist if h.p_in_flight and h.rows > 0),
            "rounds": len(hist),
            "rendezvous": engine.rendezvous.count if engine.rendezvous else 0,
            "turnstile": [(e.kind, e.epoch, e.boundary) for e in engine.turnstile.log],
            "read_late": sum(1 for h in hist if h.read_late),
            # a P step right after a P step read late: the overlap itself (its GPU work
            # queued behind the one whose tokens were not yet read)
            "p_after_late": sum(1 for a, b in zip(hist, list(hist)[1:])
                                if a.read_late and b.phase.name == "PREFILL"),
            "most_d_rows": max((h.rows for h in hist if h.phase.name == "DECODE"), default=0),
            "idle_steps": sum(1 for h in hist if h.phase.name == "IDLE")}


def cancel_during_prefill_epoch(rank: int, world: int, adp: int, ep: int) -> dict:
    """Fine mode: cancel a request whose P epoch is in flight. Its blocks drain (not reusable)
    until the epoch's work is done, its result is discarded, everything else finishes."""
    cfg, groups, sd, engine = _engine(world, adp, ep, max_batch_size=3,
                                      decode_buckets=[1, 2, 4], mode="fine", segment_span=1)
    first = [Request(f"a{i}", tuple(range(2, 9 + i)), SamplingParams(max_tokens=12, ignore_eos=True))
             for i in range(2)]
    later = [Request(f"b{i}", tuple(range(5, 60 + i)), SamplingParams(max_tokens=4, ignore_eos=True))
             for i in range(3)]
    if rank == 0:
        for r in first:
            engine.submit(r)
    for _ in range(3):
        engine.step()  # A: prefilled and decoding
    if rank == 0:
        for r in later:
            engine.submit(r)
    engine.step()  # B's epoch starts (D first: P parked at boundary 0)
    in_flight = engine.runner.epoch_active
    victim = "b1"
    if rank == 0:
        engine.cancel(victim)
    engine.step()  # the cancel is applied while the epoch is still running
    lt = engine.scheduler.by_id[victim]
    draining = sorted({d for kv in engine.scheduler.kv for d in kv.draining()})
    still_in_flight = engine.runner.epoch_active
    while engine.busy():
        engine.step()
    engine.check_integrity()
    for kv in engine.scheduler.kv:
        kv.assert_empty()
    return {"in_flight_at_cancel": in_flight and still_in_flight, "draining_mid_epoch": draining,
            "victim": (lt.finish_reason.value, len(lt.tokens)),
            "others": {r.request_id: (engine.output(r.request_id).finish_reason.value,
                                      len(engine.output(r.request_id).tokens))
                       for r in first + later if r.request_id != victim}}


def injected_violation(rank: int, world: int, adp: int, ep: int) -> dict:
    """Fine mode; mid-epoch the last rank's boundary producer skips ahead (a non-monotone
    publication). That rank raises TurnstileError at once, naming rank, epoch and boundary;
    every other rank raises within the timeout where it next waits for that rank: the control
    exchange of the next step (Fine advances P after the round's D), naming rank and step."""
    import time as _time

    from colo_rollout.runtime.control import ControlError
    from colo_rollout.multiplex.rendezvous import RendezvousError
    from colo_rollout.multiplex.turnstile import TurnstileError

    cfg, groups, sd, engine = _engine(world, adp, ep, timeout_s=3.0, max_batch_size=3,
                                      decode_buckets=[1, 2, 4], mode="fine", segment_span=1)
    if rank == 0:
        for i in range(2):
            engine.submit(Request(f"a{i}", (1, 2, 3), SamplingParams(max_tokens=30)))
    for _ in range(3):
        engine.step()
    if rank == 0:
        engine.submit(Request("b", tuple(range(1, 50)), SamplingParams(max_tokens=2)))
    engine.step()  # the epoch starts
    if rank == world - 1:
        engine.turnstile.reached += 2  # corrupt: its next publication skips boundary ids
    t0 = _time.perf_counter()
    try:
        for _ in range(10):
            engine.step()
        return {"raised": None}
    except (TurnstileError, RendezvousError, ControlError) as e:
        return {"raised": f"{type(e).__name__}: {e}", "seconds": _time.perf_counter() - t0}


def multi_turn_matches_reference(rank: int, world: int, adp: int, ep: int, mode: str = "normal",
                                 num_kv_blocks: int = 128, sessions: int = 5,
                                 turns: int = 3, model_kw: dict | None = None,
                                 dense_from: int | None = None,
                                 dense_kernel: str = "cudnn") -> dict:
    """Trajectories of several turns: each continuation prefills only its new tokens on top of
    the retained context (or re-prefills the context after an eviction). Every turn's output is
    teacher-forced through the megatron reference over the whole trajectory. ``dense_from``:
    as ``engine_matches_reference``'s."""
    cfg, groups, sd, engine = _engine(world, adp, ep, max_batch_size=3, decode_buckets=[1, 2, 4],
                                      mode=mode, num_kv_blocks=num_kv_blocks, model_kw=model_kw)
    with (_dense_mla_prefill(engine, dense_from, dense_kernel) if dense_from is not None
          else contextlib.nullcontext([0])) as calls:
        res = _serve_turns(rank, engine, turns, sessions)
    res["dense_calls"] = calls[0]
    if rank == 0:
        res.update(_turns_against_reference(cfg, sd, engine, res.pop("plan")))
    else:
        res.pop("plan")
        singleton_pg_collection()
    return res


def _serve_turns(rank: int, engine, turns: int, sessions: int) -> dict:
    rng = random.Random(42)
    plan = {f"s{k}": [(tuple(rng.randrange(1, 250) for _ in range(rng.randint(3, 20))),
                        rng.randint(2, 8)) for _ in range(turns)] for k in range(sessions)}
    turn_of = {sid: 0 for sid in plan}

    def submit(sid: str) -> None:
        prompt, n = plan[sid][turn_of[sid]]
        engine.submit(Request(f"{sid}-t{turn_of[sid]}", prompt,
                              SamplingParams(max_tokens=n, ignore_eos=True), session=sid))

    if rank == 0:
        for sid in plan:
            submit(sid)
    engine.step()
    while engine.busy():
        for out in engine.step():
            sid, t = out.request_id.split("-t")
            if int(t) + 1 < turns:
                turn_of[sid] = int(t) + 1
                if rank == 0:
                    submit(sid)
    engine.check_integrity()
    retained = len(engine.scheduler.idle_sessions())
    if rank == 0:
        for sid in plan:
            engine.close_session(sid)
    engine.step()
    for kv in engine.scheduler.kv:
        kv.assert_empty()
    return {"evictions": engine.scheduler.evictions, "retained_before_close": retained,
            "tokens": {sid: [engine.output(f"{sid}-t{t}").tokens for t in range(turns)]
                       for sid in plan}, "plan": plan}


def _turns_against_reference(cfg, sd, engine, plan: dict) -> dict:
    """Every turn's tokens teacher-forced through the megatron reference over the whole
    trajectory (rank 0)."""
    ref = build_reference(cfg.model, sd, singleton_pg_collection(), torch.device("cpu"))
    worst, mism, n = 0.0, [], 0
    for sid, spec in plan.items():
        context: list[int] = []
        for t, (prompt, _) in enumerate(spec):
            out = engine.output(f"{sid}-t{t}")
            full = context + list(prompt) + out.tokens
            lp = reference_logprobs(ref, full[:-1])
            base = len(context) + len(prompt) - 1
            for j, (tok, l) in enumerate(zip(out.tokens, out.logprobs)):
                row = lp[base + j]
                worst = max(worst, abs(float(row[tok]) - l))
                if float(row[tok]) < float(row.max()) - LOGPROB_TOL:
                    mism.append((sid, t, j))
                n += 1
            context = full
    return {"max_logprob_diff": worst, "mismatches": mism, "checked": n}


def grouped_weights_follow_updates(rank: int, world: int, adp: int, ep: int) -> dict:
    """The grouped path's stacked expert weights stay the parameters' storage: an in-place
    reload (what weight sync does) and a replaced parameter both reach the next forward."""
    cfg = tiny_config(world, adp, ep, model_kw={"moe_compute": "grouped"})
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    requests = mixed_requests(6, 3, cfg.model.vocab_size)
    engine.generate([Request(r.request_id + "-a", r.prompt, r.params) for r in requests])
    sd2 = random_state_dict(cfg.model, seed=99)
    engine.model.load_full_state_dict(sd2)  # in-place copies into the stacked views
    outs = engine.generate([Request(r.request_id + "-b", r.prompt, r.params) for r in requests])
    experts = engine.model.decoder.layers[0].mlp.experts.local_experts
    # a parameter replaced (not updated in place) by a zeroed expert: a stale stack would keep
    # computing with the old weights and reproduce run b's logprobs exactly
    experts[0].linear_fc1.weight.data = torch.zeros_like(experts[0].linear_fc1.weight)
    outs_c = engine.generate([Request(r.request_id + "-c", r.prompt, r.params) for r in requests])
    result = {"changed_after_replace": any(outs[r.request_id + "-b"].logprobs
                                           != outs_c[r.request_id + "-c"].logprobs
                                           for r in requests)}
    pgc = singleton_pg_collection()  # collective: new groups are created by every rank
    if rank == 0:
        ref = build_reference(cfg.model, sd2, pgc, torch.device("cpu"))
        renamed = {r.request_id + "-b": outs[r.request_id + "-b"] for r in requests}
        reqs_b = [Request(r.request_id + "-b", r.prompt, r.params) for r in requests]
        result.update(compare_with_reference(ref, reqs_b, renamed))
    return result


def memory_release_resume(rank: int, world: int, adp: int, ep: int,
                          mode: str = "normal") -> dict:
    """Release/resume between phases: offload is bit-identical, discard needs a reload, a busy
    engine refuses, retained contexts are evicted, the host agreement (shared-memory control
    exchange, PD rendezvous) survives; allocator statistics on CUDA."""
    from colo_rollout.worker.memory import MemoryReport

    cfg, groups, sd, engine = _engine(world, adp, ep, mode=mode)
    shm_before = engine.control.mailbox is not None
    requests = mixed_requests(8, 5, cfg.model.vocab_size)

    def run(tag: str) -> dict:
        outs = engine.generate([Request(f"{tag}{r.request_id}", r.prompt, r.params)
                                for r in requests])
        return {r.request_id: (outs[f"{tag}{r.request_id}"].tokens,
                               outs[f"{tag}{r.request_id}"].logprobs) for r in requests}

    base = run("a")
    # a retained multi-turn context must not outlive the KV storage
    if rank == 0:
        engine.submit(Request("s1", (1, 2, 3), SamplingParams(max_tokens=2, ignore_eos=True),
                              session="conv"))
    while True:
        engine.step()
        if not engine.busy():
            break
    errors = {}
    if rank == 0:
        engine.submit(Request("busy", (4, 5, 6), SamplingParams(max_tokens=5, ignore_eos=True)))
    engine.step()
    try:
        engine.release_memory()
    except RuntimeError as e:
        errors["busy"] = str(e)
    while engine.busy():
        engine.step()
    before = MemoryReport.now(groups.device)
    rel = engine.release_memory("offload")
    try:
        engine.step()
    except RuntimeError as e:
        errors["released_step"] = str(e)
    res = engine.resume_memory()
    offload = run("b")
    engine.release_memory("discard")
    try:  # (found by probing: refused as the caller's shapes against the freed storage)
        engine.model.load_full_state_dict(sd)
    except RuntimeError as e:
        errors["load_released"] = str(e)
    engine.resume_memory()
    try:
        engine.step()
    except RuntimeError as e:
        errors["discarded_step"] = str(e)
    # an idle pause() before the weights are back: nothing to cancel or serve, no step
    # (found by probing: it stepped into the discarded weights' refusal)
    paused_outputs = engine.pause()
    engine.model.load_full_state_dict(sd)  # what the weight-sync hook does, in place
    engine.weights_loaded()
    engine.resume()
    reloaded = run("c")
    engine.check_integrity()
    return {"offload_equal": offload == base, "reload_equal": reloaded == base,
            "evicted": engine.memory.evicted, "errors": errors,
            "bytes": [before.allocated, rel.allocated, res.allocated],
            "shm_before": shm_before, "shm_after": engine.control.mailbox is not None,
            "gloo_fallbacks": engine.control.fallbacks, "paused_outputs": paused_outputs}


def graph_key_agrees(rank: int, world: int, adp: int, ep: int) -> dict:
    """The D-graph key (bucket rows, longest block table) is computed from replicated state:
    identical on every rank even when the replicas' own tables differ in length."""
    cfg, groups, sd, engine = _engine(world, adp, ep, max_batch_size=3, decode_buckets=[1, 2, 4])
    runner, log = engine.runner, []
    inner = runner.run_decode

    def logged(plan, *a, **kw):
        mine = [len(d.table) for d in plan.replicas[groups.replica].decode]
        log.append((plan.bucket, plan.table_blocks, max(mine, default=0)))
        return inner(plan, *a, **kw)

    runner.run_decode = logged
    # one long and one short request: they land on different replicas
    engine.generate([Request("long", tuple(range(3, 43)), SamplingParams(max_tokens=12,
                                                                         ignore_eos=True)),
                     Request("short", (5, 6, 7), SamplingParams(max_tokens=12, ignore_eos=True))])
    return {"keys": [k[:2] for k in log], "local": [k[2] for k in log]}


class _LateP:
    """A P epoch's pending tokens that claim not to be done for the first ``lag`` checks:
    a rank whose P GPU work finishes later than its peers'."""

    def __init__(self, inner, lag: int) -> None:
        self.inner, self.lag = inner, lag

    def done(self) -> bool:
        self.lag -= 1
        return self.lag < 0 and self.inner.done()

    def wait(self, *args) -> None:
        self.lag = 0
        self.inner.wait(*args)

    def resolve(self, *args):
        return self.inner.resolve(*args)


def deferred_p_commit(rank: int, world: int, adp: int, ep: int, lag: int) -> dict:
    """Fine mode where the last rank's P epochs report done ``lag`` step ends late: every rank
    must still commit each epoch at the same step (the one whose exchange completes the set of
    P tokens) and give Normal's tokens."""
    cfg, groups, sd, engine = _engine(world, adp, ep, max_batch_size=3,
                                      decode_buckets=[1, 2, 4], mode="fine", segment_span=3)
    if rank == world - 1:
        advance = engine.runner.advance

        def late(*a, **kw):
            out = advance(*a, **kw)
            return _LateP(out, lag) if out is not None else None
        engine.runner.advance = late
    requests = mixed_requests(14, 0, cfg.model.vocab_size)
    outs = engine.generate(requests)
    engine.check_integrity()
    for kv in engine.scheduler.kv:
        kv.assert_empty()
    return {"tokens": {r.request_id: outs[r.request_id].tokens for r in requests},
            "in_flight": [h.p_in_flight for h in engine.history],
            "steps": len(engine.history)}


def successor_engines(rank: int, world: int, adp: int, ep: int) -> dict:
    """A Normal engine, then new engines in Fine (span 1) and Global-Enqueue on its worker serve
    the same requests: each is fresh (its own scheduler and turnstile), keeps the model, and
    gives the Normal engine's tokens; the engine that handed the worker over refuses to step; a
    config that changes the model or the KV storage is refused (and leaves the serving engine
    serving)."""
    import dataclasses

    cfg, groups, sd, engine = _engine(world, adp, ep, max_batch_size=3,
                                      decode_buckets=[1, 2, 4])
    requests = mixed_requests(10, 5, cfg.model.vocab_size)
    model = engine.model

    def serve(eng, tag):
        reqs = [dataclasses.replace(r, request_id=f"{tag}{r.request_id}") for r in requests]
        outs = eng.generate(reqs)
        eng.check_integrity()
        return [outs[r.request_id].tokens for r in reqs]

    out = {"normal": serve(engine, "n")}
    errors = {}
    for mode in ("fine", "global_enqueue"):
        nxt_cfg = dataclasses.replace(cfg, engine=dataclasses.replace(
            cfg.engine, mode=mode, segment_span=1))
        nxt = Engine(nxt_cfg, groups, worker=engine.worker)
        try:
            engine.step()
        except RuntimeError as e:
            errors[f"old_{mode}"] = str(e)
        assert nxt.model is model and nxt.scheduler is not engine.scheduler
        assert nxt.scheduler.step_no == 0 and not nxt.history
        out[mode] = serve(nxt, mode[0])
        out[f"{mode}_d_during_p"] = sum(1 for h in nxt.history if h.p_in_flight and h.rows > 0)
        engine = nxt
    for key, bad in (("kv", dataclasses.replace(cfg, engine=dataclasses.replace(
            cfg.engine, num_kv_blocks=cfg.engine.num_kv_blocks + 1))),
                     ("model", dataclasses.replace(cfg, model=dataclasses.replace(
                         cfg.model, seed=cfg.model.seed + 1)))):
        try:
            Engine(bad, groups, worker=engine.worker)
        except ValueError as e:
            errors[key] = str(e)
    errors["still_serves"] = serve(engine, "s") == out["normal"]
    engine.close()
    return {"tokens": out, "errors": errors}


def padded_moe_rows(rank: int, world: int, adp: int, ep: int) -> dict:
    """The grouped expert path with padding rows (a P graph's token bucket): rows < n_valid
    equal the unpadded forward, padding rows come out zero and take no expert's work -- on
    every layer, whatever garbage the padding rows hold."""
    cfg = tiny_config(world, adp, ep, model_kw={"moe_compute": "grouped"})
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    model = engine.model
    H = cfg.model.hidden_size
    gen = torch.Generator().manual_seed(3)
    worst, pad_max = 0.0, 0.0
    for i in range(cfg.model.num_layers):
        for n, pad in ((1, 31), (7, 9), (20, 28)):
            h = torch.randn(n, H, generator=gen)
            junk = torch.randn(pad, H, generator=gen) * 50  # stale rows of another epoch
            ref = model.moe_block(i, h)
            layer = model.decoder.layers[i]
            got = layer.mlp(layer.pre_mlp_layernorm(torch.cat([h, junk])),
                            n_valid=torch.tensor(n))
            worst = max(worst, (got[:n] - ref).abs().max().item())
            pad_max = max(pad_max, got[n:].abs().max().item())
    errors = {}
    try:
        mlp = model.decoder.layers[0].mlp
        mlp._use_grouped = {k: False for k in mlp._use_grouped}  # megatron's experts forward
        mlp(torch.randn(4, H), n_valid=torch.tensor(2))
    except ValueError as e:
        errors["megatron_path"] = str(e)
    return {"max_diff": worst, "pad_max": pad_max, "errors": errors}


def stall_dump(rank: int, world: int, adp: int, ep: int) -> dict:
    """engine.stall_dump_s: a step longer than the threshold prints the stepping thread's stack
    to stderr (here fd 2 redirected to a file); with 0 nothing is printed."""
    import os
    import tempfile

    out = {}
    for threshold in (0.0, 1e-4):
        cfg = tiny_config(world, adp, ep, stall_dump_s=threshold)
        groups = init_parallel(cfg.parallel)
        install_cpu_compat()
        engine = Engine(cfg, groups, random_state_dict(cfg.model))
        with tempfile.TemporaryFile() as f:
            saved = os.dup(2)
            os.dup2(f.fileno(), 2)
            try:
                engine.generate(mixed_requests(4, 3, cfg.model.vocab_size))
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            f.seek(0)
            text = f.read().decode(errors="replace")
        out[str(threshold)] = {"dumped": "[stall watch] rank" in text,
                               "in_step": "in _step" in text}
        engine.close()
    return out


def prefill_graph_data_path(rank: int, world: int, adp: int, ep: int) -> dict:
    """P's MoE graphs without the capture (CPU): a subclass whose 'graph' runs the captured
    function eagerly on the shared buffers exercises everything else -- bucket choice, the
    input copy over stale rows, the row count, padding given to no expert, the output view,
    the fallback past capacity -- against the modules, per layer and through a whole engine.
    Every kind: the partial everywhere, the new residual (the slots summed into h inside the
    graph) where the model takes that path (one rank), and that with the norms around it fused
    ("normed": h's pre-MLP norm in, the new residual and its next norm out), against
    ``ModulesMoE``."""
    from types import SimpleNamespace

    from colo_rollout.model.model import ModulesMoE
    from colo_rollout.worker.prefill_graph import PrefillMoEGraphs

    class EagerReplay(PrefillMoEGraphs):
        def _capture(self, kind, i, T):
            self._out(kind)
            g = SimpleNamespace(replay=lambda: self._block(kind, i, T))
            self._graphs[(kind, i, T)] = g
            self.captures += 1
            return g

        def normed(self, i, h, u):
            self.u_in_place.append(u.data_ptr() == self._u_buffer().data_ptr())
            return super().normed(i, h, u)

        def _replay(self, kind, i, h):
            self.kinds.append(kind)
            # whether the caller wrote h into the input buffer itself (``input``): no copy
            self.in_place.append(h.data_ptr() == self._in.data_ptr())
            return super()._replay(kind, i, h)

    cfg = tiny_config(world, adp, ep, model_kw={"moe_compute": "grouped"}, max_batch_size=4,
                      decode_buckets=[1, 2, 4])
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    model = engine.model
    graphs = EagerReplay(model, max_tokens=100, capture_stream=None)
    graphs.kinds = []  # the kind of every replay, in order
    graphs.in_place = []  # per replay: h already in the graphs' input buffer
    graphs.u_in_place = []  # per "normed" call: u already in the graphs' u buffer
    gen = torch.Generator().manual_seed(11)
    modules = ModulesMoE(model)
    worst = worst_residual = worst_normed = 0.0
    residual_layers, normed_layers = set(), set()
    for n in (1, 33, 100, 7, 130):  # 130: past capacity, the modules
        for i in range(cfg.model.num_layers):
            h = torch.randn(n, cfg.model.hidden_size, generator=gen)
            with torch.inference_mode():  # as P runs them
                d = (graphs.partial(i, h) - modules.partial(i, h)).abs().max()
                worst = max(worst, d.item())
                if model.p_moe_into_residual(i, h):
                    residual_layers.add(i)
                    d = (graphs.residual(i, h).float() - modules.residual(i, h).float()).abs()
                    worst_residual = max(worst_residual, d.max().item())
                if model.p_moe_kind(i, h) == "normed":
                    normed_layers.add(i)
                    u = model.decoder.layers[i].pre_mlp_layernorm(h)
                    for a, b in zip(graphs.normed(i, h, u), modules.normed(i, h, u)):
                        d = (a.float() - b.float()).abs().max().item()
                        worst_normed = max(worst_normed, d)
    keys = graphs.keys
    direct_u = len(graphs.u_in_place)
    requests = mixed_requests(6, 4, cfg.model.vocab_size)
    eager = engine.generate(requests)
    engine.runner.prefill_graphs = graphs
    replays, kinds = graphs.replays, len(graphs.kinds)
    graphed = engine.generate([Request(f"g{r.request_id}", r.prompt, r.params)
                               for r in requests])
    same = all(eager[r.request_id].tokens == graphed[f"g{r.request_id}"].tokens
               and eager[r.request_id].logprobs == graphed[f"g{r.request_id}"].logprobs
               for r in requests)
    return {"max_diff": worst, "max_diff_residual": worst_residual,
            "max_diff_normed": worst_normed, "normed_layers": sorted(normed_layers),
            "engine_u_in_place": sorted(set(graphs.u_in_place[direct_u:])),
            "direct_u_in_place": sorted(set(graphs.u_in_place[:direct_u])),
            "residual_layers": sorted(residual_layers), "keys": keys,
            "engine_kinds": sorted(set(graphs.kinds[kinds:])),
            "engine_replays": graphs.replays - replays,
            "engine_in_place": sorted(set(graphs.in_place[kinds:])),
            "direct_in_place": sorted(set(graphs.in_place[:kinds])),
            "engine_same": same}


def wedged_close(rank: int, world: int, adp: int, ep: int) -> dict:
    """A step whose bounded wait raised DeviceStall marks the engine wedged: the error names
    rank and step, and close() then releases host resources only -- it neither drains the
    streams nor releases the graphs (both wait on the device, which never drains). An engine
    that is not wedged does drain (the stand-ins below would fail)."""
    from colo_rollout.runtime.device import DeviceStall

    def must_not_drain():
        raise AssertionError("drained a wedged device")

    out = {}
    for wedge in (True, False):
        cfg = tiny_config(world, adp, ep)
        groups = init_parallel(cfg.parallel)
        install_cpu_compat()
        engine = Engine(cfg, groups, random_state_dict(cfg.model))
        if wedge:
            class Stuck:
                def resolve(self, timeout_s, what):
                    raise DeviceStall(f"{what}: the GPU work was not done within "
                                      f"{timeout_s:g} s")

            engine.runner.run = lambda plan: Stuck()
            for req in mixed_requests(2, 3, cfg.model.vocab_size):
                engine.submit(req)
            try:
                for _ in range(5):
                    engine.step()
            except DeviceStall as e:
                out["error"] = str(e)
        engine.route.synchronize = must_not_drain
        engine.runner.release_graphs = must_not_drain
        try:
            engine.close()
            out[f"close_wedged={wedge}"] = "ok"
        except AssertionError as e:
            out[f"close_wedged={wedge}"] = str(e)
    return out


def plain_qkv_is_the_module(rank: int, world: int, adp: int, ep: int) -> dict:
    """The attention's direct QKV call (``plain_column_linear``) against megatron's
    ColumnParallelLinear forward, bitwise, with and without the q/k/v bias, at this layout."""
    from colo_rollout.model.attention import plain_column_linear

    out = {}
    for bias in (False, True):
        cfg = tiny_config(world, adp, ep, model_kw={"qkv_bias": bias})
        groups = init_parallel(cfg.parallel)
        engine = Engine(cfg, groups, random_state_dict(cfg.model))
        x = torch.randn(5, cfg.model.hidden_size, generator=torch.Generator().manual_seed(3))
        rows = []
        with torch.inference_mode():
            for layer in engine.model.decoder.layers:
                att = layer.self_attention
                rows.append((att._plain_qkv, att.linear_qkv.bias is not None,
                             torch.equal(plain_column_linear(att.linear_qkv, x),
                                         att.linear_qkv(x)[0])))
        out[str(bias)] = rows
        engine.close()
    return out


def config_divergence(rank: int, world: int) -> dict:
    """Rank 1 builds its engine with another engine.num_kv_blocks: every rank refuses at the
    engine's build, naming the key (they would otherwise meet in collectives of other sizes)."""
    from colo_rollout.config import ConfigError

    out = {"error": None}
    try:
        _engine(world, 2, 2, num_kv_blocks=64 if rank == 0 else 48)
    except ConfigError as e:
        out = {"error": str(e), "key": e.key}
    # another hidden_size: the head_dim derived from it sorts first; both are named (found by
    # fault injection: only head_dim was)
    try:
        _engine(world, 2, 2, model_kw={"hidden_size": 64 if rank == 0 else 32})
    except ConfigError as e:
        out["hidden"] = str(e)
    return out


def engine_build_beside_generate(rank: int, world: int) -> dict:
    """Rank 0 builds an engine on the worker (a hand-over) while rank 1 is in generate():
    both raise, naming the two calls (found by fault injection: a TypeError on rank 0), and
    the engine serves on afterwards on both."""
    cfg, groups, sd, engine = _engine(world, world, world)
    try:
        if rank == 0:
            Engine(cfg, groups, worker=engine.worker)
        else:
            engine.generate([])
    except RuntimeError as e:
        error = str(e)
    outs = engine.generate([Request("after", (1, 2, 3), SamplingParams(max_tokens=2))])
    return {"error": error, "after": outs["after"].finish_reason.value}


def session_protocol(rank: int, world: int) -> dict:
    """Multi-turn sessions where the protocol used to fail (1 rank, greedy): two sessions
    whose next turns each wait for blocks the other's retained context held (the engine
    stepped idle for ever); a close and a new turn of the id in one step (the close was
    dropped: the turn continued the old context); two turns of one session in one generate()
    (the refused one was missing from its result); a turn after a cancel ended its session
    (served as a new conversation without a word)."""
    from colo_rollout.sched.request import RequestError

    cfg, groups, sd, engine = _engine(world, world, world, num_kv_blocks=8, max_seq_len=32)
    g = SamplingParams(max_tokens=4, ignore_eos=True)
    res: dict = {}
    engine.generate([Request(f"{s}0", tuple(range(1, 9)), g, session=s) for s in "AB"])
    outs = engine.generate([Request(f"{s}1", tuple(range(10, 18)), g, session=s)
                            for s in "AB"])
    res["both_turns"] = sorted((k, o.finish_reason.value) for k, o in outs.items())
    for s in "AB":
        engine.close_session(s)
    engine.step()
    # a close and a new first turn under the id in one step: a new conversation
    engine.generate([Request("c0", (3, 4, 5), g, session="C")])
    engine.close_session("C")
    again = engine.generate([Request("c1", (5, 9), g, session="C")])["c1"].tokens
    fresh = engine.generate([Request("f", (5, 9), g)])["f"].tokens
    res["closed_then_new_is_fresh"] = again == fresh
    engine.close_session("C")
    engine.step()
    both = engine.generate([Request("d0", (1, 2), g, session="D"),
                            Request("d1", (3, 4), g, session="D")])
    res["both_returned"] = sorted((k, o.finish_reason.value) for k, o in both.items())
    engine.close_session("D")
    engine.step()
    engine.submit(Request("e0", tuple(range(1, 7)), SamplingParams(max_tokens=8,
                                                                   ignore_eos=True),
                          session="E"))
    engine.step()
    engine.cancel("e0")
    engine.step()
    try:
        engine.submit(Request("e1", (7, 8), g, session="E"))
        res["after_cancel"] = "accepted"
    except RequestError as e:
        res["after_cancel"] = str(e)
    engine.close_session("E")  # acknowledges the end: the id starts a new conversation
    engine.step()
    res["reused"] = engine.generate([Request("e2", (7, 8), g, session="E")])[
        "e2"].finish_reason.value
    # a request without a session whose id is a session's: the two would share the routing
    # record's key
    engine.generate([Request("F-t0", (1, 2), g, session="F")])
    try:
        engine.submit(Request("F", (3, 4), g))
        res["id_is_a_session"] = "accepted"
    except RequestError as e:
        res["id_is_a_session"] = str(e)
    engine.check_integrity()
    engine.close()
    return res


def sessions_follow_new_weights_and_hand_over(rank: int, world: int, adp: int,
                                              ep: int) -> dict:
    """One session's turns across a weight load and a hand-over: the turn after
    load_full_state_dict re-prefills the context under the new weights (the retained KV was
    computed under the old ones), and the engine the worker is handed to (Fine mode) goes on
    with the session. Every turn teacher-forced through megatron over the whole trajectory,
    under the weights it was served with (rank 0)."""
    import dataclasses

    cfg, groups, sd, engine = _engine(world, adp, ep)
    sd2 = random_state_dict(cfg.model, seed=99)
    rng = random.Random(5)
    plan = [tuple(rng.randrange(1, 250) for _ in range(n)) for n in (14, 3, 5, 4)]

    def turn(eng, t: int):
        rid = f"S-t{t}"
        return eng.generate([Request(rid, plan[t], SamplingParams(max_tokens=4, ignore_eos=True),
                                     session="S")])[rid]

    outs = [turn(engine, 0)]
    engine.model.load_full_state_dict(sd2)
    outs.append(turn(engine, 1))
    nxt = Engine(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, mode="fine")),
                 groups, worker=engine.worker)
    outs += [turn(nxt, 2), turn(nxt, 3)]
    retained = len(nxt.scheduler.idle_sessions())
    if rank == 0:
        nxt.close_session("S")
    nxt.step()
    for kv in nxt.scheduler.kv:
        kv.assert_empty()
    res = {"tokens": [o.tokens for o in outs], "retained": retained}
    pgc = singleton_pg_collection()
    if rank == 0:
        refs = [build_reference(cfg.model, w, pgc, torch.device("cpu")) for w in (sd, sd2)]
        worst, mism, context = 0.0, [], []
        for t, out in enumerate(outs):
            full = context + list(plan[t]) + out.tokens
            lp = reference_logprobs(refs[min(t, 1)], full[:-1])
            base = len(context) + len(plan[t]) - 1
            for j, (tok, l) in enumerate(zip(out.tokens, out.logprobs)):
                row = lp[base + j]
                worst = max(worst, abs(float(row[tok]) - l))
                if float(row[tok]) < float(row.max()) - LOGPROB_TOL:
                    mism.append((t, j))
            context = full
        res.update(max_logprob_diff=worst, mismatches=mism)
    return res


def hand_over_is_refused_on_every_rank(rank: int, world: int) -> dict:
    """A hand-over that one rank must refuse (its close_session not yet sent) is refused on
    every rank (found by probing: rank 0 alone refused, the others built the next engine
    against a broken control group); once the close went out it works."""
    cfg, groups, sd, engine = _engine(world, world, world)
    engine.generate([Request("S-t0", (1, 2, 3), SamplingParams(max_tokens=2), session="S")])
    if rank == 0:
        engine.close_session("S")
    try:
        Engine(cfg, groups, worker=engine.worker)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    engine.step()  # the close goes out
    # without routing recording nothing waits on closed sessions (found by probing: the
    # set of closed sessions awaiting their routing grew by every close)
    closed_waiting = len(engine._closed_routes)
    nxt = Engine(cfg, groups, worker=engine.worker)
    after = nxt.generate([Request("x", (1, 2), SamplingParams(max_tokens=2))])["x"].tokens
    nxt.close()
    return {"refused": refused, "after": len(after), "closed_waiting": closed_waiting}


def a_failed_collective_is_named(rank: int, world: int) -> dict:
    """A backend failure inside a step (what gloo raises when a peer stalls past the timeout,
    as a plain RuntimeError) comes out of step() as a ControlError naming the rank and step;
    an engine's own RuntimeError passes as it is."""
    cfg, groups, sd, engine = _engine(world, world, world)
    res = {}
    for name, text in (("gloo", "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                                "3000ms for recv operation to complete"),
                       ("own", "this engine handed its worker to another engine")):
        def fail(text=text):
            raise RuntimeError(text)
        engine._step = fail
        try:
            engine.step()
        except RuntimeError as e:
            res[name] = (type(e).__name__, str(e))
    return res
