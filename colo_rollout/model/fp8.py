"""FP8 (e4m3) GEMM operands for rollouts: row-wise quantisation, FP8 weights, the FP8 linear.

Owns the two recipes (``model.fp8_recipe``), both with "current" scales, computed from the
tensor being quantised -- no calibration and no scaling history (nothing lags a weight update,
and a CUDA graph replays the scale computation with the data):

  * ``rowwise``: every GEMM input row (a token, or a sorted (token, expert) pair in the MoE)
    is scaled by its own amax, every weight output channel by its own. What serving engines
    run for FP8 MoE (vLLM/SGLang's per-token x per-channel W8A8); the product is rescaled in
    fp32 by s_row * s_col after the K loop.
  * ``blockwise``: DeepSeek-V3's (and megatron / Transformer Engine's ``Float8BlockScaling``):
    each input row's every 128 columns (1 x 128) and each weight's every 128 x 128 block get
    their own scale, so one outlier spoils 128 values instead of a row. The GEMM rescales
    each 128-wide K block's partial product by s_row,kb * s_blk(n,kb) inside the K loop; every
    FP8 GEMM dimension must be a multiple of 128 (the door checks).

Under ``model.fp8_backend: te`` the routed experts (which run the engine's kernel, not TE's:
model/fp8_te.py says why) take the TE recipe's scales with TE's arithmetic (``te=True`` below;
its ``compute_scale_from_amax``, epsilon 0): scale = 448 / amax by IEEE division, q = x * scale,
the GEMM multiplying by scale_inv = 1 / scale --

  * ``tensorwise`` (TE's Float8CurrentScaling): one scale per expert weight and one per
    expert's input rows, the amax over that expert's rows alone -- as TE's ``GroupedLinear``
    quantises each of its splits (``quantize_grouped``);
  * ``blockwise`` (TE's Float8BlockScaling): the 1 x 128 / 128 x 128 blocks with the scale
    rounded down to a power of 2 (the recipe's default; q = x * scale is then exact scaling).

  * ``quantize_rows(x, group=0)``: x [M, K] -> (q [Mp, K] e4m3, scale [Mp] fp32 -- or, with a
    ``group`` g, [Mp, K / g], one per g columns), Mp = M rounded up to ``ROW_MULTIPLE`` with
    zero rows (FP8 GEMMs want 16-row multiples: the token counts of P and D are padded here,
    where an FP8 GEMM consumes them). q = rne(x / scale) with scale = max(amax, tiny) / 448,
    so |q| <= 448 (e4m3's largest finite value).
  * ``Fp8Weight``: a weight's q [..., N, K] and its scales -- per channel [..., N], or with
    ``block`` b per b x b block [..., N / b, K / b] -- made once and ``refresh``-ed in place
    from the 16-bit weight (the addresses a D graph captured stay). The weight carries the
    recipe: every GEMM quantises its input the way its weight says (``block``).
  * the FP8 linear that consumes them is model/fp8_linear.py (it runs model/fused_moe.py's
    kernel, which takes these operands: kept apart so the two do not import each other).

The 16-bit weights stay the source of truth (weight sync and checkpoint loads write them); the
model re-quantises after every write (``InferenceGPT.weights_updated``).

Imports torch (and triton when present) and the config's FP8 constants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from colo_rollout.config.schema import FP8_BLOCK
from colo_rollout.config.schema import FP8_MIN_CAPABILITY as MIN_CAPABILITY
from colo_rollout.config.schema import FP8_RECIPES as RECIPES
from colo_rollout.config.schema import FP8_ROW_MULTIPLE as ROW_MULTIPLE
from colo_rollout.model.kernel_backend import pow2 as _pow2
from colo_rollout.model.kernel_backend import tl, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite magnitude
TINY = 1e-12  # the least amax a scale is made from (an all-zero row quantises to zeros)
_AMAX_ROWS = 16  # sorted rows per program of the grouped amax (model/fp8.quantize_grouped)
MAX_K = 16384  # one program quantises a whole row (its amax needs all of it)
BLOCK = FP8_BLOCK  # the blockwise recipe's scale block: 1 x 128 inputs, 128 x 128 weights


def recipe_block(recipe: str) -> int:
    """``model.fp8_recipe`` -> the engine kernels' weight ``block`` (128 blockwise; 0 for
    rowwise and for TE's tensorwise, whose expert weights are ``Fp8Weight.of(..., te=True)``:
    one scale per expert)."""
    if recipe not in RECIPES:
        raise ValueError(f"model.fp8_recipe must be one of {RECIPES}, got {recipe!r}")
    return BLOCK if recipe == "blockwise" else 0


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` runs the FP8 GEMMs natively, and why not. CPU runs the reference
    (dequantised fp32 math): supported, slowly."""
    if device.type == "cpu":
        return True, ""
    if device.type != "cuda":
        return False, f"device {device} has no FP8 GEMMs"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return False, (f"{name} (sm{cap[0]}{cap[1]}) has no FP8 tensor cores (sm89 or later "
                       "needed)")
    if not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no _scaled_mm"
    return True, ""


def padded_rows(m: int) -> int:
    return -(-m // ROW_MULTIPLE) * ROW_MULTIPLE


def quantize_rows(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  pad: bool = True, backend: str = "auto",
                  group: int = 0, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q [Mp, K] e4m3, scale [Mp] fp32); rows past M are zero
    with scale 1. ``group`` g > 0 (blockwise; K a multiple of g): one scale per g columns of a
    row, scale [Mp, K / g]. ``pad`` False: Mp = M. ``out``: (q, scale) to write into (Mp
    rows). ``backend``: "auto" (the Triton kernel on CUDA, else torch), "torch", "triton"
    (also CPU tensors under TRITON_INTERPRET=1: the tests). ``pow2`` (with a ``group``): TE's
    Float8BlockScaling arithmetic -- ``te_scales(amax, pow2=True)``, q = x * scale, exact
    scaling -- instead of the engine's scale = amax / 448."""
    M, K = x.shape
    if pow2 and not group:
        raise ValueError("quantize_rows: pow2 scales are the blockwise recipe's (give a group)")
    Mp = padded_rows(M) if pad else M
    if group and K % group:
        raise ValueError(f"quantize_rows: K {K} is not a multiple of the group {group}")
    G = K // group if group else 0
    s_shape = (Mp, G) if group else (Mp,)
    if out is None:
        q = torch.empty((Mp, K), dtype=FP8_DTYPE, device=x.device)
        s = torch.empty(s_shape, dtype=torch.float32, device=x.device)
    else:
        q, s = out
        if q.shape != (Mp, K) or s.shape != s_shape:
            raise ValueError(f"quantize_rows out {tuple(q.shape)}, {tuple(s.shape)} for "
                             f"x {tuple(x.shape)} -> {Mp} rows, scales {s_shape}")
    if Mp == 0:
        return q, s
    if backend == "auto":
        backend = ("triton" if x.is_cuda and triton is not None and K <= MAX_K
                   and x.stride(-1) == 1 else "torch")
    if backend == "triton":
        width = group or K  # one program per row, its groups a [groups, width] tile
        block = _pow2(width, 16) * _pow2(max(G, 1))
        _quantize_rows_kernel[(Mp,)](x, q, s, M, width, x.stride(0), q.stride(0), max(G, 1),
                                     GW=_pow2(width, 16), G_PAD=_pow2(max(G, 1)), POW2=pow2,
                                     num_warps=4 if block <= 4096 else 8)
        return q, s
    xf = x.float()
    if pow2:  # TE's arithmetic (te_scales)
        sc, scale = te_scales(xf.view(M, G, group).abs().amax(dim=-1), pow2=True)
        q[:M].copy_(te_quantize(xf.view(M, G, group), sc[..., None]).view(M, K))
    elif group:
        scale = xf.view(M, G, group).abs().amax(dim=-1).clamp_min(TINY) / FP8_MAX
        q[:M].copy_((xf.view(M, G, group) / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
                    .view(M, K))
    else:
        scale = xf.abs().amax(dim=-1).clamp_min(TINY) / FP8_MAX
        q[:M].copy_((xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX))
    s[:M].copy_(scale)
    if Mp > M:
        q[M:].zero_()
        s[M:].fill_(1.0)
    return q, s


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., K] e4m3, scale [...] (one per row) or [..., K / g] (one per g columns) -> fp32
    values (the reference's operands)."""
    if scale.dim() == q.dim():
        g = q.shape[-1] // scale.shape[-1]
        return (q.float().unflatten(-1, (scale.shape[-1], g)) * scale[..., None]).flatten(-2)
    return q.float() * scale[..., None]


def te_scales(amax: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformer Engine's scale from an amax (``compute_scale_from_amax``, epsilon 0):
    scale = 448 / amax by IEEE division, fp32's largest where that overflows, 1 where amax is
    0, inf or NaN; with ``pow2`` the power of 2 at or below it (the mantissa bits cleared).
    Returns (scale, scale_inv = 1 / scale), fp32, amax's shape."""
    amax = amax.float().contiguous()
    scale = torch.div(FP8_MAX, amax)
    scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
    if pow2:  # 0xFF800000 as a signed 32-bit word: sign and exponent kept
        scale = (scale.contiguous().view(torch.int32) & -8388608).view(torch.float32)
    bad = (amax == 0) | torch.isinf(amax) | torch.isnan(scale)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    return scale, torch.reciprocal(scale)


def te_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """TE's cast: (x * scale) in fp32, saturated to e4m3's range (TE casts with satfinite;
    x * scale exceeds 448 only by the division's rounding), e4m3."""
    return (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def expert_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Each sorted row's expert [rows] int64 from the group ends ``offs`` [E] (row r is expert
    e's where offs[e - 1] <= r < offs[e]); rows at or past offs[-1] get E. Graph-capturable."""
    r = torch.arange(rows, dtype=offs.dtype, device=offs.device)
    return torch.searchsorted(offs, r, right=True)


def quantize_grouped(x: torch.Tensor, offs: torch.Tensor, rows: int,
                     token: torch.Tensor | None = None,
                     backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The ``rows`` sorted rows A[r] = x[token[r]] (``token``; else x[r]) of a grouped GEMM
    quantised per expert with TE's arithmetic, as TE's ``GroupedLinear`` quantises its splits
    under Float8CurrentScaling: one scale for all of an expert's rows, from the amax over them.
    ``offs`` [E]: the experts' group ends (rows at or past offs[-1] -- a bucket's padding, their
    tokens arbitrary -- are zero with scale 1; the GEMM never reads them). Returns (q [rows, K]
    e4m3, scale_inv [rows] fp32: the row's expert's). Host values read: none
    (graph-capturable). ``backend`` as ``quantize_rows``'s: the Triton path is three launches
    (a zeroed amax per expert; row blocks raising it by atomic max, all rows in parallel --
    one program per expert walking its rows was latency-bound: 2.7x the FP8 step at 4k
    prefill on an H200; then the cast), the torch path the reference."""
    E, K = offs.shape[0], x.shape[-1]
    q = torch.empty((rows, K), dtype=FP8_DTYPE, device=x.device)
    if backend == "auto":
        backend = ("triton" if x.is_cuda and triton is not None and x.stride(-1) == 1
                   else "torch")
    if backend == "triton":
        row_inv = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows == 0:
            return q, row_inv
        tok = token if token is not None else offs  # unused without a token
        # the experts' amax as fp32 bits (>= 0: the int order is the float order), raised by
        # every row block's atomic max -- max is exact in any order, so the bits are the
        # same every run
        e_amax = torch.zeros(E, dtype=torch.int32, device=x.device)
        e_pad = _pow2(E, 16)
        _group_amax_kernel[(triton.cdiv(rows, _AMAX_ROWS),)](
            x, tok, offs, e_amax, rows, K, x.stride(0), E, HAS_TOKEN=token is not None,
            E_PAD=e_pad, BLOCK_R=_AMAX_ROWS, BLOCK_K=min(_pow2(K, 16), 512), num_warps=4)
        _quantize_scaled_kernel[(rows,)](x, tok, offs, e_amax, row_inv, q, K, x.stride(0),
                                         q.stride(0), E, HAS_TOKEN=token is not None,
                                         E_PAD=e_pad, BLOCK_K=min(_pow2(K, 16), 1024),
                                         num_warps=4)
        return q, row_inv
    e_row = expert_of_rows(offs, rows)
    valid = e_row < E
    src = None if token is None else torch.where(valid, token, torch.zeros_like(token))
    amax = x.abs().amax(dim=-1).float() if x.shape[0] else x.new_zeros(0, dtype=torch.float32)
    if src is not None:
        amax = amax[src]
    e_amax = torch.zeros(E + 1, dtype=torch.float32, device=x.device)
    e_amax.scatter_reduce_(0, e_row, amax, "amax")
    # scale 1 for the rows past the groups (bucket E), padded on without a host value: a
    # CUDA graph captures this (an item assignment would copy a host scalar)
    scale, inv = (F.pad(t, (0, 1), value=1.0) for t in te_scales(e_amax[:E]))
    row_scale, row_inv = scale[e_row], inv[e_row]
    if rows == 0:
        return q, row_inv
    src_rows = x if src is None else x[src]
    q.copy_(torch.where(valid[:, None], te_quantize(src_rows, row_scale[:, None]),
                        torch.zeros((), dtype=torch.float32, device=x.device)))
    return q, row_inv


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(X, Q, S, rows, K, stride_x, stride_q, groups,
                              GW: tl.constexpr, G_PAD: tl.constexpr, POW2: tl.constexpr):
        """Program r: row r as a [groups, K] tile (K: the group's width, or the whole row
        with one group), each group's scale at S[r * groups + g]: one program per row, not
        per group (a 128-wide program each would be hundreds of thousands on fc2's input)."""
        r = tl.program_id(0)
        g = tl.arange(0, G_PAD)
        c = tl.arange(0, GW)
        cols = g[:, None] * K + c[None, :]
        cmask = (g[:, None] < groups) & (c[None, :] < K)
        if r >= rows:  # padding rows: zeros, scale 1
            tl.store(Q + r.to(tl.int64) * stride_q + cols,
                     tl.zeros([G_PAD, GW], dtype=tl.float32).to(Q.dtype.element_ty),
                     mask=cmask)
            tl.store(S + r * groups + g, tl.full([G_PAD], 1.0, tl.float32), mask=g < groups)
            return
        x = tl.load(X + r.to(tl.int64) * stride_x + cols, mask=cmask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        if POW2:  # TE's arithmetic (te_scales): 448 / amax, rounded down to a power of 2
            big = 3.4028234663852886e38
            sc = tl.math.div_rn(tl.full([G_PAD], 448.0, tl.float32), amax)
            sc = tl.where(sc > big, big, sc)
            sc = (sc.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
            sc = tl.where((amax == 0.0) | (amax > big), 1.0, sc)
            scale = tl.math.div_rn(tl.full([G_PAD], 1.0, tl.float32), sc)  # exact: a power of 2
            q = x * sc[:, None]
        else:
            scale = tl.maximum(amax, 1e-12) / 448.0
            q = tl.math.div_rn(x, scale[:, None])  # IEEE division: the torch reference's
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        tl.store(Q + r.to(tl.int64) * stride_q + cols, q.to(Q.dtype.element_ty), mask=cmask)
        tl.store(S + r * groups + g, scale, mask=g < groups)

    @triton.jit
    def _te_scale(amax):
        """TE's scale from an fp32 amax (``te_scales``: IEEE division, fp32's largest for an
        overflow, 1 for a zero, infinite or NaN amax) and its inverse."""
        big = 3.4028234663852886e38
        sc = tl.math.div_rn(tl.zeros_like(amax) + 448.0, amax)
        sc = tl.where(sc > big, big, sc)
        sc = tl.where((amax == 0.0) | (amax > big) | (sc != sc), 1.0, sc)
        return sc, tl.math.div_rn(tl.zeros_like(sc) + 1.0, sc)

    @triton.jit
    def _rows_expert(OFFS, r, E, E_PAD: tl.constexpr):
        """The expert of each sorted row in the vector r: the number of group ends at or below
        it (E for a row at or past OFFS[E - 1])."""
        eids = tl.arange(0, E_PAD)
        ends = tl.load(OFFS + eids, mask=eids < E, other=2147483647)
        return tl.sum((ends[None, :] <= r[:, None]).to(tl.int32), 1)

    @triton.jit
    def _row_expert(OFFS, r, E, E_PAD: tl.constexpr):
        """``_rows_expert`` of one row (a scalar)."""
        eids = tl.arange(0, E_PAD)
        ends = tl.load(OFFS + eids, mask=eids < E, other=2147483647)
        return tl.sum((ends <= r).to(tl.int32), 0)

    @triton.jit
    def _group_amax_kernel(X, TOKEN, OFFS, E_AMAX, rows, K, stride_x, E,
                           HAS_TOKEN: tl.constexpr, E_PAD: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program p: the amax of sorted rows [p * BLOCK_R, +BLOCK_R) (A[r] = X[TOKEN[r]] or
        X[r]), each raised into its expert's E_AMAX (fp32 bits as int32, atomic max); rows at
        or past OFFS[E - 1] belong to no expert and are skipped."""
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        e = _rows_expert(OFFS, r, E, E_PAD)
        rm = (r < rows) & (e < E)
        src = tl.load(TOKEN + r, mask=rm, other=0) if HAS_TOKEN else r
        base = X + src.to(tl.int64)[:, None] * stride_x
        ci = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            m = rm[:, None] & (ci[None, :] < K - k0)
            v = tl.load(base + k0 + ci[None, :], mask=m, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(v))
        amax = tl.max(acc, axis=1)
        tl.atomic_max(E_AMAX + e, amax.to(tl.int32, bitcast=True), mask=rm)

    @triton.jit
    def _quantize_scaled_kernel(X, TOKEN, OFFS, E_AMAX, RINV, Q, K, stride_x, stride_q, E,
                                HAS_TOKEN: tl.constexpr, E_PAD: tl.constexpr,
                                BLOCK_K: tl.constexpr):
        """Program r: Q[r] = e4m3(clamp(A[r] * scale)) with A[r] = X[TOKEN[r]] (or X[r]) and
        scale TE's from its expert's amax (``_group_amax_kernel``), RINV[r] = 1 / scale; a row
        at or past OFFS[E - 1] (past the groups) zero, its RINV 1."""
        r = tl.program_id(0)
        e = _row_expert(OFFS, r, E, E_PAD)
        valid = e < E
        bits = tl.load(E_AMAX + e, mask=valid, other=0)
        sc, inv = _te_scale(bits.to(tl.float32, bitcast=True))
        sc = tl.where(valid, sc, 0.0)
        if HAS_TOKEN:
            src = tl.load(TOKEN + r, mask=valid, other=0)
        else:
            src = r
        tl.store(RINV + r, tl.where(valid, inv, 1.0))
        cols = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            m = cols < K - k0
            x = tl.load(X + src.to(tl.int64) * stride_x + k0 + cols, mask=m & valid,
                        other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x * sc, -448.0), 448.0)  # invalid rows: 0 * 0
            tl.store(Q + r.to(tl.int64) * stride_q + k0 + cols, q.to(Q.dtype.element_ty),
                     mask=m)


def _quantize_blocks(w: torch.Tensor, b: int, q: torch.Tensor, s: torch.Tensor,
                     chunk: int = 1 << 26, te: bool = False) -> None:
    """w [..., N, K] -> q (its shape, e4m3) and s [..., N / b, K / b]: each b x b block by its
    own amax, as ``quantize_rows`` does a row (IEEE division, clamp) -- or with ``te``, TE's
    Float8BlockScaling arithmetic (power-of-2 scales, ``te_scales``). Chunks of about
    ``chunk`` elements over the leading dims bound the fp32 temporaries."""
    N, K = w.shape[-2:]
    w3, q3, s3 = w.reshape(-1, N, K), q.view(-1, N, K), s.view(-1, N // b, K // b)
    step = max(1, chunk // max(N * K, 1))
    for i in range(0, w3.shape[0], step):
        x = w3[i : i + step].float().view(-1, N // b, b, K // b, b)
        amax = x.abs().amax(dim=(2, 4))
        if te:
            scale, sc = te_scales(amax, pow2=True)
            q3[i : i + step].copy_(te_quantize(x, scale[:, :, None, :, None]).view(-1, N, K))
        else:
            sc = amax.clamp_min(TINY) / FP8_MAX
            q3[i : i + step].copy_((x / sc[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
                                   .view(-1, N, K))
        s3[i : i + step].copy_(sc)


def _quantize_tensors(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                      chunk: int = 1 << 26) -> None:
    """w [..., N, K] -> q (its shape, e4m3) and s [..., N]: each [N, K] matrix (an expert's
    weight) by one scale from its amax, TE's Float8CurrentScaling arithmetic (``te_scales``);
    s holds the matrix's scale_inv in every channel (the kernels' per-channel operand). Chunks
    as ``_quantize_blocks``'s."""
    N, K = w.shape[-2:]
    w3, q3, s2 = w.reshape(-1, N, K), q.view(-1, N, K), s.view(-1, N)
    step = max(1, chunk // max(N * K, 1))
    for i in range(0, w3.shape[0], step):
        x = w3[i : i + step]
        amax = x.abs().amax(dim=(1, 2)) if N * K else x.new_zeros(x.shape[0])
        scale, inv = te_scales(amax)
        q3[i : i + step].copy_(te_quantize(x, scale[:, None, None]))
        s2[i : i + step].copy_(inv[:, None].expand(-1, N))


@dataclass
class Fp8Weight:
    """A 16-bit weight [..., N, K] as FP8: q [..., N, K] e4m3 and its fp32 scales -- one per
    output channel, scale [..., N] (``block`` 0: rowwise), or one per ``block`` x ``block``
    tile, scale [..., N / block, K / block] (blockwise). ``te``: TE's arithmetic
    (``te_scales``) -- with a ``block`` its power-of-2 block scales (Float8BlockScaling),
    without one a scale per [N, K] matrix (Float8CurrentScaling per expert: ``tensorwise``),
    held in every channel of scale [..., N]. ``refresh`` re-quantises in place (the same
    tensors: captured graphs read the new values)."""

    q: torch.Tensor
    scale: torch.Tensor
    block: int = 0
    te: bool = False

    @property
    def tensorwise(self) -> bool:
        """One scale per matrix (TE's Float8CurrentScaling): its GEMMs quantise their input
        per expert (``quantize_grouped``), not per row."""
        return self.te and not self.block

    @classmethod
    def of(cls, w: torch.Tensor, block: int = 0, te: bool = False) -> Fp8Weight:
        if not block:
            if te:
                q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
                s = torch.empty(w.shape[:-1], dtype=torch.float32, device=w.device)
                _quantize_tensors(w.detach(), q, s)
                return cls(q, s, 0, True)
            K = w.shape[-1]
            q, s = quantize_rows(w.detach().reshape(-1, K), pad=False)
            return cls(q.view(w.shape), s.view(w.shape[:-1]))
        N, K = w.shape[-2:]
        if N % block or K % block:
            raise ValueError(f"a blockwise FP8 weight needs both dims in multiples of {block}, "
                             f"got {tuple(w.shape)}")
        q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
        s = torch.empty((*w.shape[:-2], N // block, K // block), dtype=torch.float32,
                        device=w.device)
        _quantize_blocks(w.detach(), block, q, s, te=te)
        return cls(q, s, block, te)

    def matches(self, w: torch.Tensor) -> bool:
        return self.q.shape == w.shape and self.q.device == w.device

    def tensors(self) -> list[torch.Tensor]:
        """The FP8 data and scales (what graphs read besides the parameters)."""
        return [self.q, self.scale]

    def refresh(self, w: torch.Tensor) -> None:
        if self.block:
            _quantize_blocks(w.detach(), self.block, self.q, self.scale, te=self.te)
            return
        if self.te:
            _quantize_tensors(w.detach(), self.q, self.scale)
            return
        K = w.shape[-1]
        quantize_rows(w.detach().reshape(-1, K), out=(self.q.view(-1, K), self.scale.view(-1)),
                      pad=False)

    def dequantized(self) -> torch.Tensor:
        """The weight the FP8 GEMM multiplies by, in fp32."""
        if self.block:
            b = self.block
            return self.q.float() * self.scale.repeat_interleave(b, -2).repeat_interleave(b, -1)
        return dequantize_rows(self.q, self.scale)

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * 4
