"""Independent reference: a megatron-core ``GPTModel`` (local or TE spec) full-recompute forward.

Owns the construction of a megatron ``GPTModel`` of the same architecture, fed the same full
state dict, and a no-KV-cache forward over whole token sequences. Tests compare the engine's
tokens and logprobs against it; it shares no code path with the inference model beyond
megatron's own modules and ``megatron_config``. The RL trainer builds its model here too
(TP x DP, EP x DP, TP x EP x DP; with TP > 1 under sequence parallelism, see
``build_reference``; each rank's shard of the weights: ``shard_layout``).

The model gets a ``ProcessGroupCollection`` of single-rank groups so it can be built inside any
multi-rank job without touching the job's layout (megatron's global parallel_state is not used).

Must not go in here: the training step (rl/trainer.py), the trainer's groups
(``rl.trainer.trainer_pg_collection``), checkpoint reading (checkpoint/loader.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from colo_rollout.config import ModelConfig
from colo_rollout.model.model import megatron_config
from colo_rollout.model.mla_core_attention import with_local_mla
from colo_rollout.model.spec_edit import replace_in_spec
from colo_rollout.model.weights import load_sharded, to_spec_names
from colo_rollout.runtime.parallel import Layout

_PG_FIELDS = ("tp", "pp", "mp", "cp", "tp_cp", "ep", "expt_tp", "tp_ep", "tp_ep_pp", "embd",
              "pos_embd", "dp", "dp_cp", "expt_dp", "tp_dp_cp", "intra_dp_cp", "intra_expt_dp")


def singleton_pg_collection() -> ProcessGroupCollection:
    """Every megatron group = {this rank}. Collective over the world (new_group is) the first
    time in a process's world; later calls reuse that group (a fresh collection each call:
    callers set their own TP/DP groups on it)."""
    world = dist.group.WORLD
    mine = _SINGLETON.get(id(world))
    if mine is None:
        me = dist.get_rank()
        for r in range(dist.get_world_size()):
            g = dist.new_group([r])
            if r == me:
                mine = g
        _SINGLETON.clear()  # groups of an earlier default group are dead
        _SINGLETON[id(world)] = mine
    pgc = ProcessGroupCollection(**{f: mine for f in _PG_FIELDS})
    pgc.hcp = [mine]
    return pgc


# id(default group) -> this rank's singleton group: identical every call, and each new group
# holds threads for the life of the process
_SINGLETON: dict[int, dist.ProcessGroup] = {}


def tp_pg_collection(tp_group) -> ProcessGroupCollection:
    """Groups for a TP-only megatron model over ``tp_group`` (experts TP-sharded over it too,
    EP1); every other group is {this rank}. Collective over the world (new_group is)."""
    pgc = singleton_pg_collection()
    for f in ("tp", "mp", "tp_cp", "expt_tp", "tp_ep", "tp_ep_pp", "tp_dp_cp"):
        setattr(pgc, f, tp_group)
    return pgc


def shard_layout(pg_collection: ProcessGroupCollection) -> tuple[Layout, int]:
    """This rank's shard of the full weights as an inference ``Layout`` and a rank in it --
    what model/weights.py's rules and the checkpoint loader cut: dense tensors over TP,
    experts over EP, each over expert TP.

    ``Layout(world = EP x ETP, ADP = world / TP, EP)`` at rank ``ep_rank x ETP + etp_rank``
    has ATP = TP, that ETP and that EP rank; its ATP rank must be this rank's TP rank. True in
    megatron's layouts of TP x DP (ETP = TP, EP 1: the expert TP group is the TP group), EP x
    DP (TP 1) and TP x EP with ETP 1 and EP a multiple of TP: megatron's expert rank order
    ("tp-ep-dp") makes an ETP-1 EP group EP consecutive ranks, so EP rank = rank mod EP and
    TP rank = rank mod TP = EP rank mod TP. Other layouts are refused: one rank's dense and
    expert shards are then not one (ATP, EP) position, which is all the shard rules
    describe."""
    tp, ep, etp = (pg_collection.tp.size(), pg_collection.ep.size(),
                   pg_collection.expt_tp.size())
    world = ep * etp
    rank = pg_collection.ep.rank() * etp + pg_collection.expt_tp.rank()
    if world % tp or (rank % tp) != pg_collection.tp.rank():
        raise ValueError(f"reference/trainer model: TP {tp} x EP {ep} with expert TP {etp} is "
                         "not a layout the shard rules cut (experts whole, ETP 1, and EP a "
                         "multiple of TP; or EP 1 with the experts TP-sharded)")
    return Layout(world_size=world, adp=world // tp, ep=ep), rank


def build_reference(cfg: ModelConfig,
                    full_state: dict[str, torch.Tensor] | Callable[[torch.nn.Module], None],
                    pg_collection: ProcessGroupCollection, device: torch.device,
                    dtype: torch.dtype | None = None, te: bool = False,
                    routing_replay: bool = False, recompute: bool = False,
                    sequence_parallel: bool = False) -> torch.nn.Module:
    """``te``: build megatron's Transformer Engine layer spec (grouped-GEMM experts, fused
    norm+qkv) instead of the local spec; ``full_state`` may use either spec's names.
    ``sequence_parallel`` (TP > 1 only): megatron's sequence parallelism -- what it needs to
    train MoE with TP (``MoELayer.forward`` refuses training under TP without it). The
    activations between the TP regions are split along the sequence over the TP group (the
    input's sequence length must be divisible by TP); the logits come back whole. The local
    spec's norms are then ``SequenceParallelTorchNorm`` (megatron's torch-norm wrapper refuses
    sequence parallelism); the parameters each TP rank trains on its own tokens only carry
    ``sequence_parallel=True``, their gradients are partial sums over the TP group.
    ``routing_replay``: megatron's ``moe_enable_routing_replay`` (every router gets a
    ``RouterReplay``; the trainer sets what it replays, rl/trainer.py). ``recompute``:
    megatron's full activation recompute, one layer per unit (CUDA only).

    With a TP group of size t in ``pg_collection`` (see ``tp_pg_collection``) the model is
    megatron's TP-t model: its forward is collective over that group, and each rank loads its
    shard of ``full_state``. That is the fair bf16 yardstick for an engine with ATP = t: both
    round partial sums before reducing them. With an EP group as well (the trainer's TP x EP,
    experts whole: expert TP 1) each rank holds its EP rank's experts; megatron's allgather
    dispatcher moves the tokens over tp_ep (``shard_layout`` says which layouts load).

    ``full_state`` a callable: it loads the weights into the model (already on ``device``), e.g.
    ``checkpoint.loader.megatron_loader`` reading each rank's TP slices of a Hugging Face
    checkpoint; this module does not reach up into the checkpoint layer."""
    # megatron's DotProductAttention enters get_cuda_rng_tracker().fork() even with dropout 0;
    # the inference tracker makes that a no-op on CPU and GPU alike.
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # megatron's DotProductAttention takes its matmul scratch from parallel_state's global
    # memory buffer, which only initialize_model_parallel creates; this model may be built
    # without it (it uses explicit groups), so create the buffer if it is missing.
    from megatron.core import parallel_state as ps

    if getattr(ps, "_GLOBAL_MEMORY_BUFFER", None) is None:
        ps._set_global_memory_buffer()
    tp, ep = pg_collection.tp.size(), pg_collection.ep.size()
    # the experts' TP width is the collection's: ETP = TP with EP 1 (megatron's default
    # expert_tensor_parallel_size; the allgather dispatcher then gathers each TP rank's
    # sequence shard over tp_ep = TP and reduce-scatters the output), ETP 1 with EP > 1 (the
    # trainer's TP x EP: experts whole, rl/trainer.py trainer_pg_collection)
    etp = pg_collection.expt_tp.size()
    if sequence_parallel and tp == 1:
        raise ValueError("reference/trainer model: sequence parallelism needs a TP group of "
                         "more than one rank")
    layout, shard_rank = shard_layout(pg_collection)  # refuses a layout it cannot cut
    tcfg = megatron_config(cfg, dtype=dtype, init=False, use_te=te, tp=tp, etp=etp, ep=ep,
                           sequence_parallel=sequence_parallel)
    tcfg.moe_enable_routing_replay = routing_replay
    if recompute:
        tcfg.recompute_granularity, tcfg.recompute_method = "full", "uniform"
        tcfg.recompute_num_layers = 1
    model = build_gpt_model(cfg, tcfg, te, pg_collection)
    if callable(full_state):  # straight into the parameters on their device
        model = model.to(device)
        full_state(model)
    elif layout.world_size == 1:  # every tensor whole
        full_state = to_spec_names(full_state, te)
        missing, unexpected = model.load_state_dict(full_state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise KeyError(f"reference load: missing {missing}, unexpected {unexpected}")
    else:  # dense tensors cut over TP, experts over EP (and expert TP)
        load_sharded(model, to_spec_names(full_state, te), layout, shard_rank,
                     num_experts=cfg.num_experts)
    model = model.to(device)
    if tcfg.bf16 or tcfg.fp16:
        # megatron runs half-precision models inside Float16Module (casts inputs, fp32 logits)
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(tcfg, model)
    return model.eval()


def build_gpt_model(cfg: ModelConfig, tcfg, te: bool, pg_collection) -> GPTModel:
    """megatron's GPTModel of ``cfg``'s architecture (layer specs from megatron's own decoder
    block spec: MoE and dense layers, qk norms, shared experts; its RoPE; tied embeddings)."""
    # pp_rank 0: one pipeline stage (megatron would otherwise ask its global parallel state,
    # which a model built on explicit groups may not have)
    spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=te,
                                      normalization=cfg.normalization, pp_rank=0)
    if cfg.is_mla and not te:  # megatron's MLA on the local spec (model/mla_core_attention.py)
        spec = with_local_mla(spec)
    if tcfg.sequence_parallel and not te:  # TE's norms take sequence parallelism themselves
        spec = _sequence_parallel_norms(spec)
    # MTP (model.mtp_num_layers): megatron's block, its layer of the last decoder layer's spec
    mtp = (get_gpt_mtp_block_spec(tcfg, spec, use_transformer_engine=te, pp_rank=0)
           if cfg.mtp_num_layers else None)
    model = GPTModel(tcfg, spec, vocab_size=cfg.vocab_size, mtp_block_spec=mtp,
                     max_sequence_length=cfg.max_position_embeddings,
                     # MLA applies its own RoPE (rope or YaRN by its config's rope_type)
                     position_embedding_type=("yarn" if cfg.rope_scaling == "yarn"
                                              and not cfg.is_mla else "rope"),
                     rotary_base=cfg.rotary_base,
                     rotary_percent=cfg.rotary_percent,
                     rope_scaling=cfg.rope_scaling == "llama3",
                     rope_scaling_factor=cfg.rope_scaling_factor,
                     share_embeddings_and_output_weights=cfg.tie_embeddings,
                     parallel_output=False, pg_collection=pg_collection)
    if tcfg.sequence_parallel:
        # a norm built outside the swapped spec slots would train on its TP rank's tokens
        # alone, its gradient never summed: refuse it here rather than diverge silently
        unmarked = [n for n, m in model.named_modules()
                    if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm))
                    and not getattr(m.weight, "sequence_parallel", False)]
        if unmarked:
            raise TypeError(f"sequence-parallel model: norms not marked sequence_parallel "
                            f"(a spec slot megatron added?): {unmarked}")
    return model


class SequenceParallelTorchNorm:
    """megatron's ``WrappedTorchNorm`` (``torch.nn.RMSNorm`` or ``LayerNorm`` by
    ``config.normalization``, the same numerics) for a sequence-parallel model.

    ``WrappedTorchNorm`` asserts ``not config.sequence_parallel`` (transformer/torch_norm.py),
    and it is what the local spec builds for RMSNorm even with apex installed
    (models/backends.py ``LocalSpecProvider.layer_norm``). The torch norm itself computes per
    token, so it runs on a sequence shard unchanged; what sequence parallelism needs of a norm
    is its parameters marked: a norm sees its TP rank's shard, so its weight's gradient is a
    partial sum over the TP group.
    megatron's SP-capable norms (apex ``FusedLayerNorm``, TE's ``TENorm``) mark their
    parameters ``sequence_parallel``, and the gradient reduction sums exactly the marked ones
    over TP (``_allreduce_non_tensor_model_parallel_grads`` in
    distributed/finalize_model_grads.py; the CPU trainer the same, rl/trainer.py). This builder
    does the marking; it follows megatron's norm-builder protocol (a class called with
    ``config``, ``hidden_size``, ``eps``)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm \
                or config.memory_efficient_layer_norm:
            raise ValueError("SequenceParallelTorchNorm: zero-centered gamma, persistent and "
                             "memory-efficient layer norms are not torch norms")
        norms = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in norms:
            raise ValueError(f"SequenceParallelTorchNorm: normalization "
                             f"{config.normalization!r} is not one of {sorted(norms)}")
        norm = norms[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def _sequence_parallel_norms(spec):
    """A copy of megatron's decoder block spec with every ``WrappedTorchNorm`` slot (the
    block's final norm, each layer's input and pre-MLP norms, the q/k norms) built by
    ``SequenceParallelTorchNorm`` (model/spec_edit.py: megatron's own spec objects are left
    as they are)."""

    return replace_in_spec(spec, lambda obj: SequenceParallelTorchNorm
                           if obj is WrappedTorchNorm else None)


@torch.inference_mode()
def reference_logprobs(model: GPTModel, tokens: list[int]) -> torch.Tensor:
    """Full-recompute log-softmax over the vocabulary for every position: [len, V] (fp32)."""
    device = next(model.parameters()).device
    ids = torch.tensor(tokens, device=device)[None]
    pos = torch.arange(len(tokens), device=device)[None]
    mask = torch.triu(torch.ones(len(tokens), len(tokens), dtype=torch.bool, device=device), 1)
    logits = model(ids, pos, attention_mask=mask[None, None])
    return torch.log_softmax(logits[0].float(), dim=-1)


@torch.inference_mode()
def reference_mtp_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """The MTP layer's log-softmax at every position of ``tokens``, teacher-forced as megatron
    trains it: row i reads the decoder's output at i and the embedding of token i + 1 and
    predicts token i + 2 -- [len - 1, V] (the last position has no next token; megatron fills
    it with token 0 and masks its loss). What an MTP draft of the engine must be the argmax of.
    Runs megatron's own modules: the decoder, then ``model.mtp`` (MultiTokenPredictionBlock)
    with the main model's embedding and RoPE, then the output layer."""
    core = getattr(model, "module", model)  # Float16Module
    device = next(core.parameters()).device
    n = len(tokens)
    ids = torch.tensor(tokens, device=device)[None]
    pos = torch.arange(n, device=device)[None]
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), 1)[None, None]
    emb = core.embedding(input_ids=ids, position_ids=pos)
    if emb.dtype != core.config.params_dtype:
        emb = emb.to(core.config.params_dtype)
    rope = core.rotary_pos_emb(n)
    if isinstance(rope, tuple):  # YaRN's (angles, mscale): GPTModel's forward drops the
        rope = rope[0]  # mscale too, its attention applies it from the config
    hidden = core.decoder(hidden_states=emb, attention_mask=mask, rotary_pos_emb=rope)
    out = core.mtp(input_ids=ids, position_ids=pos, hidden_states=hidden, attention_mask=mask,
                   rotary_pos_emb=rope, embedding=core.embedding)
    depth1 = torch.chunk(out, 1 + core.config.mtp_num_layers, dim=0)[1]  # [n, 1, H]
    weight = core.shared_embedding_or_output_weight() if core.share_embeddings_and_output_weights \
        else None
    logits, _ = core.output_layer(depth1, weight=weight)
    return torch.log_softmax(logits[: n - 1, 0].float(), dim=-1)
