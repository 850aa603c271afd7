"""The new tokens' rotary embedding and KV write in one launch: q rotated, k rotated and written
with v into their paged-cache slots -- and, optionally, q's and k's per-head RMSNorm before.

Owns ``rope_and_store``: what ``PagedSelfAttention.forward`` does between its QKV projection (and
q/k norms, if any) and the attention kernel -- for q [T, G, n, D] (n query heads per KV group)
and k, v [T, G, D], with cos/sin [T, rot] of each token's position:

    q_out = rope(q);  k_cache[slot[t]] = rope(k[t]);  v_cache[slot[t]] = v[t]

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
``triton`` (one program per (token, group)). The kernel computes megatron's elementwise ops in
the same order with the same roundings: every product and the sum are rounded to the model
dtype as torch's bf16/fp16 ops round them (computed in fp32, rounded to nearest even), and
``rotate_half`` is the negation and the swap of halves, exact. Partial rotary (rot < D) passes
the rest of each head through.

Imports only torch (and triton when present): no megatron.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from colo_rollout.model.kernel_backend import as_dtype, pow2, rne_bf16, tl, triton


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
                         qk_norm: QKRMSNorm | None = None) -> torch.Tensor:
    """The reference: q [T, G, n, D], k and v [T, G, D] (any strides), cos and sin [T, rot]
    in q's dtype; k_cache and v_cache [slots, G, D]; slots [T] int64 -> rotated q
    [T, G * n, D] contiguous (k and v written into their slots, cast to the cache's dtype).
    ``qk_norm``: q and k normalised first, by torch's rms_norm (what the modules call)."""
    T, D = q.shape[0], q.shape[-1]
    if qk_norm is not None:
        q = F.rms_norm(q, (D,), qk_norm.q_weight, qk_norm.eps)
        k = F.rms_norm(k, (D,), qk_norm.k_weight, qk_norm.eps)
    qr = rotate(q, cos.view(T, 1, 1, -1), sin.view(T, 1, 1, -1))
    kr = rotate(k, cos.view(T, 1, -1), sin.view(T, 1, -1))
    k_cache.index_copy_(0, slots, as_dtype(kr, k_cache.dtype))
    v_cache.index_copy_(0, slots, as_dtype(v, v_cache.dtype))
    return qr.reshape(T, -1, q.shape[-1])


def triton_rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots,
                          qk_norm: QKRMSNorm | None = None) -> torch.Tensor:
    """``torch_rope_and_store`` in one Triton launch (q, k, v, caches in one dtype). CPU
    tensors run under TRITON_INTERPRET=1 only (the tests)."""
    if triton is None:
        raise RuntimeError("triton is not importable: use the torch attention backend")
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
    out = torch.empty((T, G, n, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out.view(T, G * n, D)
    upcast = not q.is_cuda  # the interpreter: round fp32 -> bf16 to nearest even by hand
    # without a norm the weight pointers are never read (HAS_NORM is a constexpr): q stands in
    qw, kw, eps = (q, q, 0.0) if qk_norm is None else qk_norm
    _rope_kv_kernel[(T, G)](
        q, k, v, cos, sin, k_cache, v_cache, slots, out, qw, kw, float(eps),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), n, D, rot,
        N_PAD=pow2(n), D_PAD=pow2(D), HAS_NORM=qk_norm is not None,
        RNE_BF16=upcast and q.dtype == torch.bfloat16, num_warps=4 if n * D >= 1024 else 2,
    )
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
                   qk_norm: QKRMSNorm | None = None):
    """``backend`` "triton" (the kernel, where ``kernel_fits``) or "torch" (the reference);
    ``qk_norm``: q's and k's RMSNorm first, in the same launch; see the module docstring."""
    if backend == "triton" and kernel_fits(q, k, v, cos, k_cache, v_cache) and (
            qk_norm is None or _norm_fits(qk_norm, q.shape[-1])):
        return triton_rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots, qk_norm)
    return torch_rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots, qk_norm)


if triton is not None:

    @triton.jit
    def _round(v, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
        """fp32 -> the model dtype, to nearest even (as torch's elementwise ops round)."""
        if RNE_BF16:
            v = rne_bf16(v)
        return v.to(dtype).to(tl.float32)

    @triton.jit
    def _rotated(base, rows, offs_d, row_mask, half, rot, D, Cos, Sin, W, eps,
                 dtype: tl.constexpr, HAS_NORM: tl.constexpr, RNE_BF16: tl.constexpr):
        """megatron's rope on heads ``base + rows[:, None] + d``: (t * cos) + (rotate_half(t) *
        sin), each op rounded; dims >= rot pass through. ``HAS_NORM``: each head (a row)
        RMS-normalised with weights W first. Returns fp32 values (exact in dtype)."""
        d = offs_d[None, :]
        dmask = row_mask[:, None] & (d < D)
        t = tl.load(base + rows[:, None] + d, mask=dmask, other=0.0).to(tl.float32)
        in_rot = d < rot
        # rotate_half: cat(-x2, x1): dim d < half reads -t[d + half], half <= d < rot t[d - half]
        partner = tl.where(d < half, d + half, d - half)
        tp = tl.load(base + rows[:, None] + partner, mask=dmask & in_rot,
                     other=0.0).to(tl.float32)
        if HAS_NORM:
            # torch's rms_norm: rstd = rsqrt(mean(t^2) + eps) over the whole head (masked
            # lanes are zeros), the mean an IEEE division by D as torch's; then
            # (t * rstd) * w rounded once. The partners are re-read raw and normalised by
            # the same ops, so they are the normalised row's own values.
            ss = tl.sum(t * t, axis=1)
            rstd = tl.rsqrt(tl.math.div_rn(ss, tl.zeros_like(ss) + D) + eps)[:, None]
            w = tl.load(W + d, mask=d < D, other=0.0).to(tl.float32)
            wp = tl.load(W + partner, mask=in_rot, other=0.0).to(tl.float32)
            t = _round((t * rstd) * w, dtype, RNE_BF16)
            tp = _round((tp * rstd) * wp, dtype, RNE_BF16)
        tp = tl.where(d < half, -tp, tp)
        c = tl.load(Cos + d, mask=in_rot, other=0.0).to(tl.float32)
        s = tl.load(Sin + d, mask=in_rot, other=0.0).to(tl.float32)
        r = _round(_round(t * c, dtype, RNE_BF16) + _round(tp * s, dtype, RNE_BF16), dtype,
                   RNE_BF16)
        return tl.where(in_rot, r, t)

    @triton.jit
    def _rope_kv_kernel(Q, K, V, Cos, Sin, KC, VC, Slots, Out, QW, KW, eps,
                        sq_t, sq_g, sq_h, sk_t, sk_g, sv_t, sv_g, sc_t, skc_s, skc_g,
                        svc_s, svc_g, n, D, rot,
                        N_PAD: tl.constexpr, D_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
                        RNE_BF16: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        dtype = Out.dtype.element_ty
        half = rot // 2
        offs_d = tl.arange(0, D_PAD)
        heads = tl.arange(0, N_PAD)
        hmask = heads < n
        cos_row = Cos + t * sc_t
        sin_row = Sin + t * sc_t
        qv = _rotated(Q + t * sq_t + g * sq_g, heads * sq_h, offs_d, hmask, half, rot, D,
                      cos_row, sin_row, QW, eps, dtype, HAS_NORM, RNE_BF16)
        out_rows = ((t * tl.num_programs(1) + g) * n + heads) * D
        tl.store(Out + out_rows[:, None] + offs_d[None, :], qv.to(dtype),
                 mask=hmask[:, None] & (offs_d[None, :] < D))
        one = tl.zeros([1], dtype=tl.int64)  # k: one head
        kv = _rotated(K + t * sk_t + g * sk_g, one, offs_d, one == 0, half, rot, D,
                      cos_row, sin_row, KW, eps, dtype, HAS_NORM, RNE_BF16)
        slot = tl.load(Slots + t).to(tl.int64)
        dmask = offs_d[None, :] < D
        tl.store(KC + slot * skc_s + g * skc_g + offs_d[None, :], kv.to(dtype), mask=dmask)
        vv = tl.load(V + t * sv_t + g * sv_g + offs_d[None, :], mask=dmask, other=0.0)
        tl.store(VC + slot * svc_s + g * svc_g + offs_d[None, :], vv, mask=dmask)
