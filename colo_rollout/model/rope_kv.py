"""The new tokens' rotary embedding and KV write in one launch: q rotated, k rotated and written
with v into their paged-cache slots.

Owns ``rope_and_store``: what ``PagedSelfAttention.forward`` does between its QKV projection (and
q/k norms, if any) and the attention kernel -- for q [T, G, n, D] (n query heads per KV group)
and k, v [T, G, D], with cos/sin [T, rot] of each token's position:

    q_out = rope(q);  k_cache[slot[t]] = rope(k[t]);  v_cache[slot[t]] = v[t]

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

import torch

from colo_rollout.model.kernel_backend import as_dtype, pow2, rne_bf16, tl, triton


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


def torch_rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots) -> torch.Tensor:
    """The reference: q [T, G, n, D], k and v [T, G, D] (any strides), cos and sin [T, rot]
    in q's dtype; k_cache and v_cache [slots, G, D]; slots [T] int64 -> rotated q
    [T, G * n, D] contiguous (k and v written into their slots, cast to the cache's dtype)."""
    T = q.shape[0]
    qr = rotate(q, cos.view(T, 1, 1, -1), sin.view(T, 1, 1, -1))
    kr = rotate(k, cos.view(T, 1, -1), sin.view(T, 1, -1))
    k_cache.index_copy_(0, slots, as_dtype(kr, k_cache.dtype))
    v_cache.index_copy_(0, slots, as_dtype(v, v_cache.dtype))
    return qr.reshape(T, -1, q.shape[-1])


def triton_rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots) -> torch.Tensor:
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
    out = torch.empty((T, G, n, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out.view(T, G * n, D)
    upcast = not q.is_cuda  # the interpreter: round fp32 -> bf16 to nearest even by hand
    _rope_kv_kernel[(T, G)](
        q, k, v, cos, sin, k_cache, v_cache, slots, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), n, D, rot,
        N_PAD=pow2(n), D_PAD=pow2(D),
        RNE_BF16=upcast and q.dtype == torch.bfloat16, num_warps=4 if n * D >= 1024 else 2,
    )
    return out.view(T, G * n, D)


def kernel_fits(q, k, v, cos, k_cache, v_cache) -> bool:
    """Whether the kernel takes these tensors: one dtype throughout (a cache in another dtype
    goes through the torch path's cast), contiguous head dims, an even rotary width."""
    same = q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == cos.dtype
    return (same and cos.shape[-1] % 2 == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1)
            == cos.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1)


def rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots, backend: str = "torch"):
    """``backend`` "triton" (the kernel, where ``kernel_fits``) or "torch" (the reference);
    see the module docstring."""
    if backend == "triton" and kernel_fits(q, k, v, cos, k_cache, v_cache):
        return triton_rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots)
    return torch_rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slots)


if triton is not None:

    @triton.jit
    def _round(v, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
        """fp32 -> the model dtype, to nearest even (as torch's elementwise ops round)."""
        if RNE_BF16:
            v = rne_bf16(v)
        return v.to(dtype).to(tl.float32)

    @triton.jit
    def _rotated(base, rows, offs_d, row_mask, half, rot, D, Cos, Sin,
                 dtype: tl.constexpr, RNE_BF16: tl.constexpr):
        """megatron's rope on heads ``base + rows[:, None] + d``: (t * cos) + (rotate_half(t) *
        sin), each op rounded; dims >= rot pass through. Returns fp32 values (exact in dtype)."""
        d = offs_d[None, :]
        dmask = row_mask[:, None] & (d < D)
        t = tl.load(base + rows[:, None] + d, mask=dmask, other=0.0).to(tl.float32)
        in_rot = d < rot
        # rotate_half: cat(-x2, x1): dim d < half reads -t[d + half], half <= d < rot t[d - half]
        partner = tl.where(d < half, d + half, d - half)
        tp = tl.load(base + rows[:, None] + partner, mask=dmask & in_rot, other=0.0)
        tp = tl.where(d < half, -tp.to(tl.float32), tp.to(tl.float32))
        c = tl.load(Cos + d, mask=in_rot, other=0.0).to(tl.float32)
        s = tl.load(Sin + d, mask=in_rot, other=0.0).to(tl.float32)
        r = _round(_round(t * c, dtype, RNE_BF16) + _round(tp * s, dtype, RNE_BF16), dtype,
                   RNE_BF16)
        return tl.where(in_rot, r, t)

    @triton.jit
    def _rope_kv_kernel(Q, K, V, Cos, Sin, KC, VC, Slots, Out,
                        sq_t, sq_g, sq_h, sk_t, sk_g, sv_t, sv_g, sc_t, skc_s, skc_g,
                        svc_s, svc_g, n, D, rot,
                        N_PAD: tl.constexpr, D_PAD: tl.constexpr, RNE_BF16: tl.constexpr):
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
                      cos_row, sin_row, dtype, RNE_BF16)
        out_rows = ((t * tl.num_programs(1) + g) * n + heads) * D
        tl.store(Out + out_rows[:, None] + offs_d[None, :], qv.to(dtype),
                 mask=hmask[:, None] & (offs_d[None, :] < D))
        one = tl.zeros([1], dtype=tl.int64)  # k: one head
        kv = _rotated(K + t * sk_t + g * sk_g, one, offs_d, one == 0, half, rot, D,
                      cos_row, sin_row, dtype, RNE_BF16)
        slot = tl.load(Slots + t).to(tl.int64)
        dmask = offs_d[None, :] < D
        tl.store(KC + slot * skc_s + g * skc_g + offs_d[None, :], kv.to(dtype), mask=dmask)
        vv = tl.load(V + t * sv_t + g * sv_g + offs_d[None, :], mask=dmask, other=0.0)
        tl.store(VC + slot * svc_s + g * svc_g + offs_d[None, :], vv, mask=dmask)
