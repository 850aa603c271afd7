"""The rotary embedding and KV write of one attention layer (model/rope_kv.py): the torch path
bitwise against megatron's ``_apply_rotary_pos_emb_bshd`` on q and k with the cache slots
written, and the one-launch Triton kernel bitwise against the torch path, run by Triton's CPU
interpreter in a subprocess (tests/interpreted.py; skipped when triton does not import):
fp32 and bf16, full and partial rotary, q as a strided view of the QKV projection, head
counts and head dims that are not powers of two.

With the q/k RMSNorm fused in (``QKRMSNorm``): the torch path bitwise the modules the
attention layer would run (torch's RMSNorm on q's heads and on k, then the rope), and the
kernel within NORM_EPS of the torch path -- the order of its sum of squares is the one
difference. Measured (interpreter vs torch 2.14 on CPU): the bf16 cases below are bitwise,
as were 48-token sweeps of bf16 heads of 24, 80 and 128 (one earlier draw of 33 tokens x 6
heads of 80 had one k element one bf16 ulp apart, 0.002 at its magnitude); fp16, 1 element of
24576 by 0.02 eps of its head; fp32, where nothing rounds the rstd difference away, 0.86 eps
of the head in case 4 and up to 2.1 in a 48-token sweep. A wrong weight, eps or a missing
norm moves values by orders of magnitude more."""

from __future__ import annotations


import pytest
import torch

from colo_rollout.model import rope_kv
from colo_rollout.model.attention import PagedSelfAttention
from tests.interpreted import HAS_TRITON, interpreted_main

# (tokens, KV groups, q heads per group, head dim, rotary dim, dtype)
CASES = [
    (1, 1, 1, 16, 16, torch.float32),
    (9, 2, 3, 16, 16, torch.bfloat16),
    (13, 4, 4, 24, 16, torch.bfloat16),  # partial rotary
    (6, 1, 8, 80, 80, torch.bfloat16),  # head dim not a power of two
    (5, 3, 2, 32, 8, torch.float32),
    (2, 2, 4, 128, 128, torch.bfloat16),  # Qwen3's head dim: the normed cases' long sum
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


def _run(fn, qkv, slots, cos, sin, qk_norm=None):
    T, G, n2, D = qkv.shape
    n = n2 - 2
    kc = torch.full((3 * T, G, D), 7.0, dtype=qkv.dtype)
    vc = torch.full((3 * T, G, D), 7.0, dtype=qkv.dtype)
    extra = {} if qk_norm is None else {"qk_norm": qk_norm}
    q = fn(qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1], cos, sin, kc, vc, slots, **extra)
    return q, kc, vc


# fused norm, kernel vs torch path: per head, the largest difference in units of the dtype's
# epsilon times the head's largest value (a relative measure: the rope's sums cancel, so an
# element near zero can be many of its own ulps off when its inputs are one ulp off)
NORM_EPS = 4.0


def _norms(i):
    """Qwen3's q/k norms for case i: torch's RMSNorm over the head dim, weights around 1 (not
    1: a weight applied to the wrong head or dim must show), eps 1e-6, in the model dtype."""
    D, dtype = CASES[i][3], CASES[i][5]
    g = torch.Generator().manual_seed(50 + i)
    mods = []
    for _ in range(2):
        m = torch.nn.RMSNorm(D, eps=1e-6).to(dtype)
        with torch.no_grad():
            m.weight.copy_(1 + 0.3 * torch.randn(D, generator=g))
        mods.append(m)
    return mods


def _scaled_case(i, tokens: int | None = None):
    """Case i with the heads at magnitudes 1e-2 .. 1e2 (a norm that matters); its first
    ``tokens`` tokens only, if given (the interpreter's time is per token)."""
    qkv, slots, freqs, cos, sin = _case(i)
    if tokens is not None:
        qkv, cos, sin = qkv[:tokens], cos[:tokens], sin[:tokens]
        slots = slots[:tokens].argsort().argsort() * 3  # distinct, within _run's 3 * T slots
    T, G, n2, _ = qkv.shape
    scale = torch.logspace(-2, 2, T * G * n2).view(T, G, n2, 1)
    return (qkv.float() * scale).to(qkv.dtype), slots, cos, sin


def _head_eps(a, b, dtype) -> float:
    """max over heads (the last dim) of max |a - b| / (eps(dtype) * max |b|)."""
    a, b = a.float(), b.float()
    scale = b.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    return ((a - b).abs() / scale).max().item() / torch.finfo(dtype).eps


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


@pytest.mark.parametrize("i", range(len(CASES)))
def test_fused_norm_torch_path_is_the_modules_then_the_rope(i):
    qkv, slots, cos, sin = _scaled_case(i)
    T, G, n2, D = qkv.shape
    n = n2 - 2
    qn, kn = _norms(i)
    # what PagedSelfAttention.forward runs without the fusion
    with torch.inference_mode():
        q = qn(qkv[:, :, :n].reshape(T, G * n, D)).view(T, G, n, D)
        k = kn(qkv[:, :, n].contiguous())
        kc = torch.full((3 * T, G, D), 7.0, dtype=qkv.dtype)
        vc = kc.clone()
        want = (rope_kv.torch_rope_and_store(q, k, qkv[:, :, n + 1], cos, sin, kc, vc, slots),
                kc, vc)
        got = _run(rope_kv.torch_rope_and_store, qkv, slots, cos, sin,
                   rope_kv.QKRMSNorm(qn.weight, kn.weight, qn.eps))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_only_torch_rmsnorm_q_k_norms_are_fused():
    from types import SimpleNamespace

    D = 16
    rms = [torch.nn.RMSNorm(D, eps=1e-6) for _ in range(2)]
    fused = PagedSelfAttention._fused_qk_norm
    got = fused(SimpleNamespace(q_layernorm=rms[0], k_layernorm=rms[1], head_dim=D))
    assert got is not None and got.q_weight is rms[0].weight and got.eps == 1e-6
    for q_norm, k_norm in [(None, None), (torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)),
                           (rms[0], torch.nn.RMSNorm(D, eps=1e-5)),  # two eps
                           (rms[0], torch.nn.RMSNorm(D, eps=None)),
                           (rms[0], torch.nn.RMSNorm(D, eps=1e-6, elementwise_affine=False)),
                           (torch.nn.RMSNorm(2 * D, eps=1e-6), rms[1])]:  # not the head dim
        assert fused(SimpleNamespace(q_layernorm=q_norm, k_layernorm=k_norm, head_dim=D)) is None


def test_fused_norm_weights_the_kernel_cannot_read_take_the_torch_path():
    qkv, slots, cos, sin = _scaled_case(1)
    qn, kn = _norms(1)
    D = qkv.shape[-1]
    w2 = torch.stack([qn.weight.detach()] * 2, dim=1)[:, 0]  # a strided view [D]
    assert w2.stride(-1) != 1
    norm = rope_kv.QKRMSNorm(w2, kn.weight.detach(), 1e-6)
    # backend triton on CPU tensors outside the interpreter: only the torch path can run
    got = _run(lambda *a, **kw: rope_kv.rope_and_store(*a, backend="triton", **kw), qkv, slots,
               cos, sin, norm)
    want = _run(rope_kv.torch_rope_and_store, qkv, slots, cos, sin, norm)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and D == w2.shape[0]


def test_kernel_takes_only_one_dtype_throughout():
    qkv, slots, _, cos, sin = _case(1)
    n = qkv.shape[2] - 2
    kc32 = torch.zeros(27, qkv.shape[1], qkv.shape[3])  # an fp32 cache: the torch path's cast
    assert not rope_kv.kernel_fits(qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1], cos, kc32,
                                   kc32)
    q = rope_kv.rope_and_store(qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1], cos, sin, kc32,
                               kc32.clone(), slots, backend="triton")
    assert q.dtype == qkv.dtype and kc32[slots].abs().sum() > 0


def _tabled(i):
    """Case i as the model runs it: the angles as whole tables [P, rot] (model.rope_tables)
    read at the positions, and the rotated k and the v into the dense calls' rows (kv_out)."""
    T, G, n, D, rot, dtype = CASES[i]
    g = torch.Generator().manual_seed(i)
    table = torch.randn(64, 1, 1, rot, generator=g)
    pos = torch.randint(0, 64, (T,), generator=g)
    qkv, slots, _, cos, sin = _case(i)
    f = table.view(64, rot)
    return qkv, slots, pos, (torch.cos(f).to(dtype), torch.sin(f).to(dtype)), (cos, sin)


def _run_tabled(fn, i):
    """(q, k cache, v cache, kv_out's k, kv_out's v) of ``fn`` with tables and kv_out on
    case i."""
    qkv, slots, pos, (cos_t, sin_t), _ = _tabled(i)
    T, G, _, D = qkv.shape
    kv_out = (torch.full((T, G, D), 5.0, dtype=qkv.dtype),
              torch.full((T, G, D), 5.0, dtype=qkv.dtype))
    qkv_before = qkv.clone()
    q, kc, vc = _run(lambda *a: fn(*a, positions=pos, kv_out=kv_out), qkv, slots, cos_t,
                     sin_t)
    assert torch.equal(qkv, qkv_before)  # the QKV rows are only read
    return q, kc, vc, *kv_out


@pytest.mark.parametrize("i", range(len(CASES)))
def test_angle_tables_and_the_dense_rows_change_nothing_else(i):
    """Tables read at the positions give the per-row angles' result bitwise; kv_out holds
    the rotated k and the v (the cache's rows) and nothing else is different."""
    qkv, slots, pos, _, (cos, sin) = _tabled(i)
    want = _run(rope_kv.torch_rope_and_store, qkv, slots, cos, sin)
    q, kc, vc, k_rows, v_rows = _run_tabled(rope_kv.torch_rope_and_store, i)
    assert torch.equal(q, want[0]) and torch.equal(kc, want[1]) and torch.equal(vc, want[2])
    assert torch.equal(k_rows, kc[slots]) and torch.equal(v_rows, vc[slots])
    assert not torch.equal(k_rows, qkv[:, :, qkv.shape[2] - 2])  # (rotated: not the input)


def _interpreted() -> list[str]:
    fails = []
    for whole in (rope_kv.WHOLE_TOKEN_FROM, 1):  # a program per group; all groups in one
        rope_kv.WHOLE_TOKEN_FROM = whole
        for i in range(len(CASES)):  # tables + write-back, kernel vs torch path
            ref = _run_tabled(rope_kv.torch_rope_and_store, i)
            got = _run_tabled(rope_kv.triton_rope_and_store, i)
            for name, a, b in zip(("q", "k cache", "v cache", "k rows", "v rows"), got,
                                  ref):
                if not torch.equal(a, b):
                    fails.append(f"tabled case {i}, whole tokens from {whole}: {name} differs")
    for i in range(len(CASES)):
        qkv, slots, _, cos, sin = _case(i)
        ref = _run(rope_kv.torch_rope_and_store, qkv, slots, cos, sin)
        got = _run(rope_kv.triton_rope_and_store, qkv, slots, cos, sin)
        for name, a, b in zip(("q", "k cache", "v cache"), got, ref):
            if a.shape != b.shape or not torch.equal(a, b):
                diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "-"
                fails.append(f"case {i}: {name} differs (max {diff})")
    for i in range(len(CASES)):
        qkv, slots, cos, sin = _scaled_case(i, tokens=3)
        qn, kn = _norms(i)
        norm = rope_kv.QKRMSNorm(qn.weight.detach(), kn.weight.detach(), qn.eps)
        ref = _run(rope_kv.torch_rope_and_store, qkv, slots, cos, sin, norm)
        got = _run(rope_kv.triton_rope_and_store, qkv, slots, cos, sin, norm)
        for name, a, b in zip(("q", "k cache", "v cache"), got, ref):
            gap = _head_eps(a, b, qkv.dtype)
            bad = gap > NORM_EPS if name != "v cache" else not torch.equal(a, b)
            print(f"normed case {i}: {name} {int((a != b).sum())} of {a.numel()} differ, "
                  f"max {gap:.2f} eps of the head")
            if bad:
                fails.append(f"normed case {i}: {name} {gap:.2f} eps of the head from the "
                             "torch path")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_matches_torch_path_bitwise_interpreted(interpreted):
    interpreted.check(__file__)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON,
                    reason="needs a GPU and triton")
@pytest.mark.parametrize("whole", [1, 1 << 30])
def test_kernel_is_the_torch_path_bitwise_on_the_gpu(whole):
    """The compiled kernel (no FMA contraction: rope_kv's launch options) against the torch
    path on the GPU, every case at 512 tokens, both program layouts, angle tables and dense
    rows: bitwise (with FP fusion on, ~24% of q's elements were one bf16 step off)."""
    before = rope_kv.WHOLE_TOKEN_FROM
    rope_kv.WHOLE_TOKEN_FROM = whole
    try:
        for i, (_, G, n, D, rot, dtype) in enumerate(CASES):
            g = torch.Generator(device="cuda").manual_seed(i)
            T = 512
            qkv = torch.randn(T, G, n + 2, D, device="cuda", generator=g).to(dtype)
            ang = torch.randn(4096, rot, device="cuda", generator=g)
            cos, sin = torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)
            pos = torch.randperm(4096, device="cuda", generator=g)[:T]
            slots = torch.randperm(2 * T, device="cuda", generator=g)[:T]
            outs = []
            for fn in (rope_kv.torch_rope_and_store, rope_kv.triton_rope_and_store):
                kc = torch.zeros(2 * T, G, D, device="cuda", dtype=dtype)
                vc = torch.zeros_like(kc)
                rows = (torch.empty(T, G, D, device="cuda", dtype=dtype),
                        torch.empty(T, G, D, device="cuda", dtype=dtype))
                q = fn(qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1], cos, sin, kc, vc, slots,
                       positions=pos, kv_out=rows)
                outs.append((q, kc, vc, *rows))
            for name, a, b in zip(("q", "k cache", "v cache", "k rows", "v rows"), *outs):
                assert torch.equal(a, b), (f"case {i} ({dtype}, whole tokens from {whole}): "
                                           f"{name}: {int((a != b).sum())} elements differ")
    finally:
        rope_kv.WHOLE_TOKEN_FROM = before


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)


def test_yarn_tables_are_the_forwards_angles_times_the_concentration_factor():
    """YaRN (Qwen3's long-context RoPE): the model's whole tables (what the rope kernel reads
    on a GPU) hold, at every position, bitwise the angles a forward computes (RopeAngles, the
    CPU path) -- both scaled by megatron's mscale in fp32 before the cast, as its
    ``_apply_rotary_pos_emb_bshd`` does; and that factor is transformers' attention factor."""
    import math
    import types

    from colo_rollout.config.schema import ModelConfig
    from colo_rollout.model.model import InferenceGPT, rotary_embedding
    from colo_rollout.runtime.cpu_compat import install_cpu_compat

    install_cpu_compat()  # megatron's YaRN moves its frequencies to the current device
    cfg = ModelConfig(head_dim=32, num_attention_heads=2, hidden_size=64,
                      max_position_embeddings=256, rope_scaling="yarn", rope_scaling_factor=4.0,
                      yarn_original_max_position_embeddings=64)
    for dtype in (torch.bfloat16, torch.float32):
        fake = types.SimpleNamespace(_rope=None, device=torch.device("cpu"), cfg=cfg,
                                     rotary_pos_emb=rotary_embedding(cfg), _rope_tables={},
                                     dtype=dtype, _rope_mscale=1.0)
        for name in ("rope_table", "rope_tables", "rope_angles"):
            setattr(fake, name, types.MethodType(getattr(InferenceGPT, name), fake))
        assert fake._rope is None and fake.rope_table().shape == (256, 1, 1, 32)
        assert fake._rope_mscale == pytest.approx(0.1 * math.log(4.0) + 1)
        pos = torch.tensor([0, 1, 63, 64, 200, 255])
        cos, sin = fake.rope_angles(pos).cos_sin(dtype, 2)
        cos_t, sin_t = fake.rope_tables(dtype)
        assert torch.equal(cos_t[pos], cos) and torch.equal(sin_t[pos], sin)
        assert cos[0].float().max() == pytest.approx(fake._rope_mscale, rel=1e-2)
