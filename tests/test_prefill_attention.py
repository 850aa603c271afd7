"""Batched P attention (sequences grouped by context bucket) equals the per-sequence loop, and
the bucketing is a partition of the sequences. Plain tensors, no process group."""

from __future__ import annotations

import random
import types

import pytest
import torch

from colo_rollout.model.attention import (
    AttnMetadata,
    KVStorage,
    PagedSelfAttention,
    prefill_buckets,
)
from colo_rollout.testing.attention_oracle import prefill_per_sequence

BLOCK = 4


def _fake_attention(heads: int, groups: int, dim: int):
    fake = types.SimpleNamespace(heads=heads, groups=groups, head_dim=dim,
                                 q_per_group=heads // groups, scale=dim ** -0.5)
    fake._gather_kv = lambda kv, layer, tables: PagedSelfAttention._gather_kv(fake, kv, layer,
                                                                              tables)
    return fake


def _case(seed: int):
    rng = random.Random(seed)
    n_seqs = rng.randint(1, 9)
    new = [rng.choice([1, 2, 5, 17, 40]) for _ in range(n_seqs)]
    retained = [rng.choice([0, 0, 3, 30, 90]) for _ in range(n_seqs)]  # continuation prefills
    ctx = [a + b for a, b in zip(new, retained)]
    free = list(range(200))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // BLOCK))] for c in ctx]
    return new, ctx, tables


@pytest.mark.parametrize("merge", [0, 64, 10**9])
@pytest.mark.parametrize("seed", range(8))
def test_batched_prefill_equals_per_sequence_loop(seed, merge):
    torch.manual_seed(seed)
    new, ctx, tables = _case(seed)
    heads, groups, dim = 4, 2, 8
    kv = KVStorage(1, 200, BLOCK, groups, dim, torch.float32, torch.device("cpu"))
    kv.k.normal_()
    kv.v.normal_()
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [kv.sink_block] * (width - len(t)) for t in tables])
    meta = AttnMetadata(is_prefill=True, positions=torch.zeros(0), slot_mapping=torch.zeros(0),
                        block_tables=bt, context_lens=torch.tensor(ctx), seq_lens_new=new,
                        context_lens_host=ctx)
    q = torch.randn(sum(new), heads, dim)
    attn = _fake_attention(heads, groups, dim)
    loop = prefill_per_sequence(attn, q, kv, 0, meta)
    meta.buckets = prefill_buckets(new, ctx, BLOCK, lambda v, t: torch.tensor(v, dtype=t),
                                   merge)
    batched = PagedSelfAttention._prefill(attn, q, None, kv, 0, meta)
    torch.testing.assert_close(batched, loop, rtol=1e-5, atol=1e-5)


def test_buckets_partition_sequences_and_bound_padding():
    new, ctx, _ = _case(3)
    buckets = prefill_buckets(new, ctx, BLOCK, lambda v, t: torch.tensor(v, dtype=t))
    seqs = sorted(i for b in buckets for i in b.seqs.tolist())
    assert seqs == list(range(len(new)))  # every sequence in exactly one bucket
    rows = sorted(r for b in buckets for r in b.out_rows.tolist())
    assert rows == list(range(sum(new)))  # every query row written exactly once
    for b in buckets:
        need = [-(-ctx[i] // BLOCK) for i in b.seqs.tolist()]
        assert b.blocks == max(need) and b.blocks < 2 * min(need) + 1  # power-of-two bucket
        assert b.slots.numel() == b.out_rows.numel() == sum(new[i] for i in b.seqs.tolist())


def _pairs(b, new, ctx):
    seqs = b.seqs.tolist()
    return len(seqs) * max(new[i] for i in seqs) * b.blocks * BLOCK


@pytest.mark.parametrize("seed", range(6))
def test_bucket_merging_partitions_and_respects_the_pair_budget(seed):
    rng = random.Random(seed)
    new = [rng.choice([1, 3, 20, 60]) for _ in range(12)]
    ctx = [n + rng.choice([0, 5, 40, 150, 400]) for n in new]
    to = lambda v, t: torch.tensor(v, dtype=t)  # noqa: E731
    split = prefill_buckets(new, ctx, BLOCK, to)
    for budget in (0, 500, 5000, 10**9):
        got = prefill_buckets(new, ctx, BLOCK, to, budget)
        assert sorted(i for b in got for i in b.seqs.tolist()) == list(range(12))
        assert sorted(r for b in got for r in b.out_rows.tolist()) == list(range(sum(new)))
        # every merged bucket is a run of neighbouring power-of-two buckets, and each merge
        # that made it added at most ``budget`` padded pairs
        runs, i = [], 0
        for b in got:
            members = set(b.seqs.tolist())
            run = []
            while i < len(split) and set(split[i].seqs.tolist()) <= members:
                run.append(split[i])
                i += 1
            assert set().union(*(set(x.seqs.tolist()) for x in run)) == members
            runs.append(run)
        assert i == len(split)
        for b, run in zip(got, runs):
            assert _pairs(b, new, ctx) - sum(_pairs(x, new, ctx) for x in run) \
                <= budget * (len(run) - 1)
    assert len(prefill_buckets(new, ctx, BLOCK, to, 0)) == len(split)  # 0: never merge
    assert len(prefill_buckets(new, ctx, BLOCK, to, 10**9)) == 1  # unbounded: one bucket


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 24])  # full and partial rotary
def test_rope_angles_once_per_forward_equal_megatron_bitwise(dtype, head_dim):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from colo_rollout.model.attention import RopeAngles, apply_rope

    g = torch.Generator().manual_seed(0)
    table = torch.randn(100, 1, 1, 16, generator=g)  # megatron's [positions, 1, 1, rot_dim]
    pos = torch.randint(0, 100, (37,), generator=g)
    rope = RopeAngles(table, pos)
    for _ in range(2):  # q and k of a layer read the same angles
        t = torch.randn(37, 4, head_dim, generator=g).to(dtype)
        ref = _apply_rotary_pos_emb_bshd(t, table[pos].view(37, 1, 16))
        assert torch.equal(apply_rope(t, rope), ref)


def test_rope_on_q_and_k_together_equals_megatron_on_each_bitwise():
    """The attention rotates q's and k's heads of every query group in one pass."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from colo_rollout.model.attention import RopeAngles, apply_rope

    g = torch.Generator().manual_seed(1)
    T, groups, n, dim = 29, 2, 3, 16
    table = torch.randn(64, 1, 1, dim, generator=g)
    pos = torch.randint(0, 64, (T,), generator=g)
    qkv = torch.randn(T, groups, n + 2, dim, generator=g).to(torch.bfloat16)
    qk = apply_rope(qkv[:, :, : n + 1], RopeAngles(table, pos))
    freqs = table[pos].view(T, 1, dim)
    q_ref = _apply_rotary_pos_emb_bshd(qkv[:, :, :n].reshape(T, groups * n, dim), freqs)
    k_ref = _apply_rotary_pos_emb_bshd(qkv[:, :, n], freqs)
    assert torch.equal(qk[:, :, :n].reshape(T, groups * n, dim), q_ref)
    assert torch.equal(qk[:, :, n], k_ref)


@pytest.mark.parametrize("seed", range(4))
def test_grouped_decode_attention_equals_per_head_reference(seed):
    """D attends each KV group once for all its q heads; the reference repeats K/V per head
    (what P's path does) and runs SDPA with a length mask."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    heads, groups, dim, B = 8, 2, 16, 5
    kv = KVStorage(1, 64, BLOCK, groups, dim, torch.float32, torch.device("cpu"))
    kv.k.normal_(generator=g)
    kv.v.normal_(generator=g)
    width = 6
    ctx = [rng.randint(1, width * BLOCK) for _ in range(B)]
    free = list(range(64))
    rng.shuffle(free)
    tables = torch.tensor([[free.pop() for _ in range(width)] for _ in range(B)])
    meta = AttnMetadata(is_prefill=False, positions=torch.zeros(0), slot_mapping=torch.zeros(0),
                        block_tables=tables, context_lens=torch.tensor(ctx), seq_lens_new=[],
                        context_lens_host=[])
    q = torch.randn(B, heads, dim, generator=g)
    attn = _fake_attention(heads, groups, dim)
    got = PagedSelfAttention._decode(attn, q, kv, 0, meta)
    k, v = attn._gather_kv(kv, 0, tables)  # [B, S, heads, dim], repeated per head
    S = k.shape[1]
    mask = torch.arange(S)[None, :] < torch.tensor(ctx)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=dim ** -0.5)[:, :, 0, :]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # keys past a row's context never matter: scribbling on them changes nothing
    for b in range(B):
        for s in range(ctx[b], S):
            blk = tables[b, s // BLOCK]
            kv.k[0, blk, s % BLOCK] += 100.0
            kv.v[0, blk, s % BLOCK] -= 100.0
    again = PagedSelfAttention._decode(attn, q, kv, 0, meta)  # (rows share no block)
    torch.testing.assert_close(again, got, rtol=1e-5, atol=1e-5)
