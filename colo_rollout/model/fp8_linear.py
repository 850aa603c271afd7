"""The FP8 linear: x @ W^T with x quantised on the way in and W an FP8 copy (model/fp8.py's
``Fp8Weight``, or Transformer Engine's ``TeFp8Weight``, model/fp8_te.py).

Owns ``fp8_linear`` and its backends: ``torch._scaled_mm`` with row-wise scales on CUDA
(sm89+), model/fused_moe.py's kernel as one group for blockwise weights, elsewhere the same
math on dequantised operands in fp32 (the CPU reference). Apart from model/fp8.py because it
runs the fused-MoE kernel, which itself takes fp8.py's operands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from colo_rollout.model.fp8 import Fp8Weight, dequantize_rows, quantize_rows
from colo_rollout.model.fused_moe import moe_gemm, regime, tile_for

LINEAR_BACKENDS = ("auto", "scaled_mm", "triton", "torch")


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) with x quantised per row and W per channel: [M, N] in
    ``out_dtype`` (default x's). ``backend``: "scaled_mm" (torch._scaled_mm, the rows padded
    to 16), "triton" (model/fused_moe.py's kernel as one group: CUDA, or CPU tensors under
    the interpreter), "torch" (the dequantised operands' fp32 product, the reference), "auto"
    (CUDA: scaled_mm; CPU: torch). fp32 accumulation in all; host values read: shapes only
    (graph-capturable). "auto" never picks triton: on an H200 (decode graphs,
    bench_speed_gpu, 2026-12-02) its decode tiles give a single [3072 x 2048] weight 48
    programs, 8.7 us per projection at B = 1 -- no faster than _scaled_mm's 8.4 us
    (cuBLASLt's 128 x 128 FP8 tiles) and slower at B = 32 (step 4.51 vs 3.95 ms); both are
    above bf16's 5.8 us, so the lever is a split-K FP8 GEMV. A blockwise weight (``w.block``)
    quantises x per 1 x block columns; on CUDA it runs the Triton kernel ("auto"; scaled_mm is
    rowwise only here). A ``TeFp8Weight`` (model.fp8_backend te) runs its own TE GEMM."""
    out_dtype = out_dtype or x.dtype
    if not isinstance(w, Fp8Weight):  # Transformer Engine's weight (model/fp8_te.py)
        return w.linear(x, bias, out_dtype)
    if w.tensorwise:  # TE's dense GEMMs run TE's own weight (model/fp8_te.py)
        raise ValueError("fp8_linear: a tensorwise Fp8Weight is the routed experts' "
                         "(model/fused_moe.py), not a dense GEMM's")
    M = x.shape[0]
    if M == 0:
        return x.new_zeros((0, w.q.shape[0]), dtype=out_dtype)
    if backend == "auto":
        backend = ("torch" if not x.is_cuda else "triton" if w.block else "scaled_mm")
    if backend == "scaled_mm" and w.block:
        raise ValueError("fp8_linear: the scaled_mm backend runs rowwise weights only")
    if backend == "triton":
        q, s = quantize_rows(x, pad=False, group=w.block, pow2=w.te)
        ends = torch.full((1,), M, dtype=torch.int32, device=x.device)  # one group: every row
        y = moe_gemm(q, w.q[None], ends, M, tile=tile_for(regime(M, 1), "fc2", bool(w.block)),
                     a_scale=s, w_scale=w.scale[None], out_dtype=out_dtype)
    elif backend == "scaled_mm":
        q, s = quantize_rows(x)
        y = torch._scaled_mm(q, w.q.t(), scale_a=s[:, None], scale_b=w.scale[None, :],
                             out_dtype=out_dtype if out_dtype != torch.float32 else torch.bfloat16)
        y = y[:M]
        if out_dtype == torch.float32:
            y = y.float()
    elif backend == "torch":
        q, s = quantize_rows(x, pad=False, group=w.block, pow2=w.te)
        y = F.linear(dequantize_rows(q, s), w.dequantized()).to(out_dtype)
    else:
        raise ValueError(f"fp8_linear backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y
