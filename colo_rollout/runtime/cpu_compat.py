"""CPU compatibility layer: the exact places where megatron-core assumes CUDA, patched for CPU.

Applied only when CUDA is unavailable (``install_cpu_compat`` is a no-op on a GPU host), and
idempotent. Each patch names the megatron call sites it serves; tests/test_cpu_compat.py checks
each one is needed and sufficient.

1. ``torch.cuda.current_device()`` returns ``"cpu"``. megatron uses it as a *device argument*
   (``RotaryEmbedding.get_emb`` moves ``inv_freq`` to it; ``TopKRouter`` allocates expert-bias
   buffers on it; ``SequentialMLP``/``MLP`` helpers). Returning the CPU device keeps those
   tensors on the CPU instead of initialising CUDA (which raises without a driver).
2. megatron's CUDA RNG tracker (``get_cuda_rng_tracker().fork()``, used by megatron modules when
   dropout or expert init runs under a model-parallel RNG state) seeds CUDA generators. We call
   ``initialize_rng_tracker(inference_rng_tracker=True)``, megatron's own inference tracker,
   whose ``fork()`` is a no-op context.

3. ``torch.cuda.synchronize()`` is a no-op. megatron's resharding (``execute_reshard_plan``)
   synchronizes the device around its copies; CPU copies are already synchronous.

Must not go in here: anything that changes numerics, or patches beyond these call sites.
"""

from __future__ import annotations

import torch

_ORIGINAL_CURRENT_DEVICE = torch.cuda.current_device
_ORIGINAL_SYNCHRONIZE = torch.cuda.synchronize


def _cpu_current_device():
    return "cpu"


def _cpu_synchronize(device=None) -> None:
    return None


def cpu_compat_active() -> bool:
    return torch.cuda.current_device is _cpu_current_device


def install_cpu_compat() -> bool:
    """Apply the patches when there is no CUDA; returns True if they are active."""
    if torch.cuda.is_available():
        return False
    if not cpu_compat_active():
        torch.cuda.current_device = _cpu_current_device
        torch.cuda.synchronize = _cpu_synchronize
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return True


def uninstall_cpu_compat() -> None:
    """Undo patches 1 and 3 (used by the tests that show the patches are needed)."""
    torch.cuda.current_device = _ORIGINAL_CURRENT_DEVICE
    torch.cuda.synchronize = _ORIGINAL_SYNCHRONIZE
