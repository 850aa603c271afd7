"""The MTP layer (multi-token prediction, DeepSeek-V3 / GLM-4.5; megatron's
``MultiTokenPredictionLayer``) and its two forwards inside the engine's phases.

Owns ``MTPLayer`` (parameter names megatron's: ``mtp.layers.0.{enorm, hnorm, eh_proj,
mtp_model_layer.*, final_layernorm}``) and the draft computations:

  * ``mtp_decode``: D's draft, in the same D iteration as the verify forward (worker/runner.py);
  * ``mtp_prefill``: P's MTP pass over the prompt (a segment generator: its collectives are
    P boundaries, numbered after the decoder's), which fills the MTP layer's KV and drafts the
    token after the first sampled one.

The math (megatron's, and every engine loading the released weights): at position i the layer
reads the decoder's output h_i *after* the final norm and the embedding of token i + 1,
``x_i = eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)])``, runs one transformer layer (of the last
decoder layer's kind; RoPE at position i, causal attention over the MTP layer's own KV of
positions <= i), ``final_layernorm``, and the shared output layer: logits for token i + 2.

Invariants:
  * The MTP layer's KV is layer index ``num_layers`` of the engine's KV storage: the same
    blocks, slots and tables as the decoder's, so a cached prefix keeps its MTP entries and a
    rejected draft's entry (position n + 1) is overwritten by the next iteration before any
    query attends to it (causal: only positions <= the query's).
  * Every MTP position the decoder computed gets an MTP entry: P writes all prompt positions
    (the last with the sampled token), each D iteration both verify positions -- position n
    with the token the iteration emitted there, n + 1 with the bonus token (valid when the
    draft was accepted; else overwritten next iteration). No hole, as vLLM does it.
  * No routing is recorded for the MTP layer: routing replay replays the decoder's layers
    (the trainer does not run the MTP layer; rl/trainer.py).
  * With a dispatch backend (``model.moe_dispatch``) the MTP layer's MoE goes through the
    phase's dispatcher like the decoder's (D: D's; P: P's, its split one more P boundary);
    where P computes its replica's rows alone (attention TP 1) the MTP pass does too
    (``mtp_prefill_own``: no collective but the dispatch).
"""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear



class MTPLayer(torch.nn.Module):
    """One MTP depth: enorm, hnorm, eh_proj [H, 2H] (column-parallel over ATP), the transformer
    layer ``mtp_model_layer`` (an ``InferenceLayer``), final_layernorm."""

    def __init__(self, config, groups, layer_number: int, backend, is_moe: bool,
                 moe_compute: str, moe_kernel: str) -> None:
        super().__init__()
        from colo_rollout.model.model import InferenceLayer, _norm

        self.enorm = _norm(backend, config)
        self.hnorm = _norm(backend, config)
        self.eh_proj = ColumnParallelLinear(
            2 * config.hidden_size, config.hidden_size, config=config,
            init_method=config.init_method, bias=False, gather_output=False,
            skip_bias_add=False, tp_group=groups.atp)
        self.mtp_model_layer = InferenceLayer(config, groups, layer_number, backend, is_moe,
                                              moe_compute, moe_kernel)
        self.final_layernorm = _norm(backend, config)

    def project(self, emb: torch.Tensor, hidden: torch.Tensor,
                linear=F.linear) -> torch.Tensor:
        """This rank's ATP shard of eh_proj([enorm(emb); hnorm(hidden)]): [N, H / ATP].
        ``linear``: the GEMM (D passes the model's ``d_linear``)."""
        return linear(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1),
                      self.eh_proj.weight)


class MTPBlock(torch.nn.Module):
    """megatron's ``mtp`` block: ``layers`` (one MTPLayer here)."""

    def __init__(self, layers: list[MTPLayer]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)


def shift_tokens(token_ids: torch.Tensor, local_last: torch.Tensor,
                 sampled: torch.Tensor) -> torch.Tensor:
    """P's MTP input tokens: each row's next token -- the prompt shifted left by one within
    each sequence, each sequence's last row the token sampled after it. ``local_last``: the
    last row of each sequence in ``token_ids`` (ascending)."""
    e = torch.roll(token_ids, -1)
    e[local_last] = sampled
    return e


@torch.inference_mode()
def mtp_decode(model, hidden: torch.Tensor, tokens: torch.Tensor, inp, kv,
               select: torch.Tensor) -> torch.Tensor:
    """D's MTP pass over this replica's verify rows (every rank of the world: the layer's
    collectives span it). ``hidden`` [B2, H]: the decoder's final-normed output of the
    replica's rows (whole on every ATP rank); ``tokens`` [B2]: the token after each row's (what
    the iteration emitted there; padding rows anything); ``inp``: the verify forward's
    DecodeInputs (positions, slots, tables); ``select`` [S]: the rows whose drafts are wanted.
    Returns full-vocabulary draft logits [S, V]. Unfused, the gather backend's generic path."""
    comm = model.comm
    mtp = model.mtp.layers[0]
    L = model.cfg.num_layers
    B2 = tokens.shape[0]
    atp, a = model.groups.layout.atp, model.groups.atp_rank
    c = B2 // atp
    emb = comm.d_all_gather_atp(comm.d_reduce_scatter_atp(model.embedding.partial(tokens)))
    y = comm.d_all_gather_vocab(mtp.project(emb, hidden, model.d_linear))  # [B2, H]
    res = y[a * c : (a + 1) * c]
    rope = model.rope_angles(inp.attn.positions)
    layer = mtp.mtp_model_layer
    own = slice(model.groups.replica * B2, (model.groups.replica + 1) * B2)
    x = comm.d_all_gather_atp(layer.input_layernorm(res))
    res = res + comm.d_reduce_scatter_atp(layer.self_attention(x, rope, inp.attn, kv, L))
    res = model.d_mlp(layer, res, own, None)  # the decoder's unfused MLP half, not recorded
    normed = comm.d_all_gather_atp(mtp.final_layernorm(res))
    return comm.d_all_gather_vocab(model.d_linear(normed[select], model.output_weight))


def mtp_prefill(model, hidden_all: torch.Tensor, tokens_local: torch.Tensor, inp, kv,
                boundary: int) -> Generator[int, None, torch.Tensor]:
    """P's MTP pass (a generator; yields boundary ids from ``boundary`` on, one before each
    collective: ``prefill_boundaries`` counts them). ``hidden_all`` [T, H]: the decoder's
    final-normed output of every replica's P rows (the gather backend's P layout);
    ``tokens_local`` [T_local]: this replica's next tokens (``shift_tokens``). Writes the MTP
    layer's KV of this replica's positions; returns the draft logits [n_seq, V] of this
    replica's sequences (their last rows)."""
    comm, r = model.comm, model.groups.replica
    mtp = model.mtp.layers[0]
    L = model.cfg.num_layers
    total = sum(inp.row_counts)
    off, n_local = sum(inp.row_counts[:r]), inp.row_counts[r]
    own = slice(off, off + n_local)
    atp, a = model.groups.layout.atp, model.groups.atp_rank
    yield boundary
    boundary += 1
    emb = comm.p_gather(model.embedding.partial(tokens_local), off, total)
    if atp == 1:  # every rank has every row: the whole projection here, no collective
        h = mtp.project(emb, hidden_all)
    else:  # this replica's rows, this rank's column shard, gathered by one AllReduce
        shard = mtp.project(emb[own], hidden_all[own])
        w = shard.shape[1]
        h = hidden_all.new_zeros((total, w * atp))
        h[own, a * w : (a + 1) * w] = shard
        yield boundary
        boundary += 1
        h = comm.p_allreduce(h)
    rope = model.rope_angles(inp.attn.positions)
    layer = mtp.mtp_model_layer
    # the decoder's P layer body (gather layout), its MoE unrecorded -- through P's
    # dispatcher with a dispatch backend
    h, boundary, _ = yield from model.prefill_layer(
        layer, L, h, rope, inp, kv, own, total, boundary,
        lambda x: layer.mlp(layer.pre_mlp_layernorm(x), record=None),
        dispatch=layer.is_moe and model.dispatch_p is not None)
    seq_off, n_seq = sum(inp.last_counts[:r]), inp.last_counts[r]
    last = mtp.final_layernorm(h[inp.last_rows[seq_off : seq_off + n_seq]])
    full = model.p_logits_partial(last, int(inp.last_rows.shape[0]), seq_off)
    yield boundary
    return comm.p_allreduce(full)[seq_off : seq_off + n_seq]


def mtp_prefill_own(model, hidden: torch.Tensor, tokens: torch.Tensor,
                    local_last: torch.Tensor, inp, kv, rope, boundary: int
                    ) -> Generator[int, None, torch.Tensor]:
    """P's MTP pass where P computes its replica's rows alone (a dispatch backend at attention
    TP 1: ``InferenceGPT.own_rows_prefill``; a generator). ``hidden`` [n, H]: the decoder's
    final-normed output of this replica's rows; ``tokens`` [n]: their next tokens
    (``shift_tokens``); ``local_last``: each sequence's last row; ``rope``: the decoder's
    angles of these positions (the same rows). Yields ``boundary`` at the
    MTP MoE's dispatch split (a dense MTP layer yields nothing). Writes the MTP layer's KV of
    these positions; returns the draft logits [n_seq, V]."""
    mtp = model.mtp.layers[0]
    h = mtp.project(model.embedding.partial(tokens), hidden)  # whole: attention TP 1
    h, _ = yield from model.own_rows_layer(mtp.mtp_model_layer, model.cfg.num_layers, h, rope,
                                           inp, kv, boundary, None)
    return F.linear(mtp.final_layernorm(h[local_last]), model.output_weight)


def prefill_boundaries(atp: int, own_rows: bool = False, dispatch_moe: bool = False) -> int:
    """The boundaries P's MTP pass yields. ``mtp_prefill`` (the gather layout): the embedding
    gather, the projection's gather (attention TP > 1 only), the layer's two, the draft
    logits' gather, and with ``dispatch_moe`` (its MoE through a dispatch backend) the
    dispatch split. ``mtp_prefill_own`` (``own_rows``): the dispatch split only."""
    if own_rows:
        return int(dispatch_moe)
    return 4 + (atp > 1) + dispatch_moe
