"""FP8 GEMM weights through Transformer Engine (``model.fp8_backend: te``).

The dense FP8 GEMMs -- attention projections, dense MLPs, shared experts -- run TE's own
quantizers and cuBLASLt GEMM (``general_gemm``, what ``te.Linear``'s forward calls) under the
TE recipe ``model.fp8_recipe`` names, so a rollout's dense layers have the numerics of a TE FP8
layer of that recipe:

  * ``tensorwise``: ``Float8CurrentScaling`` -- one scale for the whole GEMM input (its amax
    over every row of the call, so a row's result depends on the rows beside it, as in TE)
    and one per weight; the fprop GEMM without split accumulation (the recipe's
    ``fp8_gemm_fprop``).
  * ``blockwise``: ``Float8BlockScaling`` -- 1 x 128 input and 128 x 128 weight scales
    (power-of-2 by the recipe's default), split accumulation.

Why only the dense GEMMs: TE's FP8 grouped GEMM takes the group sizes on the host
(``GroupedLinear``'s m_splits), which a D graph cannot capture under dynamic routing, and its
device-side grouped GEMM needs cuBLASLt 13.5 (current scaling) / 13.6 (block scaling) on
Hopper. The routed experts stay on the engine's FP8 kernel (model/fused_moe.py) but take the
recipe's scales by TE's arithmetic (model/fp8.py, ``te``): ``tensorwise`` one scale per
expert weight and per expert's input rows -- what GroupedLinear's split quantizers compute
--, ``blockwise`` TE's power-of-2 block scales; only the GEMM's accumulation order is the
engine kernel's.

``TeFp8Weight`` has ``Fp8Weight``'s interface (model/fp8.py): made once from the 16-bit
weight, ``refresh``-ed in place after every weight write (TE's ``update_quantized``: the
same FP8 buffers, so captured graphs read the new values); ``fp8_linear`` calls its
``linear``. Rows are padded to ``ROW_MULTIPLE`` with zeros before quantising (TE's FP8 GEMM
wants the token count a multiple of 8 and K of 16; zero rows change no amax).

Transformer Engine is optional: nothing here imports it until a weight is made; whether it
can run a recipe here is config/te_support.py's ``te_fp8_problem`` (the door and the model
build ask first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from colo_rollout.config.schema import FP8_ROW_MULTIPLE as ROW_MULTIPLE


def te_recipe(recipe: str, fmt: str):
    """The TE recipe object of ``model.fp8_recipe`` / ``model.fp8`` ("e4m3" or "hybrid": the
    forward is e4m3 in both)."""
    from transformer_engine.common.recipe import (Float8BlockScaling, Float8CurrentScaling,
                                                  Format)

    fp8_format = Format.HYBRID if fmt == "hybrid" else Format.E4M3
    if recipe == "tensorwise":
        return Float8CurrentScaling(fp8_format=fp8_format)
    if recipe == "blockwise":
        return Float8BlockScaling(fp8_format=fp8_format)
    raise ValueError(f"model.fp8_recipe {recipe!r} has no Transformer Engine recipe here")


class TeFp8Weight:
    """A 16-bit weight [N, K] as TE's quantized weight for the recipe, with the input
    quantizer its GEMMs use. Forward only: rowwise data, no transposes kept."""

    def __init__(self, w: torch.Tensor, recipe: str, fmt: str = "e4m3") -> None:
        from transformer_engine.pytorch.quantization import RecipeState

        if w.dim() != 2:
            raise ValueError(f"TeFp8Weight takes a 2-D weight, got {tuple(w.shape)}")
        self.recipe = recipe
        te = te_recipe(recipe, fmt)
        # TE's forward slots: [input, weight] (RecipeState's positional roles)
        x_q, w_q = RecipeState.create(te, mode="forward", num_quantizers=2,
                                      device=w.device).make_quantizers()
        for q in (x_q, w_q):
            q.set_usage(rowwise=True, columnwise=False)
        x_q.internal = True  # storages, not tensor subclasses: what te.Linear hands the GEMM
        self.x_quantizer, self.w_quantizer = x_q, w_q
        self.split_accumulator = te.fp8_gemm_fprop.use_split_accumulator
        with torch.no_grad():
            self.q = w_q(w.detach().contiguous())
        self.shape = tuple(w.shape)
        self.device = w.device

    @classmethod
    def of(cls, w: torch.Tensor, recipe: str, fmt: str = "e4m3") -> TeFp8Weight:
        return cls(w, recipe, fmt)

    def matches(self, w: torch.Tensor) -> bool:
        return self.shape == tuple(w.shape) and self.device == w.device

    def refresh(self, w: torch.Tensor) -> None:
        """Re-quantise from the 16-bit weight into the same FP8 buffers."""
        with torch.no_grad():
            self.w_quantizer.update_quantized(w.detach().contiguous(), self.q)

    def dequantized(self) -> torch.Tensor:
        """The weight the FP8 GEMM multiplies by, in fp32."""
        return self.q.dequantize(dtype=torch.float32)

    def tensors(self) -> list[torch.Tensor]:
        """The FP8 data and scales (what graphs read besides the parameters)."""
        return [v for v in self.q.get_metadata().values() if isinstance(v, torch.Tensor)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] @ W^T (+ bias): x quantised by the recipe's input quantizer (rows padded
        to ROW_MULTIPLE with zeros), TE's GEMM into ``out_dtype`` (default x's)."""
        from transformer_engine.pytorch.cpp_extensions import general_gemm

        out_dtype = out_dtype or x.dtype
        M = x.shape[0]
        if M == 0:
            return x.new_zeros((0, self.shape[0]), dtype=out_dtype)
        pad = -M % ROW_MULTIPLE
        xp = F.pad(x, (0, 0, 0, pad)) if pad else x.contiguous()
        xq = self.x_quantizer(xp)
        # cuBLASLt takes no fp32 bias beside FP8 operands (te.Linear casts it to bf16 too)
        b = None if bias is None else bias.to(torch.bfloat16 if out_dtype == torch.float32
                                              else out_dtype)
        y, *_ = general_gemm(self.q, xq, out_dtype=out_dtype, bias=b,
                             use_split_accumulator=self.split_accumulator)
        return y[:M] if pad else y
