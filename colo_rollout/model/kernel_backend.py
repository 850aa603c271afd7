"""Which kernels a model runs: the optional Triton import and the backend choice shared by the
Triton kernel modules (paged_attention.py, paged_prefill.py, fused_moe.py).

Owns ``triton`` / ``tl`` (None where triton does not import: the CPU path and CI without it
must not need it), ``BACKENDS`` (auto | torch | triton) and ``resolve_backend``: the key's
requested backend -> the one a model on a device uses, decided once at model build. "auto" is
triton on CUDA when triton imports (and, where the caller says so, the dtype suits the kernel),
else torch; "triton" that cannot run is an error naming the key, never a silent fallback.

Also the kernels' small shared helpers: ``pow2`` (block sizes), ``as_dtype`` (a cast that
dispatches nothing when there is nothing to cast), ``smem_per_block`` (what a tiling must fit)
and ``rne_bf16`` (a Triton helper: round-to-nearest-even bf16 under the interpreter too).

Imports only torch (and triton when present), so a GPU check can load a kernel module alone.
"""

from __future__ import annotations

import math

import torch

try:  # triton is optional
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the host
    triton = None
    tl = None

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    """Whether a Triton kernel can be launched at all (triton imports)."""
    return triton is not None


def resolve_backend(key: str, requested: str, device: torch.device | str,
                    suits: bool = True) -> str:
    """``key`` (e.g. "engine.decode_attention") asked for ``requested`` on ``device``;
    ``suits``: whether "auto" may pick triton for the model (e.g. its dtype)."""
    if requested not in BACKENDS:
        raise ValueError(f"{key} must be one of {BACKENDS}, got {requested!r}")
    if requested == "torch":
        return "torch"
    device = torch.device(device)
    usable = device.type == "cuda" and triton_available()
    if requested == "triton":
        if not usable:
            why = "triton does not import" if not triton_available() else f"the device is {device}"
            raise RuntimeError(f"{key}: triton was requested but {why}; set it to 'torch' or "
                               "'auto'")
        return "triton"
    return "triton" if usable and suits else "torch"


def pow2(x: int, floor: int = 1) -> int:
    """The smallest power of two >= x, at least ``floor``."""
    return max(floor, 1 << max(0, math.ceil(math.log2(max(1, x)))))


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without dispatching anything when it already is (P's host time)."""
    return t if t.dtype == dtype else t.to(dtype)


def smem_per_block(device: torch.device) -> int | None:
    """Shared memory a kernel's block may use on ``device`` (the opt-in limit; 99 KiB where
    torch does not say), or None off CUDA (the interpreter): the caller picks its bound."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024


rne_bf16 = None  # a Triton function where triton imports
if triton is not None:

    @triton.jit
    def rne_bf16(v):  # noqa: F811
        """fp32 whose truncation to bf16 is the round-to-nearest-even one: the interpreter
        truncates an fp32 -> bf16 cast, so the rounding bias is added to the bits first (on a
        GPU the cast rounds to nearest even already, and this changes nothing)."""
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        # zeros stay zeros (the bias would make a subnormal the interpreter rounds up)
        return tl.where(v == 0, v, bits.to(tl.float32, bitcast=True))
