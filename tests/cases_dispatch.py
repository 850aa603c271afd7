"""Per-rank bodies of the MoE dispatch tests (tests/test_dispatch.py): alltoall vs gather."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.cases_engine import _engine, mixed_requests


def _serve(world: int, adp: int, ep: int, mode: str, model_kw: dict) -> dict:
    cfg, groups, sd, engine = _engine(world, adp, ep, max_batch_size=3,
                                      decode_buckets=[1, 2, 4], mode=mode, segment_span=1,
                                      model_kw=model_kw)
    requests = mixed_requests(10, 0, cfg.model.vocab_size)
    outs = engine.generate(requests)
    engine.check_integrity()
    m = engine.model
    return {"tokens": {r.request_id: outs[r.request_id].tokens for r in requests},
            "logprobs": {r.request_id: outs[r.request_id].logprobs for r in requests},
            "d_during_p": sum(1 for h in engine.history if h.p_in_flight and h.rows > 0),
            "a2a": [d.state.collectives if d is not None else 0
                    for d in (m.dispatch_p, m.dispatch_d)]}


def alltoall_matches_gather(rank: int, world: int, adp: int, ep: int, mode: str = "normal",
                            model_kw: dict | None = None) -> dict:
    """The same greedy requests served by the gather and the alltoall backend."""
    got = {kind: _serve(world, adp, ep, mode, {**(model_kw or {}), "moe_dispatch": kind})
           for kind in ("gather", "alltoall")}
    g, a = got["gather"], got["alltoall"]
    worst = max((abs(x - y) for rid in g["logprobs"]
                 for x, y in zip(g["logprobs"][rid], a["logprobs"][rid])), default=0.0)
    return {"same_tokens": g["tokens"] == a["tokens"], "max_logprob_diff": worst,
            "n_tokens": sum(len(t) for t in g["tokens"].values()),
            "tokens": a["tokens"], "d_during_p": a["d_during_p"], "a2a": a["a2a"],
            "gather_a2a": g["a2a"]}


def _moe_and_reference(world: int, adp: int, ep: int, capacity: int = 0, model_kw=None):
    model_kw = {"moe_dispatch": "alltoall", "moe_dispatch_capacity": capacity,
                **(model_kw or {})}
    cfg, groups, sd, engine = _engine(world, adp, ep, model_kw=model_kw)
    model = engine.model
    moe = model.moe_layers()[0]

    def reference(x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows gathered, the gather backend's MoE partials summed: the routed
        output of this rank's rows."""
        n = torch.tensor([x.shape[0]])
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, n, group=groups.full_p)
        sizes = [int(s) for s in sizes]
        m = max(sizes)  # gloo's all_gather: equal sizes
        parts = [x.new_zeros((m, x.shape[1])) for _ in sizes]
        padded = torch.cat([x, x.new_zeros((m - x.shape[0], x.shape[1]))])
        dist.all_gather(parts, padded, group=groups.full_p)
        full = torch.cat([p[:s] for p, s in zip(parts, sizes)])
        partial = moe(full)  # this rank's local experts on every row, fp32
        dist.all_reduce(partial, group=groups.full_p)
        lo = sum(sizes[:groups.rank])
        return partial[lo: lo + x.shape[0]]

    return cfg, groups, model, moe, reference


def round_trip(rank: int, world: int, adp: int, ep: int) -> dict:
    """P (variable rows per rank, one rank with none) and D (equal rows) dispatch -> local
    experts -> combine on random rows, against the gather MoE's summed partials."""
    cfg, groups, model, moe, reference = _moe_and_reference(world, adp, ep)
    H = cfg.model.hidden_size
    gen = torch.Generator().manual_seed(100 + rank)
    out = {}
    with torch.inference_mode():
        for n in (0, 1, 5, 17) if rank == 0 else (3, 9, 4, 0):
            x = torch.randn(n, H, generator=gen)
            got = model.dispatch_p.routed(moe, x, 1)
            ref = reference(x)  # collective: every rank, also with no rows
            out[f"P{n}"] = (got - ref).abs().max().item() if n else float(got.numel())
        for n in (1, 4, 8):
            x = torch.randn(n, H, generator=gen)
            got = model.dispatch_d.routed(moe, x, 1)
            out[f"D{n}"] = (got - reference(x)).abs().max().item()
    out["p_collectives"] = model.dispatch_p.state.collectives
    out["d_collectives"] = model.dispatch_d.state.collectives
    out["distinct_groups"] = model.dispatch_p.state.group is not model.dispatch_d.state.group
    out["world_groups"] = (model.dispatch_p.state.ranks == list(range(world))
                           == model.dispatch_d.state.ranks)
    return out


def overflow(rank: int, world: int, adp: int, ep: int) -> dict:
    """A D capacity of 1 pair per peer with 8 rows of top-2: every rank raises the same
    DispatchOverflow; a capacity that fits (the largest count) gives the exact result."""
    from colo_rollout.model.dispatch import DispatchOverflow, route

    cfg, groups, model, moe, reference = _moe_and_reference(world, adp, ep, capacity=1)
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(8, cfg.model.hidden_size, generator=gen)
    d = model.dispatch_d
    res = {}
    with torch.inference_mode():
        try:
            d.routed(moe, x, 3)
            res["error"] = None
        except DispatchOverflow as e:
            res["error"] = str(e)
        # the largest per-peer count over the world: a capacity that just fits
        chosen, _ = route(moe, x)
        counts = torch.bincount((chosen // d.num_local).flatten(), minlength=world)
        top = counts.max().reshape(1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=groups.full_p)
        d.capacity_setting = int(top)
        res["fit_capacity"] = int(top)
        res["fit_diff"] = (d.routed(moe, x, 3) - reference(x)).abs().max().item()
        d.capacity_setting = int(top) - 1
        try:
            d.routed(moe, x, 3)
            res["tight_error"] = None
        except DispatchOverflow as e:
            res["tight_error"] = str(e)
    return res


def _expected_boundaries(cfg) -> tuple[int, dict[int, str]]:
    """One alltoall P epoch's boundary ids by kind: at attention TP 1 (P on its own rows)
    the MoE layers' dispatch splits only; else the embedding gather, per layer the
    attention gather, (MoE) the dispatch split, the combine or dense gather; the logits."""
    if cfg.parallel.atp == 1:
        splits = [i for i in range(cfg.model.num_layers) if cfg.model.is_moe_layer(i)]
        return len(splits), {b: "split" for b in range(len(splits))}
    kinds, b = {0: "embed"}, 1
    for i in range(cfg.model.num_layers):
        kinds[b], b = "attn", b + 1
        if cfg.model.is_moe_layer(i):
            kinds[b], b = "split", b + 1
        kinds[b], b = "ffn", b + 1
    kinds[b] = "logits"
    return b + 1, kinds


def split_boundary(rank: int, world: int, adp: int, ep: int, model_kw: dict | None = None):
    """Fine mode, span 1, alltoall: every P epoch's boundary ids as P's segment generator
    yields them, with P's dispatch counters (collectives, host reads of counts) at each
    yield, and where P was parked whenever a D iteration ran; then the gather backend's
    tokens and logprobs on the same requests."""
    cfg, groups, sd, engine = _engine(world, adp, ep, max_batch_size=3,
                                      decode_buckets=[1, 2, 4], mode="fine", segment_span=1,
                                      model_kw={**(model_kw or {}), "moe_dispatch": "alltoall"})
    model, st = engine.model, engine.model.dispatch_p.state
    engine.turnstile.record = True
    epochs: list[list] = []
    orig = model.prefill_segments

    def recorded(*a, **kw):
        gen = orig(*a, **kw)
        log: list = []
        epochs.append(log)

        def body():
            try:
                b = next(gen)
                while True:
                    log.append((b, st.collectives, st.host_reads))
                    yield b
                    b = next(gen)
            except StopIteration as stop:
                log.append(("end", st.collectives, st.host_reads))
                return stop.value
        return body()

    model.prefill_segments = recorded
    requests = mixed_requests(10, 0, cfg.model.vocab_size)
    outs = engine.generate(requests)
    engine.check_integrity()
    n, kinds = _expected_boundaries(cfg)
    # where P was parked at each D iteration inside an epoch: its last published boundary
    parked, last = [], None
    for e in engine.turnstile.log:
        if e.kind == "begin":
            last = None
        elif e.kind == "publish":
            last = e.boundary
        elif e.kind == "post_d" and last is not None:
            parked.append(kinds[last])
    g_kw = {**(model_kw or {}), "moe_dispatch": "gather"}
    cfg_g, _, _, gather = _engine(world, adp, ep, max_batch_size=3, decode_buckets=[1, 2, 4],
                                  mode="fine", segment_span=1, model_kw=g_kw)
    g_outs = gather.generate(requests)
    worst = max((abs(x - y) for r in requests for x, y in
                 zip(outs[r.request_id].logprobs, g_outs[r.request_id].logprobs)),
                default=0.0)
    return {"epochs": epochs, "kinds": {str(k): v for k, v in kinds.items()},
            "expected": n, "boundaries_per_prefill": model.boundaries_per_prefill,
            "gather_boundaries": gather.model.boundaries_per_prefill,
            "gather_layers": cfg_g.model.num_layers, "producer": model.boundary_producer,
            "parked": parked,
            "d_during_p": sum(1 for h in engine.history if h.p_in_flight and h.rows > 0),
            "same_tokens": all(outs[r.request_id].tokens == g_outs[r.request_id].tokens
                               for r in requests),
            "max_logprob_diff": worst,
            "n_tokens": sum(len(outs[r.request_id].tokens) for r in requests)}
