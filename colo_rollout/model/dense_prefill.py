"""P attention of long fresh sequences through a dense fused-attention library kernel
(cuDNN's, via torch's SDPA) -- ``engine.prefill_attention: cudnn``.

Why: on one H200 cuDNN's dense causal attention ran 1.3-1.6x the engine's Triton kernel on
fresh 4k-8k sequences (530-616 TFLOP/s at the Qwen3 shape against ~350-377; docs/
benchmarks.md, session 15), while its varlen entry point rebuilt its plan on every call
(~50 ms). So the dense kernel takes one fresh sequence per call, padded to a length bucket
(one cuDNN plan per bucket), and everything else -- continuations, short sequences -- stays
on the Triton kernel in the same P step (``plan_prefill(dense=...)`` leaves those sequences
out of its tiles).

Owns: which sequences go dense (``dense_sequences``), their padded length (``padded_len``)
and the call (``dense_prefill_attention``).

Invariants:
  * Only fresh sequences (every key is one of the step's new tokens: ctx == new) of at least
    ``MIN_TOKENS`` go dense; their keys are read back from the cache rows the rope kernel
    wrote (``slot_mapping``), so K is the rotated K the Triton kernel would read.
  * Padding sits at the end of the sequence (zeros): causal attention is exact under it -- a
    real query at position j sees keys 0..j, all real -- and the padded queries' rows are
    dropped.
  * The KV heads are expanded to the query heads (torch's SDPA hands GQA to cuDNN only as
    full heads); the copies are O(T x heads x dim), small beside the O(T^2) attention.
  * On CPU (the tests) the same code runs torch's default SDPA backend: the padding, the
    gather and the head expansion are what is tested there; cuDNN itself only on a GPU.

Imports only torch (and the config's constant).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from colo_rollout.config.schema import CUDNN_MIN_VERSION

# A fresh sequence goes dense from this many new tokens: the probe measured 4k and 8k
# (1.3-1.6x); at 1k the Triton kernel's packed grid over many sequences is not yet compared.
MIN_TOKENS = 2048
# Dense lengths are padded to multiples of this: one cuDNN plan per multiple (at most
# max_seq_len / 256 plans, built lazily on first use), at most 255 padded rows per call.
PAD_MULTIPLE = 256


def dense_sequences(seq_lens_new: list[int], context_lens: list[int],
                    min_tokens: int = MIN_TOKENS) -> tuple[int, ...]:
    """Indices of the sequences the dense kernel takes: fresh (ctx == new) and long."""
    return tuple(s for s, (n, c) in enumerate(zip(seq_lens_new, context_lens))
                 if n == c and n >= min_tokens)


def padded_len(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def cudnn_usable(device: torch.device | str) -> str | None:
    """None when the dense path can run on ``device``, else why not (one line)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the device is {device}"
    if not torch.backends.cudnn.is_available() or torch.backends.cudnn.version() is None:
        return "this torch has no cuDNN"
    if torch.backends.cudnn.version() < CUDNN_MIN_VERSION:
        return f"cuDNN {torch.backends.cudnn.version()} is older than {CUDNN_MIN_VERSION}"
    return None


def _cudnn_kernel(device: torch.device):
    """Context: SDPA on cuDNN's backend (CUDA), the default selection elsewhere (CPU tests)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)


def dense_prefill_attention(q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor,
                            slots: torch.Tensor, scale: float,
                            multiple: int = PAD_MULTIPLE) -> torch.Tensor:
    """One fresh sequence: q [n, heads, dim] (its new tokens, rotated) against its own keys,
    read from one layer's cache kv_k/kv_v [blocks, block_size, groups, dim] at ``slots`` [n]
    (where the rope kernel wrote them) -> [n, heads, dim] in q's dtype, causal."""
    n, heads, dim = q.shape
    g = kv_k.shape[2]
    if heads % g:
        raise ValueError(f"q's {heads} heads are not a multiple of the cache's {g} groups")
    L = padded_len(n, multiple)
    k = kv_k.view(-1, g, dim).index_select(0, slots)  # [n, g, dim]
    v = kv_v.view(-1, g, dim).index_select(0, slots)
    qp = q.new_zeros((L, heads, dim))
    qp[:n] = q
    kp = k.new_zeros((L, g, dim))
    kp[:n] = k
    vp = v.new_zeros((L, g, dim))
    vp[:n] = v
    rep = heads // g
    if rep > 1:  # megatron's layout: q head h reads KV group h // rep
        kp = kp.repeat_interleave(rep, dim=1)
        vp = vp.repeat_interleave(rep, dim=1)
    # [1, heads, L, dim] views of the token-major buffers (SDPA takes the strides)
    qd, kd, vd = (t.transpose(0, 1).unsqueeze(0) for t in (qp, kp, vp))
    with _cudnn_kernel(q.device):
        o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
    return o[0].transpose(0, 1)[:n]
