"""engine.batch_invariant (model/batch_invariant.py): D rows whose bits do not depend on the
rows beside them.

Interpreted (Triton's CPU interpreter, tests/interpreted.py): the invariant linear's rows
alone equal them inside batches of 3 to 130 rows (bitwise), in bf16 and fp32, with a bias and
into fp32, and equal the fp32 reference within rounding; the decode attention with fixed
splits gives a row the same bits alone, beside other rows and at wider tables, and matches
the torch path; the fused experts on the invariant tiles give a token the same bits whether
its batch puts the launch in the small or the decode regime. On the ranks: a CPU engine in
bf16 gives the same greedy tokens and logprobs with and without MTP, its D iterations call
no batch-variant GEMM and no reducing collective (without the option they do: the watches can
fail), at one rank and on two-rank layouts (alltoall, gather, attention TP); the door refuses
the kernels that cannot be made invariant. On a GPU: the kernels' rows the same bits at any
batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from colo_rollout.config import ConfigError
from colo_rollout.config.loader import config_from_dict
from colo_rollout.model import batch_invariant as bi
from colo_rollout.model import fused_moe as fm
from colo_rollout.model import paged_attention as pa
from colo_rollout.model.moe_align import align
from tests.interpreted import HAS_TRITON, interpreted_main

CASES = "tests.cases_invariant"


def _linear_fails() -> list[str]:
    fails = []
    gen = torch.Generator().manual_seed(0)
    split = bi.LinearTile(16, block_k=32, split_k=3)  # 3 K ranges, their partials summed
    for dtype, K, N, bias, out, tile in [(torch.bfloat16, 96, 40, False, None, None),
                                         (torch.bfloat16, 160, 72, True, None, None),
                                         (torch.bfloat16, 64, 24, True, torch.float32, None),
                                         (torch.float32, 80, 36, True, None, None),
                                         (torch.bfloat16, 160, 40, True, None, split),
                                         (torch.bfloat16, 100, 24, False, torch.float32,
                                          split)]:
        w = torch.randn(N, K, generator=gen).to(dtype)
        b = torch.randn(N, generator=gen).to(dtype) if bias else None
        x = torch.randn(130, K, generator=gen).to(dtype)
        full = bi.invariant_linear(x, w, b, out_dtype=out, tile=tile)
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        rel = 1e-5 if dtype == torch.float32 or out == torch.float32 else 2 ** -7
        if full.dtype != (out or dtype) or not (
                (full.float() - ref).abs() <= rel * (ref.abs() + 1)).all():
            fails.append(f"linear {dtype} K{K} N{N}: off the reference by "
                         f"{(full.float() - ref).abs().max():.2e}")
        # row blocks at the same place in their 64-row tile: the interpreter's dot is numpy's,
        # whose bits follow a row's place in the tile (a GPU's MMA does not: test_gpu.py)
        for m in (1, 3, 64, 66):
            for lo in (0, 64):
                if not torch.equal(bi.invariant_linear(x[lo:lo + m], w, b, out_dtype=out,
                                                       tile=tile), full[lo:lo + m]):
                    fails.append(f"linear {dtype} K{K} N{N}: rows {lo}..{lo + m} differ")
    return fails


def _attention_fails() -> list[str]:
    fails = []
    gen = torch.Generator().manual_seed(1)
    bs, g, n, dim, blocks = 4, 2, 2, 32, 64
    k = torch.randn(blocks, bs, g, dim, generator=gen).bfloat16()
    v = torch.randn(blocks, bs, g, dim, generator=gen).bfloat16()
    ctx = [5, 40, 100, 1]
    tables = torch.full((4, 40), blocks - 1, dtype=torch.int64)  # sink padding
    perm = torch.randperm(blocks - 1, generator=gen).tolist()
    for r, c in enumerate(ctx):
        nb = -(-c // bs)
        tables[r, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
    q = torch.randn(4, g * n, dim, generator=gen).bfloat16()
    lens = torch.tensor(ctx)
    kw = dict(block_n=16, split_tokens=32)
    full = pa.triton_decode_attention(q, k, v, tables, lens, 0.2, **kw)
    ref = pa.torch_decode_attention(q.float(), k.float(), v.float(), tables, lens, 0.2)
    if (full.float() - ref).abs().max() > 2e-2:
        fails.append(f"attention off the reference by {(full.float() - ref).abs().max():.2e}")
    for r, c in enumerate(ctx):
        nb = -(-c // bs)
        for width in (nb, nb + 9, 40):  # one split, then more splits than the row needs
            alone = pa.triton_decode_attention(q[r:r + 1], k, v, tables[r:r + 1, :width],
                                               lens[r:r + 1], 0.2, **kw)
            if not torch.equal(alone[0], full[r]):
                fails.append(f"attention row {r} (ctx {c}) at width {width} differs")
    return fails


def _experts_fails() -> list[str]:
    fails = []
    gen = torch.Generator().manual_seed(2)
    E, k, H, Fd = 4, 2, 32, 32
    fc1 = (torch.randn(E, 2 * Fd, H, generator=gen) * 0.2).bfloat16()
    fc2 = (torch.randn(E, H, Fd, generator=gen) * 0.2).bfloat16()
    x = torch.randn(40, H, generator=gen).bfloat16()
    chosen = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(40)])
    weight = torch.rand(40, k, generator=gen)

    def run(N, backend):
        al = align(chosen[:N], weight[:N], 0, E, backend="torch")
        return fm.moe_experts(x[:N], al.token, al.offs, al.prob, fc1, fc2, F.silu, True,
                              backend, order=al.order, invariant=True).view(N, k, H)

    for backend in ("triton", "torch"):
        full = run(40, backend)  # 20 pairs per expert: the decode regime's rows
        for N in (1, 3):  # a pair or two per expert: the small regime's
            if not torch.equal(run(N, backend), full[:N]):
                fails.append(f"experts ({backend}): the first {N} tokens differ from the "
                             "40-token batch")
    al = align(chosen, weight, 0, E, backend="torch")
    ref = fm.moe_experts(x, al.token, al.offs, al.prob, fc1, fc2, F.silu, True, "torch",
                         order=al.order)
    if (full.reshape(ref.shape).float() - ref.float()).abs().max() > 0.05:
        fails.append("experts: the invariant path is off the torch path")
    return fails


def _interpreted() -> list[str]:
    return _linear_fails() + _attention_fails() + _experts_fails() + _far_weight_rows_fails()


def _far_weight_rows_fails() -> list[str]:
    """A weight row whose offset n * K passes 2^31 (a vocabulary x hidden past it, e.g.
    262,400 x 8192 -- D's output layer): row stride just under 2^31 over a 4 GiB uint8 storage
    from torch.empty (virtual: only touched pages committed). It wrapped in int32: row 2 was
    read 4 GiB below its place (found by an overflow audit)."""
    K, S, O = 64, 2 ** 31 - 2 ** 20, 2 ** 21
    w = torch.empty(O + 2 * S + K, dtype=torch.uint8).as_strided((3, K), (S, 1), O)
    for r in range(3):
        w[r].fill_(r + 1)
    got = bi.invariant_linear(torch.ones((1, K)), w)
    return [] if got.tolist() == [[64.0, 128.0, 192.0]] else [
        f"linear with weight rows past 2^31: {got.tolist()}, expected [[64, 128, 192]]"]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_invariant_kernels_interpreted(interpreted):
    interpreted.check(__file__)


def test_cpu_paths_are_per_row():
    """Off CUDA the linear and the experts compute one row at a time: the same bits at any
    batch, and the usual products within rounding."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=gen).bfloat16()
    x = torch.randn(33, 64, generator=gen).bfloat16()
    full = bi.invariant_linear(x, w)
    assert all(torch.equal(bi.invariant_linear(x[i:i + 1], w)[0], full[i]) for i in range(33))
    assert (full.float() - F.linear(x.float(), w.float())).abs().max() < 0.1
    assert bi.invariant_linear(x, w, out_dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="columns"):
        bi.invariant_linear(x, w.t())
    assert [bi.linear_tile(n, 2048).block_n for n in (151936, 5120, 3072, 64)] == [64, 64, 32, 16]
    assert bi.linear_tile(64, 2048).split_k == bi.linear_tile(2048, 4096).split_k == 2


@pytest.mark.parametrize("mtp", [False, True])
def test_bf16_engine_d_calls_no_batch_variant_gemm(worker_groups, mtp):
    """With the option, no D iteration (MTP's verify + draft pass included) calls a GEMM that
    may follow the row count; without it, D does -- so the watch sees what it should."""
    group = worker_groups(1)
    on = group.run(f"{CASES}:invariant_tokens", adp=1, ep=1, mtp=mtp)[0]
    assert on["variant_gemms"] == [], on["variant_gemms"]
    if not mtp:
        off = group.run(f"{CASES}:invariant_tokens", adp=1, ep=1, mtp=mtp, invariant=False)[0]
        assert off["variant_gemms"], "the watch saw no GEMM in a default D iteration"


@pytest.mark.parametrize("weights", ["random", "oracle"])
def test_bf16_mtp_streams_equal_the_plain_ones(worker_groups, weights):
    """The issue's property in bf16: greedy tokens and logprobs with MTP equal those without
    (the verify forward's 2B rows compute each row as B rows would), on the oracle's accepted
    drafts and on random weights' rejected ones."""
    group = worker_groups(1)
    on = group.run(f"{CASES}:invariant_tokens", adp=1, ep=1, mtp=True, weights=weights)[0]
    off = group.run(f"{CASES}:invariant_tokens", adp=1, ep=1, mtp=False, weights=weights)[0]
    assert on["tokens"] == off["tokens"]
    assert on["logprobs"] == off["logprobs"]
    if weights == "oracle":
        assert on["accepted"] >= 0.9 * on["verified"] > 0


@pytest.mark.parametrize("adp,dispatch", [(2, "alltoall"), (2, "gather"), (1, "gather")])
def test_bf16_two_rank_layouts_are_invariant(worker_groups, adp, dispatch):
    """Two ranks: EP2/ADP2 through the alltoall backend (D's dispatcher on the invariant
    kernels), EP2/ADP2 through the gather backend (the experts' partials summed across ranks)
    and EP2/ATP2 (attention's partials too): D calls no batch-variant GEMM and no reducing
    collective (its sums go as an all-to-all added in rank order; without the option it
    reduce-scatters), and MTP and plain streams agree bitwise."""
    group = worker_groups(2)
    kw = dict(adp=adp, ep=2, dispatch=dispatch)
    on = group.run(f"{CASES}:invariant_tokens", mtp=True, **kw)
    off = group.run(f"{CASES}:invariant_tokens", mtp=False, **kw)
    for r in on + off:
        assert r["variant_gemms"] == [] and r["d_sums"] == [], r
    assert on[0]["tokens"] == off[0]["tokens"] and on[0]["logprobs"] == off[0]["logprobs"]
    if dispatch == "gather":
        plain = group.run(f"{CASES}:invariant_tokens", mtp=False, invariant=False, **kw)
        assert plain[0]["d_sums"], "the watch saw no reducing collective in a default D"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_rows_are_the_same_bits_at_any_batch():
    """On the GPU, at the bench shapes' widths: a row's invariant linear output (bf16, and
    fp32 out: the gate) and its fixed-split attention are the same bits alone, at any place in
    batches of up to 256 rows and at wider tables (the MMA's bits do not follow a row's place
    in its tile, which the interpreter cannot show)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for K, N, out in [(2048, 3072, None), (4096, 2048, None), (2048, 32768, None),
                      (2048, 128, torch.float32)]:
        w = torch.randn(N, K, device=dev, generator=gen).bfloat16() * 0.02
        x = torch.randn(256, K, device=dev, generator=gen).bfloat16()
        for tile in (None, bi.LinearTile(32, split_k=4)):
            full = bi.invariant_linear(x, w, out_dtype=out, tile=tile)
            for m, lo in [(1, 0), (1, 200), (7, 61), (64, 100), (130, 3), (256, 0)]:
                part = bi.invariant_linear(x[lo:lo + m], w, out_dtype=out, tile=tile)
                assert torch.equal(part, full[lo:lo + m]), (K, N, m, lo, tile)
    bs, g, n, dim = 16, 4, 4, 128
    k = torch.randn(1400, bs, g, dim, device=dev, generator=gen).bfloat16()
    v = torch.randn(1400, bs, g, dim, device=dev, generator=gen).bfloat16()
    ctx = torch.tensor([100, 4000, 513, 1, 2048], device=dev)
    tables = torch.randperm(1399)[:5 * 256].view(5, 256).to(dev)
    q = torch.randn(5, g * n, dim, device=dev, generator=gen).bfloat16()
    full = pa.triton_decode_attention(q, k, v, tables, ctx, 0.08, split_tokens=bi.SPLIT_TOKENS)
    for r in range(5):
        for width in (-(-int(ctx[r]) // bs), 256):
            alone = pa.triton_decode_attention(q[r:r + 1], k, v, tables[r:r + 1, :width],
                                               ctx[r:r + 1], 0.08, split_tokens=bi.SPLIT_TOKENS)
            assert torch.equal(alone[0], full[r]), (r, width)
    # the experts at the first shape's widths: a token's rows the same bits whether its batch
    # runs the small regime's tiles (1 token), the decode regime's (100) or would reach the
    # prefill regime (300 tokens: capped at decode)
    E, k, H, Fd = 64, 8, 2048, 1408
    fc1 = torch.randn(E, 2 * Fd, H, device=dev, generator=gen).bfloat16() * 0.02
    fc2 = torch.randn(E, H, Fd, device=dev, generator=gen).bfloat16() * 0.02
    x = torch.randn(300, H, device=dev, generator=gen).bfloat16()
    chosen = torch.rand(300, E, device=dev, generator=gen).topk(k, dim=1).indices
    weight = torch.rand(300, k, device=dev, generator=gen)

    def experts(n):
        al = align(chosen[:n], weight[:n], 0, E, backend="triton")
        return fm.moe_experts(x[:n], al.token, al.offs, al.prob, fc1, fc2, F.silu, True,
                              "triton", order=al.order, invariant=True).view(n, k, H)

    full = experts(300)
    assert [fm.regime(n * k, E) for n in (1, 100, 300)] == ["small", "decode", "prefill"]
    for n in (1, 3, 100):
        assert torch.equal(experts(n), full[:n]), n


def test_fine_mode_gives_normals_invariant_streams(worker_groups):
    """Fine (D iterations between P's segments, the turnstile ordering the phases'
    collectives) with D's ordered sums on EP2/ATP2, MTP drafting: Normal's greedy tokens, no
    reducing collective in D. (Not the logprobs' last bits: Fine batches P otherwise, and P
    is not batch-invariant -- a sequence's KV from another P batch is other bits.)"""
    group = worker_groups(2)
    kw = dict(adp=1, ep=2, mtp=True)
    normal = group.run(f"{CASES}:invariant_tokens", mode="normal", **kw)
    fine = group.run(f"{CASES}:invariant_tokens", mode="fine", **kw)
    assert fine[0]["tokens"] == normal[0]["tokens"]
    assert fine[0]["d_sums"] == [] and fine[0]["variant_gemms"] == []


BASE = {"parallel": {"world_size": 1, "adp": 1, "ep": 1, "backend": "gloo"},
        "model": {"vocab_size": 256, "hidden_size": 64, "num_layers": 2,
                  "num_attention_heads": 4, "num_query_groups": 2, "moe_ffn_hidden_size": 64,
                  "num_experts": 8, "moe_router_topk": 2},
        "engine": {"batch_invariant": True}}


@pytest.mark.parametrize("change, words", [
    ({"model": {"moe_dispatch": "deepep"}, "parallel": {"backend": "nccl"}}, "DeepEP"),
    ({"model": {"use_te": "on"}}, "Transformer Engine"),
    ({"model": {"fp8": "e4m3", "params_dtype": "bfloat16"}}, "FP8 GEMMs"),
    ({"model": {"moe_compute": "megatron"}}, "megatron's expert path"),
])
def test_door_refuses_what_cannot_be_invariant(change, words):
    raw = {k: dict(v) for k, v in BASE.items()}
    for section, keys in change.items():
        raw[section].update(keys)
    with pytest.raises(ConfigError, match=words) as err:
        config_from_dict(raw)
    assert err.value.key in ("engine.batch_invariant", "model.moe_dispatch")
    raw["engine"]["batch_invariant"] = False  # the same layout without the option loads
    if "deepep" not in str(change):
        config_from_dict(raw)


def test_layouts_that_sum_across_ranks_load():
    """Attention TP and the gather backend at EP > 1 take the option (D's sums in rank
    order)."""
    for par in ({"world_size": 2, "adp": 1, "ep": 2}, {"world_size": 4, "adp": 2, "ep": 4}):
        raw = {k: dict(v) for k, v in BASE.items()}
        raw["parallel"].update(par)
        assert config_from_dict(raw).engine.batch_invariant


if __name__ == "__main__":
    interpreted_main(_interpreted)
