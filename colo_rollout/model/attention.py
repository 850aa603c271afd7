"""Paged-KV self-attention for inference, with megatron-core parallel linears.

Owns: the per-layer KV storage of one rank (its ATP shard of the KV heads), the metadata a
forward needs to read/write it (``AttnMetadata``), and ``PagedSelfAttention`` whose parameters are
named and laid out exactly like megatron's ``SelfAttention`` (``linear_qkv`` grouped
[q_0..q_{n-1}, k, v] per query group, ``linear_proj`` row-parallel), so a megatron state dict
loads into it shard by shard.

Invariants:
  * Block ``num_blocks`` (one past the manager's range) is a sink: padded D rows write and read
    it, so padding never touches a live reservation.
  * P writes its new K/V straight into the request's reservation (slot mapping) before reading,
    so a continuation prefill sees the retained context plus its own tokens.
  * ``forward`` returns the ATP-*partial* output of ``linear_proj`` (no reduction): the caller's
    communication path decides how it is reduced (P: full AllReduce, D: ATP ReduceScatter).

Must not go in here: block allocation (kv_cache.py), collectives (comm.py), scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

from colo_rollout.model.dense_prefill import (
    DENSE_BACKENDS,
    dense_calls,
    dense_prefill_attention,
    dense_sequences,
)
from colo_rollout.model.batch_invariant import SPLIT_TOKENS, invariant_linear
from colo_rollout.model.fp8_linear import fp8_linear
from colo_rollout.model.kernel_backend import as_dtype
from colo_rollout.model.paged_attention import decode_attention
from colo_rollout.model.rope_kv import QKRMSNorm, rope_and_store, rotate
from colo_rollout.model.paged_prefill import (
    PlanHost,
    plan_prefill,
    plan_prefill_host,
    triton_available,
    triton_prefill_attention,
)


def plain_column_linear(linear: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)[0]`` for megatron's ColumnParallelLinear without sequence parallelism,
    output gather or skipped bias, in inference: the same ops its forward runs
    (``torch.matmul(x, weight.t())``, then ``+ bias``), so the same bits."""
    out = torch.matmul(x, linear.weight.t())
    return out if linear.bias is None else out + linear.bias


@dataclass
class AttnMetadata:
    """Where one forward's tokens live in the paged cache (this replica's rows only).

    P: ``seq_starts``/``seq_lens_new`` split the flat token axis into sequences; each sequence's
    query at position p attends keys 0..p. D: one token per row; ``context_lens`` = position+1.
    """

    is_prefill: bool
    positions: torch.Tensor  # [T] int64 absolute positions
    slot_mapping: torch.Tensor  # [T] int64 flat slot = block * block_size + offset
    block_tables: torch.Tensor  # [S, max_blocks] int64 (padded with the sink block)
    context_lens: torch.Tensor  # [S] int64 tokens in cache after this forward
    seq_lens_new: list[int]  # P only: new tokens per sequence (host values)
    context_lens_host: list[int]  # host copy of context_lens (P only; avoids device syncs)
    # P only: sequences batched by context-length bucket (built once per P epoch, used by
    # every layer); see prefill_buckets
    buckets: list[PrefillBucket] = field(default_factory=list)
    # P only, triton / cudnn backends: the kernel's launch plan (model/paged_prefill.py), made
    # with the step's inputs (the runner: its tables in their one copy) or else by the epoch's
    # first layer, and read by every layer
    prefill_plan: object | None = None
    # P only, cudnn backend: the dense calls of the sequences the plan leaves out (model/
    # dense_prefill.py), made with the plan
    dense_calls: list = field(default_factory=list)
    # P only, MLA with flash: one variable-length call over the sequences the dense calls
    # leave (model/dense_prefill.py ``VarlenCall``), made with the step's inputs
    varlen: object | None = None


class RopeAngles:
    """cos and sin of the rotary angles of one forward's tokens, [T, 1, rot_dim], computed in
    fp32 and cast once per dtype, on first use. Made once per forward and read by every
    layer: megatron's ``_apply_rotary_pos_emb_bshd`` recomputes them for q and for k of every
    layer, and on a GPU every op is host launch time on P's critical path. Must be made inside
    the forward (never cached on the metadata): a captured D graph has to recompute them on
    replay.

    ``tables`` (``InferenceGPT.rope_tables``: dtype -> cos and sin of every position,
    [P, rot_dim], the same elementwise ops on the same angles, so bitwise these rows): the
    rope kernel reads row ``positions[t]`` itself (``kernel_angles``), and no per-step angle
    kernel runs at all where nothing else asks for them."""

    def __init__(self, table: torch.Tensor, positions: torch.Tensor, tables=None,
                 mscale: float = 1.0) -> None:
        self.table, self.positions, self._tables = table, positions, tables
        # megatron's ``_apply_rotary_pos_emb_bshd``: cos and sin times mscale in fp32, then
        # the cast (YaRN's concentration factor; 1 otherwise: an exact no-op)
        self.mscale = mscale
        self._fp32: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kernel: dict[torch.dtype, tuple] = {}

    def cos_sin(self, dtype: torch.dtype, ndim: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, ..., 1, rot_dim] (``ndim`` dims, to broadcast over the head dims)."""
        got = self._cast.get((dtype, ndim))
        if got is None:
            if self._fp32 is None:
                freqs = self.table[self.positions].view(self.positions.shape[0], 1,
                                                        self.table.shape[-1])
                cos, sin = torch.cos(freqs), torch.sin(freqs)
                if self.mscale != 1.0:  # (x * 1.0 is x: skipped, the same bits)
                    cos, sin = cos * self.mscale, sin * self.mscale
                self._fp32 = (cos, sin)
            shape = (self._fp32[0].shape[0],) + (1,) * (ndim - 2) + (self._fp32[0].shape[-1],)
            got = self._cast[(dtype, ndim)] = tuple(a.to(dtype).view(shape) for a in self._fp32)
        return got

    def kernel_angles(self, dtype: torch.dtype):
        """(cos, sin, positions) for ``rope_and_store``: the whole tables and the positions
        where there are tables, else the step's rows [T, rot] and None."""
        got = self._kernel.get(dtype)  # once per forward and dtype: every layer asks
        if got is None:
            if self._tables is not None:
                got = (*self._tables(dtype), self.positions)
            else:
                got = (*self.cos_sin(dtype, 2), None)
            self._kernel[dtype] = got
        return got


def apply_rope(t: torch.Tensor, rope: RopeAngles) -> torch.Tensor:
    """megatron's ``_apply_rotary_pos_emb_bshd`` on t [T, ..., dim] with the forward's angles
    (model/rope_kv.py: ``rotate``)."""
    return rotate(t, *rope.cos_sin(t.dtype, t.dim()))


@dataclass
class PrefillBucket:
    """P sequences whose contexts fall in one power-of-two length bucket, attended in one
    batched call: queries padded to ``n_max`` rows, keys to ``blocks`` cache blocks."""

    seqs: torch.Tensor  # [Sb] indices into block_tables
    q_rows: torch.Tensor  # [Sb, n_max] flat query row of each padded slot (pads: row 0)
    slots: torch.Tensor  # [n_valid] padded slots (s * n_max + j) that hold a real query
    out_rows: torch.Tensor  # [n_valid] flat row of each of those slots
    ctx: torch.Tensor  # [Sb] context length after this P (keys 0..ctx-1)
    new: torch.Tensor  # [Sb] new tokens (queries sit at positions ctx-new .. ctx-1)
    n_max: int
    blocks: int
    # [Sb, 1, n_max, keys] causal mask, made by the epoch's first layer and read by the rest
    # (the bucket lives for one P epoch; P is never graph-captured)
    mask: torch.Tensor | None = None

    def causal_mask(self, keys: int) -> torch.Tensor:
        if self.mask is None:
            dev = self.ctx.device
            qpos = (self.ctx - self.new)[:, None] + torch.arange(self.n_max, device=dev)[None, :]
            kpos = torch.arange(keys, device=dev)
            self.mask = (kpos[None, None, :] <= qpos[:, :, None])[:, None]
        return self.mask


def prefill_buckets(seq_lens_new: list[int], context_lens: list[int], block_size: int,
                    to_device, merge_pairs: int = 0,
                    skip: frozenset[int] = frozenset()) -> list[PrefillBucket]:
    """Group P sequences by context length (next power of two, in blocks) so that one P
    layer's attention is a few batched calls instead of one per sequence; padding costs at
    most 2x keys per bucket. Then neighbouring buckets are merged while a merge adds at most
    ``merge_pairs`` padded (query, key) pairs: every bucket costs a dozen kernel launches per
    layer (host time, which is what a short P epoch is bound by), padding costs GPU time (what
    a long one is bound by). ``to_device(values, dtype)`` makes host lists device tensors
    without a host wait. Sequences in ``skip`` are in no bucket (a dense call attends them:
    model/dense_prefill.py). Pure host logic apart from that."""
    by_key: dict[int, list[int]] = {}
    for i, ctx in enumerate(context_lens):
        if i in skip:
            continue
        nb = -(-ctx // block_size)
        key = 1
        while key < nb:
            key *= 2
        by_key.setdefault(key, []).append(i)

    def pairs(seqs: list[int]) -> int:  # padded (query, key) pairs of one bucket
        return (len(seqs) * max(seq_lens_new[i] for i in seqs)
                * max(-(-context_lens[i] // block_size) for i in seqs) * block_size)

    merged: list[list[int]] = []
    for key in sorted(by_key):
        seqs = by_key[key]
        if merged and pairs(merged[-1] + seqs) - pairs(merged[-1]) - pairs(seqs) <= merge_pairs:
            merged[-1] = merged[-1] + seqs
        else:
            merged.append(seqs)
    starts, off = [], 0
    for n in seq_lens_new:
        starts.append(off)
        off += n
    out = []
    i64 = torch.int64
    for seqs in merged:
        n_max = max(seq_lens_new[i] for i in seqs)
        q_rows, slots, out_rows = [], [], []
        for s_idx, i in enumerate(seqs):
            n = seq_lens_new[i]
            q_rows.extend(list(range(starts[i], starts[i] + n)) + [0] * (n_max - n))
            slots.extend(range(s_idx * n_max, s_idx * n_max + n))
            out_rows.extend(range(starts[i], starts[i] + n))
        blocks = max(-(-context_lens[i] // block_size) for i in seqs)
        out.append(PrefillBucket(
            seqs=to_device(seqs, i64), q_rows=to_device(q_rows, i64).view(len(seqs), n_max),
            slots=to_device(slots, i64), out_rows=to_device(out_rows, i64),
            ctx=to_device([context_lens[i] for i in seqs], i64),
            new=to_device([seq_lens_new[i] for i in seqs], i64), n_max=n_max, blocks=blocks))
    return out


class KVStorage:
    """K and V tensors of every layer for this rank: [L, num_blocks + 1, block, kv_heads, dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_blocks + 1, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.sink_block = num_blocks
        # each layer's cache as [slots, kv_heads, dim] (what the rope kernel writes), views
        # made once: every P and eager D layer would otherwise index and view both anew
        self.k_slots = [self.k[i].view(-1, kv_heads, head_dim) for i in range(num_layers)]
        self.v_slots = [self.v[i].view(-1, kv_heads, head_dim) for i in range(num_layers)]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def _prefill_kernel(attn, device: torch.device) -> str:
    """P's attention backend as ``PagedSelfAttention._prefill`` runs it on ``device``
    (``attn.prefill_backend``; a module built without it is "auto": triton on CUDA where it
    imports)."""
    backend = getattr(attn, "prefill_backend", "auto")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and triton_available() else "torch"
    return backend


def _dense(backend: str, new: list[int], ctx: list[int]) -> tuple[int, ...]:
    """The sequences P's dense calls take (cudnn, flash: long fresh ones), none otherwise."""
    return dense_sequences(new, ctx) if backend in DENSE_BACKENDS else ()


class PagedSelfAttention(torch.nn.Module):
    """megatron-named attention over a paged KV cache; heads sharded over the ATP group."""

    def __init__(self, config: TransformerConfig, layer_number: int, atp_group,
                 init_method, qkv_cls=ColumnParallelLinear, proj_cls=RowParallelLinear,
                 qk_norm_cls=None) -> None:
        super().__init__()
        self.layer_number = layer_number
        atp = atp_group.size()
        self.head_dim = config.kv_channels
        self.heads = config.num_attention_heads // atp
        self.groups = config.num_query_groups // atp
        self.q_per_group = config.num_attention_heads // config.num_query_groups
        qkv_out = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        # qkv_cls: megatron ColumnParallelLinear, or TE's LayerNorm+ColumnParallel fused linear
        # (then the layer's input_layernorm is an identity). proj_cls: megatron or TE row-parallel
        # linear; only its weight is used -- the reduction belongs to the comm path.
        self.linear_qkv = qkv_cls(
            config.hidden_size, qkv_out, config=config, init_method=init_method,
            gather_output=False, bias=config.add_bias_linear or config.add_qkv_bias,
            skip_bias_add=False, is_expert=False, tp_group=atp_group,
        )
        # megatron's SelfAttention: per-head norms of q and k (before RoPE) when qk_layernorm
        self.q_layernorm = self.k_layernorm = None
        if qk_norm_cls is not None:
            self.q_layernorm = qk_norm_cls(config=config, hidden_size=self.head_dim,
                                           eps=config.layernorm_epsilon)
            self.k_layernorm = qk_norm_cls(config=config, hidden_size=self.head_dim,
                                           eps=config.layernorm_epsilon)
        self.linear_proj = proj_cls(
            config.num_attention_heads * self.head_dim, config.hidden_size, config=config,
            init_method=init_method, bias=False, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_group=atp_group,
        )
        self.scale = self.head_dim ** -0.5
        # megatron's own ColumnParallelLinear with nothing to gather: its inference forward is
        # one matmul (+ bias), called here directly (its autograd Function and checks cost
        # ~18 us of host per call: eager P and D enqueue it every layer); TE's fused
        # norm + linear stays the module
        q = self.linear_qkv
        self._plain_qkv = (type(q) is ColumnParallelLinear and not q.sequence_parallel
                           and not q.gather_output and not q.skip_bias_add)

    def forward(self, x: torch.Tensor, rope: RopeAngles, meta: AttnMetadata,
                kv: KVStorage, layer: int) -> torch.Tensor:
        """x [T, H] (replicated over ATP) -> ATP-partial output [T, H]."""
        T = x.shape[0]
        if T == 0:  # a replica without P rows this step (TE's fused norm rejects empty input)
            return x.new_zeros((0, self.linear_proj.weight.shape[0]))
        fp8 = getattr(self, "colo_fp8", None)  # model.fp8: (qkv, proj) as FP8 (model/fp8.py)
        # engine.batch_invariant: D's projections through the batch-invariant GEMM
        # (model/batch_invariant.py; set at model build, which refuses FP8 and TE beside it)
        invariant = not meta.is_prefill and getattr(self, "batch_invariant", False)
        if invariant:
            qkv = invariant_linear(x, self.linear_qkv.weight, self.linear_qkv.bias)
        elif fp8 is not None:
            qkv = fp8_linear(x, fp8[0], bias=self.linear_qkv.bias)
        elif self._plain_qkv:
            qkv = plain_column_linear(self.linear_qkv, x)
        else:
            qkv, _ = self.linear_qkv(x)
        # per query group: q_0..q_{n-1}, k, v (megatron's layout)
        n, G, D = self.q_per_group, self.groups, self.head_dim
        qkv = qkv.view(T, G, n + 2, D)
        q, k, v = qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1]
        backend = self._rope_backend(q, meta)
        # the Triton path normalises q and k inside the rope kernel where the norms are
        # torch's RMSNorm (model/rope_kv.py: the same rms_norm); else the modules do it here
        qk_norm = self._fused_qk_norm() if backend == "triton" else None
        if self.q_layernorm is not None and qk_norm is None:  # each head of q and k
            q = self.q_layernorm(q.reshape(T, self.heads, D)).view(T, G, n, D)
            k = self.k_layernorm(k.contiguous())
        # rotate q and k, and write the new K/V into their slots before attending (a prefill
        # sees its own tokens): one Triton launch, or the torch ops (model/rope_kv.py).
        # Dense P calls (cudnn, flash) read the step's rotated k and its v from contiguous
        # copies the same launch writes (not from the cache, not as the QKV rows' views)
        kv_out = None
        if meta.is_prefill and getattr(self, "prefill_backend", "auto") in DENSE_BACKENDS \
                and (meta.dense_calls or meta.prefill_plan is None):
            kv_out = (torch.empty_like(v, memory_format=torch.contiguous_format),
                      torch.empty_like(v, memory_format=torch.contiguous_format))
        cos, sin, positions = (rope.kernel_angles(q.dtype) if backend == "triton"
                               else (*rope.cos_sin(q.dtype, 2), None))
        q = rope_and_store(q, k, v, cos, sin, kv.k_slots[layer], kv.v_slots[layer],
                           meta.slot_mapping, backend=backend,
                           qk_norm=qk_norm, positions=positions, kv_out=kv_out)

        if meta.is_prefill:
            out = self._prefill(q, kv_out, kv, layer, meta)
        else:
            out = self._decode(q, kv, layer, meta)
        out = out.reshape(T, self.heads * self.head_dim)
        if invariant:
            return invariant_linear(out, self.linear_proj.weight)
        if fp8 is not None:
            return fp8_linear(out, fp8[1])
        return F.linear(out, self.linear_proj.weight)  # partial over ATP: caller reduces

    def fp8_weights(self, block: int = 0) -> tuple[torch.Tensor, ...]:
        """The GEMM weights model.fp8 runs in FP8, in ``colo_fp8``'s order (``block``: the
        blockwise recipe's, which the door holds every dimension to)."""
        return (self.linear_qkv.weight, self.linear_proj.weight)

    def _fused_qk_norm(self) -> QKRMSNorm | None:
        """The q/k norms as the rope kernel's fused RMSNorm: when both are exactly torch's
        ``RMSNorm`` (megatron's local spec, WrappedTorchNorm) over the head dim with a
        weight and one eps -- its forward is ``F.rms_norm(x, (D,), weight, eps)``, which the
        fused path computes. None otherwise (no norms, LayerNorm, TE's norms, a subclass):
        those stay modules."""
        qn, kn = self.q_layernorm, self.k_layernorm
        if not all(type(m) is torch.nn.RMSNorm and m.weight is not None and m.eps is not None
                   and tuple(m.normalized_shape) == (self.head_dim,) for m in (qn, kn)):
            return None
        if qn.eps != kn.eps:
            return None
        return QKRMSNorm(qn.weight, kn.weight, float(qn.eps))

    def _rope_backend(self, q: torch.Tensor, meta: AttnMetadata) -> str:
        """The rope-and-store kernel follows the phase's attention backend (set at model
        build; "auto": triton for CUDA tensors when it imports)."""
        backend = getattr(self, "prefill_backend" if meta.is_prefill else "decode_backend",
                          "auto")
        if backend == "auto":
            backend = "triton" if q.is_cuda and triton_available() else "torch"
        # cudnn's (flash's) P is the Triton kernel's plus dense calls: the same rope kernel
        return "triton" if backend in DENSE_BACKENDS else backend

    def prefill_plan(self, new: list[int], ctx: list[int], dtype: torch.dtype,
                     device: torch.device) -> PlanHost | None:
        """The host half of the P epoch's kernel plan (``_prefill`` reads it from
        ``AttnMetadata.prefill_plan`` once the caller put it on the device), or None where P
        attention runs no kernel plan (the torch backend)."""
        backend = _prefill_kernel(self, device)
        if backend not in ("triton", *DENSE_BACKENDS):
            return None
        return plan_prefill_host(new, ctx, self.q_per_group, self.head_dim, dtype, device,
                                 dense=_dense(backend, new, ctx))

    def _gather_kv(self, kv: KVStorage, layer: int, tables: torch.Tensor):
        # tables [S, nb] -> [S, nb*block, groups, dim], expanded to query heads (GQA).
        k = kv.k[layer][tables].flatten(1, 2)
        v = kv.v[layer][tables].flatten(1, 2)
        k = k.repeat_interleave(self.q_per_group, dim=2)
        v = v.repeat_interleave(self.q_per_group, dim=2)
        return k, v

    def _prefill(self, q, dense_kv, kv, layer, meta: AttnMetadata) -> torch.Tensor:
        """Queries [T, heads, dim] of every sequence back to back; query j of a sequence sits
        at position ctx - new + j and sees keys 0..that position. No P rows on this replica:
        zero rows out (collectives still match). Checked against testing/attention_oracle.py's
        per-sequence loop.

        ``prefill_backend`` (set once at model build from ``engine.prefill_attention``; a
        module built without it is "auto": triton for CUDA tensors when it imports):
          * triton: the varlen paged flash-attention kernel (model/paged_prefill.py), K/V read
            through the block table, no copy per head; its plan (tiles, lengths on the device)
            is ``meta.prefill_plan`` (``prefill_plan``'s, made with the step's inputs), made
            here by the epoch's first layer where the caller did not; the buckets are unused.
          * cudnn: the same, but fresh sequences of >= 1024 tokens (model/dense_prefill.py)
            are left out of the kernel's tiles and computed by cuDNN's dense attention, up to
            8 sequences of one padded length per call, from ``dense_kv`` (the step's rotated
            k and its v [T, groups, dim], contiguous: the rope kernel's ``kv_out``).
          * flash: cudnn's calls through FlashAttention-4's kernel.
          * torch (the CPU path and the reference): one SDPA call per context bucket, queries
            [Sb, heads, n_max, dim] against the bucket's keys [Sb, heads, blocks*block, dim]
            (padding slots are computed and dropped)."""
        backend = _prefill_kernel(self, q.device)
        if backend in ("triton", *DENSE_BACKENDS):
            plan = meta.prefill_plan
            if plan is None:  # not made with the step's inputs (the runner's prefill_plan)
                plan = meta.prefill_plan = plan_prefill(
                    meta.seq_lens_new, meta.context_lens_host, self.q_per_group,
                    self.head_dim, q.dtype, q.device,
                    dense=_dense(backend, meta.seq_lens_new, meta.context_lens_host))
                meta.dense_calls = dense_calls(plan.dense, q.device)
            calls = meta.dense_calls
            if plan.n_tiles == 0 and len(calls) == 1 and calls[0].covers(q.shape[0]):
                # one dense call over every row: its result is the output (no copy)
                return dense_prefill_attention(q, *dense_kv, calls[0], self.scale, None,
                                               backend)
            out = triton_prefill_attention(q, kv.k[layer], kv.v[layer], meta.block_tables,
                                           plan, self.scale)
            for call in calls:  # the rows the kernel left unwritten
                dense_prefill_attention(q, *dense_kv, call, self.scale, out, backend)
            return out
        out = q.new_empty(q.shape)
        for b in meta.buckets:
            Sb = b.seqs.shape[0]
            k, v = self._gather_kv(kv, layer, meta.block_tables[b.seqs, : b.blocks])
            # keys past a sequence's context: stale slots (NaN/inf there would survive the
            # mask -- NaN plus -inf, zero times NaN): zeroed, as the kernels never load them
            fresh = (torch.arange(k.shape[1], device=k.device)[None, :]
                     < b.ctx[:, None])[:, :, None, None]
            k, v = torch.where(fresh, k, 0.0), torch.where(fresh, v, 0.0)
            qb = q[b.q_rows]  # [Sb, n_max, heads, dim]
            o = F.scaled_dot_product_attention(
                qb.transpose(1, 2), as_dtype(k, q.dtype).transpose(1, 2),
                as_dtype(v, q.dtype).transpose(1, 2),
                attn_mask=b.causal_mask(k.shape[1]), scale=self.scale,
            )  # [Sb, heads, n_max, dim]
            o = o.transpose(1, 2).reshape(Sb * b.n_max, self.heads, self.head_dim)
            out.index_copy_(0, b.out_rows, o.index_select(0, b.slots))  # no boolean mask: no sync
        return out

    def _decode(self, q, kv, layer, meta: AttnMetadata) -> torch.Tensor:
        """One query per row against its whole table (model/paged_attention.py): the Triton
        split-KV kernel, reading K/V through the block table, or the torch path (the CPU
        path and the reference). ``decode_backend`` is set once at model build from
        ``engine.decode_attention`` (``InferenceGPT``); a module built without it is "auto"
        (triton on CUDA when it imports)."""
        split = SPLIT_TOKENS if getattr(self, "batch_invariant", False) else None
        out = decode_attention(q, kv.k[layer], kv.v[layer], meta.block_tables,
                               meta.context_lens, self.scale,
                               backend=getattr(self, "decode_backend", "auto"),
                               split_tokens=split)
        return out.reshape(q.shape[0], self.heads, self.head_dim)
