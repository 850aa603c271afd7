"""The rotary embedding and KV write of one attention layer (model/rope_kv.py): the torch path
bitwise against megatron's ``_apply_rotary_pos_emb_bshd`` on q and k with the cache slots
written, and the one-launch Triton kernel bitwise against the torch path, run by Triton's CPU
interpreter in a subprocess (tests/interpreted.py; skipped when triton does not import):
fp32 and bf16, full and partial rotary, q as a strided view of the QKV projection, head
counts and head dims that are not powers of two."""

from __future__ import annotations


import pytest
import torch

from colo_rollout.model import rope_kv
from tests.interpreted import HAS_TRITON, interpreted_main

# (tokens, KV groups, q heads per group, head dim, rotary dim, dtype)
CASES = [
    (1, 1, 1, 16, 16, torch.float32),
    (9, 2, 3, 16, 16, torch.bfloat16),
    (13, 4, 4, 24, 16, torch.bfloat16),  # partial rotary
    (6, 1, 8, 80, 80, torch.bfloat16),  # head dim not a power of two
    (5, 3, 2, 32, 8, torch.float32),
]


def _case(i):
    T, G, n, D, rot, dtype = CASES[i]
    g = torch.Generator().manual_seed(i)
    table = torch.randn(64, 1, 1, rot, generator=g)  # megatron's [positions, 1, 1, rot_dim]
    pos = torch.randint(0, 64, (T,), generator=g)
    qkv = torch.randn(T, G, n + 2, D, generator=g).to(dtype)  # the projection's layout
    slots = torch.randperm(3 * T, generator=g)[:T]
    freqs = table[pos].view(T, rot)
    cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
    return qkv, slots, freqs, cos, sin


def _run(fn, qkv, slots, cos, sin):
    T, G, n2, D = qkv.shape
    n = n2 - 2
    kc = torch.full((3 * T, G, D), 7.0, dtype=qkv.dtype)
    vc = torch.full((3 * T, G, D), 7.0, dtype=qkv.dtype)
    q = fn(qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1], cos, sin, kc, vc, slots)
    return q, kc, vc


@pytest.mark.parametrize("i", range(len(CASES)))
def test_torch_path_equals_megatron_rope_and_writes_the_slots(i):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    qkv, slots, freqs, cos, sin = _case(i)
    T, G, n2, D = qkv.shape
    n = n2 - 2
    q, kc, vc = _run(rope_kv.torch_rope_and_store, qkv, slots, cos, sin)
    f = freqs.view(T, 1, -1)
    assert torch.equal(q, _apply_rotary_pos_emb_bshd(qkv[:, :, :n].reshape(T, G * n, D), f))
    assert torch.equal(kc[slots], _apply_rotary_pos_emb_bshd(qkv[:, :, n], f))
    assert torch.equal(vc[slots], qkv[:, :, n + 1])
    others = torch.ones(3 * T, dtype=torch.bool)
    others[slots] = False
    assert (kc[others] == 7).all() and (vc[others] == 7).all()  # no other slot touched


def test_kernel_takes_only_one_dtype_throughout():
    qkv, slots, _, cos, sin = _case(1)
    n = qkv.shape[2] - 2
    kc32 = torch.zeros(27, qkv.shape[1], qkv.shape[3])  # an fp32 cache: the torch path's cast
    assert not rope_kv.kernel_fits(qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1], cos, kc32,
                                   kc32)
    q = rope_kv.rope_and_store(qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1], cos, sin, kc32,
                               kc32.clone(), slots, backend="triton")
    assert q.dtype == qkv.dtype and kc32[slots].abs().sum() > 0


def _interpreted() -> list[str]:
    fails = []
    for i in range(len(CASES)):
        qkv, slots, _, cos, sin = _case(i)
        ref = _run(rope_kv.torch_rope_and_store, qkv, slots, cos, sin)
        got = _run(rope_kv.triton_rope_and_store, qkv, slots, cos, sin)
        for name, a, b in zip(("q", "k cache", "v cache"), got, ref):
            if a.shape != b.shape or not torch.equal(a, b):
                diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "-"
                fails.append(f"case {i}: {name} differs (max {diff})")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_matches_torch_path_bitwise_interpreted(interpreted):
    interpreted.check(__file__)


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)
