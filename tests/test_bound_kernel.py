"""model/bound_kernel.py: a Triton kernel launched through the variant its caller's key binds.

CPU: the interpreter's and unkeyed launches go through Triton's own path, nothing is bound;
the alignment test. GPU: the engine's bound call sites (rope + KV store, add + RMSNorm,
embedding + RMSNorm) write the bytes Triton's own launch writes, bind one variant per key
across token counts (with ``check``: Triton's binder agrees on every launch), and a key that
misses a specialisation is caught by ``check``.
"""

from __future__ import annotations

import pytest
import torch

from colo_rollout.model import bound_kernel as bk
from colo_rollout.model import norm_add, rope_kv
from colo_rollout.model.kernel_backend import triton

GPU = triton is not None and torch.cuda.is_available()


class _Recorder:
    """A stand-in for a jit function: records its launches (grid, args, warps)."""

    def __init__(self) -> None:
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, num_warps):
            self.calls.append((grid, args, num_warps))
        return run


def test_interpreter_and_unkeyed_launches_go_through_triton():
    fn = _Recorder()
    k = bk.BoundKernel(fn)
    x = torch.zeros(4)
    k(("key",), (2,), (x, 3), 4)  # CPU tensors: the interpreter's path, never bound
    k(("key",), (2,), (x, 3), 4)
    k(None, (1, 2), (x, 5), 2)
    assert [(g, a[1], w) for g, a, w in fn.calls] == [((2,), 3, 4), ((2,), 3, 4),
                                                        ((1, 2), 5, 2)]
    assert k.variants == 0


def test_all_aligned_reads_every_pointer():
    base = torch.zeros(64, dtype=torch.int64)
    assert bk.all_aligned(base, base[2:], base[4:].view(2, 30))
    assert not bk.all_aligned(base, base[1:])  # 8 bytes in
    assert not bk.all_aligned(base[3:])


def _rope_inputs(T, seed=0, G=4, n=8, D=128, blocks=600, bs=16):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    qkv = torch.randn(T, G, n + 2, D, device=dev, generator=g).bfloat16()
    cos = torch.randn(8192, D, device=dev, generator=g).bfloat16()
    sin = torch.randn(8192, D, device=dev, generator=g).bfloat16()
    kc = torch.zeros(blocks * bs, G, D, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(blocks * bs, device=dev, generator=g)[:T]
    pos = torch.randint(0, 8192, (T,), device=dev, generator=g)
    w = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).bfloat16()
    norm = rope_kv.QKRMSNorm(w, w.flip(0).contiguous(), 1e-6)
    return (qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1], cos, sin, kc, vc, slots, norm, pos)


def _rope(args):
    q, k, v, cos, sin, kc, vc, slots, norm, pos = args
    kv_out = (torch.empty_like(k, memory_format=torch.contiguous_format),
              torch.empty_like(v, memory_format=torch.contiguous_format))
    out = rope_kv.rope_and_store(q, k, v, cos, sin, kc, vc, slots, backend="triton",
                                 qk_norm=norm, positions=pos, kv_out=kv_out)
    return out, *kv_out, kc, vc


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_rope_bound_launch_writes_what_tritons_launch_writes(monkeypatch):
    launcher = bk.BoundKernel(rope_kv._rope_kv_kernel, check=True, **rope_kv._ROPE_KV.options)
    monkeypatch.setattr(rope_kv, "_ROPE_KV", launcher)
    for T in (300, 4096, 257):  # P's whole-token regime: one key for every count
        first = _rope(_rope_inputs(T))  # binds (Triton's own launch) or replays the bound one
        again = _rope(_rope_inputs(T))  # the bound variant, checked against Triton's binder
        for a, b in zip(first, again):
            assert torch.equal(a, b), f"T={T}: the bound launch wrote other bytes"
    assert launcher.variants == 1
    q, k, v, cos, sin, kc, vc, slots, norm, pos = _rope_inputs(64)  # D's per-group regime
    rope_kv.rope_and_store(q, k, v, cos, sin, kc, vc, slots, backend="triton", qk_norm=norm,
                           positions=pos)
    assert launcher.variants == 2


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("partial_dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_and_embedding_bound_launches(monkeypatch, partial_dtype):
    add = bk.BoundKernel(norm_add._add_rms_norm_kernel, check=True)
    emb = bk.BoundKernel(norm_add._embed_rms_norm_kernel, check=True)
    monkeypatch.setattr(norm_add, "_ADD_RMS_NORM", add)
    monkeypatch.setattr(norm_add, "_EMBED_RMS_NORM", emb)
    dev = torch.device("cuda")
    H = 2048
    w = (1 + 0.1 * torch.randn(H, device=dev)).bfloat16()
    norm = norm_add.FusedRMSNorm(w, 1e-6)
    table = torch.randn(1000, H, device=dev).bfloat16()
    outs = []
    for rep in range(2):  # the second pass runs every launch through its bound variant
        torch.manual_seed(1)
        for n in (5, 4096):
            res = torch.randn(n, H, device=dev).bfloat16()
            part = torch.randn(n, H, device=dev).to(partial_dtype)
            pairs = torch.randn(n, 8, H, device=dev).bfloat16()
            ids = torch.randint(0, 1000, (n,), device=dev)
            outs.append(norm_add.add_rms_norm(res, part, norm, "triton")
                        + norm_add.add_slots_rms_norm(res, pairs, norm, "triton")
                        + norm_add.embed_rms_norm(ids, table, norm, "triton"))
    half = len(outs) // 2
    for a, b in zip(outs[:half], outs[half:]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert add.variants == 2 and emb.variants == 1  # (bf16 partial, k 1) and (bf16, k 8)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_check_catches_a_key_that_misses_a_specialisation():
    dev = torch.device("cuda")
    k = bk.BoundKernel(norm_add._add_rms_norm_kernel, check=True)

    def launch(H):
        res = torch.randn(4, H, device=dev).bfloat16()
        pairs = res.view(4, 1, H)
        w = torch.ones(H, device=dev).bfloat16()
        k("same key", (4,), (res, pairs, w, torch.empty_like(res), torch.empty_like(res), H,
                             1e-6, 1, 2048, False), 8)

    launch(2048)  # binds
    launch(2048)  # bound, agreed
    with pytest.raises(RuntimeError, match="misses something Triton specialises on"):
        launch(2040)  # H no longer a multiple of 16: Triton picks another variant
