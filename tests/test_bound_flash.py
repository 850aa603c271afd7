"""model/bound_flash.py: FlashAttention-4's dense causal forward through the compiled kernel
its first call of a shape found.

CPU: a stand-in for ``flash_attn.cute.interface`` with FA4's protocol (``_flash_attn_fwd``
looks its kernel up in ``compile_cache``, compiles on a miss, calls it with q, k, v, the
output and the rest) computing real attention: the first call of a shape is the full path,
later ones call the recorded kernel alone and return the same numbers; calls that are not
replayable (an lse or another tensor among the arguments, two kernel calls, a copied input)
stay on the full path every time. GPU (FlashAttention-4 installed): the bound calls' bytes
equal the full path's at the engine's shapes (``check``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from colo_rollout.model.bound_flash import BoundFlash


def _attention(q, k, v, out, scale):
    """Causal attention of [S, L, h, d] rows (GQA), written into out."""
    S, L, h, _ = q.shape
    g = k.shape[2]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, scale=scale, enable_gqa=h != g)
    out.copy_(o.transpose(1, 2))


class _Interface:
    """FA4's calling protocol, in miniature. ``extra``: an lse tensor among the kernel's
    arguments; ``calls``: kernel calls per forward (2: a split); ``copy_q``: q made
    contiguous by a copy before the call."""

    def __init__(self, extra=False, calls=1, copy_q=False) -> None:
        self.full = 0  # forwards through the full path
        self.kernel = 0  # kernel calls, either path
        iface = self

        def kernel(q, k, v, out, lse, scale, cu_q, cu_k, window):
            iface.kernel += 1
            _attention(q, k, v, out, scale)

        def fwd(q, k, v, softmax_scale=None, causal=False):
            iface.full += 1
            assert causal
            key = (q.dtype, q.shape[-1], v.shape[-1], q.shape[2] // k.shape[2])
            if key not in fwd.compile_cache:
                fwd.compile_cache[key] = kernel
            if copy_q:
                q = q.clone()
            out = torch.empty(*q.shape[:3], v.shape[3], dtype=q.dtype)
            lse = torch.empty(q.shape[:3]) if extra else None
            for _ in range(calls):
                fwd.compile_cache[key](q.detach(), k.detach(), v.detach(), out, lse,
                                       softmax_scale, None, None, (None, None))
            return out, lse, None, None

        fwd.compile_cache = {}
        self._flash_attn_fwd = fwd


def _qkv(S=1, L=32, h=4, g=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(S, L, h, d, generator=gen), torch.randn(S, L, g, d, generator=gen),
            torch.randn(S, L, g, d, generator=gen))


def _want(q, k, v, scale):
    out = torch.empty(*q.shape[:3], v.shape[3])
    _attention(q, k, v, out, scale)
    return out


def test_the_first_call_of_a_shape_is_full_and_later_ones_call_the_kernel_alone():
    fa = _Interface()
    bf = BoundFlash(interface=fa)
    for seed in range(4):
        q, k, v = _qkv(seed=seed)
        got = bf(q, k, v, 0.25)
        assert torch.equal(got, _want(q, k, v, 0.25))
    assert (fa.full, fa.kernel) == (1, 4)
    # another shape, another scale: each recorded once
    q, k, v = _qkv(S=2, L=48, seed=9)
    for _ in range(2):
        assert torch.equal(bf(q, k, v, 0.25), _want(q, k, v, 0.25))
        assert torch.equal(bf(q, k, v, 0.5), _want(q, k, v, 0.5))
    assert (fa.full, fa.kernel) == (3, 8)
    # the library's own cache is left as it was (the recording stood in for one call)
    assert isinstance(fa._flash_attn_fwd.compile_cache, dict)


def test_the_bound_call_writes_a_fresh_output_each_time():
    bf = BoundFlash(interface=_Interface())
    q, k, v = _qkv()
    first = bf(q, k, v, 0.25)
    second = bf(q * 2, k, v, 0.25)
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first, _want(q, k, v, 0.25))
    assert torch.equal(second, _want(q * 2, k, v, 0.25))


@pytest.mark.parametrize("kind", ["extra tensor", "two kernel calls", "copied q"])
def test_calls_that_are_not_replayable_stay_on_the_full_path(kind):
    fa = _Interface(extra=kind == "extra tensor", calls=2 if kind == "two kernel calls" else 1,
                    copy_q=kind == "copied q")
    bf = BoundFlash(interface=fa)
    for seed in range(3):
        q, k, v = _qkv(seed=seed)
        assert torch.equal(bf(q, k, v, 0.25), _want(q, k, v, 0.25))
    assert fa.full == 3


def test_check_catches_a_bound_call_that_differs():
    fa = _Interface()
    bf = BoundFlash(interface=fa, check=True)
    q, k, v = _qkv()
    bf(q, k, v, 0.25)
    bf(q, k, v, 0.25)  # bound, checked against the full path: equal
    # a kernel that no longer computes what the full path does
    (key, _), = fa._flash_attn_fwd.compile_cache.items()
    bound = next(iter(bf._calls.values()))
    object.__setattr__(bound, "fn", lambda q, k, v, out, *rest: out.zero_())
    with pytest.raises(RuntimeError, match="differs from the full path"):
        bf(q, k, v, 0.25)


def _flash_on_gpu() -> bool:
    if not torch.cuda.is_available():
        return False
    from colo_rollout.config.attention_support import flash_usable
    return flash_usable(torch.device("cuda")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not _flash_on_gpu(), reason="needs a GPU with FlashAttention-4")
@pytest.mark.parametrize("heads,groups,dim,dv", [(16, 4, 128, 128), (32, 4, 128, 128),
                                                 (16, 16, 192, 128)])
def test_bound_calls_are_the_full_paths_bytes_on_the_gpu(heads, groups, dim, dv):
    bf = BoundFlash(check=True)  # every bound call compared with the full path, bitwise
    dev = torch.device("cuda")
    for L in (256, 1024, 4096, 1024, 256):
        gen = torch.Generator(device=dev).manual_seed(L)
        q = torch.randn(1, L, heads, dim, device=dev, generator=gen).bfloat16()
        k = torch.randn(1, L, groups, dim, device=dev, generator=gen).bfloat16()
        v = torch.randn(1, L, groups, dv, device=dev, generator=gen).bfloat16()
        for _ in range(2):
            out = bf(q, k, v, dim ** -0.5)
        ref = F.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
            is_causal=True, scale=dim ** -0.5, enable_gqa=heads != groups).transpose(1, 2)
        assert (out.float() - ref).abs().max().item() < 2e-2
    from colo_rollout.model import bound_flash
    assert all(b is not bound_flash._FULL for b in bf._calls.values()), \
        "a dense shape stayed on the full path on the GPU"
