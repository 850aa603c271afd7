"""Weight sync hook (megatron.core.resharding): training layout -> inference layout, exact."""

from __future__ import annotations

import pytest

from tests.cases_engine import LOGPROB_TOL


@pytest.mark.parametrize("world,adp,ep,trainer_tp", [
    (2, 2, 2, 2),  # trainer TP2            -> inference EP2/ADP2
    (2, 1, 1, 2),  # trainer TP2            -> inference ATP2 (experts ETP2)
    (2, 1, 2, 1),  # trainer TP1 x DP2      -> inference EP2/ATP2
    (4, 2, 4, 4),  # trainer TP4            -> inference EP4/ADP2/ATP2
    (4, 4, 2, 2),  # trainer TP2 x DP2      -> inference EP2/ADP4
])
def test_sync_is_bit_exact(worker_groups, world, adp, ep, trainer_tp):
    res = worker_groups(world).run("tests.cases_rl:weight_sync_exact", adp=adp, ep=ep,
                                   trainer_tp=trainer_tp)
    for r in res:
        assert r["checked"] > 10 and r["mismatched"] == []
        assert r["version"] == 2
    r0 = res[0]
    assert r0["mismatches"] == [] and r0["max_logprob_diff"] < LOGPROB_TOL
    assert sum(r["bytes_remote"] + r["bytes_local"] for r in res) > 0


# every new tensor of the architecture surface: q/k norms, q/k/v bias, shared experts and their
# gate, dense first layers (ATP-sharded, stride-2 fc1), the router's expert-bias buffer
ARCH = {"qk_layernorm": True, "head_dim": 24, "qkv_bias": True, "router_score": "sigmoid",
        "router_expert_bias": True, "shared_expert_ffn_hidden_size": 48,
        "shared_expert_gate": True, "first_k_dense": 1, "ffn_hidden_size": 96, "num_layers": 3}


@pytest.mark.parametrize("world,adp,ep,trainer_tp", [
    (2, 2, 2, 2),  # trainer TP2       -> inference EP2/ADP2
    (2, 1, 2, 1),  # trainer TP1 x DP2 -> inference EP2/ATP2
    (4, 2, 4, 2),  # trainer TP2 x DP2 -> inference EP4/ADP2/ATP2
])
def test_sync_of_every_architecture_tensor_is_bit_exact(worker_groups, world, adp, ep,
                                                        trainer_tp):
    res = worker_groups(world).run("tests.cases_rl:weight_sync_exact", adp=adp, ep=ep,
                                   trainer_tp=trainer_tp, model_kw=ARCH)
    for r in res:
        assert r["checked"] > 20 and r["mismatched"] == []
    r0 = res[0]
    assert r0["mismatches"] == [] and r0["max_logprob_diff"] < LOGPROB_TOL


@pytest.mark.parametrize("world,adp,ep,trainer_ep", [
    (2, 2, 2, 2),  # trainer EP2          -> inference EP2/ADP2
    (2, 1, 1, 2),  # trainer EP2          -> inference ATP2 (experts ETP2)
    (4, 2, 4, 2),  # trainer EP2 x DP2    -> inference EP4/ADP2/ATP2
])
def test_sync_from_an_expert_parallel_trainer_is_bit_exact(worker_groups, world, adp, ep,
                                                          trainer_ep):
    res = worker_groups(world).run("tests.cases_rl:weight_sync_exact", adp=adp, ep=ep,
                                   trainer_tp=1, trainer_ep=trainer_ep)
    for r in res:
        assert r["checked"] > 10 and r["mismatched"] == []
    r0 = res[0]
    assert r0["mismatches"] == [] and r0["max_logprob_diff"] < LOGPROB_TOL


def test_two_model_pairs_of_one_layout_each_sync_exactly(worker_groups):
    res = worker_groups(2).run("tests.cases_rl:weight_sync_two_model_pairs", adp=2, ep=2,
                               trainer_tp=2)
    for r in res:
        assert r["mismatched"] == []


def test_expert_parallel_trainer_takes_the_same_gradient(worker_groups):
    """rl.trainer_ep: megatron's token dispatcher over the trainer's EP group (uneven batches
    padded to one shape), expert gradients summed over the ranks holding the same experts:
    the step's gradient is the data-parallel trainer's, parameter by parameter."""
    res = worker_groups(2).run("tests.cases_rl:expert_parallel_trainer_grads")
    for r in res:
        assert r["compared"] > 10 and r["experts"] > 0
        assert r["worst_rel"] < 1e-5, r
