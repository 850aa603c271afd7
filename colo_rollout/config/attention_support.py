"""What P's dense attention kernels can run on this host, asked without building anything.

Owns whether cuDNN's fused attention (``engine.prefill_attention: cudnn``) and FlashAttention-4
(``flash``: its one-sequence calls; the batched ones stay cuDNN's) can run on a device for a
model's dtype and head dim, and the one import of ``flash_attn.cute``. The door asks
``dense_kernel_problem`` before any rank starts; the model's backend choice asks it again on
each rank (model/paged_prefill.py ``resolve_backend``); model/dense_prefill.py runs the calls.
Imports torch when asked, flash_attn.cute on the first ``flash_attention()``.
"""

from __future__ import annotations

from typing import Any

from colo_rollout.config.schema import CUDNN_MIN_VERSION, FLASH_MAJORS, FLASH_MAX_HEAD_DIM

# cuDNN's fused attention: the head dims measured (multiples of 8 up to this)
CUDNN_MAX_HEAD_DIM = 128
# ... and the (query/key, value) head dims measured where they differ (MLA's P: DeepSeek-V2/V3,
# Kimi-K2, Moonlight)
CUDNN_QK_V_DIMS = ((192, 128),)

_FLASH: list = []  # flash_attn.cute's forward, imported once (first use of ``flash``)


def _sixteen_bit(dtype: Any) -> bool:
    import torch

    return dtype in (torch.bfloat16, torch.float16)


def cudnn_usable(device: Any) -> str | None:
    """None when the dense path can run on ``device``, else why not (one line)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return f"the device is {device}"
    if not torch.cuda.is_available():
        return "this host has no CUDA device"
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None:
        return "this torch has no cuDNN"
    if version < CUDNN_MIN_VERSION:
        return f"cuDNN {version} is older than {CUDNN_MIN_VERSION}"
    return None


def cudnn_fits(dtype: Any, head_dim: int | None, v_dim: int | None = None) -> str | None:
    """None when cuDNN's fused attention takes a model of ``dtype`` and ``head_dim`` (16-bit,
    a head dim that is a multiple of 8 up to 128 -- the range measured; None: unchecked) and
    value heads of ``v_dim`` (None: ``head_dim``'s; MLA's query/key heads are wider than its
    value heads: DeepSeek's (192, 128) is among ``CUDNN_QK_V_DIMS``), else why not (one
    line)."""
    if dtype is not None and not _sixteen_bit(dtype):
        return f"the model is {dtype} (cuDNN's fused attention takes 16-bit)"
    if head_dim is None or v_dim is None or v_dim == head_dim:
        if head_dim is not None and (head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM):
            return f"head_dim {head_dim} is not a multiple of 8 up to {CUDNN_MAX_HEAD_DIM}"
        return None
    if (head_dim, v_dim) not in CUDNN_QK_V_DIMS:
        return (f"query/key heads of {head_dim} with value heads of {v_dim} are not among the "
                f"shapes measured ({', '.join(f'{a}/{b}' for a, b in CUDNN_QK_V_DIMS)})")
    return None


def flash_attention():
    """FlashAttention-4's ``flash_attn_func`` (``flash_attn.cute``); ImportError (one line)
    where it is not installed."""
    if not _FLASH:
        try:
            from flash_attn.cute import flash_attn_func
        except Exception as e:  # not installed, or installed without its CuTe DSL
            raise ImportError(f"flash_attn.cute (FlashAttention-4) does not import: "
                              f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
        _FLASH.append(flash_attn_func)
    return _FLASH[0]


def flash_varlen():
    """FlashAttention-4's ``flash_attn_varlen_func`` (imported with ``flash_attention``'s
    rule: ImportError, one line, where it is not installed)."""
    flash_attention()
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def flash_usable(device: Any) -> str | None:
    """None when FlashAttention-4's dense path can run on ``device``, else why not (one
    line)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return f"the device is {device}"
    if not torch.cuda.is_available():
        return "this host has no CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FLASH_MAJORS:
        return (f"the GPU is sm_{major}{minor} (FlashAttention-4's forward is used on sm_90 "
                "and sm_100 here)")
    try:
        flash_attention()
    except ImportError as e:
        return str(e)
    return None


def flash_fits(dtype: Any, head_dim: int | None, v_dim: int | None = None) -> str | None:
    """None when FlashAttention-4 takes a model of ``dtype`` and ``head_dim`` (16-bit, a head
    dim that is a multiple of 8 up to 256; value heads of ``v_dim`` the same, None: the
    head dim's), else why not (one line)."""
    if dtype is not None and not _sixteen_bit(dtype):
        return f"the model is {dtype} (FlashAttention-4 takes 16-bit)"
    for name, d in (("head_dim", head_dim), ("v_head_dim", v_dim)):
        if d is not None and (d % 8 or d > FLASH_MAX_HEAD_DIM):
            return f"{name} {d} is not a multiple of 8 up to {FLASH_MAX_HEAD_DIM}"
    return None


def dense_kernel_problem(kernel: str, device: Any, dtype: Any = None,
                         head_dim: int | None = None, v_dim: int | None = None) -> str | None:
    """Why the dense kernel ``kernel`` ("cudnn" or "flash") cannot serve a model of ``dtype``,
    ``head_dim`` and value heads of ``v_dim`` (None: unchecked / the head dim's) on ``device``,
    or None. flash needs cuDNN's too: its batched calls are cuDNN's; its own problem is named
    first."""
    why = cudnn_usable(device) or cudnn_fits(dtype, head_dim, v_dim)
    if kernel == "flash":
        why = flash_usable(device) or flash_fits(dtype, head_dim, v_dim) or why
    return why


def choose_dense_kernel(requested: str, order: tuple[str, ...], problem, others: str) -> str | None:
    """The dense kernel ``engine.prefill_attention: requested`` names, for a model whose
    ``problem(kernel)`` says why that kernel cannot serve it (None: it can): "cudnn" / "flash"
    -> that kernel, or RuntimeError naming why not and the ``others`` to set instead; "auto" ->
    the first of ``order`` that can serve, else None; any other name -> None (no dense
    kernel: the caller's own backends)."""
    if requested in ("cudnn", "flash"):
        why = problem(requested)
        if why is not None:
            raise RuntimeError(f"engine.prefill_attention: {requested} was requested but {why}; "
                               f"set it to {others}")
        return requested
    if requested == "auto":
        return next((kernel for kernel in order if problem(kernel) is None), None)
    return None
