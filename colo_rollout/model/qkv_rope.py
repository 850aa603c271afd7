"""P's QKV projection with the q/k norms, the rotary embedding and the KV write in its
epilogue: one launch where the attention layer ran a GEMM and then ``rope_and_store``.

Owns ``qkv_rope_and_store`` and ``fits`` (which layers and steps it takes). What it computes,
for x [T, H] and the QKV weight [G * (n + 2) * D, H] in megatron's per-group layout (n query
heads, k, v per KV group):

    qkv = round(x @ W^T)                             (the projection, as the GEMM writes it)
    q_out, k_cache[slot], v_cache[slot], kv_out     = rope_and_store(qkv's q, k, v, ...)

-- ``model/rope_kv.py``'s kernel on the projection's rows, without the projection's [T, G (n + 2)
D] output ever reaching memory: a tile of the GEMM is one head of BM tokens, and its epilogue
rounds the fp32 accumulator to the model dtype (what the GEMM would have stored), then
normalises, rotates and stores that head where the rope kernel would: a q head into the
rotated queries [T, G n, D], k into its cache slot (and the dense calls' contiguous K rows), v
likewise. The epilogue's ops are rope_kv's, in the same order with the same roundings (the
same ``_round``, compiled without FMA contraction), so given the same projection the outputs
are rope_kv's -- bitwise without q/k norms, and with them up to the norm's sum of squares'
order (a tree over another layout). The projection itself is a Triton GEMM: its fp32 sums run
in another order than cuBLAS's, so the rounded projection can differ from ``torch.matmul``'s
in the last bit of a few elements, as two GEMM libraries' do (megatron's own GEMM is
cuBLAS's or TE's).

Why: in a Qwen3-30B-A3B P step of 8 x 1k tokens on one H100 the rope kernel took 1.62 ms (its
bytes: the projection's rows read back, ~1.2x its HBM time) and the QKV GEMM 5.50 ms
(docs/benchmarks.md sessions 40 and 43). Here the rows are read from the accumulator instead.

Taken (``fits``): CUDA with triton's TMA descriptors (sm90+) or the interpreter's CPU tensors;
bf16 / fp16; a bias-free projection; whole-width rotary (rot = D) and D in {64, 128, 256};
the angles as tables read at the positions; caches in the model dtype. Everything else keeps
the GEMM + ``rope_and_store``.

Imports only torch (and triton when present).
"""

from __future__ import annotations

import torch

from colo_rollout.model.kernel_backend import tl, triton
from colo_rollout.model.rope_kv import QKRMSNorm

if triton is not None:
    from colo_rollout.model.rope_kv import _round

try:  # host-side TMA descriptors (triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the host
    TensorDescriptor = None

# the tile: BM tokens x one head (D columns), K in steps of BK; 8 warps, STAGES-deep pipeline
BM, BK, WARPS, STAGES = 128, 64, 8, 4
HEAD_DIMS = (64, 128, 256)
# from this many tokens a P step takes the fused launch (shorter steps: the GEMM's tiles
# would leave the SMs idle, and the rope launch is cheap there)
FROM_TOKENS = 512
# the epilogue: EPI_FUSED the norms, rope and KV stores; EPI_PLAIN the rounded projection
# stored as [T, G (n + 2) D] (what the GEMM alone writes: the tests' and the sweep's view)
EPI_FUSED, EPI_PLAIN = 1, 0


def fits(x: torch.Tensor, w: torch.Tensor, D: int, rot: int, cache_dtype: torch.dtype,
         tables: bool) -> bool:
    """Whether ``qkv_rope_and_store`` takes this projection (module docstring)."""
    if triton is None or TensorDescriptor is None or D not in HEAD_DIMS or rot != D:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype \
            or cache_dtype != x.dtype or not tables:
        return False
    if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    esize = x.element_size()
    return (x.dim() == 2 and w.dim() == 2 and x.stride(1) == 1 and w.stride(1) == 1
            and (x.stride(0) * esize) % 16 == 0 and (w.stride(0) * esize) % 16 == 0
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and w.shape[1] == x.shape[1] and w.shape[0] % D == 0)


def qkv_rope_and_store(x: torch.Tensor, w: torch.Tensor, groups: int, n: int,
                       cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       qk_norm: QKRMSNorm | None = None,
                       kv_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                       epilogue: int = EPI_FUSED) -> torch.Tensor:
    """x [T, H], w [groups * (n + 2) * D, H] -> the rotated queries [T, groups * n, D] (k and
    v written into their slots, and into ``kv_out``'s [T, groups, D] rows where given);
    ``cos`` / ``sin`` tables [P, D] read at ``positions`` [T] int64. ``epilogue`` EPI_PLAIN:
    the rounded projection [T, groups * (n + 2) * D] instead, nothing else written. The
    caller has checked ``fits``."""
    T, H = x.shape
    D = cos.shape[-1]
    heads = w.shape[0] // D
    if heads != groups * (n + 2):
        raise ValueError(f"qkv_rope: weight rows {w.shape[0]} are not {groups} groups of "
                         f"{n} + 2 heads of {D}")
    dtype = x.dtype
    plain = epilogue == EPI_PLAIN
    out = torch.empty((T, heads * D) if plain else (T, groups * n, D), dtype=dtype,
                      device=x.device)
    if T == 0:
        return out
    if not plain and (positions.dtype != torch.int64 or positions.shape != (T,)):
        raise ValueError("qkv_rope: positions must be int64 [T]")
    qw, kw, eps = (cos, cos, 0.0) if qk_norm is None else qk_norm
    ko, vo = (k_cache, v_cache) if kv_out is None else kv_out
    a = TensorDescriptor(x, [T, H], [x.stride(0), 1], [BM, BK])
    b = TensorDescriptor(w, [heads * D, H], [w.stride(0), 1], [D, BK])
    interp = not x.is_cuda
    _qkv_rope_kernel[(heads, triton.cdiv(T, BM))](
        a, b, cos, sin, positions, slots, qw, kw, float(eps), out, k_cache, v_cache, ko, vo,
        T, H, cos.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), ko.stride(0), ko.stride(1), vo.stride(0), vo.stride(1), n,
        BM=BM, D=D, BK=BK, EPI=epilogue, HAS_NORM=qk_norm is not None,
        STORE_KV=kv_out is not None, UPCAST=interp,
        RNE_BF16=interp and dtype == torch.bfloat16,
        num_warps=WARPS, num_stages=STAGES, enable_fp_fusion=False)
    return out


if triton is not None:

    @triton.jit
    def _store_head(dst, rows, stride_row, o1, o2, rmask, HALF: tl.constexpr, dtype):
        """The two halves of one head per row at ``dst + rows * stride_row``."""
        j = tl.arange(0, HALF)[None, :]
        base = dst + rows[:, None] * stride_row
        m = rmask[:, None]
        tl.store(base + j, o1.to(dtype), mask=m)
        tl.store(base + HALF + j, o2.to(dtype), mask=m)

    # T changes every step: never specialised on (one compiled kernel per model layout)
    @triton.jit(do_not_specialize=["T"])
    def _qkv_rope_kernel(A, W, Cos, Sin, Pos, Slots, QW, KW, eps, Out, KC, VC, KO, VO,
                         T, K_DIM, sc_t, skc_s, skc_g, svc_s, svc_g, sko_t, sko_g, svo_t,
                         svo_g, n, BM: tl.constexpr, D: tl.constexpr, BK: tl.constexpr,
                         EPI: tl.constexpr, HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr,
                         UPCAST: tl.constexpr, RNE_BF16: tl.constexpr):
        # axis 0 the head: consecutive programs share the token block's A tile (L2)
        hid = tl.program_id(0)
        row0 = tl.program_id(1) * BM
        acc = tl.zeros([BM, D], dtype=tl.float32)
        for k0 in range(0, K_DIM, BK):
            a = A.load([row0, k0])
            wt = W.load([hid * D, k0]).T
            if UPCAST:  # the interpreter's dot reads 16-bit floats as integers: fp32 there
                a = a.to(tl.float32)
                wt = wt.to(tl.float32)
            acc = tl.dot(a, wt, acc)
        dtype = Out.dtype.element_ty
        HALF: tl.constexpr = D // 2
        rows = (row0 + tl.arange(0, BM)).to(tl.int64)
        rmask = rows < T
        # the projection as the GEMM stores it: rounded once to the model dtype
        x1, x2 = acc.reshape(BM, 2, HALF).permute(0, 2, 1).split()
        x1 = _round(x1, dtype, RNE_BF16)
        x2 = _round(x2, dtype, RNE_BF16)
        heads = tl.num_programs(0)
        if EPI == 0:  # EPI_PLAIN
            _store_head(Out + hid * D, rows, heads * D, x1, x2, rmask, HALF, dtype)
        else:
            g = hid // (n + 2)  # the head's KV group and its place there: q_0..q_{n-1}, k, v
            j = hid % (n + 2)
            G = heads // (n + 2)
            if j == n + 1:  # v: into its slot (and the dense calls' rows) as projected
                slot = tl.load(Slots + rows, mask=rmask, other=0).to(tl.int64)
                _store_head(VC + g * svc_g, slot, svc_s, x1, x2, rmask, HALF, dtype)
                if STORE_KV:
                    _store_head(VO + g * svo_g, rows, svo_t, x1, x2, rmask, HALF, dtype)
            else:
                jj = tl.arange(0, HALF)[None, :]
                if HAS_NORM:  # torch's rms_norm over the head: rope_kv's _rope_rows' ops
                    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
                    rstd = tl.rsqrt(tl.math.div_rn(ss, tl.zeros_like(ss) + D) + eps)[:, None]
                    if j < n:
                        w1 = tl.load(QW + jj).to(tl.float32)
                        w2 = tl.load(QW + HALF + jj).to(tl.float32)
                    else:
                        w1 = tl.load(KW + jj).to(tl.float32)
                        w2 = tl.load(KW + HALF + jj).to(tl.float32)
                    x1 = _round((x1 * rstd) * w1, dtype, RNE_BF16)
                    x2 = _round((x2 * rstd) * w2, dtype, RNE_BF16)
                pos = tl.load(Pos + rows, mask=rmask, other=0).to(tl.int64)
                ang = pos[:, None] * sc_t + jj
                c1 = tl.load(Cos + ang).to(tl.float32)
                s1 = tl.load(Sin + ang).to(tl.float32)
                c2 = tl.load(Cos + HALF + ang).to(tl.float32)
                s2 = tl.load(Sin + HALF + ang).to(tl.float32)
                o1 = _round(_round(x1 * c1, dtype, RNE_BF16)
                            + _round(-x2 * s1, dtype, RNE_BF16), dtype, RNE_BF16)
                o2 = _round(_round(x2 * c2, dtype, RNE_BF16)
                            + _round(x1 * s2, dtype, RNE_BF16), dtype, RNE_BF16)
                if j < n:  # q head g * n + j of the rotated queries [T, G n, D]
                    _store_head(Out + (g * n + j) * D, rows, G * n * D, o1, o2, rmask, HALF,
                                dtype)
                else:  # k: its cache slot, and the dense calls' K rows
                    slot = tl.load(Slots + rows, mask=rmask, other=0).to(tl.int64)
                    _store_head(KC + g * skc_g, slot, skc_s, o1, o2, rmask, HALF, dtype)
                    if STORE_KV:
                        _store_head(KO + g * sko_g, rows, sko_t, o1, o2, rmask, HALF, dtype)
else:  # pragma: no cover - depends on the host
    _qkv_rope_kernel = None
