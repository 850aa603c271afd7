"""P attention's Triton kernel (model/paged_prefill.py) against testing/attention_oracle.py's
per-sequence loop, run by Triton's CPU interpreter in a subprocess (TRITON_INTERPRET is read
when the kernels are decorated, so it must be set before the module is first imported; skipped
when triton does not import); the plan's tiles, the tile defaults, the backend's resolution at
model build and ``PagedSelfAttention._prefill``'s dispatch to the kernel."""

from __future__ import annotations

import random
import types

import pytest
import torch

from colo_rollout.model import paged_prefill as pp
from colo_rollout.testing.attention_oracle import prefill_per_sequence
from tests.interpreted import HAS_TRITON, interpreted_main

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
T = pp.TileConfig

# (groups, q per group, dim, block size, new tokens, contexts, dtype, tiling, table dtype).
# Fresh prefills (ctx == new) and continuations (ctx > new), new = 1, contexts that are exact
# block multiples and ragged, tiles of one head and of a packed group, several key tiles on
# and below the diagonal; tiling None: the engine's default (tile_config)
CASES = [
    (2, 1, 64, 16, [16, 5, 1], [16, 5, 40], F32, T(16, 16, 4, 2, True), torch.int64),
    (1, 2, 128, 16, [37, 8], [64, 70], F32, T(32, 16, 4, 2, False), torch.int64),
    (2, 4, 64, 8, [1, 1, 20, 9], [1, 33, 20, 24], F32, T(32, 32, 4, 2, True), torch.int32),
    (1, 8, 128, 16, [50, 3], [96, 3], BF16, T(64, 32, 4, 2, True), torch.int64),
    (2, 8, 64, 16, [17, 32, 2], [17, 80, 48], BF16, T(16, 16, 4, 2, False), torch.int32),
    (4, 2, 128, 16, [24, 1], [64, 1], F16, T(16, 32, 4, 2, True), torch.int64),
    (1, 4, 64, 16, [70], [70], BF16, None, torch.int64),
    (2, 2, 64, 16, [3, 16, 1, 30, 12], [3, 48, 64, 30, 100], F32, T(16, 16, 4, 2, True),
     torch.int64),
]


def _random_case(seed: int):
    rng = random.Random(seed)
    S = rng.randint(1, 4)
    new = [rng.choice([1, 2, 9, 16, 23]) for _ in range(S)]
    ctx = [n + rng.choice([0, 0, 7, 16, 41]) for n in new]
    return (rng.choice([1, 2]), rng.choice([1, 2, 4, 8]), rng.choice([64, 128]),
            rng.choice([8, 16]), new, ctx, rng.choice([F32, BF16]),
            rng.choice([T(16, 16, 4, 2, True), T(32, 16, 4, 2, False), T(32, 32, 4, 2, True)]),
            torch.int64)


def _case(g, n, dim, bs, new, ctx, dtype, table_dtype, seed):
    """One layer's paged cache inside a 2-layer storage (the layer is a strided slice),
    shuffled block tables padded with the sink block; the sink and the unwritten tails of the
    last blocks hold large values that a masked key must never let through."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-c // bs) for c in ctx) + 1  # one extra sink column for every row
    num_blocks = sum(-(-c // bs) for c in ctx) + 3
    shape = (2, num_blocks + 1, bs, g, dim)
    k_all = torch.randn(shape, generator=gen).to(dtype)
    v_all = torch.randn(shape, generator=gen).to(dtype)
    sink = num_blocks
    k_all[1, sink] = 50.0
    v_all[1, sink] = 1e4
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(ctx), width), sink, dtype=table_dtype)
    for s, c in enumerate(ctx):
        nb = -(-c // bs)
        tables[s, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=table_dtype)
        last, used = int(tables[s, nb - 1]), c - (nb - 1) * bs
        k_all[1, last, used:] = 50.0  # unwritten tail of the last block: masked
        v_all[1, last, used:] = 1e4
    q = torch.randn(sum(new), g * n, dim, generator=gen).to(dtype)
    return q, k_all, v_all, tables


def _oracle(q, k_all, v_all, tables, new, ctx, g, n, dim):
    """testing/attention_oracle.py's loop on layer 1 (``_gather_kv`` as PagedSelfAttention's:
    the table's blocks, repeated to every q head)."""
    def gather(kv, layer, tab):
        k = kv.k[layer][tab.long()].flatten(1, 2).repeat_interleave(n, dim=2)
        v = kv.v[layer][tab.long()].flatten(1, 2).repeat_interleave(n, dim=2)
        return k, v

    attn = types.SimpleNamespace(heads=g * n, head_dim=dim, scale=dim ** -0.5,
                                 _gather_kv=gather)
    meta = types.SimpleNamespace(seq_lens_new=new, context_lens_host=ctx, block_tables=tables)
    return prefill_per_sequence(attn, q, types.SimpleNamespace(k=k_all, v=v_all), 1, meta)


def _interpreted() -> list[str]:
    """Run every case through the interpreted kernel; returns the failures."""
    fails = []
    cases = CASES + [_random_case(100 + s) for s in range(3)]
    for i, (g, n, dim, bs, new, ctx, dtype, cfg, tdt) in enumerate(cases):
        q, k_all, v_all, tables = _case(g, n, dim, bs, new, ctx, dtype, tdt, seed=i)
        plan = pp.plan_prefill(new, ctx, n, dim, dtype, q.device, cfg)
        got = pp.triton_prefill_attention(q, k_all[1], v_all[1], tables, plan, dim ** -0.5)
        ref32 = _oracle(q.float(), k_all.float(), v_all.float(), tables, new, ctx, g, n, dim)
        err = (got.float() - ref32).abs().max().item()
        tol = 1e-4 if dtype == F32 else 2e-2
        if got.dtype != dtype or got.shape != q.shape or not torch.isfinite(got).all() \
                or err > tol:
            fails.append(f"case {i} {cases[i][4:6]}: dtype {got.dtype}, err vs fp32 oracle "
                         f"{err:.2e} > {tol}")
        if dtype != F32:  # and against the oracle in the same dtype
            ref = _oracle(q, k_all, v_all, tables, new, ctx, g, n, dim)
            err = (got.float() - ref.float()).abs().max().item()
            if err > 5e-2:
                fails.append(f"case {i}: err vs {dtype} oracle {err:.2e}")
        # the reference the GPU check uses is the oracle too
        mine = pp.torch_prefill_attention(q.float(), k_all[1].float(), v_all[1].float(),
                                          tables, plan, dim ** -0.5)
        if (mine - ref32).abs().max().item() > 1e-4:
            fails.append(f"case {i}: torch_prefill_attention differs from the oracle")
    # engine.prefill_attention cudnn: sequences 0 and 2 (fresh) left out of the tiles and
    # computed by the dense call (model/dense_prefill.py; torch's SDPA on CPU) into the rows
    # the kernel leaves: together the oracle's output
    from colo_rollout.model.dense_prefill import dense_calls, dense_prefill_attention
    from colo_rollout.testing.attention_oracle import kv_from_cache

    g, n, dim, bs, new, ctx = 2, 4, 64, 16, [40, 9, 33, 5], [40, 30, 33, 5]
    q, k_all, v_all, tables = _case(g, n, dim, bs, new, ctx, F32, torch.int64, seed=77)
    plan = pp.plan_prefill(new, ctx, n, dim, F32, q.device, T(16, 16, 4, 2, True), dense=(0, 2))
    got = pp.triton_prefill_attention(q, k_all[1], v_all[1], tables, plan, dim ** -0.5)
    slots = torch.cat([torch.tensor([int(tables[s, p // bs]) * bs + p % bs
                                     for p in range(c - m, c)]) for s, (m, c) in
                       enumerate(zip(new, ctx))])
    k, v = kv_from_cache(k_all[1], v_all[1], slots)
    for call in dense_calls(plan.dense, "cpu", 16):  # one call: 40 and 33 padded to 48
        dense_prefill_attention(q, k, v, call, dim ** -0.5, got)
    ref = _oracle(q, k_all, v_all, tables, new, ctx, g, n, dim)
    err = (got - ref).abs().max().item()
    if plan.dense != ((0, 0, 40), (2, 49, 33)) or not err < 1e-4:
        fails.append(f"dense + kernel: plan {plan.dense}, err vs oracle {err:.2e}")
    # zero sequences: zero rows, no launch
    plan = pp.plan_prefill([], [], 2, 64, F32, "cpu", T(16, 16, 4, 2, True))
    got = pp.triton_prefill_attention(torch.zeros(0, 4, 64), torch.zeros(3, 16, 2, 64),
                                      torch.zeros(3, 16, 2, 64),
                                      torch.zeros(0, 1, dtype=torch.int64), plan, 0.125)
    if got.shape != (0, 4, 64):
        fails.append(f"zero sequences: {tuple(got.shape)}")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_matches_oracle_interpreted(interpreted):
    interpreted.check(__file__)


@pytest.mark.parametrize("pack_group", [True, False])
def test_plan_tiles_cover_every_query_once_longest_first(pack_group):
    new, ctx = [1, 40, 17, 64, 3], [9, 40, 100, 64, 3]
    cfg = T(32, 16, 4, 2, pack_group)
    plan = pp.plan_prefill(new, ctx, 8, 64, F32, "cpu", cfg)
    per_tile = 32 // plan.pack
    assert plan.pack == (8 if pack_group else 1) and plan.tokens == sum(new)
    assert plan.q_starts.tolist() == [0, 1, 41, 58, 122]
    assert plan.new_lens.tolist() == new and plan.ctx_lens.tolist() == ctx
    assert plan.tiles.dtype == torch.int32 and plan.n_tiles == plan.tiles.shape[0]
    seen = []
    for s, t0 in plan.tiles.tolist():
        assert t0 % per_tile == 0 and t0 < new[s]
        seen += [(s, t) for t in range(t0, min(t0 + per_tile, new[s]))]
    assert sorted(seen) == [(s, t) for s in range(len(new)) for t in range(new[s])]
    work = [ctx[s] - new[s] + min(t0 + per_tile, new[s]) for s, t0 in plan.tiles.tolist()]
    assert work == sorted(work, reverse=True)
    empty = pp.plan_prefill([], [], 8, 64, F32, "cpu", cfg)
    assert empty.n_tiles == 0 and empty.tokens == 0
    with pytest.raises(ValueError, match="exceed its context"):
        pp.plan_prefill([5], [4], 8, 64, F32, "cpu", cfg)


def test_pack_divides_the_group_and_the_tile():
    assert [pp.group_pack(n, 16) for n in (1, 2, 4, 8, 16, 32, 6, 12)] == \
        [1, 2, 4, 8, 16, 16, 2, 4]
    auto, on, off = T(64, 64, 4, 2, None), T(64, 64, 4, 2, True), T(64, 64, 4, 2, False)
    long_, short = [4096, 512, 1024, 64], [1, 1, 20, 3]
    assert pp.plan_pack(long_, 8, on) == pp.plan_pack(short, 8, on) == 8
    assert pp.plan_pack(long_, 8, off) == pp.plan_pack(short, 8, off) == 1
    assert pp.plan_pack(long_, 8, auto) == 1  # full tiles either way: one head (the faster)
    assert pp.plan_pack(short, 8, auto) == 8  # new = 1: 1/8 of the rows when packed
    assert pp.plan_pack(short, 1, auto) == 1
    assert pp.plan_prefill(short, [9, 9, 20, 40], 8, 64, F32, "cpu", auto).pack == 8


def test_tile_config_fits_shared_memory():
    cpu = torch.device("cpu")  # no device properties: the conservative bound (99 KiB)
    for dim, dtype in ((64, BF16), (128, BF16), (128, F32), (256, F16)):
        c = pp.tile_config(cpu, dim, dtype)
        assert 16 <= c.block_m <= pp.DEFAULT.block_m and 16 <= c.block_n <= pp.DEFAULT.block_n
        esize = torch.finfo(dtype).bits // 8
        need = (c.num_stages * 2 * c.block_n + c.block_m) * dim * esize \
            + c.block_m * c.block_n * 4
        assert need <= 99 * 1024 and 2 <= c.num_stages <= pp.DEFAULT.num_stages


def test_resolve_backend():
    cpu = torch.device("cpu")
    assert pp.resolve_backend("torch", cpu) == "torch"
    assert pp.resolve_backend("auto", cpu) == "torch"
    with pytest.raises(RuntimeError, match="engine.prefill_attention: triton was requested"):
        pp.resolve_backend("triton", cpu)
    with pytest.raises(ValueError, match="must be one of"):
        pp.resolve_backend("flashinfer", cpu)
    if pp.triton_available():
        from colo_rollout.model.dense_prefill import cudnn_usable, flash_usable

        # auto: dense calls beside the kernel where cuDNN >= 9 is there, FlashAttention-4's
        # for single sequences where it is installed too
        cudnn, flash = cudnn_usable("cuda:0") is None, flash_usable("cuda:0") is None
        want = "flash" if cudnn and flash else "cudnn" if cudnn else "triton"
        assert pp.resolve_backend("auto", "cuda:0") == want
        assert pp.resolve_backend("triton", "cuda:0") == "triton"


def test_engine_config_key():
    from colo_rollout.config import ConfigError
    from colo_rollout.config.schema import EngineConfig

    assert EngineConfig().prefill_attention == "auto"
    assert EngineConfig(prefill_attention="triton").prefill_attention == "triton"
    with pytest.raises(ConfigError, match="engine.prefill_attention"):
        EngineConfig(prefill_attention="flashinfer")


def test_prefill_dispatches_to_the_kernel_with_one_plan_per_epoch(monkeypatch):
    """``_prefill`` with the triton backend: the plan is made by the first layer and kept on
    the metadata, and the kernel's arguments give the oracle's output (the kernel replaced by
    its torch reference, which takes the same arguments); "auto" on CPU tensors never calls
    the kernel (the bucketed SDPA path)."""
    from colo_rollout.model import attention as at

    heads, groups, dim, bs = 8, 2, 16, 4
    new, ctx = [5, 1, 12], [5, 9, 20]
    kv = at.KVStorage(2, 40, bs, groups, dim, F32, torch.device("cpu"))
    kv.k.normal_()
    kv.v.normal_()
    free = list(range(40))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctx]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [kv.sink_block] * (width - len(t)) for t in tables])
    meta = at.AttnMetadata(is_prefill=True, positions=torch.zeros(0),
                           slot_mapping=torch.zeros(0), block_tables=bt,
                           context_lens=torch.tensor(ctx), seq_lens_new=new,
                           context_lens_host=ctx)
    meta.buckets = at.prefill_buckets(new, ctx, bs, lambda v, t: torch.tensor(v, dtype=t))
    fake = types.SimpleNamespace(heads=heads, groups=groups, head_dim=dim,
                                 q_per_group=heads // groups, scale=dim ** -0.5)
    fake._gather_kv = lambda kv, layer, tab: at.PagedSelfAttention._gather_kv(fake, kv, layer,
                                                                              tab)
    q = torch.randn(sum(new), heads, dim)
    calls = []

    def kernel(*args):
        calls.append(args[4])
        return pp.torch_prefill_attention(*args)

    monkeypatch.setattr(at, "triton_prefill_attention", kernel)
    fake.prefill_backend = "auto"  # CPU tensors: the buckets, never the kernel
    torch.testing.assert_close(at.PagedSelfAttention._prefill(fake, q, None, kv, 0, meta),
                               prefill_per_sequence(fake, q, kv, 0, meta))
    assert calls == [] and meta.prefill_plan is None
    fake.prefill_backend = "triton"
    for layer in (0, 1):
        got = at.PagedSelfAttention._prefill(fake, q, None, kv, layer, meta)
        torch.testing.assert_close(got, prefill_per_sequence(fake, q, kv, layer, meta),
                                   rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 and calls[0] is calls[1] is meta.prefill_plan


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)


@pytest.mark.parametrize("stale", [float("nan"), float("inf")])
def test_the_torch_path_ignores_stale_slots_past_each_context(stale):
    """``PagedSelfAttention._prefill`` on the torch backend (the CPU path): NaN or inf in the
    slots a bucket's keys cover past a sequence's context gives the output of finite ones."""
    from colo_rollout.model.attention import PagedSelfAttention, prefill_buckets

    g, n, dim, bs, new, ctx = 2, 2, 64, 16, [5, 20, 3], [21, 20, 40]
    q, k_all, v_all, tables = _case(g, n, dim, bs, new, ctx, F32, torch.int64, seed=11)

    def run(k, v):
        attn = types.SimpleNamespace(prefill_backend="torch", heads=g * n, head_dim=dim,
                                     scale=dim ** -0.5, q_per_group=n)
        attn._gather_kv = lambda kv, layer, tab: PagedSelfAttention._gather_kv(attn, kv, layer,
                                                                               tab)
        meta = types.SimpleNamespace(
            block_tables=tables, buckets=prefill_buckets(
                new, ctx, bs, lambda vals, t: torch.tensor(vals, dtype=t), 0))
        return PagedSelfAttention._prefill(attn, q, None, types.SimpleNamespace(k=k, v=v), 1,
                                           meta)

    clean = run(k_all, v_all)
    k2, v2 = k_all.clone(), v_all.clone()
    for s, c in enumerate(ctx):
        for pos in range(c, tables.shape[1] * bs):
            blk = int(tables[s, pos // bs])
            k2[1, blk, pos % bs], v2[1, blk, pos % bs] = stale, stale
    got = run(k2, v2)
    assert torch.isfinite(got).all() and torch.equal(got, clean)
