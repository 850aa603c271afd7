"""Per-rank bodies of the GPU tests (NCCL, one process per GPU)."""

from __future__ import annotations

import functools

import dataclasses
import time

import torch

from colo_rollout.testing.attention_oracle import prefill_per_sequence

from colo_rollout.config import Config, EngineConfig, ModelConfig, ParallelConfig
from colo_rollout.engine.engine import Engine
from colo_rollout.model.weights import random_state_dict
from colo_rollout.runtime.parallel import init_parallel
from colo_rollout.model.megatron_gpt import (
    build_reference,
    singleton_pg_collection,
    tp_pg_collection,
)
from colo_rollout.model.megatron_gpt import reference_logprobs
from tests.cases_engine import compare_with_reference, mixed_requests

# Acceptance on GPU (logprobs of the engine's tokens, teacher-forced through megatron GPTModel
# full recompute with the same weights):
#  * fp32 engine vs fp32 reference: they differ only in summation order (NCCL vs local, paged vs
#    dense attention), ~1e-5; FP32_TOL = 2e-3 leaves margin while a wrong shard/position/row
#    costs O(0.1-1). Every token must be the reference argmax (within the tolerance).
#  * bf16 engine: its error against the fp32 ground truth must be no worse than megatron's own
#    bf16 GPTModel's -- same spec, TP = ATP, so both round the same partial sums -- error
#    against it on the same tokens (ratio <= BF16_RATIO), and its greedy tokens must be the
#    fp32 argmax (within BF16_ARGMAX_SLACK) on nearly as many positions as megatron bf16's own
#    argmax is (at most BF16_AGREE_DROP fewer): bf16 rounding legitimately flips near-ties of a
#    random-weight model, in both, and with a few hundred tokens by chance.
FP32_TOL = 2e-3
BF16_RATIO = 1.5
BF16_ARGMAX_SLACK = 0.05
BF16_AGREE_DROP = 0.03


def gpu_config(world: int, adp: int, ep: int, dtype: str = "bfloat16",
               use_te: str = "off", backend: str = "nccl",
               model_kw: dict | None = None, engine_kw: dict | None = None) -> Config:
    small = backend == "gloo"  # the CPU variant of the check uses a narrower model
    return Config(
        parallel=ParallelConfig(world_size=world, adp=adp, ep=ep, backend=backend, timeout_s=60.0),
        model=ModelConfig(**{"vocab_size": 2048, "hidden_size": 128 if small else 512,
                             "num_layers": 4, "num_attention_heads": 8, "num_query_groups": 4,
                             "moe_ffn_hidden_size": 128 if small else 512, "num_experts": 16,
                             "moe_router_topk": 2, "max_position_embeddings": 1024,
                             "init_method_std": 0.05, "params_dtype": dtype, "seed": 11,
                             "use_te": use_te, **(model_kw or {})}),
        engine=EngineConfig(**{"max_batch_size": 4, "max_prefill_tokens": 512,
                               "kv_block_size": 16, "num_kv_blocks": 256, "max_seq_len": 512,
                               "decode_buckets": [1, 2, 4], **(engine_kw or {})}),
    )


def gpu_engine_matches_reference(rank: int, world: int, adp: int, ep: int, dtype: str,
                                 use_te: str = "off", n_requests: int = 16, seed: int = 0,
                                 backend: str = "nccl", model_kw: dict | None = None,
                                 engine_kw: dict | None = None,
                                 dense_from: int | None = None,
                                 max_tokens: int | None = None) -> dict:
    """``dense_from``: P's dense calls (engine.prefill_attention cudnn / flash) take fresh
    sequences from this many tokens (model/dense_prefill.py's MIN_TOKENS, 1024, is longer
    than these prompts); the result counts the P steps' dense calls. ``max_tokens``: every
    request's (else 1-12)."""
    from colo_rollout.model import dense_prefill

    cfg = gpu_config(world, adp, ep, dtype, use_te, backend, model_kw, engine_kw)
    groups = init_parallel(cfg.parallel)
    if backend == "gloo":
        from colo_rollout.runtime.cpu_compat import install_cpu_compat

        install_cpu_compat()
    sd = random_state_dict(cfg.model)
    engine = Engine(cfg, groups, sd)
    requests = mixed_requests(n_requests, seed, cfg.model.vocab_size)
    if max_tokens is not None:
        requests = [dataclasses.replace(r, params=dataclasses.replace(r.params,
                                                                      max_tokens=max_tokens))
                    for r in requests]
    saved, dense_prefill.MIN_TOKENS = (dense_prefill.MIN_TOKENS,
                                       dense_from or dense_prefill.MIN_TOKENS)
    try:
        outs, wall = timed_generate(engine, requests)
    finally:
        dense_prefill.MIN_TOKENS = saved
    pgc = singleton_pg_collection()
    res = {"layout": groups.layout.name, "wall_s": wall,
           "device": torch.cuda.get_device_name() if backend == "nccl" else "cpu",
           "te": engine.model.use_te, "prefill_attention": engine.model.prefill_attention,
           "dispatch": [d.report().row() for d in (engine.model.dispatch_p,
                                                   engine.model.dispatch_d)
                        if hasattr(d, "report")],
           "tokens": {r.request_id: outs[r.request_id].tokens for r in requests},
           "generated": sum(len(outs[r.request_id].tokens) for r in requests),
           "preemptions": engine.scheduler.preemptions}
    dev = groups.device
    lp16 = None
    if dtype != "float32":
        # yardstick: megatron's own GPTModel of the same spec (local or TE) in bf16 at TP = ATP
        # (collective over each replica's ATP group; every rank evaluates every request)
        ypgc = tp_pg_collection(groups.atp) if groups.layout.atp > 1 else pgc
        ref16 = build_reference(cfg.model, sd, ypgc, dev, te=engine.model.use_te)
        lp16 = [reference_logprobs(ref16, _teacher(r, outs)) for r in requests]
    if rank == 0:
        ref_cfg = dataclasses.replace(cfg.model, params_dtype="float32", use_te="off")
        ref32 = build_reference(ref_cfg, {k: v.float() for k, v in sd.items()}, pgc, dev)
        if dtype == "float32":
            res.update(compare_with_reference(ref32, requests, outs, tol=FP32_TOL))
        else:
            res.update(compare_bf16(ref32, lp16, requests, outs))
    return res


def timed_generate(engine, requests) -> tuple[dict, float]:
    """``engine.generate(requests)`` timed between device syncs, then the KV integrity
    check: (outputs, wall seconds)."""
    sync = torch.cuda.synchronize if engine.groups.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outs = engine.generate(requests)
    sync()
    wall = time.perf_counter() - t0
    engine.check_integrity()
    return outs, wall


def _teacher(req, outs) -> list[int]:
    return (list(req.prompt) + outs[req.request_id].tokens)[:-1]


def compare_bf16(ref32, lp16_all, requests, outs) -> dict:
    eng_err, ref_err, agree, ref_agree, n = 0.0, 0.0, 0, 0, 0
    worst = 0.0
    for req, lp16 in zip(requests, lp16_all):
        out = outs[req.request_id]
        lp32 = reference_logprobs(ref32, _teacher(req, outs))
        for j, (tok, lp) in enumerate(zip(out.tokens, out.logprobs)):
            row = len(req.prompt) - 1 + j
            truth = float(lp32[row, tok])
            top = float(lp32[row].max()) - BF16_ARGMAX_SLACK
            eng_err += abs(lp - truth)
            ref_err += abs(float(lp16[row, tok]) - truth)
            worst = max(worst, abs(lp - truth))
            agree += truth >= top  # the engine's greedy pick is (near) the fp32 argmax
            ref_agree += float(lp32[row, int(lp16[row].argmax())]) >= top  # megatron bf16's
            n += 1
    return {"checked": n, "mean_logprob_diff": eng_err / n, "max_logprob_diff": worst,
            "megatron_bf16_mean_diff": ref_err / n, "argmax_agreement": agree / n,
            "megatron_bf16_argmax_agreement": ref_agree / n, "mismatches": []}


def gpu_mode_tokens(rank: int, world: int, adp: int, ep: int, mode: str,
                    stream_route: str = "auto", policy: str = "fixed", **engine_kw) -> dict:
    """The PD modes on NCCL, with streams: same greedy tokens as Normal (fp32: batching does not
    change a row's result beyond summation order, far below a token flip). ``engine_kw``: more
    engine settings -- Normal's engine.overlap_prefill with a P budget that makes the prompts
    several P steps in a row, each (when on) enqueued before the last one's tokens are read."""
    cfg = gpu_config(world, adp, ep, "float32")
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, mode=mode,
                                                              segment_span=1,
                                                              segment_policy=policy,
                                                              stream_route=stream_route,
                                                              **engine_kw))
    groups = init_parallel(cfg.parallel)
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    requests = mixed_requests(16, 0, cfg.model.vocab_size)
    outs = engine.generate(requests)
    engine.check_integrity()
    for kv in engine.scheduler.kv:
        kv.assert_empty()
    hist = list(engine.history)
    return {"tokens": {r.request_id: outs[r.request_id].tokens for r in requests},
            "d_during_p": sum(1 for h in hist if h.p_in_flight and h.d_rows > 0),
            "streams": engine.route.active, "routed": engine.route.routed,
            "read_late": sum(1 for h in hist if h.read_late),
            "p_after_late": sum(1 for a, b in zip(hist, hist[1:])
                                if a.read_late and b.phase.name == "PREFILL")}


def overlap_config(world: int, adp: int, ep: int, mode: str, policy: str = "fixed") -> Config:
    """A model where one long P epoch takes many D iterations' time (bf16: grouped experts)."""
    return Config(
        parallel=ParallelConfig(world_size=world, adp=adp, ep=ep, backend="nccl", timeout_s=120.0),
        model=ModelConfig(vocab_size=4096, hidden_size=1024, num_layers=8, num_attention_heads=16,
                          num_query_groups=4, moe_ffn_hidden_size=1024, num_experts=16,
                          moe_router_topk=2, max_position_embeddings=4096, init_method_std=0.02,
                          params_dtype="bfloat16", seed=5, use_te="off"),
        engine=EngineConfig(max_batch_size=8, max_prefill_tokens=16384, kv_block_size=16,
                            num_kv_blocks=2048, max_seq_len=4096, decode_buckets=[1, 2, 4, 8],
                            mode=mode, segment_span=1, segment_policy=policy,
                            cuda_timing=True),
    )


def gpu_pd_overlap(rank: int, world: int, adp: int, ep: int, mode: str,
                   long_prompts: int = 8, long_len: int = 1800, policy: str = "fixed") -> dict:
    """D rows decode; then a long P epoch arrives. CUDA events on both streams say whether D
    iterations ran *while* the P epoch was in flight on the GPU, and the sync-debug mode counts
    host syncs while P segments and D iterations are enqueued (the overlap needs none)."""
    import random
    import warnings

    from colo_rollout.sched.request import Request, SamplingParams

    cfg = overlap_config(world, adp, ep, mode, policy)
    groups = init_parallel(cfg.parallel)
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    V = cfg.model.vocab_size
    rng = random.Random(1)
    warm = [Request(f"w{i}", tuple(rng.randrange(V) for _ in range(64)),
                    SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(4 * adp)]
    engine.generate(warm)  # NCCL communicators, allocator pools, GEMM plans
    torch.cuda.synchronize()
    engine.route._marks.clear()

    syncs = {"P": 0, "D": 0}
    where: set[str] = set()  # the Python lines that synchronized (diagnosis)

    def counted(kind, fn):
        def wrapper(*a, **kw):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = fn(*a, **kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            hits = [w for w in caught if "synchroniz" in str(w.message)]
            syncs[kind] += len(hits)
            where.update(f"{kind} {w.filename}:{w.lineno}" for w in hits)
            return out
        return wrapper

    if mode != "normal":
        engine.runner.advance = counted("P", engine.runner.advance)
        engine.runner.run_decode = counted("D", engine.runner.run_decode)
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    if rank == 0:
        for i in range(4 * adp):
            engine.submit(Request(f"d{i}", tuple(rng.randrange(V) for _ in range(16)), params))
    for _ in range(6):  # the D rows are admitted and decoding
        engine.step()
    if rank == 0:
        for i in range(long_prompts * adp):
            engine.submit(Request(f"p{i}", tuple(rng.randrange(V) for _ in range(long_len)),
                                  SamplingParams(max_tokens=1, ignore_eos=True)))
    while engine.busy():
        engine.step()
    spans = engine.route.gpu_spans()
    engine.check_integrity()
    return {"layout": groups.layout.name, "mode": mode, "policy": policy,
            "final_span": getattr(engine.policy, "span", None), "streams": engine.route.active,
            "syncs": syncs, "sync_sites": sorted(where)[:8], **overlap_stats(spans)}


def overlap_stats(spans) -> dict:
    """The longest P epoch's GPU window and the D iterations inside it (spans in seconds,
    results in ms)."""
    p_epochs: dict[int, list] = {}
    for i, s in enumerate(spans):
        if s.kind == "P":  # Normal: every P step is its own epoch (keyed by its position)
            p_epochs.setdefault(s.epoch if s.epoch >= 0 else -1 - i, []).append(s)
    windows = [(min(s.start for s in ss), max(s.end for s in ss)) for ss in p_epochs.values()]
    start, end = max(windows, key=lambda w: w[1] - w[0])
    d = sorted((s for s in spans if s.kind == "D"), key=lambda s: s.start)
    inside = [s for s in d if s.start >= start and s.end <= end]
    outside = [s for s in d if s.end < start or s.start > end]
    gaps = [b.start - a.end for a, b in zip(d, d[1:])]
    mean = lambda xs: sum(x.end - x.start for x in xs) / len(xs) * 1e3 if xs else 0.0
    return {"p_window_ms": (end - start) * 1e3, "d_inside": len(inside), "d_total": len(d),
            "d_gap_max_ms": max(gaps, default=0.0) * 1e3, "d_ms_inside": mean(inside),
            "d_ms_outside": mean(outside)}


def gpu_graphs_vs_eager(rank: int, world: int, adp: int, ep: int,
                        kernels: str = "auto") -> dict:
    """D and P's MoE blocks by graph replay against eager on the same engine and requests
    (bf16), then after an in-place weight reload (graphs must see the new weights without
    re-capture) and after a replaced parameter that both phases' graphs read (both must be
    re-captured)."""
    import random

    from colo_rollout.sched.request import Request, SamplingParams

    cfg = overlap_config(world, adp, ep, "normal")
    # kernels: the MoE and P attention kernels ("auto": Triton; "torch": grouped_mm and SDPA;
    # "moe" / "attention": only that one Triton)
    moe, attn = {"moe": ("triton", "torch"), "attention": ("torch", "triton")}.get(
        kernels, (kernels, kernels))
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(
        cfg.engine, moe_kernel=moe, prefill_attention=attn))
    groups = init_parallel(cfg.parallel)
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    graphs, pgraphs = engine.runner.graphs, engine.runner.prefill_graphs
    V = cfg.model.vocab_size
    rng = random.Random(2)
    prompts = [tuple(rng.randrange(V) for _ in range(rng.choice([8, 40, 200])))
               for _ in range(8 * adp)]
    params = SamplingParams(max_tokens=48, ignore_eos=True)

    def run(tag: str, use_graphs: bool, p_graphs: bool | None = None):
        engine.runner.graphs = graphs if use_graphs else None
        p_graphs = use_graphs if p_graphs is None else p_graphs
        engine.runner.prefill_graphs = pgraphs if p_graphs else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.generate([Request(f"{tag}{i}", p, params) for i, p in enumerate(prompts)])
        torch.cuda.synchronize()
        engine.runner.graphs, engine.runner.prefill_graphs = graphs, pgraphs
        return [outs[f"{tag}{i}"] for i in range(len(prompts))], time.perf_counter() - t0

    def agree(a, b) -> dict:
        same = sum(x.tokens == y.tokens for x, y in zip(a, b))
        diffs = []
        for x, y in zip(a, b):  # logprobs along the common prefix of the two token streams
            for tx, ty, lx, ly in zip(x.tokens, y.tokens, x.logprobs, y.logprobs):
                if tx != ty:
                    break
                diffs.append(abs(lx - ly))
        return {"identical": same / len(a), "max_dlogp": max(diffs, default=0.0), "n": len(diffs)}

    def agree_first(a, b) -> dict:
        """P's own output: the first token (argmax of the P logits) and its logprob."""
        same = [x.tokens[0] == y.tokens[0] for x, y in zip(a, b)]
        d = [abs(x.logprobs[0] - y.logprobs[0]) for x, y, s in zip(a, b, same) if s]
        return {"identical": sum(same) / len(a), "max_dlogp": max(d, default=0.0)}

    warm = engine.warmup(max_context=max(len(p) for p in prompts) + params.max_tokens)
    caps, pcaps = graphs.captures, pgraphs.captures
    run("w", True)  # every key this workload uses was captured by warmup
    after_warmup = graphs.captures - caps + pgraphs.captures - pcaps
    we1, _ = run("we", False)
    g1, t_graph = run("g", True)
    e1, t_eager = run("e", False)
    d1, _ = run("d", True, p_graphs=False)  # D graphs, eager P
    # D graphs against eager D, P the same (eager) in both: the same kernels up to padding;
    # P graphs against eager P: a bucket's GEMM shapes differ, so bf16 bits may too
    res = {"layout": groups.layout.name, "graph_keys": graphs.keys, "first": agree(d1, e1),
           "p_first_token": agree_first(g1, d1), "all_graphs_vs_eager": agree(g1, e1),
           "eager_first_token": agree_first(we1, e1), "eager_vs_eager": agree(we1, e1),
           "t_graph_s": t_graph, "t_eager_s": t_eager, "replays": graphs.replays,
           "p_graph_keys": len(pgraphs.keys), "p_replays": pgraphs.replays,
           "warmup_captures": warm, "captured_after_warmup": after_warmup}
    caps, pcaps = graphs.captures, pgraphs.captures
    engine.model.load_full_state_dict(random_state_dict(cfg.model, seed=77))  # in place
    g2, _ = run("g2", True)
    e2, _ = run("e2", False)
    res.update(reloaded=agree(g2, e2), reloaded_first_token=agree_first(g2, e2),
               recaptured_after_reload=graphs.captures - caps
               + pgraphs.captures - pcaps, changed_by_reload=agree(g1, g2)["identical"])
    w = engine.model.decoder.layers[0].mlp.router.weight  # read by D's and P's graphs
    w.data = w.data.clone()  # replaced, same values
    caps, pcaps = graphs.captures, pgraphs.captures
    g3, _ = run("g3", True)
    res.update(recaptured_after_replace=graphs.captures - caps,
               p_recaptured_after_replace=pgraphs.captures - pcaps, after_replace=agree(g3, e2),
               after_replace_first_token=agree_first(g3, e2))
    engine.close()
    return res


def _live_cuda_tensors(top: int = 6) -> list:
    """(shape, dtype, MB) of the largest CUDA tensors Python still references (diagnosis)."""
    import gc

    seen, out = set(), []
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) and obj.is_cuda and id(obj) not in seen:
                seen.add(id(obj))
                out.append((tuple(obj.shape), str(obj.dtype),
                            obj.untyped_storage().nbytes() / 2**20))
        except Exception:  # objects that fail inspection are not tensors we care about
            continue
    out.sort(key=lambda x: -x[2])
    return [len(out), round(sum(x[2] for x in out), 1), out[:top]]


def gpu_memory_phases(rank: int, world: int, adp: int, ep: int) -> dict:
    """Release/resume of KV, graphs and weights measured with torch.cuda allocator statistics;
    generation after resume equals generation before."""
    from colo_rollout.worker.memory import MemoryReport
    from colo_rollout.sched.request import Request, SamplingParams

    cfg = overlap_config(world, adp, ep, "normal")
    groups = init_parallel(cfg.parallel)
    sd = random_state_dict(cfg.model)
    torch.cuda.synchronize()
    empty = MemoryReport.now(groups.device)
    engine = Engine(cfg, groups, sd)
    prompts = [tuple(range(7 + i, 47 + i)) for i in range(4 * adp)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def run(tag):
        outs = engine.generate([Request(f"{tag}{i}", p, params) for i, p in enumerate(prompts)])
        return [outs[f"{tag}{i}"].tokens for i in range(len(prompts))]

    base = run("a")
    kv_bytes = engine.runner.kv.nbytes()
    w_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    res = {"layout": groups.layout.name, "kv_mb": kv_bytes / 2**20, "weights_mb": w_bytes / 2**20}
    for policy in ("keep", "offload", "discard"):
        before = MemoryReport.now(groups.device)
        rel = engine.release_memory(policy)
        res[f"live_after_{policy}"] = _live_cuda_tensors()
        resumed = engine.resume_memory()
        if policy == "discard":
            engine.model.load_full_state_dict(sd)
            engine.weights_loaded()
        equal = run(policy) == base
        res[policy] = {"engine_mb": (before.allocated - empty.allocated) / 2**20,
                       "released_engine_mb": (rel.allocated - empty.allocated) / 2**20,
                       "released_reserved_mb": rel.reserved / 2**20,
                       "resumed_engine_mb": (resumed.allocated - empty.allocated) / 2**20,
                       "equal_after_resume": equal}
    engine.close()
    return res


class _Unroute:
    """Removes a wrapped ``route`` (the instance attribute over GatherMoE's method)."""

    def __init__(self, moe) -> None:
        self.moe = moe

    def remove(self) -> None:
        del self.moe.route


def gpu_layer_errors(rank: int, world: int, adp: int, ep: int, moe_compute: str = "auto",
                     backend: str = "nccl", prefill_attention: str = "batched") -> dict:
    """Diagnosis of bf16 error growth: the residual stream after every attention and MoE block
    of one P forward, engine bf16 and megatron bf16 (TP = ATP) against megatron fp32.

    Also, per MoE layer: tokens whose top-k expert set differs from fp32's (engine, megatron
    bf16), and whether the ranks of the engine agree bitwise on the residual stream and on the
    routing (ranks that route a token differently would sum mismatched partials)."""
    from colo_rollout.sched.request import Request, SamplingParams

    cfg = gpu_config(world, adp, ep, "bfloat16", backend=backend)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_compute=moe_compute))
    groups = init_parallel(cfg.parallel)
    if backend == "gloo":
        from colo_rollout.runtime.cpu_compat import install_cpu_compat

        install_cpu_compat()
    sd = random_state_dict(cfg.model)
    engine = Engine(cfg, groups, sd)
    if prefill_attention == "loop":  # the per-sequence reference path instead of buckets
        for layer in engine.model.decoder.layers:  # this engine's instances only
            layer.self_attention._prefill = functools.partial(prefill_per_sequence,
                                                              layer.self_attention)
    prompt = tuple((i * 37 + 11) % cfg.model.vocab_size for i in range(96))

    def hook_routers(layers) -> tuple[list[torch.Tensor], list]:
        maps: list[torch.Tensor] = []
        hooks = [layer.mlp.router.register_forward_hook(
            lambda m, a, o: maps.append(o[1].reshape(-1, o[1].shape[-1]).clone()))
            for layer in layers]
        return maps, hooks

    def hook_engine_routes(layers) -> tuple[list[torch.Tensor], list]:
        """The engine's routing maps [N, E], read from GatherMoE.route's expert ids (its
        grouped path routes without the router's forward; the other path calls it)."""
        maps: list[torch.Tensor] = []
        hooked = []
        for layer in layers:
            moe = layer.mlp
            inner = moe.route

            def route(x, inner=inner, moe=moe):
                weight, chosen = inner(x)
                maps.append(torch.zeros(x.shape[0], moe.num_experts, dtype=torch.bool,
                                        device=x.device).scatter_(1, chosen, True))
                return weight, chosen

            moe.route = route
            hooked.append(moe)
        uses_route = [m.uses_grouped(torch.zeros(1, device=groups.device,
                                                 dtype=m.router.weight.dtype))
                      for m in hooked]
        if all(uses_route):
            return maps, [_Unroute(m) for m in hooked]
        for m in hooked:
            del m.route
        return hook_routers(layers)

    emaps, ehooks = hook_engine_routes(engine.model.decoder.layers)
    engine.model.trace = []
    engine.generate([Request("x", prompt, SamplingParams(max_tokens=1, ignore_eos=True))])
    eng = engine.model.trace
    engine.model.trace = None
    for h in ehooks:
        h.remove()
    emaps = emaps[: cfg.model.num_layers]  # the P forward's (D of the 1 token is not traced)
    # cross-rank agreement of the engine (every rank holds every token in P)
    cross_h, cross_route = [], []
    for t in eng:
        parts = [torch.empty_like(t) for _ in range(world)]
        torch.distributed.all_gather(parts, t.contiguous(), group=groups.full_p)
        cross_h.append(max(float((p - parts[0]).abs().max()) for p in parts))
    for m in emaps:
        parts = [torch.empty_like(m) for _ in range(world)]
        torch.distributed.all_gather(parts, m.contiguous(), group=groups.full_p)
        cross_route.append(sum(int((p != parts[0]).any(dim=1).sum()) for p in parts))
    dev = groups.device
    pgc = singleton_pg_collection()

    def megatron_trace(model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        out: list[torch.Tensor] = []
        hooks = []
        core = getattr(model, "module", model)  # bf16: megatron's Float16Module wrapper
        for layer in core.decoder.layers:
            hooks.append(layer.pre_mlp_layernorm.register_forward_pre_hook(
                lambda m, a: out.append(a[0][:, 0].float().clone())))
            hooks.append(layer.register_forward_hook(
                lambda m, a, o: out.append((o[0] if isinstance(o, tuple) else o)[:, 0]
                                           .float().clone())))
        maps, rhooks = hook_routers(core.decoder.layers)
        with torch.no_grad():
            reference_logprobs(model, list(prompt))
        for h in hooks + rhooks:
            h.remove()
        return out, maps

    ypgc = tp_pg_collection(groups.atp) if groups.layout.atp > 1 else pgc
    m16, mmaps16 = megatron_trace(build_reference(cfg.model, sd, ypgc, dev))
    ref_cfg = dataclasses.replace(cfg.model, params_dtype="float32", use_te="off")
    m32, mmaps32 = megatron_trace(build_reference(ref_cfg, {k: v.float() for k, v in sd.items()},
                                                  pgc, dev))
    rows = []
    for i, (e, m, t) in enumerate(zip(eng, m16, m32)):
        row = {"point": f"L{i // 2}.{'attn' if i % 2 == 0 else 'moe'}",
               "engine": float((e - t).abs().mean()), "megatron": float((m - t).abs().mean()),
               "engine_max": float((e - t).abs().max()),
               "megatron_max": float((m - t).abs().max()),
               "scale": float(t.abs().mean()), "ranks_max_diff": cross_h[i]}
        if i % 2 == 1:
            li = i // 2
            truth = mmaps32[li]
            row["engine_flips"] = int((emaps[li] != truth).any(dim=1).sum())
            row["megatron_flips"] = int((mmaps16[li] != truth).any(dim=1).sum())
            row["ranks_route_disagree"] = cross_route[li]
        rows.append(row)
    engine.close()
    return {"layout": groups.layout.name, "rows": rows, "moe_compute": moe_compute,
            "prefill_attention": prefill_attention}


def gpu_mtp_tokens(rank: int, world: int, adp: int, ep: int, dtype: str = "bfloat16",
                   backend: str = "nccl", model_kw: dict | None = None,
                   engine_kw: dict | None = None, prompt_len: int = 0) -> dict:
    """engine.mtp on a GPU (D graphs: verify + draft captured for the greedy rows; the Triton
    kernels in bf16): the same greedy requests served with and without MTP, on random weights
    and on the MTP oracle (model/mtp_oracle.py). Reports per weight set: the share of
    streams identical to the non-MTP run, their common-prefix share, the first tokens (P's,
    which MTP does not change), the acceptance rate and the D iterations of each run. In fp32
    the two runs differ by summation order only; in bf16 the verify forward's 2B-row GEMMs
    may round differently from the B-row ones, so a stream may part at a near-tie (not with
    engine.batch_invariant). ``model_kw``: more model keys (a dispatch backend); ``engine_kw``:
    more engine keys. Also reports whether the logprobs of identical streams are equal.
    ``prompt_len`` > 0: 32 requests of prompt_len to 1.5 x prompt_len tokens and 24 new ones,
    D batches of up to 32 sequences (64 verify rows): the decode attention's splits and the
    GEMMs' algorithms change between B and 2B rows there."""
    import dataclasses

    from colo_rollout.model.mtp_oracle import oracle_state_dict

    base = gpu_config(world, adp, ep, dtype, backend=backend,
                      model_kw={"mtp_num_layers": 1, **(model_kw or {})})
    groups = init_parallel(base.parallel)
    if backend == "gloo":  # the CPU smoke run of this case
        from colo_rollout.runtime.cpu_compat import install_cpu_compat

        install_cpu_compat()
    requests = mixed_requests(16, 0, base.model.vocab_size)
    if prompt_len:
        import random as _random

        from colo_rollout.sched.request import Request, SamplingParams

        rng = _random.Random(5)
        requests = [Request(f"r{i}", tuple(rng.randrange(base.model.vocab_size) for _ in
                                           range(rng.randint(prompt_len, prompt_len * 3 // 2))),
                            SamplingParams(max_tokens=24, ignore_eos=True)) for i in range(32)]
        longest = max(prompt_len * 3 // 2 + 32, 128)  # (the workload defaults fit too)
        base = dataclasses.replace(
            base, model=dataclasses.replace(base.model, max_position_embeddings=2 * longest),
            engine=dataclasses.replace(
                base.engine, max_batch_size=32, decode_buckets=[1, 2, 4, 8, 16, 32],
                max_seq_len=longest, max_prefill_tokens=8 * longest,
                num_kv_blocks=32 * (-(-longest // 16)) + 64))
    weights = {"random": random_state_dict(base.model), "oracle": oracle_state_dict(base.model)}
    runs: dict = {}
    for mtp in (False, True):
        cfg = dataclasses.replace(base, engine=dataclasses.replace(base.engine, mtp=mtp,
                                                                   **(engine_kw or {})))
        engine = Engine(cfg, groups, weights["random"])
        for name, sd in weights.items():
            engine.model.load_full_state_dict(sd)
            engine.warmup(max_context=128)
            reqs = [dataclasses.replace(r, request_id=f"{name}-{r.request_id}") for r in requests]
            v0, a0 = engine.scheduler.drafts_verified, engine.scheduler.drafts_accepted
            d0 = sum(1 for h in engine.history if h.rows > 0)
            outs = engine.generate(reqs)
            runs[name, mtp] = {
                "tokens": [outs[r.request_id].tokens for r in reqs],
                "logprobs": [outs[r.request_id].logprobs for r in reqs],
                "d_iterations": sum(1 for h in engine.history if h.rows > 0) - d0,
                "verified": engine.scheduler.drafts_verified - v0,
                "accepted": engine.scheduler.drafts_accepted - a0,
                "graphs": engine.runner.graphs is not None}
        engine.close()
    res = {"layout": groups.layout.name, "dtype": dtype}
    for name in weights:
        off, on = runs[name, False], runs[name, True]
        same = [a == b for a, b in zip(off["tokens"], on["tokens"])]
        prefix = []
        for a, b in zip(off["tokens"], on["tokens"]):
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            prefix.append(k / max(len(a), 1))
        same_lp = [a == b for a, b in zip(off["logprobs"], on["logprobs"])]
        res[name] = {"identical": sum(same) / len(same), "prefix": sum(prefix) / len(prefix),
                     "logprobs_identical": sum(same_lp) / len(same_lp),
                     "first_equal": all(a[:1] == b[:1] for a, b in zip(off["tokens"],
                                                                         on["tokens"])),
                     "acceptance": on["accepted"] / max(on["verified"], 1),
                     "d_iterations": (off["d_iterations"], on["d_iterations"]),
                     "graphs": on["graphs"]}
    return res


def gpu_mtp_drafts(rank: int, world: int, adp: int, ep: int, graphs: bool = True,
                   weights: str = "random", backend: str = "nccl") -> dict:
    """Every MTP draft of the bf16 engine against megatron's MTP block in fp32 on the same
    weights, teacher-forced over each final sequence: the draft's rank in megatron's row (0:
    its argmax). bf16 noise moves near-ties to small ranks; a path that feeds the layer the
    wrong hidden state, KV or position lands anywhere in the vocabulary. ``weights``: "random"
    (the MTP layer's hidden-state half, attention and MoE all count -- the oracle's drafts
    ignore the first two) or "distilled" (the random model's MTP layer fit for 40 steps to the
    model's own greedy outputs, rl/mtp_distill.py: trained norms and projections, as bench-mtp's
    distilled row, which the H200 never accepted); ``graphs``: D in CUDA graphs (the verify +
    draft captured) or eager."""
    from tests.cases_mtp import draft_rows, record_drafts

    dtype = "bfloat16" if backend == "nccl" else "float32"
    base = gpu_config(world, adp, ep, dtype, backend=backend, model_kw={"mtp_num_layers": 1})
    cfg = dataclasses.replace(base, engine=dataclasses.replace(base.engine, mtp=True,
                                                               cuda_graphs=graphs))
    groups = init_parallel(cfg.parallel)
    if backend == "gloo":  # the CPU smoke run of this case
        from colo_rollout.runtime.cpu_compat import install_cpu_compat

        install_cpu_compat()
    sd = random_state_dict(cfg.model)
    if weights == "distilled":
        from colo_rollout.rl.mtp_distill import distill_mtp

        plain = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, mtp=False))
        data_engine = Engine(plain, groups, sd)
        data = mixed_requests(16, 7, cfg.model.vocab_size)
        outs = data_engine.generate(data)
        data_engine.close()
        del data_engine
        seqs = [list(r.prompt) + outs[r.request_id].tokens for r in data]
        sd = distill_mtp(cfg.model, sd, seqs, groups.device, steps=40, batch=4).weights
    engine = Engine(cfg, groups, sd)
    drafts = record_drafts(engine)
    requests = mixed_requests(16, 0, cfg.model.vocab_size)
    outs = engine.generate(requests)
    has_graphs = engine.runner.graphs is not None
    engine.close()
    pgc = singleton_pg_collection()
    res = {"layout": groups.layout.name, "graphs": has_graphs}
    if rank == 0:
        fp32 = dataclasses.replace(cfg.model, params_dtype="float32")
        ref = build_reference(fp32, {k: v.float() for k, v in sd.items()}, pgc, groups.device)
        ranks = sorted(int((row > row[d]).sum()) for _, _, d, row in
                       draft_rows(ref, requests, outs, drafts))
        n = len(ranks)
        res.update({"checked": n, "argmax": sum(r == 0 for r in ranks) / max(n, 1),
                    "top5": sum(r < 5 for r in ranks) / max(n, 1),
                    "median_rank": ranks[n // 2] if n else -1,
                    "vocab": cfg.model.vocab_size})
    return res


def gpu_sampled_graphs(rank: int, world: int, adp: int, ep: int, mtp: bool = False,
                       truncate: bool = False, backend: str = "nccl") -> dict:
    """Temperature rows drawn inside the D graphs (the draw graph, worker/decode_graph.py)
    against eager D on the same engine, requests and seed (P eager in both, so P's first
    tokens see the same noise): the share of identical streams and the logprob gap along
    their common prefix, the draw-graph replays, wall times; a greedy run of the same prompts
    shows the draw really sampled. With ``mtp`` the verify + draft of the drawn tokens is in
    the draw graph too (random weights: drafts almost never accepted); with ``truncate`` the
    sampled rows have top-k 20 and top-p 0.9 (the truncated draw graph)."""
    import random

    from colo_rollout.sched.request import Request, SamplingParams

    cfg = gpu_config(world, adp, ep, "bfloat16", backend=backend,
                     model_kw={"mtp_num_layers": 1} if mtp else None)
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, mtp=mtp))
    groups = init_parallel(cfg.parallel)
    if backend == "gloo":  # the CPU smoke run of this case
        from colo_rollout.runtime.cpu_compat import install_cpu_compat

        install_cpu_compat()
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    runner = engine.runner
    graphs, pgraphs = runner.graphs, runner.prefill_graphs
    V = cfg.model.vocab_size
    rng = random.Random(4)
    prompts = [tuple(rng.randrange(V) for _ in range(rng.choice([8, 40, 120])))
               for _ in range(8 * adp)]
    # mostly T = 0.8, every fourth greedy: a Draw.TEMPERATURE iteration mixes both; every
    # fourth reports tempered logprobs (the draw graph's per-row logprob temperatures)
    cut = {"top_k": 20, "top_p": 0.9} if truncate else {}
    params = [SamplingParams(temperature=0.0 if i % 4 == 3 else 0.8, max_tokens=32,
                             ignore_eos=True, tempered_logprobs=i % 4 == 1,
                             **({} if i % 4 == 3 else cut))
              for i in range(len(prompts))]
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)

    def run(tag: str, use_graphs: bool, ps) -> tuple[list, float]:
        runner.graphs = graphs if use_graphs else None
        runner.prefill_graphs = None  # eager P in every run
        runner.generator.manual_seed(1234)
        if graphs is not None:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.generate([Request(f"{tag}{i}", p, q)
                                for i, (p, q) in enumerate(zip(prompts, ps))])
        if graphs is not None:
            torch.cuda.synchronize()
        runner.graphs, runner.prefill_graphs = graphs, pgraphs
        return [outs[f"{tag}{i}"] for i in range(len(prompts))], time.perf_counter() - t0

    def agree(a, b) -> dict:
        same = sum(x.tokens == y.tokens for x, y in zip(a, b))
        diffs, prefix = [], []
        for x, y in zip(a, b):
            k = 0
            for tx, ty, lx, ly in zip(x.tokens, y.tokens, x.logprobs, y.logprobs):
                if tx != ty:
                    break
                diffs.append(abs(lx - ly))
                k += 1
            prefix.append(k / len(x.tokens))
        return {"identical": same / len(a), "prefix": sum(prefix) / len(prefix),
                "max_dlogp": max(diffs, default=0.0)}

    warm = engine.warmup(max_context=max(len(p) for p in prompts) + 32)
    run("w", True, params)  # the draw graphs' first replays, off the clock
    draws0 = graphs.draws if graphs is not None else 0
    v0, a0 = engine.scheduler.drafts_verified, engine.scheduler.drafts_accepted
    g, t_graph = run("g", True, params)
    draws = (graphs.draws - draws0) if graphs is not None else 0
    verified = engine.scheduler.drafts_verified - v0
    accepted = engine.scheduler.drafts_accepted - a0
    e, t_eager = run("e", False, params)
    gg, _ = run("gg", True, [greedy] * len(prompts))
    sampled_rows = [i for i, q in enumerate(params) if not q.greedy]
    res = {"layout": groups.layout.name, "mtp": mtp, "truncate": truncate,
           "graphs": graphs is not None,
           "warmup_captures": warm, "draws": draws, "graph_vs_eager": agree(g, e),
           "greedy_rows_vs_greedy_run": agree([g[i] for i in range(len(g)) if params[i].greedy],
                                              [gg[i] for i in range(len(g)) if params[i].greedy]),
           "sampled_vs_greedy": agree([g[i] for i in sampled_rows], [gg[i] for i in sampled_rows]),
           "t_graph_s": t_graph, "t_eager_s": t_eager,
           "acceptance": accepted / max(verified, 1) if mtp else None}
    engine.close()
    return res


def _gpu_moe_case(g, dev, N: int, E: int, k: int, H: int, Fd: int):
    """Random top-k routing of N tokens over E experts, sorted by expert as the engine's pairs:
    (x [N, H] bf16, token per sorted row, offs [E] int32 group ends, prob per sorted row,
    fc1 [E, 2 Fd, H], fc2 [E, H, Fd]), drawn from ``g`` in that order."""
    logits = torch.randn(N, E, generator=g, device=dev)
    chosen = logits.topk(k, dim=1).indices
    prob = torch.softmax(logits, -1).gather(1, chosen).flatten()
    key, order = torch.sort(chosen.flatten(), stable=True)
    offs = torch.searchsorted(key, torch.arange(E, device=dev), right=True, out_int32=True)
    x = torch.randn(N, H, generator=g, device=dev).bfloat16()
    fc1 = (torch.randn(E, 2 * Fd, H, generator=g, device=dev) / H ** 0.5).bfloat16()
    fc2 = (torch.randn(E, H, Fd, generator=g, device=dev) / Fd ** 0.5).bfloat16()
    return x, order // k, offs, prob[order], fc1, fc2


def gpu_fp8_kernels(rank: int, world: int) -> dict:
    """The FP8 kernels on the GPU against the torch reference math (model/fp8.py,
    model/fused_moe.py): the row quantiser bitwise (the interpreter cannot check its cast),
    the FP8 linear (torch._scaled_mm, row-wise scales) and the FP8 expert GEMMs against the
    dequantised operands' fp32 products."""
    import torch.nn.functional as F

    from colo_rollout.model import fp8 as f8
    from colo_rollout.model.fp8_linear import fp8_linear
    from colo_rollout.model import fused_moe as fm

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    res = {}
    same = True
    for M, K in ((1, 2048), (37, 768), (512, 4096)):
        x = torch.randn(M, K, generator=g, device=dev).bfloat16() * 3
        a, b = f8.quantize_rows(x, backend="triton"), f8.quantize_rows(x, backend="torch")
        same &= torch.equal(a[0].float(), b[0].float()) and torch.equal(a[1], b[1])
    res["quantize_bitwise"] = bool(same)
    x = torch.randn(45, 2048, generator=g, device=dev).bfloat16()
    w = (torch.randn(1536, 2048, generator=g, device=dev) / 45).bfloat16()
    fw = f8.Fp8Weight.of(w)
    y = fp8_linear(x, fw)
    q, s = f8.quantize_rows(x)
    ref = F.linear(f8.dequantize_rows(q[:45], s[:45]), fw.dequantized())
    exact = F.linear(x.float(), w.float())
    res["linear_vs_reference"] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    res["linear_vs_bf16"] = ((y.float() - exact).abs().max() / exact.abs().max()).item()
    # the few-rows path (the fused-MoE kernel as one group) against torch._scaled_mm
    res["linear_rows"] = {}
    for M in (1, 16, 64, 256):
        xs = torch.randn(M, 2048, generator=g, device=dev).bfloat16()
        t = fp8_linear(xs, fw, backend="triton")
        m = fp8_linear(xs, fw, backend="scaled_mm")
        row = {"triton_vs_scaled_mm": ((t.float() - m.float()).abs().max()
                                       / m.float().abs().max()).item()}
        res["linear_rows"][M] = row
    xm, token, offs, prob, fc1, fc2 = _gpu_moe_case(g, dev, 300, 16, 4, 2048, 768)
    w1, w2 = f8.Fp8Weight.of(fc1), f8.Fp8Weight.of(fc2)
    got = fm.triton_experts(xm, token, offs, prob, w1, w2, F.silu, True)
    ref = fm.torch_experts_fp8(xm.float(), token, offs, prob, w1, w2, F.silu, True)
    b16 = fm.torch_experts(xm.float(), token, offs, prob, fc1.float(), fc2.float(), F.silu,
                           True)
    scale = b16.abs().max()
    res["moe_vs_reference"] = ((got.float() - ref).abs().max() / scale).item()
    res["moe_vs_bf16"] = ((got.float() - b16).abs().max() / scale).item()
    # blockwise (1 x 128 inputs, 128 x 128 weights): the group quantiser bitwise, the linear
    # (the kernel as one group) and the expert GEMMs against their dequantised references
    same = True
    for M, K in ((1, 2048), (37, 768), (512, 4096)):
        x = torch.randn(M, K, generator=g, device=dev).bfloat16() * 3
        a = f8.quantize_rows(x, backend="triton", group=128)
        b = f8.quantize_rows(x, backend="torch", group=128)
        same &= torch.equal(a[0].float(), b[0].float()) and torch.equal(a[1], b[1])
    res["blockwise_quantize_bitwise"] = bool(same)
    bw = f8.Fp8Weight.of(w, 128)
    yb = fp8_linear(x45 := torch.randn(45, 2048, generator=g, device=dev).bfloat16(), bw)
    qb, sb = f8.quantize_rows(x45, pad=False, group=128)
    refb = F.linear(f8.dequantize_rows(qb, sb), bw.dequantized())
    res["blockwise_linear_vs_reference"] = ((yb.float() - refb).abs().max()
                                            / refb.abs().max()).item()
    res["blockwise_linear_vs_bf16"] = ((yb.float() - F.linear(x45.float(), w.float())).abs().max()
                                       / refb.abs().max()).item()
    b1, b2 = f8.Fp8Weight.of(fc1, 128), f8.Fp8Weight.of(fc2, 128)
    gotb = fm.triton_experts(xm, token, offs, prob, b1, b2, F.silu, True)
    refb = fm.torch_experts_fp8(xm.float(), token, offs, prob, b1, b2, F.silu, True)
    res["blockwise_moe_vs_reference"] = ((gotb.float() - refb).abs().max() / scale).item()
    res["blockwise_moe_vs_bf16"] = ((gotb.float() - b16).abs().max() / scale).item()
    return res


def gpu_te_fp8_linear(rank: int, world: int) -> dict:
    """model.fp8_backend te's dense GEMM (model/fp8_te.py) per recipe, against
    Transformer Engine's own te.Linear under te.autocast with the same recipe and weight (the
    same quantizers and GEMM: bitwise), against the dequantised operands' fp32 product, and
    through a weight refresh -- in place (the FP8 buffers' addresses kept) and seen by a
    captured CUDA graph's replay."""
    import torch.nn.functional as F
    import transformer_engine.pytorch as te

    from colo_rollout.model.fp8_te import TeFp8Weight, te_recipe

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    N, K, M = 768, 1024, 37

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * std).to(torch.bfloat16)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    res = {}
    for recipe in ("tensorwise", "blockwise"):
        w, x, bias = rnd(N, K, std=0.02), rnd(M, K), rnd(N, std=0.1)
        tw = TeFp8Weight.of(w, recipe)
        with torch.inference_mode():
            y = tw.linear(x)
            yb = tw.linear(x, bias)
            y32 = tw.linear(x, out_dtype=torch.float32)
        ref_lin = te.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device=dev)
        with torch.no_grad():
            ref_lin.weight.copy_(w)
        xpad = F.pad(x, (0, 0, 0, 48 - M))  # what the engine's linear quantises
        with torch.inference_mode(), te.autocast(enabled=True, recipe=te_recipe(recipe, "e4m3")):
            y_te = ref_lin(xpad)[:M]
        with torch.inference_mode():
            xdq = tw.x_quantizer(xpad).dequantize(dtype=torch.float32)[:M]
        y_ref = F.linear(xdq, tw.dequantized())
        row = {"vs_te_linear_bitwise": bool(torch.equal(y, y_te)),
               "vs_te_linear": rel(y, y_te),
               "vs_dequantised_reference": rel(y, y_ref),
               "vs_bf16": rel(y, F.linear(x.float(), w.float())),
               "bias_fused_vs_added": rel(yb, y.float() + bias.float()),
               "fp32_out_vs_bf16_out": rel(y32, y), "fp32_out_dtype": str(y32.dtype),
               "fp8_bytes": tw.nbytes}
        # a weight write: refreshed in place equals a fresh quantisation, and a graph captured
        # before the write replays with the new weight
        ptrs = [t.data_ptr() for t in tw.tensors()]
        xs = x.clone()
        with torch.inference_mode():
            tw.linear(xs)  # warm (TE's workspace allocated outside the capture)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ys = tw.linear(xs)
        w2 = rnd(N, K, std=0.03)
        tw.refresh(w2)
        with torch.inference_mode():
            graph.replay()
            fresh = TeFp8Weight.of(w2, recipe).linear(x)
            eager = tw.linear(x)
        torch.cuda.synchronize()
        row.update({"refresh_in_place": ptrs == [t.data_ptr() for t in tw.tensors()],
                    "refresh_equals_fresh": bool(torch.equal(eager, fresh)),
                    "graph_replay_after_refresh": bool(torch.equal(ys, fresh)),
                    "graph_replay_vs_old": rel(ys, y)})
        res[recipe] = row
    return res


def gpu_te_fp8_experts(rank: int, world: int) -> dict:
    """The routed experts under model.fp8_backend te (model/fp8.py's ``te`` arithmetic): per
    recipe, the FP8 weights and inputs against Transformer Engine's own quantizers (the
    dequantised values bitwise: the same bytes and scales), the Triton quantisers' bytes
    against their torch paths, and the experts against a pair of te.GroupedLinear under
    te.autocast of the recipe (host splits, eager) and against the dequantised reference."""
    import torch.nn.functional as F
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.quantization import RecipeState

    from colo_rollout.model import fp8 as f8
    from colo_rollout.model import fused_moe as fm
    from colo_rollout.model.fp8_te import te_recipe

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    N, E, k, H, Fd = 300, 8, 2, 512, 256

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    x, token, offs, prob, fc1, fc2 = _gpu_moe_case(g, dev, N, E, k, H, Fd)
    fc1[3] *= 20  # experts of different ranges
    splits = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    res = {"splits": splits}
    for recipe, block in (("tensorwise", 0), ("blockwise", 128)):
        rcp = te_recipe(recipe, "e4m3")
        x_q, w_q = RecipeState.create(rcp, mode="forward", num_quantizers=2,
                                      device=dev).make_quantizers()
        for q in (x_q, w_q):
            q.set_usage(rowwise=True, columnwise=False)
        w1, w2 = f8.Fp8Weight.of(fc1, block, te=True), f8.Fp8Weight.of(fc2, block, te=True)
        d1, d2 = w1.dequantized(), w2.dequantized()
        weights_equal = all(
            torch.equal(w_q(w[e].contiguous()).dequantize(dtype=torch.float32), d[e])
            for w, d in ((fc1, d1), (fc2, d2)) for e in range(E))
        row = {"weights_equal_te": weights_equal}
        xs = x[token]
        if block:  # 1 x 128 inputs: per row, so per token before the gather
            ours = f8.quantize_rows(x, pad=False, group=128, pow2=True)
            tq = f8.quantize_rows(x, pad=False, group=128, pow2=True, backend="torch")
            row["inputs_equal_te"] = bool(torch.equal(
                x_q(x).dequantize(dtype=torch.float32), f8.dequantize_rows(*ours)))
        else:  # one scale per expert's rows, as GroupedLinear's split quantizers
            ours = f8.quantize_grouped(x, offs, token.shape[0], token=token)
            tq = f8.quantize_grouped(x, offs, token.shape[0], token=token, backend="torch")
            deq, lo, same = f8.dequantize_rows(*ours), 0, True
            for e, n in enumerate(splits):
                if n:
                    same &= torch.equal(x_q(xs[lo : lo + n].contiguous())
                                        .dequantize(dtype=torch.float32), deq[lo : lo + n])
                lo += n
            row["inputs_equal_te"] = bool(same)
        row["kernel_bytes_equal_torch"] = bool(
            torch.equal(ours[0].view(torch.uint8), tq[0].view(torch.uint8))
            and torch.equal(ours[1], tq[1]))
        with torch.inference_mode():
            got = fm.triton_experts(x, token, offs, prob, w1, w2, F.silu, True)
            ref = fm.torch_experts_fp8(x, token, offs, prob, w1, w2, F.silu, True)
        # TE's GroupedLinear pair on the sorted rows, the engine's activation and probability
        g1 = te.GroupedLinear(E, H, 2 * Fd, bias=False, params_dtype=torch.bfloat16,
                              device=dev)
        g2 = te.GroupedLinear(E, Fd, H, bias=False, params_dtype=torch.bfloat16, device=dev)
        with torch.no_grad():
            for e in range(E):
                getattr(g1, f"weight{e}").copy_(fc1[e])
                getattr(g2, f"weight{e}").copy_(fc2[e])
        # TE's FP8 GEMMs want every split a multiple of 8 rows (block scaling asserts it):
        # each expert's rows padded with zero rows, which change no amax and no 1 x 128 scale
        padded = [-(-n // 16) * 16 for n in splits]
        dst = torch.tensor([sum(padded[:e]) + i for e, n in enumerate(splits)
                            for i in range(n)], device=dev)
        xs_p = xs.new_zeros(sum(padded), H).index_copy_(0, dst, xs)
        prob_p = prob.new_zeros(sum(padded)).index_copy_(0, dst, prob)
        with torch.inference_mode(), te.autocast(enabled=True, recipe=rcp):
            hmid = g1(xs_p, padded)
            gate, up = hmid.float().chunk(2, dim=-1)
            hmid = (F.silu(gate) * up * prob_p[:, None]).to(torch.bfloat16)
            y_te = g2(hmid, padded)[dst]
        b16 = fm.torch_experts(x.float(), token, offs, prob, fc1.float(), fc2.float(),
                               F.silu, True)
        row.update({"vs_te_grouped_linear": rel(got, y_te), "vs_reference": rel(got, ref),
                    "te_vs_reference": rel(y_te, ref), "vs_bf16": rel(got, b16),
                    "te_vs_bf16": rel(y_te, b16)})
        res[recipe] = row
    return res


def gpu_fp8_graphs(rank: int, world: int, model_kw: dict | None = None) -> dict:
    """The FP8 engine's D graphs against its eager D (P eager in both), greedy, and the D
    step's path: graphs captured with the FP8 copies."""
    from colo_rollout.sched.request import Request, SamplingParams

    cfg = gpu_config(1, 1, 1, "bfloat16")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fp8="e4m3",
                                                             **(model_kw or {})))
    groups = init_parallel(cfg.parallel)
    engine = Engine(cfg, groups, random_state_dict(cfg.model))
    runner = engine.runner
    graphs, pgraphs = runner.graphs, runner.prefill_graphs
    reqs = mixed_requests(12, 5, cfg.model.vocab_size)
    reqs = [dataclasses.replace(r, params=SamplingParams(max_tokens=24, ignore_eos=True))
            for r in reqs]

    def run(tag, use_graphs):
        runner.graphs = graphs if use_graphs else None
        runner.prefill_graphs = None
        outs = engine.generate([dataclasses.replace(r, request_id=tag + r.request_id)
                                for r in reqs])
        runner.graphs, runner.prefill_graphs = graphs, pgraphs
        return [outs[tag + r.request_id].tokens for r in reqs]

    engine.warmup(max_context=128)
    g, e = run("g", True), run("e", False)
    res = {"graphs": graphs is not None, "replays": graphs.replays if graphs else 0,
           "identical": sum(a == b for a, b in zip(g, e)) / len(g),
           "first_equal": sum(a[:1] == b[:1] for a, b in zip(g, e)) / len(g)}
    engine.close()
    return res
