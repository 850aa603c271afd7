"""FlashAttention-4's dense causal forward launched through the compiled kernel its first call
found (the host path of P's dense attention calls: layer 0's lies on the step's head, while
the GPU waits).

``flash_attn_func`` goes through torch's autograd Function and ``_flash_attn_fwd``'s ~600
lines of argument checks, heuristics and compile-key building before it calls the compiled
kernel (a TVM-FFI function taking the torch tensors as they are): ~130-165 us of host per call
on the GPU machine, the largest single launch lag of layer 0 (docs/benchmarks.md session 33).

``BoundFlash`` runs that full path once per call shape (q, k, v shapes, strides and dtypes,
the scale), records the one compiled function it called and its arguments, and from then on
calls that function itself with the new q, k, v and a fresh output. A shape is bound only
when the recorded call is replayable: exactly one call of the compiled function, whose tensor
arguments are exactly q, k, v and the output it returned (no lse, no scheduler metadata, no
split-KV partials, no contiguous copies of the inputs) -- anything else keeps that shape on
the full path. ``check=True`` (the GPU tests) runs both and raises where they differ.

Imports torch only; ``flash_attn.cute.interface`` on the first call (or the ``interface``
given, the tests' stand-in).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FULL = object()  # a shape whose calls take the full path


@dataclass(frozen=True)
class _Bound:
    fn: object  # the compiled kernel's callable
    args: tuple  # its recorded arguments
    at: tuple[int, int, int, int]  # positions of q, k, v and the output in args


class _Recording:
    """Stands in for ``_flash_attn_fwd.compile_cache`` during one full call: lookups and
    stores go to the real cache; each compiled function fetched is wrapped to record its
    call."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.calls: list[tuple[object, tuple]] = []

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __setitem__(self, key, value) -> None:
        self.cache[key] = value

    def __getitem__(self, key):
        fn = self.cache[key]

        def recorded(*args):
            self.calls.append((fn, args))
            return fn(*args)

        return recorded


class BoundFlash:
    """``bf(q, k, v, scale)``: causal attention of q [S, L, heads, dim] over k [S, L, groups,
    dim] and v [S, L, groups, v dim] (CUDA) -> [S, L, heads, v dim], as ``flash_attn_func``
    returns it."""

    def __init__(self, interface=None, check: bool = False) -> None:
        self._interface = interface
        self.check = check
        self._calls: dict = {}

    def _fa(self):
        if self._interface is None:
            from flash_attn.cute import interface

            self._interface = interface
        return self._interface

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.stride(), k.stride(),
               v.stride(), q.dtype, k.dtype, v.dtype, q.device, float(scale))
        bound = self._calls.get(key)
        if bound is None:
            out, self._calls[key] = self._record(q, k, v, scale)
            return out
        if bound is _FULL:
            return self._full(q, k, v, scale)
        out = torch.empty((*q.shape[:3], v.shape[3]), dtype=q.dtype, device=q.device)
        args = list(bound.args)
        for i, t in zip(bound.at, (q, k, v, out)):
            args[i] = t
        bound.fn(*args)
        if self.check:
            want = self._full(q, k, v, scale)
            if not torch.equal(out, want):
                raise RuntimeError(f"BoundFlash: the bound call differs from the full path at "
                                   f"q {tuple(q.shape)}, k {tuple(k.shape)}")
        return out

    def _full(self, q, k, v, scale) -> torch.Tensor:
        return self._fa()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True)[0]

    def _record(self, q, k, v, scale):
        """The full call, recorded: (its output, the _Bound that replays it or _FULL)."""
        fwd = self._fa()._flash_attn_fwd
        cache = fwd.compile_cache
        rec = _Recording(cache)
        fwd.compile_cache = rec
        try:
            out = self._full(q, k, v, scale)
        finally:
            fwd.compile_cache = cache
        return out, _replayable(rec.calls, q, k, v, out)


def _replayable(calls, q, k, v, out):
    """The recorded call as a _Bound, or _FULL where it is not one call whose tensor
    arguments are exactly q, k, v and out (each found once, by its storage address and
    shape)."""
    if len(calls) != 1:
        return _FULL
    fn, args = calls[0]
    tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    want = (q, k, v, out)
    if len(tensors) != len(want):
        return _FULL
    at = []
    for t in want:
        hits = [i for i, a in tensors if a.data_ptr() == t.data_ptr() and a.shape == t.shape
                and a.stride() == t.stride() and a.dtype == t.dtype]
        if len(hits) != 1:
            return _FULL
        at.append(hits[0])
    if len(set(at)) != len(at):
        return _FULL
    # containers holding tensors (a scheduler's metadata, block-sparse tables) are not
    # replayable either: their tensors would be the first call's
    for a in args:
        if isinstance(a, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in a):
            return _FULL
    return _Bound(fn, tuple(args), tuple(at))
