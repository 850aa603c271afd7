"""The per-sequence P attention loop: the oracle the batched (bucketed) P attention is checked
against, kept out of the model's hot module.

Owns ``prefill_per_sequence(attn, q, kv, layer, meta)``: one SDPA call per sequence against
its own keys, with the causal offset of a continuation prefill (query j of a sequence with
``new`` tokens and context ``ctx`` sits at position ctx - new + j and sees keys 0..that). Its
arguments are those of ``PagedSelfAttention._prefill`` (``attn`` supplies heads, groups,
head_dim, scale and ``_gather_kv``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_per_sequence(attn, q: torch.Tensor, kv, layer: int, meta) -> torch.Tensor:
    outs = []
    start = 0
    for i, n in enumerate(meta.seq_lens_new):
        ctx = meta.context_lens_host[i]
        k, v = attn._gather_kv(kv, layer, meta.block_tables[i : i + 1])
        k, v = k[0, :ctx], v[0, :ctx]  # [ctx, heads, dim]
        qi = q[start : start + n]  # [n, heads, dim]
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        o = F.scaled_dot_product_attention(
            qi.transpose(0, 1), k.transpose(0, 1).to(qi.dtype), v.transpose(0, 1).to(qi.dtype),
            attn_mask=kpos <= qpos, scale=attn.scale,
        )
        outs.append(o.transpose(0, 1))
        start += n
    if not outs:
        return q.new_zeros((0, attn.heads, attn.head_dim))
    return torch.cat(outs, dim=0)


def kv_from_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's rotated keys and values as the rope kernel's ``kv_out`` holds them after the
    step -- each [T, groups, dim], contiguous -- rebuilt from the K and V that the step wrote
    into one layer's cache [blocks, block_size, groups, dim] at ``slots`` [T]. What the dense
    P calls read (model/dense_prefill.py), for tests that start from a cache."""
    g, dim = k_cache.shape[2], k_cache.shape[3]
    return k_cache.reshape(-1, g, dim)[slots], v_cache.reshape(-1, g, dim)[slots]