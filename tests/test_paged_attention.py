"""D attention's backends (model/paged_attention.py): the Triton split-KV paged kernel against
the torch path, run by Triton's CPU interpreter in a subprocess (TRITON_INTERPRET is read when
the kernels are decorated, so it must be set before the module is first imported; skipped when
triton does not import), and the backend's resolution at model build."""

from __future__ import annotations


import pytest
import torch

from colo_rollout.config import ConfigError
from colo_rollout.config.schema import EngineConfig
from colo_rollout.model import paged_attention as pa
from tests.interpreted import HAS_TRITON, interpreted_main



# (B, groups, q per group, dim, block size, contexts, dtype, splits, block_n, table dtype)
# splits None: the engine's own choice (num_splits); the contexts cover 1, exact block
# multiples, ragged tails, splits past a row's length (empty splits), and padding rows (-1:
# context 1, the whole table the sink block, as the runner and the D graphs feed them)
CASES = [
    (1, 2, 1, 64, 16, [1], torch.float32, None, 16, torch.int64),
    (3, 2, 2, 128, 16, [1, 32, 77], torch.float32, 3, 16, torch.int64),
    (2, 1, 4, 64, 8, [64, 19], torch.float32, 4, 16, torch.int32),
    (5, 1, 8, 128, 16, [1, 16, 100, 200, -1], torch.float32, 4, 32, torch.int64),
    (1, 1, 4, 64, 16, [600], torch.float32, None, 64, torch.int64),  # default: 2 splits
    (4, 1, 8, 128, 16, [1, 16, 100, 200], torch.bfloat16, 4, 32, torch.int64),
    (2, 2, 2, 64, 16, [33, 48], torch.float16, 1, 16, torch.int64),  # single pass
    (3, 2, 4, 64, 16, [5, 64, -1], torch.bfloat16, 2, 16, torch.int32),
]


def _case(B, g, n, dim, bs, ctx, dtype, table_dtype, seed):
    """A paged cache of one layer (inside a 2-layer storage, so the layer is a strided
    slice), shuffled block tables padded with the sink block; the sink and the tails of
    reserved blocks hold large values that a masked key must never let through."""
    gen = torch.Generator().manual_seed(seed)
    pad = [c < 0 for c in ctx]
    ctx = [1 if p else c for p, c in zip(pad, ctx)]
    width = max(-(-c // bs) for c in ctx) + 1  # one extra sink column for every row
    num_blocks = sum(-(-c // bs) for c in ctx) + 3
    shape = (2, num_blocks + 1, bs, g, dim)
    k_all = torch.randn(shape, generator=gen).to(dtype)
    v_all = torch.randn(shape, generator=gen).to(dtype)
    sink = num_blocks
    k_all[1, sink] = 50.0
    v_all[1, sink] = 1e4
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((B, width), sink, dtype=table_dtype)
    for b, c in enumerate(ctx):
        if pad[b]:
            continue
        nb = -(-c // bs)
        tables[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=table_dtype)
        last, used = int(tables[b, nb - 1]), c - (nb - 1) * bs
        v_all[1, last, used:] = 1e4  # unwritten tail of the last block: masked
    q = torch.randn(B, g * n, dim, generator=gen).to(dtype)
    return q, k_all[1], v_all[1], tables, torch.tensor(ctx, dtype=torch.int64)


def _interpreted() -> list[str]:
    """Run every case through the interpreted kernel; returns the failures."""
    fails = []
    for i, (B, g, n, dim, bs, ctx, dtype, splits, block_n, tdt) in enumerate(CASES):
        q, k, v, tables, lens = _case(B, g, n, dim, bs, ctx, dtype, tdt, seed=i)
        scale = dim ** -0.5
        got = pa.triton_decode_attention(q, k, v, tables, lens, scale, splits=splits,
                                         block_n=block_n)
        ref32 = pa.torch_decode_attention(q.float(), k.float(), v.float(), tables, lens, scale)
        err = (got.float() - ref32).abs().max().item()
        tol = 1e-3 if dtype == torch.float32 else 2e-2
        if got.dtype != dtype or not torch.isfinite(got).all() or err > tol:
            fails.append(f"case {i}: dtype {got.dtype}, err vs fp32 {err:.2e} > {tol}")
        if dtype != torch.float32:  # and against the torch path in the same dtype
            ref = pa.torch_decode_attention(q, k, v, tables, lens, scale)
            err = (got.float() - ref.float()).abs().max().item()
            if err > 5e-2:
                fails.append(f"case {i}: err vs torch {dtype} {err:.2e}")
        # the entry point's triton backend is this same kernel
        via = pa.decode_attention(q, k, v, tables, lens, scale, backend="triton")
        if (via.float() - ref32).abs().max().item() > tol:
            fails.append(f"case {i}: decode_attention(backend='triton') differs")
    # a row of length 0 (never fed: padding rows get 1) yields zeros, not NaN; splits > 1 too
    q, k, v, tables, lens = _case(2, 1, 2, 64, 16, [40, 1], torch.float32, torch.int64, 99)
    lens[1] = 0
    for splits in (1, 2):
        got = pa.triton_decode_attention(q, k, v, tables, lens, 0.125, splits=splits,
                                         block_n=16)
        if not torch.isfinite(got).all() or got[1].abs().max() != 0:
            fails.append(f"length 0, {splits} splits: {got[1].abs().max()}")
    return fails + _far_rows_fails()


# a row stride under 2^31 whose multiple by the row passes it: the split partials of long
# batch-invariant rows ([rows, heads, splits, dim] at fixed 512-token splits: 1024 MTP rows x
# 64 heads past 131k tokens). Over a 4 GiB uint8 storage from torch.empty: virtual, only the
# touched pages are committed.
FAR_STRIDE, FAR_OFFSET = 2 ** 31 - 2 ** 20, 2 ** 21


def _far_rows_fails() -> list[str]:
    """The split kernel's partial store and the reduce's reads at offsets past 2^31 (they
    wrapped in int32: row 2 landed 4 GiB below its place; found by an overflow audit)."""
    fails = []
    B, D, bs = 3, 16, 16
    store = torch.empty(FAR_OFFSET + (B - 1) * FAR_STRIDE + D, dtype=torch.uint8)
    part = store.as_strided((B, 1, 1, D), (FAR_STRIDE, D, D, 1), FAR_OFFSET)
    part.zero_()
    q = torch.ones((B, 1, D))
    k, v = torch.zeros((2, bs, 1, D)), torch.full((2, bs, 1, D), 5.0)
    tables, ctx = torch.zeros((B, 1), dtype=torch.int64), torch.full((B,), 4, dtype=torch.int64)
    lse = torch.empty((B, 1, 1))
    pa._decode_split_kernel[(B, 1, 1)](
        q, k, v, tables, ctx, part, lse, 1.0, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), tables.stride(0),
        tables.stride(1), ctx.stride(0), part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1), bs, bs, N_Q=1, N_PAD=16, HEAD_DIM=D, D_PAD=16,
        BLOCK_SIZE=bs, BLOCK_N=16, SINGLE=False, DOT_PREC="ieee", UPCAST=True)
    got = [int(part[b, 0, 0, 0]) for b in range(B)]
    if got != [5] * B:  # v is 5 everywhere: every row's partial is 5
        fails.append(f"split partials past 2^31: rows hold {got}, expected 5 each")
    for b in range(B):
        part[b, 0, 0].fill_(10 + b)
    for ordered in (True, False):
        out = torch.full((B, 1, D), -1.0)
        pa.reduce_splits(part, torch.zeros((B, 1, 1)), out, ordered=ordered)
        if out[:, 0, 0].tolist() != [10.0, 11.0, 12.0]:
            fails.append(f"reduce (ordered {ordered}) past 2^31 read {out[:, 0, 0].tolist()}")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_matches_torch_path_interpreted(interpreted):
    interpreted.check(__file__)


def test_resolve_backend():
    cpu = torch.device("cpu")
    assert pa.resolve_backend("torch", cpu) == "torch"
    assert pa.resolve_backend("auto", cpu) == "torch"
    with pytest.raises(RuntimeError, match="triton was requested"):
        pa.resolve_backend("triton", cpu)
    with pytest.raises(ValueError, match="must be one of"):
        pa.resolve_backend("flash", cpu)
    if pa.triton_available():
        assert pa.resolve_backend("auto", "cuda:0") == "triton"
        assert pa.resolve_backend("triton", "cuda:0") == "triton"


def test_auto_on_cpu_tensors_is_the_torch_path():
    q, k, v, tables, lens = _case(2, 2, 2, 16, 4, [3, 9], torch.float32, torch.int64, 5)
    got = pa.decode_attention(q, k, v, tables, lens, 0.25)
    assert torch.equal(got, pa.torch_decode_attention(q, k, v, tables, lens, 0.25))
    with pytest.raises(ValueError):
        pa.decode_attention(q, k, v, tables, lens, 0.25, backend="flash")


def test_num_splits_fills_the_machine_from_shapes_alone():
    assert pa.num_splits(1, 4, 64) == 1  # short table: one pass
    assert pa.num_splits(128, 4, 8192) == 1  # 512 programs already: one pass
    assert pa.num_splits(32, 4, 4096) == 2  # one wave of 2 programs per multiprocessor
    assert pa.num_splits(8, 4, 4096) == 8
    assert pa.num_splits(64, 4, 4096) == 1
    assert pa.num_splits(1, 4, 8192) == pa.MAX_SPLITS
    for rows in (1, 8, 32, 64, 128):
        for width in (64, 2048, 4096, 8192):
            s = pa.num_splits(rows, 4, width)
            assert 1 <= s <= pa.MAX_SPLITS
            assert s * pa.MIN_TILES_PER_SPLIT * pa.BLOCK_N <= max(width, pa.BLOCK_N * 4)


def test_tile_config_fits_shared_memory():
    cpu = torch.device("cpu")  # no device properties: the conservative bound (99 KiB)
    for dim, dtype in ((64, torch.bfloat16), (128, torch.bfloat16), (128, torch.float32),
                       (256, torch.float16)):
        n, stages = pa.tile_config(cpu, dim, dtype)
        assert 16 <= n <= pa.BLOCK_N and 2 <= stages <= pa.NUM_STAGES
        assert stages * 2 * n * dim * torch.finfo(dtype).bits // 8 + 16384 <= 99 * 1024


def test_engine_config_key():
    assert EngineConfig().decode_attention == "auto"
    assert EngineConfig(decode_attention="torch").decode_attention == "torch"
    with pytest.raises(ConfigError, match="engine.decode_attention"):
        EngineConfig(decode_attention="flash")


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)


@pytest.mark.parametrize("stale", [float("nan"), float("inf")])
def test_stale_slots_past_the_context_change_nothing(stale):
    """The torch path: slots past a row's context (the sink, a block's unwritten tail) holding
    NaN or inf -- another request's leftovers after a bad weight load -- give the output of
    finite leftovers (zero probability times NaN used to be NaN)."""
    q, k, v, tables, lens = _case(3, 2, 2, 16, 4, [3, 9, 6], torch.float32, torch.int64, 7)
    clean = pa.torch_decode_attention(q, k, v, tables, lens, 0.25)
    k2, v2 = k.clone(), v.clone()
    for b, c in enumerate(lens.tolist()):
        for pos in range(c, tables.shape[1] * k.shape[1]):
            blk, off = int(tables[b, pos // k.shape[1]]), pos % k.shape[1]
            k2[blk, off], v2[blk, off] = stale, stale
    got = pa.torch_decode_attention(q, k2, v2, tables, lens, 0.25)
    assert torch.isfinite(got).all() and torch.equal(got, clean)
