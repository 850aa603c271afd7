"""MLA's D attention (model/mla_decode.py): the Triton split-KV kernel over the paged latent
cache against the torch path, run by Triton's CPU interpreter in a worker process (see
tests/interpreted.py; skipped when triton does not import), and the torch path against a
per-row loop of the decompressed attention it stands for."""

from __future__ import annotations

import pytest
import torch

from colo_rollout.model import mla_decode as md
from tests.interpreted import HAS_TRITON, interpreted_main

# (B, heads, latent, rope, block size, contexts, dtype, splits, block_n); contexts cover 1,
# block multiples, ragged tails, splits past a row's length, -1 = a padding row (context 1,
# the whole table the sink), heads that do not fill a 16-head block, rope widths under 16
CASES = [
    (1, 4, 16, 8, 16, [1], torch.float32, None, 16),
    (3, 16, 32, 16, 16, [1, 32, 77], torch.float32, 3, 16),
    (2, 20, 64, 8, 8, [64, 19], torch.float32, 4, 32),
    (4, 8, 32, 16, 16, [5, 100, 200, -1], torch.bfloat16, 2, 32),
    (2, 16, 512, 64, 16, [40, 129], torch.bfloat16, None, 32),  # DeepSeek-V3's widths
]


def _case(B, heads, lat, rope, bs, ctx, dtype, seed):
    """One layer of a 2-layer latent cache (a strided slice), shuffled tables padded with the
    sink block; the sink and the unwritten tails hold values a masked key must not let in."""
    gen = torch.Generator().manual_seed(seed)
    pad = [c < 0 for c in ctx]
    ctx = [1 if p else c for p, c in zip(pad, ctx)]
    width = max(-(-c // bs) for c in ctx) + 1
    num_blocks = sum(-(-c // bs) for c in ctx) + 3
    cache = torch.randn((2, num_blocks + 1, bs, lat + rope), generator=gen).to(dtype)
    sink = num_blocks
    cache[1, sink] = 1e4
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((B, width), sink, dtype=torch.int64)
    for b, c in enumerate(ctx):
        if pad[b]:
            continue
        nb = -(-c // bs)
        tables[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
        last, used = int(tables[b, nb - 1]), c - (nb - 1) * bs
        cache[1, last, used:] = 1e4
    q_lat = torch.randn(B, heads, lat, generator=gen).to(dtype) / lat ** 0.5
    q_rope = torch.randn(B, heads, rope, generator=gen).to(dtype)
    return q_lat, q_rope, cache[1], tables, torch.tensor(ctx, dtype=torch.int64)


def _interpreted() -> list[str]:
    fails = []
    for i, (B, h, lat, rope, bs, ctx, dtype, splits, block_n) in enumerate(CASES):
        q_lat, q_rope, cache, tables, lens = _case(B, h, lat, rope, bs, ctx, dtype, seed=i)
        scale = (lat + rope) ** -0.5
        got = md.mla_decode_attention(q_lat, q_rope, cache, tables, lens, scale,
                                      splits=splits, block_n=block_n)
        ref32 = md.torch_mla_decode_attention(q_lat.float(), q_rope.float(), cache.float(),
                                              tables, lens, scale)
        err = (got.float() - ref32).abs().max().item()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        if got.dtype != dtype or not torch.isfinite(got).all() or err > tol:
            fails.append(f"case {i}: dtype {got.dtype}, err vs fp32 {err:.2e} > {tol}")
        via = md.mla_decode(q_lat, q_rope, cache, tables, lens, scale, backend="triton")
        if (via.float() - ref32).abs().max().item() > tol:
            fails.append(f"case {i}: mla_decode(backend='triton') differs")
    # a row of length 0 (never fed) yields zeros, not NaN
    q_lat, q_rope, cache, tables, lens = _case(2, 4, 16, 8, 16, [40, 1], torch.float32, 99)
    lens[1] = 0
    got = md.mla_decode_attention(q_lat, q_rope, cache, tables, lens, 0.2, splits=2,
                                  block_n=16)
    if not torch.isfinite(got).all() or got[1].abs().max() != 0:
        fails.append(f"length 0: {got[1].abs().max()}")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_matches_torch_path_interpreted(interpreted):
    interpreted.check(__file__)


def test_torch_path_is_the_decompressed_attention():
    """Absorbed D = softmax over each head's decompressed keys [k_nope | rope key] of the
    values it would decompress (per row, per head, by loop): the identity MLA's D rests on."""
    gen = torch.Generator().manual_seed(5)
    heads, nope, v_dim, lat, rope, bs = 3, 6, 5, 8, 4, 4
    q_lat_w = torch.randn(heads, nope + v_dim, lat, generator=gen, dtype=torch.float64)
    w_k, w_v = q_lat_w[:, :nope], q_lat_w[:, nope:]
    q_lat, q_rope, cache, tables, lens = _case(2, heads, lat, rope, bs, [7, 3],
                                               torch.float64, 7)
    q_nope = torch.randn(2, heads, nope, generator=gen, dtype=torch.float64)
    absorbed = torch.einsum("bhn,hnl->bhl", q_nope, w_k)
    o_lat = md.torch_mla_decode_attention(absorbed, q_rope, cache, tables, lens, 0.3)
    got = torch.einsum("bhl,hvl->bhv", o_lat, w_v)
    for b in range(2):
        entries = cache[tables[b]].flatten(0, 1)[: int(lens[b])]
        c, k_pe = entries[:, :lat], entries[:, lat:]
        for h in range(heads):
            k = torch.cat((c @ w_k[h].T, k_pe), dim=-1)
            v = c @ w_v[h].T
            p = torch.softmax(0.3 * (k @ torch.cat((q_nope[b, h], q_rope[b, h]))), dim=0)
            assert torch.allclose(got[b, h], p @ v, atol=1e-10)


def test_unknown_backend_is_refused():
    q = torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match="torch or triton"):
        md.mla_decode(q, q, torch.zeros(2, 4, 8), torch.zeros(1, 1, dtype=torch.int64),
                      torch.ones(1, dtype=torch.int64), 1.0, backend="flash")


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)
