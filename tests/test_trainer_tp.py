"""Trainer TP > 1 without processes: the sequence-parallel norm spec, each rank's weight shard
in megatron's TP x EP rank layout, and what the door and the trainer refuse. (The multi-rank
checks -- gradients, weight sync, a training run -- are in test_weight_sync.py and
test_train.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from colo_rollout.config import ModelConfig, RLConfig
from colo_rollout.config.checks import ConfigError
from colo_rollout.model.megatron_gpt import (
    SequenceParallelTorchNorm,
    _sequence_parallel_norms,
    shard_layout,
)
from colo_rollout.model.model import megatron_config
from colo_rollout.rl.trainer import check_trainer_layout, check_trainer_tp

TINY = dict(vocab_size=256, hidden_size=64, num_layers=3, num_attention_heads=4,
            num_query_groups=2, moe_ffn_hidden_size=64, num_experts=8, moe_router_topk=2,
            max_position_embeddings=512, qk_layernorm=True, first_k_dense=1,
            ffn_hidden_size=96)


def _slots(spec) -> list:
    """Every norm class the decoder block spec names, in order."""
    out = [spec.layer_norm]
    for layer in spec.layer_specs:
        sub = layer.submodules
        attn = sub.self_attention.submodules
        out += [sub.input_layernorm, sub.pre_mlp_layernorm, attn.q_layernorm, attn.k_layernorm]
    return out


def test_sequence_parallel_spec_swaps_every_torch_norm_and_leaves_megatrons_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = ModelConfig(**TINY)
    tcfg = megatron_config(cfg, tp=2, etp=2, sequence_parallel=True, init=False)
    spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False,
                                      normalization=cfg.normalization, pp_rank=0)
    before = _slots(spec)
    swapped = _sequence_parallel_norms(spec)
    assert WrappedTorchNorm in before  # the local spec's RMSNorm (apex or not)
    # every torch-norm slot swapped, any other (apex's FusedLayerNorm marks itself) kept
    assert _slots(swapped) == [SequenceParallelTorchNorm if c is WrappedTorchNorm else c
                               for c in before]
    assert _slots(spec) == before  # megatron's objects untouched


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_sequence_parallel_norm_is_the_torch_norm_with_marked_parameters(normalization):
    cfg = ModelConfig(**{**TINY, "normalization": normalization})
    tcfg = megatron_config(cfg, tp=2, etp=2, sequence_parallel=True, init=False)
    norm = SequenceParallelTorchNorm(tcfg, hidden_size=64, eps=1e-5)
    ref = getattr(torch.nn, normalization)(64, eps=1e-5)
    assert type(norm) is type(ref)
    assert all(p.sequence_parallel for p in norm.parameters())
    x = torch.randn(3, 64)
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_()
        ref.load_state_dict(norm.state_dict())
    assert torch.equal(norm(x), ref(x))


def test_trainer_ep_not_a_multiple_of_trainer_tp_is_refused_at_the_door():
    RLConfig(trainer_tp=2)  # TP x DP (sequence parallel)
    RLConfig(trainer_ep=2)
    RLConfig(trainer_tp=2, trainer_ep=2)  # TP x EP, experts whole
    RLConfig(trainer_tp=2, trainer_ep=4)
    with pytest.raises(ConfigError, match=r"rl\.trainer_ep: 2 with rl\.trainer_tp 4 .*"
                                          r"a multiple of trainer_tp"):
        RLConfig(trainer_tp=4, trainer_ep=2)


def test_trainer_layout_refusals_name_the_key():
    check_trainer_layout(4, 2, 2)
    check_trainer_layout(4, 2, 4)
    check_trainer_layout(8, 2, 4)
    for (world, tp, ep), key in (((4, 4, 2), r"rl\.trainer_ep 2 is not a multiple of "
                                             r"rl\.trainer_tp 4"),
                                 ((6, 2, 3), r"rl\.trainer_ep 3 is not a multiple"),
                                 ((4, 3, 1), r"rl\.trainer_tp 3 does not divide"),
                                 ((4, 1, 3), r"rl\.trainer_ep 3 does not divide")):
        with pytest.raises(ValueError, match=key):
            check_trainer_layout(world, tp, ep)


class _Group:
    """A process group's size and rank, all ``shard_layout`` reads."""

    def __init__(self, ranks: list[int], rank: int) -> None:
        self._size, self._rank = len(ranks), ranks.index(rank)

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _megatron_groups(world: int, tp: int, ep: int, etp: int, rank: int) -> SimpleNamespace:
    """``rank``'s TP, EP and expert-TP groups as megatron's initialize_model_parallel lays
    them out (its RankGenerator, default order) -- what trainer_pg_collection builds."""
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=world // tp, pp=1, cp=1, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep), pp=1, cp=1, order=order)

    def group(gen, token):
        return _Group(next(g for g in gen.get_ranks(token) if rank in g), rank)

    return SimpleNamespace(tp=group(dense, "tp"), ep=group(expert, "ep"),
                           expt_tp=group(expert, "tp"))


@pytest.mark.parametrize("world,tp,ep", [(4, 2, 2), (4, 2, 4), (8, 2, 4), (8, 4, 4),
                                         (4, 2, 1), (4, 1, 2), (1, 1, 1)])
def test_each_rank_of_a_trainer_layout_is_one_shard_position(world, tp, ep):
    """In megatron's layout of every allowed trainer width (expert TP = TP at EP 1, else 1)
    a rank's shard is one inference Layout position: its ATP rank is its TP rank, its EP rank
    owns the experts megatron gives it, each expert TP-split only at EP 1."""
    from colo_rollout.model.weights import shard_rule

    etp = tp if ep == 1 else 1
    n_local = 8 // ep
    for rank in range(world):
        pgc = _megatron_groups(world, tp, ep, etp, rank)
        layout, at = shard_layout(pgc)
        assert (layout.atp, layout.etp, layout.ep) == (tp, etp, ep)
        assert layout.atp_rank_of(at) == pgc.tp.rank()
        qkv = shard_rule("decoder.layers.0.self_attention.linear_qkv.weight", layout, at, n_local)
        assert (qkv.kind, qkv.rank, qkv.size) == ("rows", pgc.tp.rank(), tp)
        owned = [e for e in range(8) if shard_rule(
            f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc2.weight", layout, at,
            n_local) is not None]
        first = pgc.ep.rank() * n_local  # megatron's local_expert_indices
        assert owned == list(range(first, first + n_local))
        fc2 = shard_rule(f"decoder.layers.0.mlp.experts.local_experts.{first}.linear_fc2.weight",
                         layout, at, n_local)
        assert (fc2.rank, fc2.size) == (pgc.expt_tp.rank(), etp)


def test_a_layout_the_shard_rules_cannot_cut_is_refused():
    # TP4 x EP2 with expert TP 1: ranks 2 and 3 hold EP rank 0/1's experts at TP rank 2/3
    with pytest.raises(ValueError, match=r"TP 4 x EP 2 with expert TP 1 is not a layout"):
        shard_layout(_megatron_groups(4, 4, 2, 1, rank=2))


def test_trainer_tp_that_does_not_split_the_model_is_refused():
    cfg = ModelConfig(**TINY)
    check_trainer_tp(cfg, 2)
    odd = ModelConfig(**{**TINY, "moe_ffn_hidden_size": 65})
    check_trainer_tp(odd, 2, ep=2)  # experts whole with EP: their width is not split
    with pytest.raises(ValueError, match=r"rl\.trainer_tp 2 .*moe_ffn_hidden_size"):
        check_trainer_tp(odd, 2)
    with pytest.raises(ValueError, match=r"rl\.trainer_tp 4 .*num_query_groups"):
        check_trainer_tp(cfg, 4)  # 2 KV groups: megatron's TP > groups replicates them
    with pytest.raises(ValueError, match=r"rl\.trainer_tp 3 .*num_attention_heads"):
        check_trainer_tp(cfg, 3)
