"""FP8 rollouts (model.fp8; model/fp8.py, the FP8 expert GEMMs of model/fused_moe.py): the
row-wise quantisation's bounds, the FP8 linear, the FP8 weight copies following every weight
write, the Triton kernels (Triton's CPU interpreter, in a subprocess) against the torch
reference math; the FP8 engine against the fp32 megatron reference beside the bf16 engine and
megatron's own bf16 on CPU layouts; the door's refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from colo_rollout.model import fp8 as f8
from colo_rollout.model.fp8_linear import fp8_linear
from colo_rollout.model import fused_moe as fm
from tests.cases_engine import MLA_ARCH
from tests.interpreted import HAS_TRITON, interpreted_main

# MLA attention (with its YaRN) on the FP8 tests' model (8 heads of 16 + 8 query/key and 12
# value dims, hidden 128): every FP8 GEMM dimension a multiple of 16 -- the latent 24 + rope 8,
# the query bottleneck 32. The model's own router, not MLA_ARCH's: the sigmoid group-limited
# routing with scaling 2.5 flips experts under FP8 alike with either attention (measured
# 0.072 mean |dlogp|, argmax 0.80 with GQA; 0.074 / 0.86 with MLA)
MLA_FP8 = {k: MLA_ARCH[k] for k in ("attention", "qk_layernorm", "q_lora_rank",
                                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                    "rope_scaling", "rope_scaling_factor",
                                    "yarn_original_max_position_embeddings",
                                    "yarn_mscale_all_dim")}
MLA_FP8.update(num_attention_heads=8, num_query_groups=8, kv_lora_rank=24)

# e4m3: 3 mantissa bits, so a normal value rounds within 2^-4 of itself; below 2^-6 (the
# least normal) the step is 2^-9, so the absolute error is within 2^-10 (in units of scale)
REL, SUB = 2.0 ** -4, 2.0 ** -10


def _bound_ok(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> bool:
    deq = f8.dequantize_rows(q[: x.shape[0]], s[: x.shape[0]])
    err = (deq - x.float()).abs()
    return bool((err <= x.float().abs() * REL + s[: x.shape[0], None] * SUB + 1e-30).all())


# --------------------------------------------------------------------------- quantisation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_bounds_scales_and_padding(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(21, 48, generator=g) * torch.logspace(-3, 3, 21)[:, None]).to(dtype)
    x[5] = 0.0  # an all-zero row
    q, s = f8.quantize_rows(x)
    assert q.dtype == f8.FP8_DTYPE and q.shape == (32, 48) and s.shape == (32,)
    assert q.float().abs().max() <= f8.FP8_MAX
    amax = x.float().abs().amax(dim=1)
    assert torch.equal(s[:21], amax.clamp_min(f8.TINY) / f8.FP8_MAX)
    assert torch.equal(q[5].float(), torch.zeros(48))
    # every row's largest element lands on +-448 (the scale uses the whole range)
    big = q[:21].float().abs().amax(dim=1)
    assert torch.equal(big[torch.arange(21) != 5], torch.full((20,), f8.FP8_MAX))
    assert _bound_ok(x, q, s)
    # padding rows: zeros with scale 1; pad=False keeps M rows
    assert torch.equal(q[21:].float(), torch.zeros(11, 48)) and torch.equal(s[21:], torch.ones(11))
    q2, s2 = f8.quantize_rows(x, pad=False)
    assert q2.shape == (21, 48) and torch.equal(q2.float(), q[:21].float())
    assert f8.quantize_rows(x[:0])[0].shape == (0, 48)


def test_quantize_rows_rejects_a_wrong_out():
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="quantize_rows out"):
        f8.quantize_rows(x, out=(torch.empty(3, 16, dtype=f8.FP8_DTYPE), torch.empty(3)))


def test_fp8_linear_is_the_dequantised_product_and_near_the_16_bit_one():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 64, generator=g).bfloat16()
    w = (torch.randn(48, 64, generator=g) / 8).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    fw = f8.Fp8Weight.of(w)
    assert fw.q.shape == (48, 64) and fw.scale.shape == (48,)
    y = fp8_linear(x, fw, bias=b)
    q, s = f8.quantize_rows(x)
    ref = (F.linear(f8.dequantize_rows(q[:7], s[:7]), fw.dequantized()).bfloat16()
           + b)
    assert y.dtype == torch.bfloat16 and y.shape == (7, 48) and torch.equal(y, ref)
    exact = F.linear(x.float(), w.float()) + b.float()
    rel = (y.float() - exact).abs().max() / exact.abs().max()
    assert 1e-4 < rel < 0.1  # FP8 rounding is visible, and bounded
    assert fp8_linear(x[:0], fw).shape == (0, 48)


def test_fp8_weight_refresh_is_in_place():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 32, 16, generator=g).bfloat16()
    fw = f8.Fp8Weight.of(w)
    ptrs = (fw.q.data_ptr(), fw.scale.data_ptr())
    w2 = torch.randn(4, 32, 16, generator=g).bfloat16()
    fw.refresh(w2)
    assert (fw.q.data_ptr(), fw.scale.data_ptr()) == ptrs  # captured graphs read these
    new = f8.Fp8Weight.of(w2)
    assert torch.equal(fw.q.float(), new.q.float()) and torch.equal(fw.scale, new.scale)
    assert fw.matches(w2) and not fw.matches(w2[:2])
    assert fw.nbytes == 4 * 32 * 16 + 4 * 32 * 4


def test_blockwise_scales_bound_each_block_and_refresh_in_place():
    """The blockwise recipe: an input row's every 128 columns and a weight's every 128 x 128
    block by its own amax -- one outlier spoils only its block (a row-wise scale would shrink
    the whole row's other values toward e4m3's subnormals)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=g).bfloat16()
    x[1, 7] = 1e6  # an outlier in row 1's first group: ~2^20 times the rest
    q, s = f8.quantize_rows(x, group=128)
    assert q.shape == (16, 256) and s.shape == (16, 2)
    amax = x.float().view(5, 2, 128).abs().amax(dim=-1)
    assert torch.equal(s[:5], amax.clamp_min(f8.TINY) / f8.FP8_MAX)
    assert torch.equal(s[5:], torch.ones(11, 2)) and torch.equal(q[5:].float(), torch.zeros(11, 256))
    deq = f8.dequantize_rows(q[:5], s[:5])
    err = (deq - x.float()).abs()
    assert bool((err <= x.float().abs() * REL + s[:5].repeat_interleave(128, 1) * SUB).all())
    # row 1's second group keeps its precision; under a row-wise scale its values fall below
    # e4m3's subnormals (2^-9 of the scale)
    rowwise = f8.dequantize_rows(*f8.quantize_rows(x, pad=False))
    assert (deq[1, 128:] - x[1, 128:].float()).abs().max() < 0.1 * (
        rowwise[1, 128:] - x[1, 128:].float()).abs().max()
    with pytest.raises(ValueError, match="multiple of the group"):
        f8.quantize_rows(x[:, :200], group=128)
    w = torch.randn(3, 256, 128, generator=g).bfloat16()
    fw = f8.Fp8Weight.of(w, 128)
    assert fw.block == 128 and fw.scale.shape == (3, 2, 1) and fw.q.shape == (3, 256, 128)
    blocks = w.float().view(3, 2, 128, 1, 128).abs().amax(dim=(2, 4))
    assert torch.equal(fw.scale, blocks.clamp_min(f8.TINY) / f8.FP8_MAX)
    d = fw.dequantized()
    assert bool(((d - w.float()).abs() <= w.float().abs() * REL
                 + fw.scale.repeat_interleave(128, 1).repeat_interleave(128, 2) * SUB).all())
    ptrs = (fw.q.data_ptr(), fw.scale.data_ptr())
    w2 = torch.randn(3, 256, 128, generator=g).bfloat16()
    fw.refresh(w2)
    new = f8.Fp8Weight.of(w2, 128)
    assert (fw.q.data_ptr(), fw.scale.data_ptr()) == ptrs
    assert torch.equal(fw.q.float(), new.q.float()) and torch.equal(fw.scale, new.scale)
    with pytest.raises(ValueError, match="multiples of 128"):
        f8.Fp8Weight.of(torch.randn(64, 128).bfloat16(), 128)
    # the linear: blockwise x against blockwise W, the dequantised product
    xl = torch.randn(7, 128, generator=g).bfloat16()
    wl = f8.Fp8Weight.of((torch.randn(256, 128, generator=g) / 11).bfloat16(), 128)
    y = fp8_linear(xl, wl)
    ql, sl = f8.quantize_rows(xl, pad=False, group=128)
    assert torch.equal(y, F.linear(f8.dequantize_rows(ql, sl), wl.dequantized()).bfloat16())
    with pytest.raises(ValueError, match="rowwise weights only"):
        fp8_linear(xl, wl, backend="scaled_mm")
    assert f8.recipe_block("blockwise") == 128 and f8.recipe_block("rowwise") == 0


def test_fp8_supported_names_what_is_missing():
    assert f8.fp8_supported(torch.device("cpu")) == (True, "")  # the reference math
    ok, why = f8.fp8_supported(torch.device("meta"))
    assert not ok and "no FP8 GEMMs" in why


# --------------------------------------------------------------------------- kernels


def _moe_case(seed, N, E, k, H, Fd, gated, act):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g)
    chosen = logits.topk(k, dim=1).indices
    prob = torch.softmax(logits, -1).gather(1, chosen).flatten()
    key, order = torch.sort(chosen.flatten(), stable=True)
    offs = torch.searchsorted(key, torch.arange(E), right=True, out_int32=True)
    x = torch.randn(N, H, generator=g).bfloat16()
    fc1 = (torch.randn(E, 2 * Fd if gated else Fd, H, generator=g) / H ** 0.5).bfloat16()
    fc2 = (torch.randn(E, H, Fd, generator=g) / Fd ** 0.5).bfloat16()
    return x, order // k, offs, prob[order], fc1, fc2, act, gated, order


def _experts_errors(case, tiles, block: int = 0) -> tuple[float, float, float]:
    """The FP8 experts (weights of ``block``) on a ``_moe_case``: the kernel's relative error
    against the dequantised reference and against the 16-bit experts, and the scale."""
    x, token, offs, prob, fc1, fc2, act, gated, _ = case
    w1, w2 = f8.Fp8Weight.of(fc1, block), f8.Fp8Weight.of(fc2, block)
    got = fm.triton_experts(x, token, offs, prob, w1, w2, act, gated, tiles=tiles)
    ref = fm.torch_experts_fp8(x, token, offs, prob, w1, w2, act, gated)
    b16 = fm.torch_experts(x.float(), token, offs, prob, fc1.float(), fc2.float(), act, gated)
    scale = b16.abs().max().item()
    return ((got.float() - ref.float()).abs().max().item() / scale,
            (got.float() - b16).abs().max().item() / scale, scale)


def _interpreted() -> list[str]:
    fails = []
    # the row quantiser's kernel against the torch path: the scales bitwise (IEEE division in
    # both), the padding rows. Not q: this interpreter's fp32 -> e4m3 cast mis-rounds values
    # whose mantissa carries into the exponent (126.3 -> 64; the GPU's cvt.rn is right) --
    # the GPU tier compares q bitwise (tests/cases_gpu.py: gpu_fp8_kernels)
    g = torch.Generator().manual_seed(5)
    for M, K in ((1, 16), (13, 48), (32, 200)):
        x = (torch.randn(M, K, generator=g) * 3).bfloat16()
        x[0, :3] = 0.0
        a = f8.quantize_rows(x, backend="triton")
        b = f8.quantize_rows(x, backend="torch")
        if not torch.equal(a[1], b[1]):
            fails.append(f"quantize_rows {M}x{K}: the kernel's scales differ")
        if not (torch.equal(a[0][M:].float(), b[0][M:].float()) and torch.equal(a[1][M:],
                                                                              b[1][M:])):
            fails.append(f"quantize_rows {M}x{K}: the kernel's padding rows differ")
    # the FP8 expert GEMMs against the dequantised reference (fp32 math in both: the
    # interpreter's dots are exact fp32) and against the 16-bit experts (FP8 rounding only)
    T = fm.Tile
    for i, (N, E, k, H, Fd, gated, act, tiles) in enumerate((
            (9, 4, 2, 64, 32, True, F.silu, None),
            (30, 8, 2, 64, 48, True, F.silu, (T(16, 16, 32, 4, 2), T(16, 32, 32, 4, 2))),
            (17, 4, 2, 80, 32, False, F.gelu, (T(16, 16, 32, 4, 2), T(16, 16, 32, 4, 2))))):
        case = _moe_case(i, N, E, k, H, Fd, gated, act)
        x, token, offs, prob, fc1, fc2, act, gated, order = case
        w1, w2 = f8.Fp8Weight.of(fc1), f8.Fp8Weight.of(fc2)
        err, err16, scale = _experts_errors(case, tiles)
        if err > 1e-2:
            fails.append(f"fp8 moe case {i}: rel err vs the FP8 reference {err:.2e}")
        if not 1e-4 < err16 < 0.15:
            fails.append(f"fp8 moe case {i}: rel err vs 16-bit experts {err16:.2e}")
        via = fm.moe_experts(x, token, offs, prob, w1, w2, act, gated, backend="triton",
                             order=order)
        if not torch.equal(via[order], fm.triton_experts(x, token, offs, prob, w1, w2, act,
                                                         gated)):
            fails.append(f"fp8 moe case {i}: the scattered fc2 is not the sorted one permuted")
        tref = fm.moe_experts(x, token, offs, prob, w1, w2, act, gated, backend="torch",
                              order=order)
        if (via.float() - tref.float()).abs().max().item() / scale > 1e-2:
            fails.append(f"fp8 moe case {i}: moe_experts triton vs torch backends differ")
    # blockwise: the group quantiser's scales, the expert GEMMs (per-K-block rescaling in the
    # loop; a K step of 32 and of 64 inside the 128-wide blocks) and the linear
    for M, K in ((1, 128), (13, 256), (5, 384)):  # 384: three groups in a 4-row tile
        x = (torch.randn(M, K, generator=g) * 3).bfloat16()
        a = f8.quantize_rows(x, backend="triton", group=128)
        b = f8.quantize_rows(x, backend="torch", group=128)
        if not torch.equal(a[1], b[1]):
            fails.append(f"quantize_rows {M}x{K} group 128: the kernel's scales differ")
        if not torch.equal(a[0][M:].float(), b[0][M:].float()):
            fails.append(f"quantize_rows {M}x{K} group 128: the padding rows differ")
    for i, tiles in enumerate(((T(16, 16, 32, 4, 2), T(16, 32, 32, 4, 2)),
                               (T(16, 32, 64, 4, 2), T(16, 16, 64, 4, 2)))):
        # H 256: fc1's K spans two scale blocks (the in-loop rescaling), its 2F = 256 rows
        # two (gate, up)
        err, err16, _ = _experts_errors(_moe_case(10 + i, 9, 4, 2, 256, 128, True, F.silu),
                                        tiles, 128)
        if err > 1e-2 or not 1e-4 < err16 < 0.15:
            fails.append(f"blockwise fp8 moe case {i}: rel err {err:.2e}, vs 16-bit {err16:.2e}")
    for M, K, N in ((1, 128, 128), (20, 256, 384)):
        xl = torch.randn(M, K, generator=g).bfloat16()
        wl = f8.Fp8Weight.of((torch.randn(N, K, generator=g) / K ** 0.5).bfloat16(), 128)
        a = fp8_linear(xl, wl, backend="triton")
        b = fp8_linear(xl, wl, backend="torch")
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        if a.shape != (M, N) or err > 1e-2:
            fails.append(f"blockwise fp8_linear {M}x{K}x{N}: {tuple(a.shape)} err {err:.2e}")
    # the FP8 linear's one-group kernel path against its reference
    for M, K, N in ((1, 64, 48), (16, 128, 96), (40, 80, 32)):
        xl = torch.randn(M, K, generator=g).bfloat16()
        wl = f8.Fp8Weight.of((torch.randn(N, K, generator=g) / K ** 0.5).bfloat16())
        a = fp8_linear(xl, wl, backend="triton")
        b = fp8_linear(xl, wl, backend="torch")
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        if a.shape != (M, N) or a.dtype != torch.bfloat16 or err > 1e-2:
            fails.append(f"fp8_linear triton {M}x{K}x{N}: {tuple(a.shape)} {a.dtype} err {err:.2e}")
    try:
        fm.moe_gemm(x, w1.q, offs, 3, a_scale=torch.ones(3), tile=T(16, 16, 32, 4, 2))
        fails.append("an FP8 GEMM without w_scale was accepted")
    except ValueError:
        pass
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fp8_kernels_match_the_reference_interpreted(interpreted):
    interpreted.check(__file__)


# --------------------------------------------------------------------------- the model


def test_fp8_copies_follow_every_weight_write(worker_groups):
    r = worker_groups(1).run("tests.cases_fp8:fp8_weight_copies", timeout=300)[0]
    assert r["made_where_the_model_runs"] and r["sites"] == 4 and r["grouped"], r
    # a load writes in place: the same FP8 tensors, re-quantised from the new weights
    assert r["same_addresses_after_load"] and r["qkv_requantised"] and r["experts_requantised"]
    # a replaced parameter: the idle check re-quantises from it, only then
    assert r["check_clean"] is False and r["check_after_replace"] is True, r
    assert r["proj_requantised"] and r["dropped"]
    assert r["refused_shapes"].startswith("model.fp8: ") and "multiples of 16" in r["refused_shapes"]
    assert "grouped expert path" in r["refused_megatron"]
    assert r["refused_te"] == ("model.fp8_backend: Transformer Engine's FP8 GEMMs run on a "
                               "CUDA GPU only"), r


# --------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("world,adp,ep,extra", [
    (1, 1, 1, {}),
    (4, 2, 4, {}),  # EP4/ADP2/ATP2 (EP2/ADP2 through alltoall: the PD-modes test)
    (1, 1, 1, {"model_kw": {"first_k_dense": 1, "shared_expert_ffn_hidden_size": 128}}),
    (1, 1, 1, {"model_kw": {"mtp_num_layers": 1}, "engine_kw": {"mtp": True}}),
    # the blockwise recipe (every FP8 GEMM dimension a multiple of 128: 8 KV heads x 16);
    # measured 0.048 mean |dlogp| beside rowwise's 0.044 on this model, argmax 0.93
    (1, 1, 1, {"model_kw": {"fp8_recipe": "blockwise", "num_query_groups": 8}}),
])
def test_fp8_engine_against_fp32_beside_bf16(worker_groups, world, adp, ep, extra):
    """FP8 on CPU is the dequantised reference math: the FP8 GEMMs' numbers up to summation
    order. Its tokens' logprobs stay within 0.1 of fp32 on average (measured 0.049-0.054,
    5-9x the bf16 engine's 0.005-0.012: e4m3 keeps 3 mantissa bits against bf16's 7) and
    greedy tokens near the fp32 argmax; P's first tokens mostly those of bf16."""
    r = worker_groups(world).run("tests.cases_fp8:fp8_vs_reference", timeout=900, adp=adp,
                                   ep=ep, **extra)[0]
    _assert_fp8_near_fp32(r)


def test_fp8_blockwise_mla_keeps_a_partial_block_kv_down_in_bf16(worker_groups):
    """The blockwise recipe on an MLA model whose key/value down projection has no whole
    number of 128-row blocks (24 + 8 rows here, DeepSeek-V3's 576): that GEMM stays bf16,
    every other FP8 -- and the engine stays near fp32. Measured (session 31, CPU reference
    math): mean |dlogp| to fp32 0.089, argmax 0.81, beside rowwise's 0.069 / 0.85 and bf16's
    0.005 on the same model."""
    model_kw = {**MLA_FP8, "fp8_recipe": "blockwise", "q_lora_rank": 128,
                "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16}
    r = worker_groups(1).run("tests.cases_fp8:fp8_vs_reference", timeout=900, adp=1, ep=1,
                             model_kw=model_kw)[0]
    b, f = r["bf16"], r["fp8"]
    assert b["fp8_bytes"] == 0 and f["fp8_bytes"] > 0, r
    assert f["bf16_gemms"] == [[2]] * 4, r  # the kv down projection of each of the 4 layers
    assert b["mean_logprob_diff"] < f["mean_logprob_diff"] < 0.1, r
    assert f["argmax_agreement"] >= 0.75, r


@pytest.mark.parametrize("world,adp,q_lora_rank", [(2, 2, 32), (1, 1, None), (2, 1, 32)])
def test_fp8_mla_engine_against_fp32_beside_bf16(worker_groups, world, adp, q_lora_rank):
    """MLA (DeepSeek-V3's attention; EP2/ADP2 and EP2/ATP2 -- the heads' FP8 GEMMs split --
    with a query bottleneck, 1 rank without): the
    query, key/value-down and output projections in FP8, kv_b's absorbed matrices in bf16.
    Measured (session 29): mean |dlogp| to fp32 0.064 / 0.083 against bf16's 0.012 / 0.009,
    argmax 0.88 / 0.80, P's first tokens 0.92 / 0.58 as bf16's -- further from fp32 than the
    GQA model's 0.049-0.054 / 0.94-0.96 (not diagnosed: the latent path's two FP8 GEMMs in
    series, or this random model; the H200 row will say), so the bounds here are MLA's own."""
    r = worker_groups(world).run("tests.cases_fp8:fp8_vs_reference", timeout=900, adp=adp,
                                 ep=world, model_kw={**MLA_FP8, "q_lora_rank": q_lora_rank})[0]
    b, f = r["bf16"], r["fp8"]
    assert b["fp8_bytes"] == 0 and f["fp8_bytes"] > 0, r
    assert b["mean_logprob_diff"] < f["mean_logprob_diff"] < 0.1, r
    assert f["argmax_agreement"] >= 0.75, r


def _assert_fp8_near_fp32(r: dict) -> None:
    b, f = r["bf16"], r["fp8"]
    assert b["fp8_bytes"] == 0 and f["fp8_bytes"] > 0, r
    assert f["mean_logprob_diff"] > b["mean_logprob_diff"]  # FP8 really ran
    assert f["mean_logprob_diff"] < 0.1, r
    assert f["argmax_agreement"] >= 0.9, r
    assert r["first_tokens_equal"] >= 0.75, r


def test_fp8_pd_modes_give_normals_tokens(worker_groups):
    """FP8 quantises each row by itself, so interleaving P and D (Fine) changes no row's
    numbers: the same greedy tokens as Normal -- at EP2/ADP2 through the alltoall backend,
    whose Normal run is also held to the fp32 bounds of the engine rows above."""
    runs = {mode: worker_groups(2).run("tests.cases_fp8:fp8_vs_reference", timeout=900,
                                         adp=2, ep=2, mode=mode,
                                         model_kw={"moe_dispatch": "alltoall"})[0]
            for mode in ("normal", "fine")}
    assert runs["fine"]["tokens"] == runs["normal"]["tokens"]
    _assert_fp8_near_fp32(runs["normal"])


def test_fp8_rollouts_beside_a_bf16_trainer(worker_groups, tmp_path):
    """GRPO with FP8 rollouts and the bf16 trainer (2 CPU ranks, engine EP2/ADP2, trainer
    DP2, routing replay on): the per-step rollout/trainer logprob gap and mismatch KL are
    reported (issue 18's metrics), larger than the same run's with bf16 rollouts."""
    rows = {}
    for fp8 in (None, "e4m3"):
        res = worker_groups(2).run(
            "colo_rollout.rl.train:run_train", timeout=600, config_path="configs/grpo_cpu.yaml",
            overrides={"rl.out_dir": str(tmp_path / str(fp8)), "model.params_dtype": "bfloat16",
                       "model.fp8": fp8, "rl.steps": 3, "engine.record_routing": True,
                       "rl.routing_replay": True}, quiet=True)
        h = res[0]["history"]
        rows[fp8] = (sum(x["logprob_gap_mean"] for x in h) / len(h),
                     max(x["logprob_gap_max"] for x in h),
                     sum(x["mismatch_kl_k3"] for x in h) / len(h))
    assert all(v == v and abs(v) < 10 for r in rows.values() for v in r), rows
    assert rows["e4m3"][0] > rows[None][0] and rows["e4m3"][1] > rows[None][1], rows


def test_door_fp8_refusals_on_an_fp8_gpu_host(monkeypatch):
    """The door's other FP8 checks, as a GPU host would see them (CUDA stubbed)."""
    from colo_rollout.config import Config, ConfigError, EngineConfig, ModelConfig, ParallelConfig
    from colo_rollout.door import check_fp8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Old GPU")
    cap = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: cap[0])

    def error(**model) -> str:
        kw = {"params_dtype": "bfloat16", "fp8": "e4m3", **model}
        par = kw.pop("parallel", ParallelConfig())
        with pytest.raises(ConfigError) as info:
            check_fp8(Config(parallel=par, model=ModelConfig(**kw)), "c.yaml")
        return str(info.value)

    check_fp8(Config(model=ModelConfig(params_dtype="bfloat16", fp8="e4m3")), "c.yaml")  # ok
    assert error(params_dtype="float32").startswith(
        "c.yaml: model.fp8: 'e4m3' needs params_dtype 'bfloat16'")
    assert error(use_te="on").startswith("c.yaml: model.use_te: 'e4m3' runs colo_rollout's")
    # every dispatch backend runs the FP8 experts (deepep's in its low-latency layout)
    check_fp8(Config(parallel=ParallelConfig(backend="nccl"),
                     model=ModelConfig(params_dtype="bfloat16", fp8="e4m3",
                                       moe_dispatch="deepep", hidden_size=2048)), "c.yaml")
    assert "model.hidden_size is 72" in error(hidden_size=72, num_attention_heads=4, head_dim=16)
    with pytest.raises(ConfigError, match="engine.moe_kernel: 'torch' is the FP8 experts' CPU"):
        check_fp8(Config(model=ModelConfig(params_dtype="bfloat16", fp8="e4m3"),
                         engine=EngineConfig(moe_kernel="torch")), "c.yaml")
    got = error(hidden_size=128, num_attention_heads=8, num_query_groups=4, head_dim=8,
                parallel=ParallelConfig(world_size=4, adp=1, ep=1))  # ATP4: 4 x 8 / 4 per rank
    assert "num_query_groups x head_dim / parallel.atp is 8" in got
    # blockwise: every FP8 GEMM dimension, the routed experts' too, a multiple of 128
    got = error(fp8_recipe="blockwise", hidden_size=256, moe_ffn_hidden_size=96)
    assert got.startswith("c.yaml: model.fp8_recipe: FP8 GEMMs (blockwise) need every "
                          "dimension in multiples of 128; model.moe_ffn_hidden_size is 96")
    check_fp8(Config(model=ModelConfig(params_dtype="bfloat16", fp8="e4m3",
                                       fp8_recipe="blockwise", hidden_size=256,
                                       num_attention_heads=8, num_query_groups=4,
                                       moe_ffn_hidden_size=128)), "c.yaml")  # ok
    # MLA at DeepSeek-V3's widths: the key/value down projection's 512 + 64 rows stay bf16
    # (no whole number of blocks); every other width still a multiple of 128
    mla = dict(params_dtype="bfloat16", fp8="e4m3", fp8_recipe="blockwise", attention="mla",
               hidden_size=256, num_attention_heads=8, num_query_groups=8, qk_layernorm=True,
               q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64,
               v_head_dim=16, moe_ffn_hidden_size=128)
    check_fp8(Config(model=ModelConfig(**mla)), "c.yaml")  # ok
    got = error(**{**mla, "q_lora_rank": 96})
    assert "model.q_lora_rank is 96" in got, got
    # model.fp8_backend te: Transformer Engine importable with the recipe supported (this
    # host has no TE: the door names the key and what to do)
    got = error(fp8_backend="te", fp8_recipe="tensorwise")
    assert got.startswith("c.yaml: model.fp8_backend: 'te': Transformer Engine's PyTorch "
                          "package is not importable here ("), got
    assert got.endswith("install transformer-engine[pytorch] (the 'te' extra) or set "
                        "model.fp8_backend: engine"), got
    import colo_rollout.config.te_support as te_support

    monkeypatch.setattr(te_support, "te_fp8_problem", lambda recipe: None)  # as where TE runs
    check_fp8(Config(model=ModelConfig(params_dtype="bfloat16", fp8="e4m3", fp8_backend="te",
                                       fp8_recipe="tensorwise")), "c.yaml")  # ok
    got = error(fp8_backend="te", fp8_recipe="blockwise", hidden_size=256,
                moe_ffn_hidden_size=96)  # TE's blockwise: the engine's experts' 128 too
    assert "model.moe_ffn_hidden_size is 96" in got, got
    cap[0] = (8, 0)
    assert "Old GPU is sm80" in error()


def test_fp8_recipe_belongs_to_its_backend():
    """model.fp8_recipe names a recipe of model.fp8_backend: tensorwise is TE's
    (Float8CurrentScaling), rowwise the engine's own; one error naming the key."""
    from colo_rollout.config import ConfigError, ModelConfig

    ModelConfig(fp8_backend="te", fp8_recipe="tensorwise")
    ModelConfig(fp8_backend="te", fp8_recipe="blockwise")
    ModelConfig(fp8_backend="engine", fp8_recipe="blockwise")
    with pytest.raises(ConfigError) as info:
        ModelConfig(fp8_recipe="tensorwise")
    assert str(info.value) == (
        "model.fp8_recipe: 'tensorwise' is not a recipe of model.fp8_backend 'engine' (its "
        "recipes: rowwise, blockwise); 'tensorwise' is Transformer Engine's "
        "Float8CurrentScaling: set model.fp8_backend: te")
    with pytest.raises(ConfigError, match="model.fp8_recipe: 'rowwise' is not a recipe of "
                       "model.fp8_backend 'te' .* Transformer Engine has no per-row FP8 recipe"):
        ModelConfig(fp8_backend="te")
    with pytest.raises(ConfigError, match="model.fp8_backend: expected one of 'engine', 'te'"):
        ModelConfig(fp8_backend="cublas")


if __name__ == "__main__":  # the interpreted run (the kernel test above starts it)
    interpreted_main(_interpreted)
