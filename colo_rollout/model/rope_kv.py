"""The new tokens' rotary embedding and KV write in one launch: q rotated, k rotated and written
with v into their paged-cache slots -- and, optionally, q's and k's per-head RMSNorm before.

Owns ``rope_and_store``: what ``PagedSelfAttention.forward`` does between its QKV projection (and
q/k norms, if any) and the attention kernel -- for q [T, G, n, D] (n query heads per KV group)
and k, v [T, G, D], with cos/sin [T, rot] of each token's position:

    q_out = rope(q);  k_cache[slot[t]] = rope(k[t]);  v_cache[slot[t]] = v[t]

With ``positions`` [T], cos and sin are whole tables [P, rot] and token t's angles are row
``positions[t]`` (the kernel reads the row itself: no per-step gather of the angles, and a
captured graph reads the positions buffer on replay). With ``kv_out`` (two [T, G, D]
tensors) the rotated k and v are also written there: a dense attention call over the step's
own rows then reads K and V without gathering them from the cache, and contiguously (on one
H200 FlashAttention-4 ran a 4k causal call 1.15x faster on contiguous K/V than on the QKV
projection's strided views: docs/benchmarks.md session 27).

With ``qk_norm`` (a ``QKRMSNorm``: Qwen3's q/k norms when they are torch's RMSNorm) q and k are
first normalised per head as ``F.rms_norm(x, (D,), weight, eps)`` computes it -- the torch
path calls exactly that, so it is the modules' own result. What that is (torch 2.14: its
composite path in ATen's layer_norm.cpp, and matched bitwise on CPU where the fused kernel
runs, model-dtype weights): rstd = rsqrt(mean(x^2) + eps) in fp32 from the widened inputs,
then (x * rstd) * weight in fp32, rounded to the model dtype once -- no rounding before the
weight. The kernel computes the same ops in that order on the head it holds (the mean an
IEEE division by D); the one difference is the order of the sum of squares (a tree in the
kernel). On a GPU, torch's CUDA RMSNorm kernel and Triton's rsqrt (an approximation there,
1 / sqrt in the interpreter) are their own: the two have not been compared on a GPU yet.
LayerNorm q/k norms (and TE's norms) are not fused: they stay modules.

Two backends, bitwise the same result: ``torch`` (``rotate`` -- megatron's
``_apply_rotary_pos_emb_bshd`` op by op -- and two ``index_copy_``: ~8 kernels per layer) and
``triton`` (one program per token, or per (token, group) under ``WHOLE_TOKEN_FROM`` tokens).
The kernel computes megatron's elementwise ops in the same order with the same roundings:
every product and the sum are rounded to the model dtype as torch's bf16/fp16 ops round
them (computed in fp32, rounded to nearest even), and ``rotate_half`` is the negation and the
swap of halves, exact. Partial rotary (rot < D) passes
the rest of each head through. The launch is compiled without floating-point contraction
(``enable_fp_fusion=False``): with it, on the GPU, ptxas fused a product into the sum across
the casts that round it (~24% of q's elements one bf16 step off megatron's; docs/
benchmarks.md sessions 34 and 37); without it the rotation is bitwise megatron's on the GPU
too (``scripts/gpu_rope_bitwise.py``). With the q/k norms a few elements in a million still
differ by one step (the sum of squares' order and the rsqrt, above).

Imports only torch (and triton when present): no megatron.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from colo_rollout.model.bound_kernel import BoundKernel, all_aligned
from colo_rollout.model.kernel_backend import as_dtype, pow2, rne_bf16, tl, triton


# from this many tokens one program takes all of a token's groups (tests lower it)
WHOLE_TOKEN_FROM = 256


class QKRMSNorm(NamedTuple):
    """The per-head RMSNorms of q and k fused into ``rope_and_store``: weights [D] (any float
    dtype, contiguous) and the one eps both norms use."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron's ``_apply_rotary_pos_emb_bshd`` (not interleaved, mscale 1) on t [..., D]
    with angles cos, sin [..., rot] broadcasting over t's head dims: the same elementwise ops
    on the same values, so bitwise the same -- also when q's and k's heads go through it
    together."""
    rot = cos.shape[-1]
    t_pass = None
    if rot != t.shape[-1]:
        t, t_pass = t[..., :rot], t[..., rot:]
    x1, x2 = torch.chunk(t, 2, dim=-1)
    t = (t * cos) + (torch.cat((-x2, x1), dim=-1) * sin)
    return t if t_pass is None else torch.cat((t, t_pass), dim=-1)


def torch_rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots,
                         qk_norm: QKRMSNorm | None = None, positions=None,
                         kv_out: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> torch.Tensor:
    """The reference: q [T, G, n, D], k and v [T, G, D] (any strides), cos and sin [T, rot]
    in q's dtype (or tables [P, rot] read at ``positions`` [T]); k_cache and v_cache
    [slots, G, D]; slots [T] int64 -> rotated q [T, G * n, D] contiguous (k and v written
    into their slots, cast to the cache's dtype; with ``kv_out`` the rotated k and v into
    those [T, G, D] too).
    ``qk_norm``: q and k normalised first, by torch's rms_norm (what the modules call)."""
    T, D = q.shape[0], q.shape[-1]
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    if qk_norm is not None:
        q = F.rms_norm(q, (D,), qk_norm.q_weight, qk_norm.eps)
        k = F.rms_norm(k, (D,), qk_norm.k_weight, qk_norm.eps)
    qr = rotate(q, cos.view(T, 1, 1, -1), sin.view(T, 1, 1, -1))
    kr = rotate(k, cos.view(T, 1, -1), sin.view(T, 1, -1))
    k_cache.index_copy_(0, slots, as_dtype(kr, k_cache.dtype))
    v_cache.index_copy_(0, slots, as_dtype(v, v_cache.dtype))
    if kv_out is not None:
        kv_out[0].copy_(kr)
        kv_out[1].copy_(v)
    return qr.reshape(T, -1, q.shape[-1])


def triton_rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots,
                          qk_norm: QKRMSNorm | None = None, positions=None,
                          kv_out: tuple[torch.Tensor, torch.Tensor] | None = None
                          ) -> torch.Tensor:
    """``torch_rope_and_store`` in one Triton launch (q, k, v, caches in one dtype). CPU
    tensors run under TRITON_INTERPRET=1 only (the tests)."""
    T, G, n, D = q.shape
    rot = cos.shape[-1]
    if not (q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == cos.dtype):
        raise ValueError(f"rope kernel: one dtype for q, k, v, caches and angles, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}, {k_cache.dtype}, {cos.dtype}")
    if min(q.stride(-1), k.stride(-1), v.stride(-1), cos.stride(-1)) != 1 \
            or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or rot % 2:
        raise ValueError("rope kernel: the head dims must be contiguous and rot even")
    if qk_norm is not None and not _norm_fits(qk_norm, D):
        raise ValueError("rope kernel: the q/k norm weights must be contiguous [D]")
    if kv_out is not None and not _out_fits(kv_out, k):
        raise ValueError("rope kernel: kv_out must be two [T, G, D] tensors of k's dtype with "
                         "contiguous head dims")
    return _launch(q, k, v, cos, sin, k_cache, v_cache, slots, qk_norm, positions, kv_out)


def _out_fits(kv_out, k: torch.Tensor) -> bool:
    return all(t.shape == k.shape and t.dtype == k.dtype and t.stride(-1) == 1
               for t in kv_out)


def _launch(q, k, v, cos, sin, k_cache, v_cache, slots, qk_norm, positions, kv_out):
    """The kernel on tensors ``triton_rope_and_store`` (or ``kernel_fits``) has checked: one
    launch, every group of each token in one program from WHOLE_TOKEN_FROM tokens."""
    if triton is None:
        raise RuntimeError("triton is not importable: use the torch attention backend")
    T, G, n, D = q.shape
    rot = cos.shape[-1]
    out = torch.empty((T, G, n, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out.view(T, G * n, D)
    upcast = not q.is_cuda  # the interpreter: round fp32 -> bf16 to nearest even by hand
    # without a norm the weight pointers are never read (HAS_NORM is a constexpr): q stands in
    qw, kw, eps = (q, q, 0.0) if qk_norm is None else qk_norm
    if positions is not None and (positions.dtype != torch.int64 or positions.shape != (T,)):
        raise ValueError("rope kernel: positions must be int64 [T]")
    # one program per token and GB groups: all their q heads as one [heads, rot / 2] block per
    # half. Many tokens (P): every group in one program (per-(token, group) programs of
    # Qwen3's 2 KB left the SMs underfed); few (D): a program per group, for parallelism.
    half = rot // 2
    GB = G if T >= WHOLE_TOKEN_FROM else 1
    block = pow2(GB * n) * pow2(half)
    pos = slots if positions is None else positions
    # without kv_out its pointers are never read (STORE_KV is a constexpr): k and v stand in
    ko, vo = (k, v) if kv_out is None else kv_out
    ints = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), ko.stride(0), ko.stride(1), vo.stride(0),
            vo.stride(1), G, GB, n, D, half)
    consts = (pow2(GB * n), pow2(GB), pow2(half), pow2(D), rot < D, qk_norm is not None,
              positions is not None, kv_out is not None,
              upcast and q.dtype == torch.bfloat16)
    warps = 8 if block >= 4096 else 4 if block >= 1024 else 2
    # the bound variant's key: every integer and constexpr as it is (constants of the model's
    # layout, one variant per model and regime) and the dtypes; pointers not all 16-byte
    # aligned go through Triton's own launch (key None)
    key = ((q.dtype, qw.dtype, ints, consts, warps)
           if all_aligned(q, k, v, cos, sin, k_cache, v_cache, slots, qw, kw, pos, ko, vo)
           else None)
    _ROPE_KV(key, (T, G // GB), (q, k, v, cos, sin, k_cache, v_cache, slots, out, qw, kw,
                                 float(eps), pos, ko, vo, *ints, *consts), warps)
    return out.view(T, G * n, D)


def kernel_fits(q, k, v, cos, k_cache, v_cache) -> bool:
    """Whether the kernel takes these tensors: one dtype throughout (a cache in another dtype
    goes through the torch path's cast), contiguous head dims, an even rotary width."""
    same = q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == cos.dtype
    return (same and cos.shape[-1] % 2 == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1)
            == cos.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1)


def _norm_fits(qk_norm: QKRMSNorm, D: int) -> bool:
    return all(w.shape == (D,) and w.stride(-1) == 1 and w.is_floating_point()
               for w in (qk_norm.q_weight, qk_norm.k_weight))


def rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots, backend: str = "torch",
                   qk_norm: QKRMSNorm | None = None, positions=None,
                   kv_out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """``backend`` "triton" (the kernel, where ``kernel_fits``) or "torch" (the reference);
    ``qk_norm``: q's and k's RMSNorm first, in the same launch; ``positions``: cos and sin
    are tables read at them; ``kv_out``: the rotated k and v written there too; see the
    module docstring."""
    if backend == "triton" and kernel_fits(q, k, v, cos, k_cache, v_cache) and (
            qk_norm is None or _norm_fits(qk_norm, q.shape[-1])) and (
            kv_out is None or _out_fits(kv_out, k)):
        # checked here: the launch without triton_rope_and_store's second look (host time on
        # P's critical path, every layer)
        return _launch(q, k, v, cos, sin, k_cache, v_cache, slots, qk_norm, positions, kv_out)
    return torch_rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots, qk_norm,
                                positions, kv_out)


if triton is not None:

    @triton.jit
    def _round(v, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
        """fp32 -> the model dtype, to nearest even (as torch's elementwise ops round).
        ``RNE_BF16``: by bit arithmetic alone (the rounding bias, then the low half cleared:
        a value bf16 holds exactly, which the casts after it keep on any target)."""
        if RNE_BF16:
            bits = rne_bf16(v).to(tl.uint32, bitcast=True) & 0xFFFF0000
            v = bits.to(tl.float32, bitcast=True)
        return v.to(dtype).to(tl.float32)

    @triton.jit
    def _rope_rows(src, rows, hmask, half, D, Cos, Sin, W, eps, dtype: tl.constexpr,
                   HALF_PAD: tl.constexpr, D_PAD: tl.constexpr, PASS: tl.constexpr,
                   HAS_NORM: tl.constexpr, RNE_BF16: tl.constexpr):
        """megatron's rope on the heads at ``src + rows[:, None] + d``: (t * cos) +
        (rotate_half(t) * sin), each op rounded, on the two halves of the rotary dims loaded
        once each -- rotate_half is cat(-x2, x1), so the first half is x1 * c + (-x2) * s and
        the second x2 * c + x1 * s; dims >= rot (``PASS``) pass through. ``HAS_NORM``: each
        head (a row) RMS-normalised with weights W first: torch's rms_norm -- rstd =
        rsqrt(mean(t^2) + eps) over the whole head, the mean an IEEE division by D, then
        (t * rstd) * w rounded once. Returns the halves and the passed dims, fp32 values
        exact in dtype (the passed ones zeros without ``PASS``)."""
        j = tl.arange(0, HALF_PAD)[None, :]
        m = hmask[:, None] & (j < half)
        x1 = tl.load(src + rows[:, None] + j, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + rows[:, None] + half + j, mask=m, other=0.0).to(tl.float32)
        p = 2 * half + tl.arange(0, D_PAD)[None, :]
        xp = tl.load(src + rows[:, None] + p, mask=hmask[:, None] & (p < D) & PASS,
                     other=0.0).to(tl.float32)
        if HAS_NORM:
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xp * xp, axis=1)
            rstd = tl.rsqrt(tl.math.div_rn(ss, tl.zeros_like(ss) + D) + eps)[:, None]
            w1 = tl.load(W + j, mask=j < half, other=0.0).to(tl.float32)
            w2 = tl.load(W + half + j, mask=j < half, other=0.0).to(tl.float32)
            wp = tl.load(W + p, mask=(p < D) & PASS, other=0.0).to(tl.float32)
            x1 = _round((x1 * rstd) * w1, dtype, RNE_BF16)
            x2 = _round((x2 * rstd) * w2, dtype, RNE_BF16)
            xp = _round((xp * rstd) * wp, dtype, RNE_BF16)
        c1 = tl.load(Cos + j, mask=j < half, other=0.0).to(tl.float32)
        s1 = tl.load(Sin + j, mask=j < half, other=0.0).to(tl.float32)
        c2 = tl.load(Cos + half + j, mask=j < half, other=0.0).to(tl.float32)
        s2 = tl.load(Sin + half + j, mask=j < half, other=0.0).to(tl.float32)
        o1 = _round(_round(x1 * c1, dtype, RNE_BF16) + _round(-x2 * s1, dtype, RNE_BF16),
                    dtype, RNE_BF16)
        o2 = _round(_round(x2 * c2, dtype, RNE_BF16) + _round(x1 * s2, dtype, RNE_BF16),
                    dtype, RNE_BF16)
        return o1, o2, xp

    @triton.jit
    def _store_rows(dst, rows, o1, o2, xp, hmask, half, D, dtype: tl.constexpr,
                    HALF_PAD: tl.constexpr, D_PAD: tl.constexpr, PASS: tl.constexpr):
        j = tl.arange(0, HALF_PAD)[None, :]
        m = hmask[:, None] & (j < half)
        tl.store(dst + rows[:, None] + j, o1.to(dtype), mask=m)
        tl.store(dst + rows[:, None] + half + j, o2.to(dtype), mask=m)
        if PASS:
            p = 2 * half + tl.arange(0, D_PAD)[None, :]
            tl.store(dst + rows[:, None] + p, xp.to(dtype), mask=hmask[:, None] & (p < D))

    @triton.jit
    def _rope_kv_kernel(Q, K, V, Cos, Sin, KC, VC, Slots, Out, QW, KW, eps, Pos, KO, VO,
                        sq_t, sq_g, sq_h, sk_t, sk_g, sv_t, sv_g, sc_t, skc_s, skc_g,
                        svc_s, svc_g, sko_t, sko_g, svo_t, svo_g, G, GB, n, D, half,
                        H_PAD: tl.constexpr, G_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                        D_PAD: tl.constexpr, PASS: tl.constexpr, HAS_NORM: tl.constexpr,
                        TABLES: tl.constexpr, STORE_KV: tl.constexpr,
                        RNE_BF16: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        dtype = Out.dtype.element_ty
        row = tl.load(Pos + t).to(tl.int64) if TABLES else t  # the angles' row
        cos_row = Cos + row * sc_t
        sin_row = Sin + row * sc_t
        g0 = tl.program_id(1).to(tl.int64) * GB  # this program's first group
        # q: head h = g * n + j of the token, from the projection's layout into Out [T, G*n, D]
        hh = g0 * n + tl.arange(0, H_PAD).to(tl.int64)
        hmask = hh < (g0 + GB) * n
        o1, o2, xp = _rope_rows(Q + t * sq_t, (hh // n) * sq_g + (hh % n) * sq_h, hmask, half,
                                D, cos_row, sin_row, QW, eps, dtype, HALF_PAD, D_PAD, PASS,
                                HAS_NORM, RNE_BF16)
        _store_rows(Out + t * G * n * D, hh * D, o1, o2, xp, hmask, half, D, dtype, HALF_PAD,
                    D_PAD, PASS)
        # k: one head per group, rotated into its cache slot
        gg = g0 + tl.arange(0, G_PAD).to(tl.int64)
        gmask = gg < g0 + GB
        slot = tl.load(Slots + t).to(tl.int64)
        o1, o2, xp = _rope_rows(K + t * sk_t, gg * sk_g, gmask, half, D, cos_row, sin_row,
                                KW, eps, dtype, HALF_PAD, D_PAD, PASS, HAS_NORM, RNE_BF16)
        _store_rows(KC + slot * skc_s, gg * skc_g, o1, o2, xp, gmask, half, D, dtype,
                    HALF_PAD, D_PAD, PASS)
        if STORE_KV:  # the dense calls' K
            _store_rows(KO + t * sko_t, gg * sko_g, o1, o2, xp, gmask, half, D, dtype,
                        HALF_PAD, D_PAD, PASS)
        d = tl.arange(0, D_PAD)[None, :]
        dm = gmask[:, None] & (d < D)
        vv = tl.load(V + t * sv_t + gg[:, None] * sv_g + d, mask=dm, other=0.0)
        tl.store(VC + slot * svc_s + gg[:, None] * svc_g + d, vv, mask=dm)
        if STORE_KV:  # ... and V
            tl.store(VO + t * svo_t + gg[:, None] * svo_g + d, vv, mask=dm)


# the rope launch through its bound variant (model/bound_kernel.py): P's critical path; no
# FMA contraction (the roundings above are megatron's only when each product is rounded
# before the sum)
_ROPE_KV = (BoundKernel(_rope_kv_kernel, enable_fp_fusion=False) if triton is not None
            else None)
