"""The routed experts under ``model.fp8_backend: te`` (model/fp8.py's ``te`` arithmetic): TE's
scale from an amax, its power-of-2 block scales (Float8BlockScaling), one scale per expert
weight and per expert's input rows (Float8CurrentScaling, as TE's GroupedLinear quantises its
splits) -- each against an independent rendering of TE's reference math (its Python
``_scale_from_amax_tensor``: frexp / ldexp for the power of 2), and the FP8 experts against a
loop over the experts that quantises every split on its own, as GroupedLinear does. The Triton
kernels run under the interpreter (in a subprocess); the GPU tier compares the quantised bytes
with Transformer Engine's own quantizers (tests/cases_gpu.py: gpu_te_fp8_experts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from colo_rollout.model import fp8 as f8
from colo_rollout.model import fused_moe as fm
from colo_rollout.model.fp8_linear import fp8_linear
from tests.interpreted import HAS_TRITON, interpreted_main

FP32_MAX = torch.finfo(torch.float32).max


def ref_scale(amax: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's reference (transformer_engine/pytorch/custom_recipes/reference_current_scaling.py,
    epsilon 0) with its CUDA kernel's fp32 maximum for an overflowing scale."""
    amax = amax.float()
    scale = torch.div(448.0, amax)
    scale = torch.where(scale == torch.inf, FP32_MAX, scale)
    if pow2:
        _, exp = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exp - 1)
    scale = torch.where((amax == 0) | (amax == torch.inf), 1.0, scale)
    return scale, torch.reciprocal(scale)


def ref_cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() * scale).clamp(-448.0, 448.0).to(f8.FP8_DTYPE)


def test_te_scales_are_tes_arithmetic():
    g = torch.Generator().manual_seed(0)
    amax = torch.cat([torch.logspace(-30, 30, 97), torch.rand(200, generator=g) * 10,
                      torch.tensor([0.0, 1e-38, 1e-40, 1e-45, 448.0, 1.0, 3e38,
                                    float("inf")])])
    for pow2 in (False, True):
        scale, inv = f8.te_scales(amax, pow2)
        want, want_inv = ref_scale(amax, pow2)
        assert torch.equal(scale, want) and torch.equal(inv, want_inv), pow2
    scale, _ = f8.te_scales(amax, pow2=True)
    mant, _ = torch.frexp(scale)
    assert torch.equal(mant, torch.full_like(mant, 0.5))  # every scale a power of 2
    # never above 448 / amax: the largest element lands at or below 448
    finite = (amax > 0) & (amax < 1e30)
    assert bool((amax[finite] * scale[finite] <= 448.0).all())
    assert f8.te_scales(torch.tensor([0.0]))[0].item() == 1.0


def test_block_inputs_take_power_of_2_scales():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 384, generator=g) * torch.logspace(-2, 2, 37)[:, None]).bfloat16()
    x[3, 128:256] = 0.0  # an all-zero group: scale 1
    q, s = f8.quantize_rows(x, pad=False, group=128, pow2=True, backend="torch")
    scale, inv = ref_scale(x.float().view(37, 3, 128).abs().amax(-1), pow2=True)
    assert torch.equal(s, inv) and s[3, 1].item() == 1.0
    assert torch.equal(q.view(torch.uint8), ref_cast(x.view(37, 3, 128), scale[..., None])
                       .view(37, 384).view(torch.uint8))
    # pow2 with an amax / 448 engine scale would differ: the two recipes are not one
    q_e, s_e = f8.quantize_rows(x, pad=False, group=128, backend="torch")
    assert not torch.equal(s_e, s)
    # padded rows as the engine's: zeros with scale 1
    qp, sp = f8.quantize_rows(x, group=128, pow2=True, backend="torch")
    assert qp.shape[0] == 48 and torch.equal(sp[37:], torch.ones(11, 3))
    with pytest.raises(ValueError, match="pow2 scales are the blockwise recipe's"):
        f8.quantize_rows(x, pow2=True)


def test_te_weights_blocks_and_per_expert_tensors_refresh_in_place():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(3, 256, 128, generator=g) * torch.tensor([0.01, 1.0, 30.0])[:, None, None]
         ).bfloat16()
    # blockwise: power-of-2 scales per 128 x 128 block
    bw = f8.Fp8Weight.of(w, 128, te=True)
    amax = w.float().view(3, 2, 128, 1, 128).abs().amax(dim=(2, 4))
    scale, inv = ref_scale(amax, pow2=True)
    assert bw.te and bw.block == 128 and not bw.tensorwise and torch.equal(bw.scale, inv)
    assert torch.equal(bw.q.view(torch.uint8), ref_cast(
        w.float().view(3, 2, 128, 1, 128), scale[:, :, None, :, None]).view(3, 256, 128)
        .view(torch.uint8))
    # tensorwise: one scale per expert, held in every channel
    tw = f8.Fp8Weight.of(w, 0, te=True)
    scale, inv = ref_scale(w.float().abs().amax(dim=(1, 2)), pow2=False)
    assert tw.tensorwise and tw.scale.shape == (3, 256)
    assert torch.equal(tw.scale, inv[:, None].expand(3, 256))
    assert torch.equal(tw.q.view(torch.uint8),
                       ref_cast(w, scale[:, None, None]).view(torch.uint8))
    err = (tw.dequantized() - w.float()).abs().amax(dim=(1, 2)) / w.float().abs().amax(dim=(1, 2))
    assert bool((err < 2 ** -4).all())
    # refresh: the same tensors, the new values
    w2 = w.flip(0).contiguous()
    for fw, block in ((bw, 128), (tw, 0)):
        ptrs = (fw.q.data_ptr(), fw.scale.data_ptr())
        fw.refresh(w2)
        fresh = f8.Fp8Weight.of(w2, block, te=True)
        assert (fw.q.data_ptr(), fw.scale.data_ptr()) == ptrs
        assert torch.equal(fw.q.view(torch.uint8), fresh.q.view(torch.uint8))
        assert torch.equal(fw.scale, fresh.scale)
    with pytest.raises(ValueError, match="tensorwise Fp8Weight is the routed experts'"):
        fp8_linear(torch.randn(4, 128).bfloat16(), f8.Fp8Weight.of(w[0], 0, te=True))


def _routing(seed: int, N: int, E: int, k: int, empty: int | None = None):
    """Pairs sorted by expert as the engine's: (token per sorted row, offs [E] int32 group
    ends, prob per sorted row, the sort order), optionally with expert ``empty`` unrouted."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g)
    if empty is not None:
        logits[:, empty] = -1e9
    chosen = logits.topk(k, dim=1).indices
    prob = torch.softmax(logits, -1).gather(1, chosen).flatten()
    key, order = torch.sort(chosen.flatten(), stable=True)
    offs = torch.searchsorted(key, torch.arange(E), right=True, out_int32=True)
    return order // k, offs, prob[order], order


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_grouped_quantiser_on_the_gpu_at_prefill_sizes():
    """The Triton grouped quantiser on an H200 at a 4k P step's sizes (fc1's gathered input,
    fc2's rows, Qwen3's 128 and the first shape's 64 experts, top-8): the torch path's bytes
    and scales, bitwise, padding rows included; and its time against the per-row quantiser
    (printed: the amax per expert is one pass over the rows in parallel, not a walk per
    expert -- the first version's 2.7x P step)."""
    import time

    for E, H, F in ((128, 2048, 768), (64, 2048, 1408)):
        token, offs, _, _ = _routing(5, 4096, E, 8)
        token, offs = token.cuda(), offs.cuda()
        x = (torch.randn(4096, H, device="cuda") * 3).bfloat16()
        R = token.shape[0] + 64
        tok = torch.cat([token, torch.zeros(64, dtype=token.dtype, device="cuda")])
        h = (torch.randn(R, F, device="cuda") * 2).bfloat16()
        for args in ((x, offs, R, tok), (h, offs, R, None)):
            a = f8.quantize_grouped(*args, backend="triton")
            b = f8.quantize_grouped(*args, backend="torch")
            assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)), (E, args[0].shape)
            assert torch.equal(a[1], b[1]), (E, args[0].shape)

            def ms(fn, n=20):
                fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                torch.cuda.synchronize()
                return (time.perf_counter() - t0) / n * 1e3

            rows = args[0][args[3]] if args[3] is not None else args[0]
            grouped = ms(lambda: f8.quantize_grouped(*args, backend="triton"))
            per_row = ms(lambda: f8.quantize_rows(rows, backend="triton"))
            print(f"E {E} {tuple(args[0].shape)} -> {R} rows: grouped {grouped:.3f} ms, "
                  f"per-row {per_row:.3f} ms")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("token", [True, False])
def test_grouped_quantiser_kernels_compile_for_sm90(token):
    """The kernels compiled for an H100/H200 (sm_90) on this CPU machine, down to the cubin:
    the interpreter runs code the compiler refuses (a helper returning a scalar on one path
    and a vector on the other passed the interpreted cases and failed on the GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    const = {"HAS_TOKEN": token, "E_PAD": 128, "BLOCK_K": 512}
    amax = ASTSource(f8._group_amax_kernel, {
        "X": "*bf16", "TOKEN": "*i64", "OFFS": "*i32", "E_AMAX": "*i32", "rows": "i32",
        "K": "i32", "stride_x": "i32", "E": "i32", "HAS_TOKEN": "constexpr",
        "E_PAD": "constexpr", "BLOCK_R": "constexpr", "BLOCK_K": "constexpr"},
        constexprs={**const, "BLOCK_R": 16})
    cast = ASTSource(f8._quantize_scaled_kernel, {
        "X": "*bf16", "TOKEN": "*i64", "OFFS": "*i32", "E_AMAX": "*i32", "RINV": "*fp32",
        "Q": "*fp8e4nv", "K": "i32", "stride_x": "i32", "stride_q": "i32", "E": "i32",
        "HAS_TOKEN": "constexpr", "E_PAD": "constexpr", "BLOCK_K": "constexpr"},
        constexprs=const)
    for src in (amax, cast):
        assert "cubin" in triton.compile(src, target=target).asm


def test_grouped_quantisation_is_per_split():
    g = torch.Generator().manual_seed(3)
    N, E, k, H = 23, 5, 2, 96
    token, offs, _, _ = _routing(3, N, E, k, empty=2)
    x = (torch.randn(N, H, generator=g) * torch.logspace(-1, 1, N)[:, None]).bfloat16()
    R = token.shape[0] + 6  # rows past the groups (a bucket's padding), tokens out of range
    tok = torch.cat([token, torch.full((6,), 10 ** 6)])
    e_row = f8.expert_of_rows(offs, R)
    assert e_row.tolist() == [e for e in range(E)
                              for _ in range(int(offs[e]) - (int(offs[e - 1]) if e else 0))
                              ] + [E] * 6
    q, inv = f8.quantize_grouped(x, offs, R, token=tok, backend="torch")
    lo = 0
    for e in range(E):
        hi = int(offs[e])
        rows = x[token[lo:hi]]
        if hi > lo:  # the split's own amax, as GroupedLinear's quantizer e sees it
            scale, want_inv = ref_scale(rows.float().abs().amax(), pow2=False)
            assert torch.equal(inv[lo:hi], want_inv.expand(hi - lo)), e
            assert torch.equal(q[lo:hi].view(torch.uint8), ref_cast(rows, scale)
                               .view(torch.uint8)), e
        lo = hi
    assert offs[2] == offs[1]  # the unrouted expert: no rows, nothing to check
    assert torch.equal(q[lo:].float(), torch.zeros(6, H)) and torch.equal(inv[lo:], torch.ones(6))
    # without tokens: the rows themselves (fc2's input)
    h = x[token]
    q2, inv2 = f8.quantize_grouped(h, offs, token.shape[0], backend="torch")
    assert torch.equal(q2.view(torch.uint8), q[:lo].view(torch.uint8))
    assert torch.equal(inv2, inv[:lo])


def _split_experts(x, token, offs, prob, fc1, fc2, act, gated, pow2_block: int = 0):
    """TE's GroupedLinear pair emulated on the dequantised operands: every expert's split of
    x quantised on its own (tensorwise) -- or each row per 1 x 128 (blockwise) --, its FP8
    weight, an fp32 product, the activation and probability rounded to x's dtype, the split
    quantised again for fc2. One matmul per expert (not a grouped GEMM)."""
    E = fc1.shape[0]
    out = torch.zeros(token.shape[0], fc2.shape[1])
    lo = 0
    for e in range(E):
        hi = int(offs[e])
        if hi == lo:
            continue
        rows = x[token[lo:hi]].float()
        if pow2_block:
            w1 = f8.Fp8Weight.of(fc1[e : e + 1], pow2_block, te=True).dequantized()[0]
            w2 = f8.Fp8Weight.of(fc2[e : e + 1], pow2_block, te=True).dequantized()[0]
            xq = f8.dequantize_rows(*f8.quantize_rows(rows, pad=False, group=pow2_block,
                                                      pow2=True, backend="torch"))
        else:
            s1, i1 = ref_scale(fc1[e].float().abs().amax(), False)
            s2, i2 = ref_scale(fc2[e].float().abs().amax(), False)
            w1 = ref_cast(fc1[e], s1).float() * i1
            w2 = ref_cast(fc2[e], s2).float() * i2
            sx, ix = ref_scale(rows.abs().amax(), False)
            xq = ref_cast(rows, sx).float() * ix
        hmid = xq @ w1.T
        if gated:
            gate, up = hmid.chunk(2, dim=-1)
            hmid = act(gate) * up
        else:
            hmid = act(hmid)
        hmid = (hmid * prob[lo:hi, None]).to(x.dtype).float()
        if pow2_block:
            hq = f8.dequantize_rows(*f8.quantize_rows(hmid, pad=False, group=pow2_block,
                                                      pow2=True, backend="torch"))
        else:
            sh, ih = ref_scale(hmid.abs().amax(), False)
            hq = ref_cast(hmid, sh).float() * ih
        out[lo:hi] = hq @ w2.T
        lo = hi
    return out


@pytest.mark.parametrize("block", [0, 128])
def test_fp8_experts_under_te_recipes_are_grouped_linears(block):
    g = torch.Generator().manual_seed(4)
    N, E, k, H, Fd = 19, 4, 2, 128, 128
    token, offs, prob, _ = _routing(4, N, E, k, empty=1)
    x = torch.randn(N, H, generator=g).bfloat16()
    fc1 = (torch.randn(E, 2 * Fd, H, generator=g) / H ** 0.5).bfloat16()
    fc2 = (torch.randn(E, H, Fd, generator=g) / Fd ** 0.5).bfloat16()
    fc1[3] *= 20  # experts of very different ranges: one scale each
    w1, w2 = f8.Fp8Weight.of(fc1, block, te=True), f8.Fp8Weight.of(fc2, block, te=True)
    got = fm.torch_experts_fp8(x, token, offs, prob, w1, w2, F.silu, True).float()
    want = _split_experts(x, token, offs, prob, fc1, fc2, F.silu, True, block)
    scale = want.abs().max()
    assert (got - want).abs().max() / scale < 2e-2  # bf16 output rounding
    # and not the engine's own recipe (per-row / amax-over-448 scales) on the same weights
    e1, e2 = f8.Fp8Weight.of(fc1, block), f8.Fp8Weight.of(fc2, block)
    own = fm.torch_experts_fp8(x, token, offs, prob, e1, e2, F.silu, True).float()
    assert not torch.equal(own, got)
    b16 = fm.torch_experts(x.float(), token, offs, prob, fc1.float(), fc2.float(), F.silu, True)
    assert 1e-4 < (got - b16).abs().max() / scale < 0.2


def _interpreted() -> list[str]:
    fails = []
    g = torch.Generator().manual_seed(7)
    # the power-of-2 row quantiser and the grouped one against their torch paths: scales
    # bitwise; q only within a factor of 2 -- this interpreter's fp32 -> e4m3 cast rounds
    # exact ties away from zero (200 -> 208, torch and the GPU's cvt.rn: 192) and mis-rounds
    # a carry into the exponent (124 -> 64; tests/test_fp8.py), and power-of-2 scaling makes
    # ties common. The GPU tier compares q bitwise (tests/cases_gpu.py: gpu_te_fp8_experts)
    for M, K in ((1, 128), (13, 256), (40, 384)):
        x = (torch.randn(M, K, generator=g) * 3).bfloat16()
        x[0, :128] = 0.0
        a = f8.quantize_rows(x, group=128, pow2=True, backend="triton")
        b = f8.quantize_rows(x, group=128, pow2=True, backend="torch")
        if not torch.equal(a[1], b[1]):
            fails.append(f"pow2 quantize_rows {M}x{K}: the kernel's scales differ")
        da, db = f8.dequantize_rows(*a), f8.dequantize_rows(*b)
        if bool(((da - db).abs() > db.abs() * 0.55).any()):
            fails.append(f"pow2 quantize_rows {M}x{K}: the kernel's values differ")
    N, E, k, H = 21, 4, 2, 96
    token, offs, _, _ = _routing(8, N, E, k, empty=0)
    x = (torch.randn(N, H, generator=g) * torch.logspace(-1, 1, N)[:, None]).bfloat16()
    tok = torch.cat([token, torch.full((5,), 10 ** 6)])
    a = f8.quantize_grouped(x, offs, tok.shape[0], token=tok, backend="triton")
    b = f8.quantize_grouped(x, offs, tok.shape[0], token=tok, backend="torch")
    da, db = f8.dequantize_rows(*a), f8.dequantize_rows(*b)
    if not torch.equal(a[1], b[1]) or bool(((da - db).abs() > db.abs() * 0.55).any()):
        fails.append("quantize_grouped: the kernel differs from the torch path")
    if not (torch.equal(a[0][-5:].float(), torch.zeros(5, H))
            and torch.equal(a[1][-5:], torch.ones(5))):
        fails.append("quantize_grouped: rows past the groups are not zero with scale 1")
    h = x[token]  # without tokens: the rows themselves (fc2's input)
    a = f8.quantize_grouped(h, offs, token.shape[0], backend="triton")
    b = f8.quantize_grouped(h, offs, token.shape[0], backend="torch")
    if not torch.equal(a[1], b[1]):
        fails.append("quantize_grouped without tokens: the kernel's scales differ")
    # the FP8 experts under each TE recipe: the kernel against the dequantised reference
    T = fm.Tile
    for block, (N, E, k, H, Fd) in ((0, (17, 4, 2, 128, 128)), (0, (9, 3, 3, 64, 32)),
                                    (128, (11, 4, 2, 128, 128))):
        token, offs, prob, order = _routing(9 + block, N, E, k, empty=2)
        x = torch.randn(N, H, generator=g).bfloat16()
        fc1 = (torch.randn(E, 2 * Fd, H, generator=g) / H ** 0.5).bfloat16()
        fc2 = (torch.randn(E, H, Fd, generator=g) / Fd ** 0.5).bfloat16()
        w1, w2 = f8.Fp8Weight.of(fc1, block, te=True), f8.Fp8Weight.of(fc2, block, te=True)
        tiles = None if block else (T(16, 16, 32, 4, 2), T(16, 32, 32, 4, 2))
        got = fm.triton_experts(x, token, offs, prob, w1, w2, F.silu, True, tiles=tiles).float()
        ref = fm.torch_experts_fp8(x, token, offs, prob, w1, w2, F.silu, True).float()
        err = (got - ref).abs().max() / ref.abs().max()
        if err > 1e-2:
            fails.append(f"te fp8 experts block {block} {N}x{E}: rel err vs the reference "
                         f"{err:.2e}")
        via = fm.moe_experts(x, token, offs, prob, w1, w2, F.silu, True, backend="triton",
                             order=order)
        if (via[order].float() - got).abs().max() > 0:
            fails.append(f"te fp8 experts block {block}: the scattered fc2 differs")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_te_fp8_kernels_match_the_reference_interpreted(interpreted):
    interpreted.check(__file__)


if __name__ == "__main__":  # the interpreted run (the kernel test above starts it)
    interpreted_main(_interpreted)
