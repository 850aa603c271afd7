"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) over a paged latent cache.

Owns: ``LatentKVStorage`` (per layer and token, the normalised key/value latent and the rotated
RoPE key: ``kv_lora_rank + qk_rope_head_dim`` values, one copy shared by every head -- what
makes MLA's cache small) and ``PagedMLAttention``, whose parameters are named and laid out
exactly like megatron's ``MLASelfAttention`` (``linear_q_down_proj`` / ``q_layernorm`` /
``linear_q_up_proj``, or ``linear_q_proj`` without a query bottleneck; ``linear_kv_down_proj``
= [latent | rope key] rows, ``kv_layernorm``, ``linear_kv_up_proj`` = per head [k_nope | v]
rows, ``linear_proj``), so a megatron state dict loads into it as it is.

The math is megatron's (multi_latent_attention.py, its unfused path): RoPE on the last
``qk_rope_head_dim`` dims of each query head and on the token's one rope key, after megatron's
MLA de-interleave (even dims, then odd: transformers' ``rope_interleave``), cos and sin times
YaRN's mscale (``RopeAngles``); softmax scale 1/sqrt(q head) times mscale(mscale_all_dim)^2
(the model passes it). Two equal forms of the same attention:
  * P (prefill): the keys and values of the context are decompressed from the cache
    (``linear_kv_up_proj``), the new tokens' among them, and attended per head like
    megatron's core attention -- long fresh sequences in dense calls over their own rows
    (cuDNN or FlashAttention-4), the rest in one FlashAttention-4 variable-length call
    (flash) or one SDPA call per context bucket (model/dense_prefill.py; ``_prefill``);
  * D (decode): the up-projection is absorbed -- each query's nope part is mapped into the
    latent space by the key half of ``linear_kv_up_proj`` and scored against the cached
    latents directly (a single shared key of ``kv_lora_rank + qk_rope_head_dim`` dims), the
    probabilities weight the latents, and the value half maps the result back per head. No
    per-head key or value is ever materialised for the context: D reads the small cache.

Invariants:
  * Attention TP splits the heads (the query and key/value up projections' rows, the output
    projection's columns), never the latent: the latent is one head that every query head
    reads, so every ATP rank holds the whole cache and computes the whole down projections
    (``linear_q_down_proj`` and ``linear_kv_down_proj`` are duplicated, as in megatron's TE
    spec; megatron's local spec splits their rows and gathers their outputs -- the weight
    sync and the loaders hand each rank the whole tensor, ``weights.DUPLICATED``). No
    collective is added: the attention's input rows are the replica's on every ATP rank, its
    output the ATP-partial sum the layer reduces, as ``PagedSelfAttention``'s. Attention DP
    with expert parallelism is the layout that does not repeat the cache.
  * P writes its tokens' latents into their slots before reading, so a continuation sees the
    retained context plus itself (as ``PagedSelfAttention``). Block ``num_blocks`` is the sink.
  * Slots past a row's context may hold anything (a stale request, NaN after a bad load):
    they are zeroed before they meet a zero probability.
  * ``forward`` returns the ATP-partial output of ``linear_proj`` (no reduction), as
    ``PagedSelfAttention``.

Must not go in here: block allocation (kv_cache.py), collectives (comm.py), scheduling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

from colo_rollout.model.attention import AttnMetadata, RopeAngles
from colo_rollout.model.dense_prefill import dense_mla_attention, mla_kv, varlen_attention
from colo_rollout.model.fp8_linear import fp8_linear
from colo_rollout.model.mla_decode import cached_entries, mla_decode
from colo_rollout.model.rope_kv import rotate
from colo_rollout.model.weights import mark_duplicated


# engine.prefill_attention "auto" for MLA: the dense backends in the order tried
AUTO_ORDER = ("flash", "cudnn")


def resolve_prefill(requested: str, device: torch.device | str, dtype: torch.dtype | None,
                    qk_dim: int, v_dim: int) -> str:
    """``engine.prefill_attention`` for MLA -> "torch" (P per context bucket through SDPA),
    or "cudnn" / "flash": the same with fresh sequences of at least
    ``dense_prefill.MIN_TOKENS`` through that dense kernel (model/dense_prefill.py), which
    needs the kernel to take query/key heads of ``qk_dim`` with value heads of ``v_dim``;
    flash also sends the other sequences to one FlashAttention-4 variable-length call.
    "auto": flash where it imports, else cudnn, else torch -- flash's dense calls were
    1.006-1.024x cuDNN's (docs/benchmarks.md session 30) and its variable-length call for
    the other sequences passed its GPU checks (session 32), where cudnn leaves them to the
    buckets' masked SDPA. "triton" is refused: MLA has no Triton P kernel."""
    from colo_rollout.config.attention_support import choose_dense_kernel, dense_kernel_problem

    if requested == "triton":
        raise ValueError("engine.prefill_attention: 'triton' with attention 'mla': MLA's P has "
                         "no Triton kernel ('auto', 'torch', 'cudnn' or 'flash')")
    return choose_dense_kernel(
        requested, AUTO_ORDER,
        lambda kernel: dense_kernel_problem(kernel, device, dtype, qk_dim, v_dim),
        "'torch' or 'auto'") or "torch"


class LatentKVStorage:
    """The latent cache of every layer for this rank: [L, num_blocks + 1, block, latent + rope].

    Same block geometry as ``KVStorage`` (block ``num_blocks`` is the sink); one tensor, no
    separate values: a token's value is its latent, the first ``kv_lora_rank`` dims."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_lora_rank: int,
                 rope_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        width = kv_lora_rank + rope_dim
        self.latent = torch.zeros((num_layers, num_blocks + 1, block_size, width),
                                  dtype=dtype, device=device)
        self.block_size = block_size
        self.sink_block = num_blocks
        self.slots = [self.latent[i].view(-1, width) for i in range(num_layers)]

    def nbytes(self) -> int:
        return self.latent.numel() * self.latent.element_size()


def mla_deinterleave(t: torch.Tensor) -> torch.Tensor:
    """megatron's MLA rope input order (``mla_rotary_interleaved``): even dims, then odd."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


class DuplicatedLinear(torch.nn.Module):
    """A projection every attention-TP rank holds whole (``weight`` [n_out, n_in], no bias):
    the weight is marked ``weights.DUPLICATED`` (loaders and the export read it whole) and
    not ``tensor_model_parallel`` (megatron's resharding then gathers a TP trainer's row
    shards into it)."""

    def __init__(self, n_in: int, n_out: int, config: TransformerConfig, init_method) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty((n_out, n_in),
                                                     dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)
        mark_duplicated(self.weight)


class PagedMLAttention(torch.nn.Module):
    """megatron-named MLA over a paged latent cache; this rank's ATP share of the heads."""

    def __init__(self, config: TransformerConfig, layer_number: int, atp_group, init_method,
                 norm_cls, *, q_lora_rank: int | None, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, softmax_scale: float) -> None:
        super().__init__()
        atp = atp_group.size()
        if config.num_attention_heads % atp:
            raise ValueError(f"attention 'mla': {config.num_attention_heads} heads do not split "
                             f"over attention TP {atp}")
        self.layer_number = layer_number
        self.heads = config.num_attention_heads // atp  # this rank's
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.q_head = qk_nope_head_dim + qk_rope_head_dim
        self.kv_lora_rank = kv_lora_rank
        H = config.hidden_size

        def column(n_in: int, n_out: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(n_in, n_out, config=config, init_method=init_method,
                                        gather_output=False, bias=False, skip_bias_add=False,
                                        is_expert=False, tp_group=atp_group)

        def norm(width: int) -> torch.nn.Module:
            return norm_cls(config=config, hidden_size=width, eps=config.layernorm_epsilon)

        all_heads = config.num_attention_heads  # megatron's sizes are whole; it splits them
        q_out = all_heads * self.q_head
        self.linear_q_proj = self.linear_q_down_proj = self.linear_q_up_proj = None
        self.q_layernorm = None
        if q_lora_rank is None:
            self.linear_q_proj = column(H, q_out)
        else:
            self.linear_q_down_proj = DuplicatedLinear(H, q_lora_rank, config, init_method)
            self.linear_q_up_proj = column(q_lora_rank, q_out)
            self.q_layernorm = norm(q_lora_rank)
        self.linear_kv_down_proj = DuplicatedLinear(H, kv_lora_rank + qk_rope_head_dim, config,
                                                    init_method)
        self.linear_kv_up_proj = column(kv_lora_rank, all_heads * (qk_nope_head_dim + v_head_dim))
        self.kv_layernorm = norm(kv_lora_rank)
        self.linear_proj = RowParallelLinear(
            all_heads * v_head_dim, H, config=config, init_method=init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_group=atp_group)
        self.scale = softmax_scale

    def prefill_plan(self, new, ctx, dtype, device) -> None:
        """No kernel plan: P attends per context bucket (``AttnMetadata.buckets``) and, with
        a dense backend, in the runner's dense calls."""
        return None

    # ------------------------------------------------------------------ projections
    def fp8_weights(self, block: int = 0) -> tuple[torch.Tensor | None, ...]:
        """The GEMM weights model.fp8 runs in FP8, in ``colo_fp8``'s order: the query
        projection(s), the key/value down projection, the output projection; None where one
        stays in params_dtype -- the key/value down projection under the blockwise recipe
        (``block``) when its [latent | rope key] rows are no whole number of blocks
        (DeepSeek-V3's 512 + 64 = 576; a small GEMM: H x 576 of the layer's). Always:
        ``linear_kv_up_proj`` stays in params_dtype: D reads it as the per-head key and value
        matrices of the absorbed attention, not as a GEMM over the rows."""
        q = ((self.linear_q_proj.weight,) if self.linear_q_proj is not None
             else (self.linear_q_down_proj.weight, self.linear_q_up_proj.weight))
        kv = self.linear_kv_down_proj.weight
        return (*q, None if block and kv.shape[0] % block else kv, self.linear_proj.weight)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, i: int) -> torch.Tensor:
        """x @ w^T, through weight i of the FP8 copies where model.fp8 made one."""
        fp8 = getattr(self, "colo_fp8", None)
        return F.linear(x, w) if fp8 is None or fp8[i] is None else fp8_linear(x, fp8[i])

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> queries [T, heads, q_head] (not yet rotated)."""
        if self.linear_q_proj is not None:
            q = self._linear(x, self.linear_q_proj.weight, 0)
        else:
            q = self._linear(self.q_layernorm(self._linear(x, self.linear_q_down_proj.weight,
                                                           0)),
                             self.linear_q_up_proj.weight, 1)
        return q.view(x.shape[0], self.heads, self.q_head)

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``linear_kv_up_proj`` per head: the key half [heads, nope, latent] and the value
        half [heads, v, latent] (views)."""
        w = self.linear_kv_up_proj.weight.view(self.heads, self.nope + self.v_dim,
                                               self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope:]

    def forward(self, x: torch.Tensor, rope: RopeAngles, meta: AttnMetadata,
                kv: LatentKVStorage, layer: int) -> torch.Tensor:
        """x [T, H] (normalised rows) -> ATP-partial output [T, H]."""
        T = x.shape[0]
        if T == 0:
            return x.new_zeros((0, self.linear_proj.weight.shape[0]))
        q = self._queries(x)
        n_q = 1 if self.linear_q_proj is not None else 2  # the FP8 copies' order
        down = self._linear(x, self.linear_kv_down_proj.weight, n_q)  # [T, latent + rope]
        latent = self.kv_layernorm(down[:, : self.kv_lora_rank])
        cos, sin = rope.cos_sin(q.dtype, 3)  # [T, 1, rope]
        q_pe = rotate(mla_deinterleave(q[..., self.nope:]), cos, sin)
        k_pe = rotate(mla_deinterleave(down[:, None, self.kv_lora_rank:]), cos, sin)[:, 0]
        # the token's cache entry before any read: a prefill attends its own tokens
        entries = torch.cat((latent, k_pe), dim=-1).to(kv.latent.dtype)
        kv.slots[layer].index_copy_(0, meta.slot_mapping, entries)
        if meta.is_prefill:
            out = self._prefill(q[..., : self.nope], q_pe, entries, kv, layer, meta)
        else:
            out = self._decode(q[..., : self.nope], q_pe, kv, layer, meta)
        return self._linear(out.reshape(T, self.heads * self.v_dim), self.linear_proj.weight,
                            n_q + 1)

    # ------------------------------------------------------------------ attention
    def _prefill(self, q_nope, q_pe, entries, kv, layer, meta: AttnMetadata) -> torch.Tensor:
        """The fresh long sequences of ``meta.dense_calls`` (``prefill_backend`` cudnn or
        flash: the runner made them, and left those sequences out of the buckets) through
        a dense causal kernel over their own rows -- every key is one of the step's new tokens,
        so their keys and values are this step's cache entries decompressed (``entries``
        [T, latent + rope], as written into the cache), no cache read. The others: with flash, in
        ``meta.varlen`` (one variable-length call, ``_varlen``); else per context bucket:
        the context's keys [k_nope | rope key] and values decompressed from the cache,
        queries [q_nope | rotated q_pe], one SDPA call (megatron's core attention per head;
        padded query rows are computed and dropped)."""
        q = torch.cat((q_nope, q_pe), dim=-1)
        T = q.shape[0]
        calls, vc = meta.dense_calls, meta.varlen
        if vc is not None and not calls and vc.q_rows is None:
            return self._varlen(q, kv, layer, vc)  # one call over every row: the output
        w_up = self.linear_kv_up_proj.weight
        if calls:
            entries = entries.to(q.dtype)  # the values the cache holds, as the buckets read them
            backend = getattr(self, "prefill_backend", "cudnn")
            if not meta.buckets and len(calls) == 1 and calls[0].covers(T):
                # one dense call over every row: its result is the output (no copy)
                return dense_mla_attention(q, entries, w_up, self.nope, calls[0], self.scale,
                                           None, backend)
        out = q.new_empty((T, self.heads, self.v_dim))
        for call in calls:
            dense_mla_attention(q, entries, w_up, self.nope, call, self.scale, out, backend)
        if vc is not None:
            out.index_copy_(0, vc.q_rows, self._varlen(q.index_select(0, vc.q_rows), kv,
                                                       layer, vc))
        for b in meta.buckets:
            Sb = b.seqs.shape[0]
            lat, _ = cached_entries(kv.latent[layer], meta.block_tables[b.seqs, : b.blocks],
                                    b.ctx, q.dtype)
            keys = lat.shape[1]
            k, v = mla_kv(lat.flatten(0, 1), w_up, self.heads, self.nope)
            k = k.view(Sb, keys, self.heads, self.q_head)
            v = v.view(Sb, keys, self.heads, self.v_dim)
            o = F.scaled_dot_product_attention(
                q[b.q_rows].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=b.causal_mask(keys), scale=self.scale)  # [Sb, heads, n_max, v]
            o = o.transpose(1, 2).reshape(Sb * b.n_max, self.heads, self.v_dim)
            out.index_copy_(0, b.out_rows, o.index_select(0, b.slots))
        return out

    def _varlen(self, q: torch.Tensor, kv: LatentKVStorage, layer: int, vc) -> torch.Tensor:
        """``vc``'s sequences (``VarlenCall``; q: their rows) against their whole contexts,
        read from the cache by slot and decompressed -- one variable-length call
        (FlashAttention-4's on a GPU)."""
        lat = kv.slots[layer].index_select(0, vc.kv_slots).to(q.dtype)  # [keys, latent+rope]
        k, v = mla_kv(lat, self.linear_kv_up_proj.weight, self.heads, self.nope)
        return varlen_attention(q, k, v, vc, self.scale)

    def _decode(self, q_nope, q_pe, kv, layer, meta: AttnMetadata) -> torch.Tensor:
        """Absorbed: q_nope into the latent space, scored with q_pe against every cached
        [latent | rope key] of the row's table (model/mla_decode.py: the torch path or the
        Triton kernel, ``decode_backend`` set at model build); the probabilities weight the
        latents; the value half of ``linear_kv_up_proj`` maps the result to each head's
        value width."""
        w_k, w_v = self._up()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_k).transpose(0, 1)  # [B, heads, latent]
        o_lat = mla_decode(q_lat, q_pe, kv.latent[layer], meta.block_tables,
                           meta.context_lens, self.scale,
                           getattr(self, "decode_backend", "torch"))
        return torch.bmm(o_lat.transpose(0, 1), w_v.transpose(1, 2)).transpose(0, 1)
