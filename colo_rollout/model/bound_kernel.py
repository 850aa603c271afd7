"""A Triton kernel launched through the compiled variant its caller's key names (the host
path of the eager launches on P's critical path).

Triton's launch, ``kernel[grid](...)``, finds the compiled variant from every argument on
every call (its binder specialises each one, builds a key string, looks it up) before the
launch proper: 46 us of host per rope launch on the GPU machine against 13 us for the
compiled variant's own launcher (``scripts/gpu_launch_overhead.py``, 2026-12-03; docs/
benchmarks.md session 19). A P step launches two such kernels per layer on its host path and
two more before layer 0's attention, while the GPU waits (the step's head).

``BoundKernel`` keeps, per caller key, the variant Triton's launch returned the first time and
launches it directly afterwards. Contract: the caller's ``key`` determines the variant, i.e.
everything Triton specialises on -- each tensor argument's dtype and whether its data pointer
is 16-byte aligned, each integer argument's class (== 1, divisible by 16, 32 or 64 bits) and
every constexpr -- for all calls made with that key; arguments that only take values (data
pointers, integers the kernel marks ``do_not_specialize``, floats) may change freely. The
caller builds it from what can vary between its calls. ``check=True`` (tests) asks Triton's
binder on every launch and raises where the bound variant is not the one it would pick.

Off CUDA (the interpreter's CPU tensors) and where the compiled variant has no launcher of the
known form, every launch is Triton's own. Imports only torch and triton (where present).
"""

from __future__ import annotations

import torch

from colo_rollout.model.kernel_backend import triton

try:  # the launch hooks (triton >= 3.4); None: no hooks to pass
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - depends on the host
    _knobs = None

_JIT = object()  # a key whose launches go through Triton's own path


class BoundKernel:
    """``fn`` (a ``triton.jit`` function) launched as ``bk(key, grid, args, num_warps)``:
    ``args`` every parameter in signature order, constexprs included (positionally);
    ``options``: compile options every launch passes (e.g. ``enable_fp_fusion=False``)."""

    def __init__(self, fn, check: bool = False, **options) -> None:
        self.fn = fn
        self.check = check
        self.options = options
        self._variants: dict = {}

    def __call__(self, key, grid: tuple, args: tuple, num_warps: int) -> None:
        """Launch on the current stream; ``key`` None: Triton's own launch (arguments the
        caller cannot key cheaply, e.g. unaligned pointers)."""
        if key is None or not args[0].is_cuda:  # (CPU tensors: the interpreter)
            self.fn[grid](*args, num_warps=num_warps, **self.options)
            return
        dev = torch.cuda.current_device()  # Triton's variants are per current device
        kernel = self._variants.get((key, dev))
        if kernel is None:
            got = self.fn[grid](*args, num_warps=num_warps, **self.options)
            self._variants[(key, dev)] = got if _launchable(got) else _JIT
            return
        if kernel is _JIT:
            self.fn[grid](*args, num_warps=num_warps, **self.options)
            return
        if self.check:
            picked = self.fn.run(*args, grid=grid, warmup=True, num_warps=num_warps,
                                 **self.options)
            if picked is not kernel:
                raise RuntimeError(f"{self.fn.__name__}: key {key!r} names a compiled variant "
                                   "Triton's binder does not pick for these arguments (the "
                                   "caller's key misses something Triton specialises on)")
        g = tuple(grid) + (1,) * (3 - len(grid))
        stream = torch._C._cuda_getCurrentRawStream(dev)
        enter = exit_ = meta = None
        if _knobs is not None:
            enter, exit_ = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
            if enter is not None:
                meta = kernel.launch_metadata(g, stream, *args)
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, meta,
                   enter, exit_, *args)

    @property
    def variants(self) -> int:
        """Keys bound so far (a caller's key that grows without bound is a bug)."""
        return len(self._variants)


def _launchable(kernel) -> bool:
    """Whether Triton's launch returned a compiled variant whose launcher this module knows
    (triton 3.4-3.8's ``CompiledKernel``: ``run``, ``function``, ``packed_metadata``)."""
    return (triton is not None and _knobs is not None
            and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata",
                                                 "launch_metadata"))
            and getattr(kernel, "function", None) is not None)


def all_aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's data pointer is 16-byte aligned (what Triton specialises a
    pointer on): keys built where this holds need no per-pointer bits."""
    acc = 0
    for t in tensors:
        acc |= t.data_ptr()
    return acc % 16 == 0
