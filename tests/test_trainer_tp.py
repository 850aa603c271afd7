"""Trainer TP > 1 without processes: the sequence-parallel norm spec and what the door and the
trainer refuse. (The multi-rank checks -- gradients, weight sync, a training run -- are in
test_weight_sync.py and test_train.py.)"""

from __future__ import annotations

import pytest
import torch

from colo_rollout.config import ModelConfig, RLConfig
from colo_rollout.config.checks import ConfigError
from colo_rollout.model.megatron_gpt import SequenceParallelTorchNorm, _sequence_parallel_norms
from colo_rollout.model.model import megatron_config
from colo_rollout.rl.trainer import check_trainer_tp

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


def test_trainer_tp_with_trainer_ep_is_refused_at_the_door():
    RLConfig(trainer_tp=2)  # TP x DP (sequence parallel) is a layout now
    RLConfig(trainer_ep=2)
    with pytest.raises(ConfigError, match=r"rl\.trainer_tp.*rl\.trainer_ep 2.*set one of them"):
        RLConfig(trainer_tp=2, trainer_ep=2)


def test_trainer_tp_that_does_not_split_the_model_is_refused():
    cfg = ModelConfig(**TINY)
    check_trainer_tp(cfg, 2)
    with pytest.raises(ValueError, match=r"rl\.trainer_tp 4 .*num_query_groups"):
        check_trainer_tp(cfg, 4)  # 2 KV groups: megatron's TP > groups replicates them
    with pytest.raises(ValueError, match=r"rl\.trainer_tp 3 .*num_attention_heads"):
        check_trainer_tp(cfg, 3)
