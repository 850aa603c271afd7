"""P attention of fresh sequences through a dense fused-attention library kernel -- cuDNN's,
via torch's SDPA (``engine.prefill_attention: cudnn``), or FlashAttention-4's CuTe DSL kernel
where ``flash_attn.cute`` is installed (``flash``) -- for GQA's heads and for multi-head latent
attention's (``dense_mla_attention``: the fresh rows' latents decompressed, query/key heads
wider than value heads).

Why: on one H200 cuDNN's dense causal attention ran 1.3-1.65x the engine's Triton kernel on
fresh sequences (4k-8k single, 8 x 1k batched: 390-600 TFLOP/s against 250-375; docs/
benchmarks.md, sessions 15-16), while its varlen entry point rebuilt its plan on every call
(~50 ms). So fresh sequences go through dense calls -- up to ``BATCHES[0]`` sequences of one
padded length per call, [S, heads, L, dim] -- and everything else (continuations, short
sequences) stays on the Triton kernel in the same P step (``plan_prefill(dense=...)`` leaves
the dense sequences out of its tiles).

Why FlashAttention-4 beside it: on one H200 its Hopper forward (``flash_attn.cute``, JIT-compiled
through nvidia-cutlass-dsl, no nvcc) ran a causal 4k sequence at 0.90x cuDNN's time (Qwen3's
32 heads) and 0.78-0.84x (16 heads; q/k/v as separate tensors), 8k at 0.87-0.94x, but 8 x 1k
batched at 1.08-1.55x; in bench-speed's P steps (same process) 0.969x at Qwen3 1 x 4k and
1.116x at 8 x 1k (docs/benchmarks.md session 27). So ``flash`` sends a call of ONE sequence
to FlashAttention-4 and batched calls to cuDNN; same calls, same padding: only the kernel
differs.

Owns: which sequences go dense (``dense_sequences``), their padded length (``padded_len``),
their grouping into calls (``dense_calls``: made once per P epoch with the plan, read by every
layer), and the calls (``dense_prefill_attention``, ``dense_mla_attention``); MLA's
variable-length call over the other sequences with flash (``VarlenCall``, ``varlen_call``,
``varlen_attention``: FlashAttention-4's varlen forward, queries at the end of each
context). Whether each kernel can run is config/attention_support.py's (the door asks it
too).

Invariants:
  * Only fresh sequences (every key is one of the step's new tokens: ctx == new) of at least
    ``MIN_TOKENS`` go dense; their keys and values are the step's own rows, as the rope
    kernel wrote them beside the cache (``rope_and_store(kv_out=...)``: the K and V it wrote
    into the cache, which the Triton kernel reads) -- no gather from the cache.
  * Q, K and V reach the kernels contiguous per row ([T, heads or groups, dim]: views of
    those, or row gathers of them): cuDNN's plans are keyed by strides too, and
    ``warm_plans`` builds the plans of exactly those.
  * A call's sequences share one padded length L (a multiple of ``PAD_MULTIPLE``) and a batch
    size from ``BATCHES``: cuDNN builds one plan per (S, L) shape (~50 ms, on its first use),
    so the shapes are few -- at most len(BATCHES) x max_seq_len / PAD_MULTIPLE.
  * Padding sits at the end of each sequence: the padded rows repeat the sequence's last row
    (finite values; the rows are gathered by a per-epoch index); causal attention is exact
    under it -- a real query at position j sees keys 0..j, all real -- and the padded queries'
    rows are dropped. A call whose sequences lie back to back with no padding reads q and
    writes its rows as views (no gather).
  * GQA is handed to the kernel (``enable_gqa``): the KV heads are never expanded.
  * On CPU (the tests) the same code runs torch's default SDPA backend: the grouping, the
    padding, the gathers and GQA are what is tested there; cuDNN and FlashAttention-4
    themselves only on a GPU.

Imports only torch (and the config level's checks); ``flash_attn.cute`` on first use of
``flash``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (the checks of whether each kernel can run live at the config level, where the door asks
# them too; imported here as this module's own)
from colo_rollout.config.attention_support import (  # noqa: F401
    cudnn_fits, cudnn_usable, flash_attention, flash_fits, flash_usable, flash_varlen)

# A fresh sequence goes dense from this many new tokens: the 1k rows of the probe (8 x 1k
# batched) were 1.5-1.65x the Triton kernel's packed grid; shorter ones are not compared.
MIN_TOKENS = 1024
# Dense lengths are padded to multiples of this: one cuDNN plan per multiple and batch size
# (built lazily on first use), at most 255 padded rows per sequence.
PAD_MULTIPLE = 256
# Sequences per dense call: a group of one padded length is cut greedily into these sizes.
BATCHES = (8, 4, 2, 1)
# engine.prefill_attention's values whose P runs dense calls (each names the dense kernel)
DENSE_BACKENDS = ("cudnn", "flash")


@dataclass(frozen=True)
class DenseCall:
    """One dense attention call of an epoch: ``seqs`` (sequence, first row, new tokens), all
    padded to ``length``; ``rows`` [S * length] the flat q row of each padded slot (a
    sequence's padding repeats its last row), or None when the sequences lie back to back
    from ``seqs[0]``'s first row with no padding (the call then works on views)."""

    length: int
    seqs: tuple[tuple[int, int, int], ...]
    rows: torch.Tensor | None

    def covers(self, tokens: int) -> bool:
        """Whether this call's rows are exactly rows [0, tokens) of q, unpadded (its result
        is then the whole output)."""
        return (self.rows is None and self.seqs[0][1] == 0
                and len(self.seqs) * self.length == tokens)


def dense_sequences(seq_lens_new: list[int], context_lens: list[int],
                    min_tokens: int = MIN_TOKENS) -> tuple[int, ...]:
    """Indices of the sequences the dense kernel takes: fresh (ctx == new) and long."""
    return tuple(s for s, (n, c) in enumerate(zip(seq_lens_new, context_lens))
                 if n == c and n >= min_tokens)


def dense_held(seq_lens_new: list[int], dense: tuple[int, ...]
               ) -> tuple[tuple[int, int, int], ...]:
    """(sequence, first row, new tokens) of each of the ``dense`` sequences, their rows back
    to back in sequence order (what ``dense_calls`` takes; the Triton kernel's plan makes the
    same for GQA)."""
    starts = row_starts(seq_lens_new)
    return tuple((s, starts[s], seq_lens_new[s]) for s in dense)


def row_starts(seq_lens_new: list[int]) -> list[int]:
    """Each sequence's first row in a P step's rows (the sequences back to back)."""
    return [0, *itertools.accumulate(seq_lens_new)][: len(seq_lens_new)]


def padded_len(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def dense_calls(held: tuple[tuple[int, int, int], ...], device: torch.device | str,
                multiple: int = PAD_MULTIPLE,
                batches: tuple[int, ...] = BATCHES) -> list[DenseCall]:
    """The epoch's dense calls for ``held`` (sequence, first row, new tokens -- the plan's
    ``dense``): grouped by padded length in sequence order, each group cut greedily into
    ``batches`` sizes; the padded row index of a call that needs one, built on the host and
    copied once (the epoch's layers share it)."""
    by_len: dict[int, list[tuple[int, int, int]]] = {}
    for seq in held:
        by_len.setdefault(padded_len(seq[2], multiple), []).append(seq)
    calls = []
    for L, group in by_len.items():
        at = 0
        while at < len(group):
            S = next(b for b in batches if b <= len(group) - at)
            seqs = tuple(group[at : at + S])
            at += S
            flat = all(n == L and q0 == seqs[0][1] + i * L for i, (_, q0, n) in enumerate(seqs))
            rows = None
            if not flat:
                idx = []
                for _, q0, n in seqs:
                    idx.extend(range(q0, q0 + n))
                    idx.extend([q0 + n - 1] * (L - n))
                rows = torch.tensor(idx, dtype=torch.int64)
                rows = (rows.pin_memory().to(device, non_blocking=True)
                        if torch.device(device).type == "cuda" else rows.to(device))
            calls.append(DenseCall(L, seqs, rows))
    return calls


def dense_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            call: DenseCall, scale: float, out: torch.Tensor | None,
                            kernel: str = "cudnn") -> torch.Tensor:
    """One dense call: the rows of ``call``'s sequences in q [T, heads, dim] (rotated)
    against their own keys, causal. k and v [T, groups, dim]: the step's rotated keys and
    values (the rope kernel's ``kv_out``: contiguous). Writes the sequences' rows of ``out``
    [T, heads, dim] and returns it; ``out`` None (the call covers every row of q back to
    back): returns the result itself, a view. ``kernel``: "cudnn", or "flash"
    (FlashAttention-4 for a call of one sequence, cuDNN for a batched one) on CUDA tensors;
    on CPU torch's SDPA either way."""
    T, heads, dim = q.shape
    g = k.shape[1]
    if heads % g or k.shape != (T, g, dim) or v.shape != (T, g, dim):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} "
                         "do not match")
    qb, kb, vb = _call_rows(call, T, q, k, v)
    return _scatter(dense_attention(qb, kb, vb, call, scale, kernel), call, out, T)


def dense_mla_attention(q: torch.Tensor, entries: torch.Tensor, w_up: torch.Tensor, nope: int,
                        call: DenseCall, scale: float, out: torch.Tensor | None,
                        kernel: str = "cudnn") -> torch.Tensor:
    """One dense call of multi-head latent attention (model/mla_attention.py): q [T, heads,
    nope + rope] (rope part rotated) against the call's own keys [k_nope | k_pe] and values,
    causal. ``entries`` [T, latent + rope]: the step's rows as the latent cache holds them
    (normalised latent, rotated rope key), decompressed here for the call's rows only
    (``mla_kv``). Rows, padding, ``out`` and ``kernel`` as ``dense_prefill_attention``'s
    (out [T, heads, v])."""
    T = q.shape[0]
    qb, eb = _call_rows(call, T, q, entries)
    k, v = mla_kv(eb, w_up, q.shape[1], nope)
    return _scatter(dense_attention(qb, k, v, call, scale, kernel), call, out, T)


def mla_kv(entries: torch.Tensor, w_up: torch.Tensor, heads: int, nope: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's keys and values of latent-cache entries [N, latent + rope] (normalised latent,
    rotated rope key) through ``w_up`` (``linear_kv_up_proj``: per head the key's nope part,
    then the value): keys [N, heads, nope + rope] (contiguous: the rope key copied to every
    head) and values [N, heads, v] (a view of the decompression) -- what every MLA P path
    attends, and, with these strides, what ``warm_mla_plans`` builds cuDNN's plans for."""
    N, rank = entries.shape[0], w_up.shape[1]
    up = F.linear(entries[:, :rank], w_up).view(N, heads, -1)
    rope = entries.shape[1] - rank
    k = torch.cat((up[..., :nope], entries[:, None, rank:].expand(N, heads, rope)), dim=-1)
    return k, up[..., nope:]


@dataclass(frozen=True)
class VarlenCall:
    """One variable-length call over sequences of any context: sequence i's ``new`` query
    rows (the last of its ``ctx`` positions) against its ``ctx`` keys, causal with the
    queries at the end. ``q_rows`` [sum new]: the rows of q it takes, in order (None: every
    row of q, back to back); ``cu_q`` / ``cu_k`` [S + 1] int32: the sequences' offsets in
    the packed queries and keys; ``kv_slots`` [sum ctx] int64: the cache slot of each packed
    key (made on the device from the block tables: no host loop over the keys)."""

    q_rows: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    kv_slots: torch.Tensor


def varlen_call(seqs: tuple[int, ...], seq_lens_new: list[int], context_lens: list[int],
                block_tables: torch.Tensor, block_size: int, to_device) -> VarlenCall:
    """The call of sequences ``seqs`` of a P epoch (their new tokens, contexts and block
    tables [S, W] on the device); ``to_device(values, dtype)`` makes host lists device
    tensors without a host wait."""
    new = [seq_lens_new[s] for s in seqs]
    ctx = [context_lens[s] for s in seqs]
    starts = row_starts(seq_lens_new)
    everything = list(seqs) == list(range(len(seq_lens_new)))
    q_rows = None if everything else to_device(
        [r for s in seqs for r in range(starts[s], starts[s] + seq_lens_new[s])], torch.int64)
    cu_q = to_device([0, *itertools.accumulate(new)], torch.int32)
    cu_k = to_device([0, *itertools.accumulate(ctx)], torch.int32)
    total_k = sum(ctx)
    dev = block_tables.device
    which = torch.repeat_interleave(torch.arange(len(seqs), device=dev),
                                    to_device(ctx, torch.int64), output_size=total_k)
    pos = torch.arange(total_k, device=dev) - cu_k[:-1].long()[which]
    tables = block_tables[to_device(list(seqs), torch.int64)]
    slots = tables[which, pos // block_size] * block_size + pos % block_size
    return VarlenCall(q_rows, cu_q, cu_k, max(new), max(ctx), slots)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: VarlenCall,
                     scale: float) -> torch.Tensor:
    """``call``'s causal attention: q [sum new, heads, dim] (its rows), k [sum ctx, kv heads,
    dim], v [sum ctx, kv heads, v dim] packed by sequence -> [sum new, heads, v dim]; query j
    of a sequence of ``new`` rows and ``ctx`` keys sees keys 0..ctx - new + j. CUDA:
    FlashAttention-4's varlen forward (its causal mask sits at the bottom right: exactly
    that); CPU (the tests): the same per sequence through SDPA."""
    if q.is_cuda:
        got = flash_varlen()(q, k, v, cu_seqlens_q=call.cu_q, cu_seqlens_k=call.cu_k,
                             max_seqlen_q=call.max_q, max_seqlen_k=call.max_k,
                             softmax_scale=scale, causal=True)
        return got[0] if isinstance(got, tuple) else got
    cu_q, cu_k = call.cu_q.tolist(), call.cu_k.tolist()
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    heads, g = q.shape[1], k.shape[1]
    for i in range(len(cu_q) - 1):
        n, c = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        qs = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)
        ks, vs = (t[cu_k[i] : cu_k[i + 1]].transpose(0, 1) for t in (k, v))
        mask = (torch.arange(c)[None, :] <= (c - n + torch.arange(n))[:, None])
        out[cu_q[i] : cu_q[i + 1]] = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=heads != g).transpose(0, 1)
    return out


def _call_rows(call: DenseCall, T: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The call's rows of each [T, ...] tensor: views where its sequences lie back to back
    unpadded (the tensors themselves where the call covers them), else gathered by the
    call's padded row index."""
    if call.rows is None:
        q0, n = call.seqs[0][1], len(call.seqs) * call.length
        return [t if q0 == 0 and n == T else t[q0 : q0 + n] for t in tensors]
    return [t.index_select(0, call.rows) for t in tensors]


def dense_attention(qb: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: DenseCall,
                    scale: float, kernel: str) -> torch.Tensor:
    """The call's causal attention: qb [S * L, heads, dim], k [S * L, kv heads, dim], v
    [S * L, kv heads, v dim] (the call's rows) -> [S, L, heads, v dim]. ``kernel`` "flash":
    FlashAttention-4 for a call of one sequence, else (and "cudnn") cuDNN's fused attention
    on CUDA tensors; torch's SDPA on CPU."""
    S, L = len(call.seqs), call.length
    heads, dim, g, dv = qb.shape[1], qb.shape[2], k.shape[1], v.shape[2]
    if qb.is_cuda and kernel == "flash" and S == 1:  # (batched calls stay cuDNN's: below)
        # [S, L, h, dim] views of the token-major rows; GQA's k and v as they are, each KV
        # head's query heads as their own rows (``pack_gqa=False``: FA4's default packs them
        # into one query block -- 1.02-1.03x slower at one sequence of 4k-8k on an H100;
        # docs/benchmarks.md session 40)
        got = flash_attention()(qb.view(S, L, heads, dim), k.view(S, L, g, dim),
                                v.view(S, L, g, dv), softmax_scale=scale, causal=True,
                                pack_gqa=False)
        return got[0] if isinstance(got, tuple) else got  # [S, L, heads, dv]
    # [S, h, L, dim] views of the token-major rows (SDPA takes the strides)
    qd, kd, vd = (t.view(S, L, t.shape[1], t.shape[2]).transpose(1, 2) for t in (qb, k, v))
    if qb.is_cuda:
        # the op SDPA's dispatcher calls for its cuDNN backend, with the same arguments (GQA's
        # k and v handed over as they are): no backend context to enter and leave, no
        # selection -- ~0.1 ms of host per call, on P's critical path. A shape cuDNN cannot
        # take raises here as the forced backend did.
        o = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qd, kd, vd, None, False, 0.0, True, False, scale=scale)[0]
    else:  # CPU (the tests): SDPA's own selection
        o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale,
                                           enable_gqa=heads != g)
    return o.transpose(1, 2)


def _scatter(o: torch.Tensor, call: DenseCall, out: torch.Tensor | None, T: int
             ) -> torch.Tensor:
    """A call's result o [S, L, heads, dim] as its sequences' rows: the output itself where
    the call covers all T rows (``out`` None), else written into ``out``'s rows (padding
    dropped)."""
    S, L, heads, dim = o.shape
    if out is None:
        if not call.covers(T):
            raise ValueError("a call that does not cover q back to back needs out")
        return o.reshape(T, heads, dim)
    if call.rows is None:
        q0 = call.seqs[0][1]
        out[q0 : q0 + S * L] = o.reshape(S * L, heads, dim)
    else:
        for i, (_, q0, n) in enumerate(call.seqs):
            out[q0 : q0 + n] = o[i, :n]
    return out


def warm_plans(heads: int, groups: int, dim: int, dtype: torch.dtype, device: torch.device,
               max_tokens: int, max_len: int, multiple: int = PAD_MULTIPLE,
               batches: tuple[int, ...] = BATCHES, kernel: str = "cudnn") -> int:
    """Run one dense call of every shape ``dense_calls`` can make for P steps of up to
    ``max_tokens`` tokens and sequences of up to ``max_len``, so that cuDNN builds each plan
    (40-70 ms apiece on one H200) -- or FlashAttention-4 JIT-compiles its kernel (~2.5 s, once
    per process) -- before serving rather than inside a P epoch. Returns the shapes run."""
    shapes = _call_shapes(max_tokens, max_len, multiple, batches)
    for call in shapes:
        T = len(call.seqs) * call.length
        q = torch.zeros(T, heads, dim, dtype=dtype, device=device)
        k = torch.zeros(T, groups, dim, dtype=dtype, device=device)
        dense_prefill_attention(q, k, torch.zeros_like(k), call, dim ** -0.5, None, kernel)
    return len(shapes)


def warm_mla_plans(heads: int, nope: int, rope: int, v_dim: int, rank: int,
                   dtype: torch.dtype, device: torch.device, max_tokens: int, max_len: int,
                   multiple: int = PAD_MULTIPLE, batches: tuple[int, ...] = BATCHES,
                   kernel: str = "cudnn") -> int:
    """``warm_plans`` for MLA's dense calls (``dense_mla_attention``: its keys and values
    with the strides ``mla_kv`` gives them; ``rank``: the latent width)."""
    shapes = _call_shapes(max_tokens, max_len, multiple, batches)
    w_up = torch.zeros(heads * (nope + v_dim), rank, dtype=dtype, device=device)
    for call in shapes:
        T = len(call.seqs) * call.length
        q = torch.zeros(T, heads, nope + rope, dtype=dtype, device=device)
        entries = torch.zeros(T, rank + rope, dtype=dtype, device=device)
        dense_mla_attention(q, entries, w_up, nope, call, (nope + rope) ** -0.5, None, kernel)
    return len(shapes)


def _call_shapes(max_tokens: int, max_len: int, multiple: int,
                 batches: tuple[int, ...]) -> list[DenseCall]:
    """One unpadded call of every (batch size, padded length) ``dense_calls`` can make."""
    calls = []
    for S in batches:
        L = padded_len(MIN_TOKENS, multiple)
        while L <= min(max_len, max_tokens // S):
            calls.append(DenseCall(L, tuple((s, s * L, L) for s in range(S)), None))
            L += multiple
    return calls
