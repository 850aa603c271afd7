"""P's fused QKV projection + q/k norms + rope + KV store (model/qkv_rope.py), run by Triton's
CPU interpreter in a subprocess (tests/interpreted.py; skipped when triton does not import):
its plain epilogue (the rounded projection) against ``torch.matmul``, and its fused epilogue
against ``rope_kv.torch_rope_and_store`` on that projection (bitwise; with q/k norms within
test_rope_kv's NORM_EPS, the sum of squares' order) -- q, both caches' slots
and the dense calls' K/V rows, with and without Qwen3's q/k RMSNorms, bf16 and fp16, a token
count past one row block (the last block's rows masked), a head dim of 64 and 128. Where
``fits`` refuses, and the attention layer on the fused path against its own two-launch path
(the model's P with the kernel on and off)."""

from __future__ import annotations

import pytest
import torch

from colo_rollout.model import qkv_rope, rope_kv
from tests.interpreted import HAS_TRITON, interpreted_main
from tests.test_rope_kv import NORM_EPS, _head_eps

# (tokens, hidden, KV groups, q heads per group, head dim, dtype, q/k norms)
CASES = [
    (130, 96, 2, 2, 64, torch.bfloat16, False),
    (130, 96, 2, 2, 64, torch.bfloat16, True),
    (7, 64, 1, 3, 64, torch.float16, True),
    (129, 64, 2, 1, 128, torch.bfloat16, True),
]


def _case(i):
    T, H, G, n, D, dt, norm = CASES[i]
    g = torch.Generator().manual_seed(i)
    x = torch.randn(T, H, generator=g).to(dt)
    w = (torch.randn(G * (n + 2) * D, H, generator=g) / H ** 0.5).to(dt)
    ang = torch.randn(300, D, generator=g)
    cos, sin = torch.cos(ang).to(dt), torch.sin(ang).to(dt)
    pos = torch.randint(0, 300, (T,), generator=g)
    slots = torch.randperm(2 * T, generator=g)[:T]
    qk = (rope_kv.QKRMSNorm(torch.randn(D, generator=g).to(dt),
                            torch.randn(D, generator=g).to(dt), 1e-6) if norm else None)
    return x, w, G, n, D, cos, sin, pos, slots, qk


def _buffers(T, G, D, dt):
    kc = torch.full((2 * T, G, D), 7.0, dtype=dt)
    return kc, kc.clone(), (torch.full((T, G, D), 5.0, dtype=dt),
                            torch.full((T, G, D), 5.0, dtype=dt))


def _interpreted() -> list[str]:
    fails = []
    for i, (T, H, _, _, _, dt, _) in enumerate(CASES):
        x, w, G, n, D, cos, sin, pos, slots, qk = _case(i)
        kc, vc, _ = _buffers(T, G, D, dt)
        plain = qkv_rope.qkv_rope_and_store(x, w, G, n, cos, sin, pos, kc, vc, slots,
                                            epilogue=qkv_rope.EPI_PLAIN)
        if not torch.equal(kc, torch.full_like(kc, 7.0)):
            fails.append(f"case {i}: the plain epilogue wrote the cache")
        # fp32 sums in another order than torch's CPU matmul: a rounding step at most
        gap = (plain.float() - torch.matmul(x, w.t()).float()).abs().max().item()
        if gap > 0.02:
            fails.append(f"case {i}: the projection is {gap:.3g} from torch.matmul")
        qkv = plain.view(T, G, n + 2, D)
        kc1, vc1, rows1 = _buffers(T, G, D, dt)
        want = (rope_kv.torch_rope_and_store(qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1],
                                             cos, sin, kc1, vc1, slots, qk, pos, rows1),
                kc1, vc1, *rows1)
        kc2, vc2, rows2 = _buffers(T, G, D, dt)
        got = (qkv_rope.qkv_rope_and_store(x, w, G, n, cos, sin, pos, kc2, vc2, slots, qk,
                                           rows2), kc2, vc2, *rows2)
        for name, a, b in zip(("q", "k cache", "v cache", "k rows", "v rows"), got, want):
            if a.shape != b.shape:
                fails.append(f"case {i}: {name} has shape {tuple(a.shape)}")
            elif qk is not None and name in ("q", "k cache", "k rows"):
                # the norm's sum of squares over another layout (tests/test_rope_kv.py)
                if _head_eps(a, b, dt) > NORM_EPS:
                    fails.append(f"case {i}: {name} {_head_eps(a, b, dt):.2f} eps of the "
                                 "head from the two-launch path")
            elif not torch.equal(a, b):
                fails.append(f"case {i}: {name}: {int((a != b).sum())} elements differ from "
                             "the two-launch path")
        # without kv_out: the same q and caches (bitwise the run with it), nothing else
        kc3, vc3, _ = _buffers(T, G, D, dt)
        q3 = qkv_rope.qkv_rope_and_store(x, w, G, n, cos, sin, pos, kc3, vc3, slots, qk)
        if not (torch.equal(q3, got[0]) and torch.equal(kc3, kc2) and torch.equal(vc3, vc2)):
            fails.append(f"case {i}: without kv_out the outputs differ")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_epilogue_is_the_rope_kernel_on_its_projection_interpreted(interpreted):
    interpreted.check(__file__)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fits_refuses_what_the_kernel_does_not_compute():
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    w = torch.zeros(4 * 128, 64, dtype=torch.bfloat16)
    assert qkv_rope.fits(x, w, 128, 128, torch.bfloat16, True)
    assert not qkv_rope.fits(x, w, 128, 64, torch.bfloat16, True)  # partial rotary
    assert not qkv_rope.fits(x, w, 96, 96, torch.bfloat16, True)  # head dim
    assert not qkv_rope.fits(x.float(), w.float(), 128, 128, torch.float32, True)
    assert not qkv_rope.fits(x, w, 128, 128, torch.float8_e4m3fn, True)  # an FP8 cache
    assert not qkv_rope.fits(x, w, 128, 128, torch.bfloat16, False)  # per-row angles
    assert not qkv_rope.fits(x[:, 1:], w[:, 1:], 128, 128, torch.bfloat16, True)  # unaligned
    with pytest.raises(ValueError, match="groups"):
        qkv_rope.qkv_rope_and_store(x, w, 1, 1, torch.zeros(4, 128, dtype=torch.bfloat16),
                                    None, None, None, None, None)


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)
