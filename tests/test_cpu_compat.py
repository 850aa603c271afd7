"""The CPU compatibility layer: each patch is needed (megatron fails without it) and sufficient."""

from __future__ import annotations

import pytest
import torch

from colo_rollout.runtime.cpu_compat import (
    cpu_compat_active,
    install_cpu_compat,
    uninstall_cpu_compat,
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="patches apply only without CUDA")


def _rope_table():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True).get_emb(4)


def test_patch1_current_device_needed_and_sufficient_for_rope():
    uninstall_cpu_compat()
    try:
        with pytest.raises((RuntimeError, AssertionError)):
            _rope_table()  # megatron moves inv_freq to torch.cuda.current_device()
    finally:
        install_cpu_compat()
    assert cpu_compat_active()
    emb = _rope_table()
    assert emb.device.type == "cpu" and emb.shape == (4, 1, 1, 8)


def test_patch1_router_expert_bias_buffers_on_cpu():
    from megatron.core.transformer.moe.router import TopKRouter

    from colo_rollout.config import ModelConfig
    from colo_rollout.model.model import megatron_config

    cfg = megatron_config(ModelConfig(hidden_size=16, num_attention_heads=2, num_query_groups=1,
                                      num_experts=4, moe_router_topk=2, vocab_size=32), init=False)
    cfg.moe_router_enable_expert_bias = True
    cfg.moe_router_score_function = "sigmoid"
    install_cpu_compat()
    pgc = _single_rank_pgc()
    router = TopKRouter(config=cfg, pg_collection=pgc)
    assert router.expert_bias.device.type == "cpu"


def test_patch2_rng_tracker_fork_is_a_noop_context():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, initialize_rng_tracker

    initialize_rng_tracker(force_reset=True)  # megatron's default tracker: needs CUDA states
    with pytest.raises(Exception, match="not added"):
        with get_cuda_rng_tracker().fork():
            pass
    install_cpu_compat()
    with get_cuda_rng_tracker().fork():
        x = torch.randn(3)
    assert x.shape == (3,)


def test_install_is_idempotent():
    assert install_cpu_compat() and install_cpu_compat()
    assert torch.cuda.current_device() == "cpu"


def _single_rank_pgc():
    import tempfile

    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not dist.is_initialized():
        store = dist.FileStore(tempfile.mktemp(prefix="colo_compat_"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    g = dist.new_group([0])
    return ProcessGroupCollection(tp=g, ep=g, expt_tp=g, tp_ep=g, cp=g, tp_cp=g, dp=g,
                                  dp_cp=g, expt_dp=g, tp_dp_cp=g, pp=g, mp=g)


def test_patch3_synchronize_needed_and_a_no_op():
    uninstall_cpu_compat()
    try:
        with pytest.raises((RuntimeError, AssertionError)):
            torch.cuda.synchronize()
    finally:
        install_cpu_compat()
    assert torch.cuda.synchronize() is None
