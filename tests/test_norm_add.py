"""A residual add fused with the RMSNorm that follows it (model/norm_add.py): the Triton kernel
against the torch path -- ``add_rounded`` / ``add_rounded_slots`` and then torch's rms_norm,
what the unfused layer runs -- run by Triton's CPU interpreter in a subprocess
(tests/interpreted.py; skipped when triton does not import), and the torch path and the norm
check where no kernel runs. The embedding + norm kernel (``embed_rms_norm``) likewise: its rows
bitwise F.embedding's, its norm within the same bounds.

The new residual must be bitwise the torch path's (and the unfused kernels'). The normalised
rows may differ by the order of the sum of squares alone: at most NORM_ULPS ulp of the model
dtype per element, on at most NORM_DIFFERING of the elements. Measured (interpreter vs torch
2.14 on CPU): bitwise on the cases below; on sweeps of 64-256 rows with H in 37, 768, 1031,
2048 and 4096, k 1 and 8, bf16 4 elements of 2.5M differ (1 ulp, 0.0078 at most), fp16 70 of
2.5M (1 ulp, 0.002 at most). A norm rounded before its weight (torch's older composite) puts a
quarter of the elements 1 ulp off, which the bounds tell apart (tested); a wrong eps or weight,
far more. On a GPU (skipped without CUDA; not yet run): the same bounds against torch's CUDA
rms_norm, and the fused call replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from colo_rollout.model.norm_add import (
    FusedRMSNorm,
    add_rms_norm,
    add_slots_rms_norm,
    embed_rms_norm,
    fused_rms_norm,
)
from colo_rollout.model.residual import add_rounded, add_rounded_slots
from tests.test_residual import sorted_slots
from tests.interpreted import HAS_TRITON, interpreted_main

NORM_ULPS = 1
NORM_DIFFERING = 1e-3  # of the elements (measured: at most 4e-5)

# (rows n, slots k, hidden H, dtype; k 0: add_rms_norm on an [n, H] partial): decode's one
# row, odd row counts and widths, the Qwen3 hidden 2048, Qwen3's k = 8
CASES = [(1, 0, 2048, torch.bfloat16), (1, 8, 2048, torch.bfloat16), (4, 0, 37, torch.bfloat16),
         (3, 8, 1031, torch.bfloat16), (4, 1, 2048, torch.float16), (5, 0, 1031, torch.float16),
         (1, 8, 2048, torch.float16), (3, 2, 37, torch.float16)]


def _case(i, fp32_partial: bool = False):
    """Case i: (res, partial [n, H] or pairs [n, k, H], the norm module). The rows at
    magnitudes 0.1 .. 10 (a norm that matters), the partials' columns from 1e-3 to 10."""
    n, k, H, dtype = CASES[i]
    g = torch.Generator().manual_seed(200 + i)
    res = (torch.randn(n, H, generator=g) * torch.logspace(-1, 1, n)[:, None]).to(dtype)
    shape = (n, H) if k == 0 else (n, k, H)
    part = torch.randn(shape, generator=g) * torch.logspace(-3, 1, H)
    part = part if fp32_partial else part.to(dtype)
    norm = torch.nn.RMSNorm(H, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(H, generator=g))  # not 1: a weight that shows
    return res, part, norm


def _unfused(res, part, norm):
    """What the layer runs without the fusion: the residual.py add, then the norm module."""
    new = add_rounded(res, part) if part.dim() == 2 else add_rounded_slots(res, part)
    with torch.inference_mode():
        return new, norm(new)


def _fused(res, part, norm, backend):
    fn = add_rms_norm if part.dim() == 2 else add_slots_rms_norm
    return fn(res, part, fused_rms_norm(norm, res.shape[-1]), backend)


def _ulps(a, b) -> tuple[float, int]:
    """(max |a - b| in ulps of the larger value in a's dtype, elements that differ)."""
    mant = {torch.bfloat16: 8, torch.float16: 11}[a.dtype]  # significand bits
    x, y = a.float(), b.float()
    exp = torch.frexp(torch.maximum(x.abs(), y.abs())).exponent  # x = m 2^e, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(x), exp - mant).clamp_min(torch.finfo(a.dtype).tiny)
    return ((x - y).abs() / ulp).max().item(), int((a != b).sum())


def _within(ulps: float, differ: int, numel: int) -> bool:
    return ulps <= NORM_ULPS and differ <= max(1, NORM_DIFFERING * numel)


def test_the_bounds_tell_a_norm_rounded_before_its_weight_apart():
    res, part, norm = _case(1)
    new, want = _unfused(res, part, norm)
    x = new.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    once = ((x * rstd) * norm.weight.float()).to(new.dtype)
    twice = (x * rstd).to(new.dtype) * norm.weight  # rounded, then weighted and rounded
    assert torch.equal(once, want)  # the kernel's formula, in torch's sum order: bitwise
    assert not _within(*_ulps(twice, want), want.numel())


def test_only_torch_rmsnorm_over_the_hidden_dim_is_fused():
    H = 16
    rms = torch.nn.RMSNorm(H, eps=1e-6)
    got = fused_rms_norm(rms, H)
    assert got == FusedRMSNorm(rms.weight, 1e-6) and got.weight is rms.weight

    class Sub(torch.nn.RMSNorm):
        pass

    for other in (torch.nn.LayerNorm(H), torch.nn.RMSNorm(H, eps=None), Sub(H, eps=1e-6),
                  torch.nn.RMSNorm(H, eps=1e-6, elementwise_affine=False),
                  torch.nn.RMSNorm(2 * H, eps=1e-6), torch.nn.Identity()):
        assert fused_rms_norm(other, H) is None


@pytest.mark.parametrize("i", range(len(CASES)))
def test_torch_path_is_the_add_then_the_module(i):
    for fp32 in (False, True):
        res, part, norm = _case(i, fp32)
        want = _unfused(res, part, norm)
        got = _fused(res, part, norm, "torch")
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        if part.dim() == 3:  # the slots where fc2 left them sorted, read by index
            got = add_slots_rms_norm(res, sorted_slots(part, i),
                                     fused_rms_norm(norm, res.shape[-1]), "torch")
            assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.filterwarnings("ignore:Mismatch dtype")  # torch: no fused kernel, as intended
def test_embed_rms_norm_torch_path_is_the_embedding_then_the_norm():
    """Where the kernel does not run (backend torch; an fp32 table): F.embedding's rows and
    the module's norm of them, bitwise; a wrong rank of ids or table is refused."""
    for backend, dtype in (("torch", torch.bfloat16), ("triton", torch.float32)):
        ids, table, norm = _embed_case(1)
        table, norm = table.to(dtype), norm.to(dtype)
        rows, normed = embed_rms_norm(ids, table, fused_rms_norm(norm, table.shape[1]),
                                      backend)
        with torch.inference_mode():
            assert torch.equal(rows, F.embedding(ids, table))
            assert torch.equal(normed, norm(F.embedding(ids, table)))
    with pytest.raises(ValueError, match="must be"):
        embed_rms_norm(ids[None], table, fused_rms_norm(norm, table.shape[1]))


def test_where_the_kernel_does_not_apply_it_is_the_torch_path():
    # backend "triton" on CPU tensors outside the interpreter: only the torch path can run
    res, pairs, norm = _case(3)
    want = _unfused(res, pairs, norm)
    H = res.shape[-1]
    w32 = FusedRMSNorm(norm.weight.float(), 1e-6)  # a weight in another dtype than the rows
    got = add_slots_rms_norm(res, pairs, w32, "triton")
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], F.rms_norm(want[0], (H,), w32.weight, 1e-6))
    strided = pairs.transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous pairs
    got = _fused(res, strided, norm, "triton")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    r32, p32, n32 = res.float(), pairs.float(), norm.float()  # an fp32 model
    assert all(torch.equal(a, b) for a, b in zip(_fused(r32, p32, n32, "triton"),
                                                 _unfused(r32, p32, n32)))
    with pytest.raises(ValueError, match="do not match"):
        add_slots_rms_norm(res, pairs[:, :, :-1], fused_rms_norm(norm, H))
    with pytest.raises(ValueError, match="does not match"):
        add_rms_norm(res, pairs[:, 0, :-1], fused_rms_norm(norm, H))


def _embed_case(i):
    """Case i's width and dtype as an embedding: ids [n] (repeats, the first and last rows)
    into a table [V, H] at row magnitudes 0.1 .. 10, and the norm module."""
    n, _, H, dtype = CASES[i]
    g = torch.Generator().manual_seed(300 + i)
    V = 50
    table = (torch.randn(V, H, generator=g) * torch.logspace(-1, 1, V)[:, None]).to(dtype)
    ids = torch.cat([torch.tensor([0, V - 1, 7, 7]), torch.randint(0, V, (n,), generator=g)])
    norm = torch.nn.RMSNorm(H, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(H, generator=g))
    return ids, table, norm


def _embed_check(i, name, fails, device="cpu"):
    ids, table, norm = (t.to(device) for t in _embed_case(i))
    rows, normed = embed_rms_norm(ids, table, fused_rms_norm(norm, table.shape[1]), "triton")
    want = F.embedding(ids, table)
    with torch.inference_mode():
        want_normed = norm(want)
    if rows.dtype != table.dtype or not torch.equal(rows, want):
        fails.append(f"{name}: embedding rows differ")
    ulps, differ = _ulps(normed, want_normed)
    if normed.dtype != table.dtype or not _within(ulps, differ, normed.numel()):
        fails.append(f"{name}: normed {differ} elements differ, up to {ulps} ulp")


def _interpreted() -> list[str]:
    fails = []
    for i in range(len(CASES)):
        _embed_check(i, f"embed case {i}", fails)
    for i in range(len(CASES)):
        for fp32 in (False, True):  # the partial in the model dtype, or fp32 (add_rounded's)
            res, part, norm = _case(i, fp32)
            if fp32 and part.dim() == 3:
                continue  # the MoE's slots come in the model dtype
            before = (res.clone(), part.clone())
            new, normed = _fused(res, part, norm, "triton")
            want_new, want_normed = _unfused(res, part, norm)
            name = f"case {i}{' (fp32 partial)' if fp32 else ''}"
            if part.dim() == 3:  # and the unfused slot kernel it replaces
                if not torch.equal(new, add_rounded_slots(res, part, "triton")):
                    fails.append(f"{name}: the residual differs from the slot kernel's")
                # the slots read by index where fc2 left them sorted: the same bits
                got = add_slots_rms_norm(res, sorted_slots(part, i),
                                         fused_rms_norm(norm, res.shape[-1]), "triton")
                if not (torch.equal(got[0], new) and torch.equal(got[1], normed)):
                    fails.append(f"{name}: the sorted slots' outputs differ")
            if new.dtype != res.dtype or not torch.equal(new, want_new):
                fails.append(f"{name}: residual {int((new != want_new).sum())} elements differ")
            ulps, differ = _ulps(normed, want_normed)
            print(f"{name}: normed {differ} of {normed.numel()} differ, max {ulps:.2f} ulp")
            if normed.dtype != res.dtype or not _within(ulps, differ, normed.numel()):
                fails.append(f"{name}: normed {differ} elements differ, up to {ulps} ulp")
            if not (torch.equal(res, before[0]) and torch.equal(part, before[1])):
                fails.append(f"{name}: an input was written")
    return fails


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a GPU")
def test_kernel_on_a_gpu_against_torch_and_in_a_graph():
    """On a GPU: torch's CUDA rms_norm (its own sums and rsqrtf) against the kernel (a tree sum,
    Triton's rsqrt.approx) under the same bounds, the embedding's too, and the fused call
    captured in a CUDA graph, replayed on new inputs (no host sync, static shapes)."""
    dev = torch.device("cuda")
    for i in range(len(CASES)):
        res, part, norm = (t.to(dev) for t in _case(i))
        new, normed = _fused(res, part, norm, "triton")
        want_new, want_normed = _unfused(res, part, norm)
        assert torch.equal(new, want_new), f"case {i}: the residual differs"
        ulps, differ = _ulps(normed, want_normed)
        print(f"case {i}: normed {differ} of {normed.numel()} differ, max {ulps:.2f} ulp")
        assert _within(ulps, differ, normed.numel()), f"case {i}: {differ} differ, {ulps} ulp"
    fails = []
    for i in range(len(CASES)):
        _embed_check(i, f"embed case {i}", fails, dev)
    assert not fails, fails
    res, pairs, norm = (t.to(dev) for t in _case(1))
    fused = fused_rms_norm(norm, res.shape[-1])
    static = (res.clone(), pairs.clone())
    add_slots_rms_norm(*static, fused, "triton")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = add_slots_rms_norm(*static, fused, "triton")
    static[0].copy_(res.flip(-1))  # new values, the same shapes
    static[1].copy_(pairs.flip(-1))
    graph.replay()
    want = _unfused(*static, norm)
    assert torch.equal(out[0], want[0]) and _within(*_ulps(out[1], want[1]), want[1].numel())


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_matches_the_torch_path_interpreted(interpreted):
    interpreted.check(__file__)


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)
