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


@pytest.mark.parametrize("world,adp,ep,model_kw", [
    (2, 2, 2, None),  # RL trainer TP2 (sequence parallel)  -> inference EP2/ADP2
    (4, 2, 4, None),  # RL trainer TP2 x DP2                -> inference EP4/ADP2/ATP2
    (4, 2, 4, ARCH),  # the same, every architecture tensor (q/k norms, gates, dense layers)
])
def test_sync_from_a_sequence_parallel_trainer_is_bit_exact(worker_groups, world, adp, ep,
                                                            model_kw):
    """The RL Trainer's own model at rl.trainer_tp 2: megatron's sequence parallelism (norms
    marked sequence_parallel), experts TP-sharded, vocab-parallel embedding and output."""
    res = worker_groups(world).run("tests.cases_rl:weight_sync_exact", adp=adp, ep=ep,
                                   trainer_tp=2, model_kw=model_kw, rl_trainer=True)
    for r in res:
        assert r["checked"] > 10 and r["mismatched"] == []
        assert r["sp_params"] > 0  # the trainer really is sequence parallel
    r0 = res[0]
    assert r0["mismatches"] == [] and r0["max_logprob_diff"] < LOGPROB_TOL


@pytest.mark.parametrize("adp,ep,trainer_ep", [
    (2, 4, 2),  # RL trainer TP2 x EP2 (x DP2) -> inference EP4/ADP2/ATP2
    (4, 2, 2),  # RL trainer TP2 x EP2 (x DP2) -> inference EP2/ADP4 (experts ETP2 there)
    (2, 2, 4),  # RL trainer TP2 x EP4 (x DP2) -> inference EP2/ADP2/ATP2
])
def test_sync_from_a_tensor_and_expert_parallel_trainer_is_bit_exact(worker_groups, adp, ep,
                                                                     trainer_ep):
    """rl.trainer_tp 2 with rl.trainer_ep on 4 ranks: dense tensors TP-sharded over
    {0,1}/{2,3} (sequence parallel), DP over {0,2}/{1,3}; experts whole (ETP 1) over EP groups
    of trainer_ep consecutive ranks, data-parallel over the rest (EP2: {0,2}/{1,3}; EP4:
    none): megatron's planner reads the expert ownership from the EP group and the expert TP
    width from expt_tp."""
    res = worker_groups(4).run("tests.cases_rl:weight_sync_exact", adp=adp, ep=ep,
                               trainer_tp=2, trainer_ep=trainer_ep, rl_trainer=True)
    for r in res:
        assert r["checked"] > 10 and r["mismatched"] == []
        assert r["trainer_groups"] == {"tp": 2, "dp": 2, "ep": trainer_ep, "expt_tp": 1,
                                       "tp_ep": trainer_ep, "expt_dp": 4 // trainer_ep}
        assert r["sp_params"] > 0 and r["ep_params"] > 0
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


@pytest.mark.parametrize("world,algorithm,is_level,replay,model_kw", [
    (2, "grpo", "none", True, ARCH),  # TP2: q/k norms, shared-expert gate, dense layer
    (2, "ppo", "token", False, None),  # TP2: the value head on the gathered hidden states
    (4, "ppo", "none", True, None),  # TP2 x DP2
])
def test_tensor_parallel_trainer_takes_the_same_gradient(worker_groups, world, algorithm,
                                                         is_level, replay, model_kw):
    """rl.trainer_tp 2 (sequence parallel, experts TP-sharded): each TP rank's gradient is
    the TP1 trainer's cut to its shard, the parameters trained on a sequence shard (norms,
    routers, gates) or a head shard (q/k norms) summed over TP; with routing replay each TP
    rank replays its shard of the sequence. Loss and metrics are the TP1 trainer's too: TP
    and SP change the summation order only."""
    res = worker_groups(world).run("tests.cases_rl:tensor_parallel_trainer_grads", tp=2,
                                   model_kw=model_kw, replay=replay, algorithm=algorithm,
                                   is_level=is_level)
    assert _gradient_problems(res, replay, algorithm, sharded=30) == []


@pytest.mark.parametrize("algorithm,is_level,is_mode", [
    ("grpo", "token", "mask"),  # the ranks keep unequal token counts
    ("ppo", "sequence", "mask"),  # ... and PPO whitens over the whole batch
])
def test_a_data_parallel_split_trains_as_one_batch(worker_groups, algorithm, is_level, is_mode):
    """TP1 x DP2: the trajectories split over the two ranks give the loss, the metrics and
    the gradients of one replica holding them all -- every token mean, PPO's whitening and
    every reported number over the whole batch, whatever each rank kept."""
    res = worker_groups(2).run("tests.cases_rl:data_parallel_split_is_one_batch",
                               algorithm=algorithm, is_level=is_level, is_mode=is_mode)
    for r in res:
        assert r["compared"] > 20
        assert r["worst_rel"] < 1e-5, r["worst_rel"]
        assert r["worst_stat"] < 1e-6, r["stats"]
        assert r["stats"]["split"]["is_corrected_frac"] > 0.1  # masked IS dropped tokens
        assert r["refused"] == ("trainer step: trajectory (group 0, sample 1) has a rollout "
                                "logprob that is not finite at a trained position")


def _gradient_problems(res: list, replay: bool, algorithm: str, sharded: int,
                       experts: bool = False) -> list:
    """What differs from the TP1 trainer on any rank (cases_rl:
    tensor_parallel_trainer_grads): too few tensors compared, a gradient, the loss or a
    metric off, a metric missing. Empty when every rank matches."""
    problems = []
    for r in res:
        if not (r["compared"] > 40 and r["sharded"] > sharded):
            problems.append(("compared", r["compared"], r["sharded"]))
        if experts and not r["experts"] > 0:
            problems.append(("experts", r["experts"]))
        if not r["worst_rel"] < 2e-5:
            problems.append((r["worst_name"], r["worst_rel"]))
        if not r["worst_stat"] < 1e-5:
            problems.append(("stats", r["stats"]))
        if replay and "routing_disagree_frac" not in r["keys"]:
            problems.append("routing_disagree_frac missing")
        if algorithm == "ppo" and "value_loss" not in r["keys"]:
            problems.append("value_loss missing")
    return problems


@pytest.mark.parametrize("ep,algorithm,replay", [
    (2, "grpo", True),  # TP2 x EP2: expt_dp {0,2}/{1,3}
    (2, "ppo", False),
    (4, "grpo", True),  # TP2 x EP4: tp_ep spans both replicas (they pad to one shape),
])                      # expt_dp is 1 while DP is 2
def test_tensor_and_expert_parallel_trainer_takes_the_same_gradient(worker_groups, ep,
                                                                    algorithm, replay):
    """rl.trainer_tp 2 x rl.trainer_ep on 4 ranks (DP2; experts whole, ETP 1): megatron's
    allgather dispatcher moves each rank's sequence shard over tp_ep, the expert gradients are
    summed over expt_dp, the sequence-shard ones over TP, the dense ones over DP, both then
    / DP -- and every gradient, the loss and the metrics are the TP1 x DP4 trainer's (ARCH:
    q/k norms, shared experts and their gate, a dense layer, the router's expert bias)."""
    res = worker_groups(4).run("tests.cases_rl:tensor_parallel_trainer_grads", tp=2, ep=ep,
                               model_kw=ARCH, replay=replay, algorithm=algorithm)
    assert _gradient_problems(res, replay, algorithm, sharded=10, experts=True) == []


def test_refit_view_unwraps_megatrons_module_prefix():
    """A half-precision trainer is megatron's Float16Module (and DDP on GPU): its parameters
    are named 'module.<name>'; the refit planner matches trainer and inference parameters by
    name, so the view yields them unwrapped (the GPU bf16 sync failed with 'Destination
    parameter embedding.word_embeddings.weight not found in source model' before)."""
    import torch

    from colo_rollout.rl.weight_sync import RefitView

    inner = torch.nn.Module()
    inner.embedding = torch.nn.Linear(2, 2)
    inner.config, inner.pg_collection = object(), object()

    class Wrapper(torch.nn.Module):  # Float16Module's shape: the model under .module
        def __init__(self, module):
            super().__init__()
            self.module = module
            self.config, self.pg_collection = module.config, module.pg_collection

    view = RefitView(Wrapper(Wrapper(inner)))
    names = [n for n, _ in view.named_parameters()]
    assert names == ["embedding.weight", "embedding.bias"]
    assert next(view.named_parameters())[1] is inner.embedding.weight


@pytest.mark.parametrize("world,adp,ep,trainer_tp,replay", [
    (2, 2, 2, 1, True),   # trainer TP1 x DP2 -> EP2/ADP2: every slice on its own rank
    (2, 2, 2, 2, False),  # trainer TP2 -> EP2/ADP2: the TP shards cross ranks
])
def test_same_rank_refit_is_replayed_and_follows_the_trainer(worker_groups, world, adp, ep,
                                                            trainer_tp, replay):
    """A refit whose transfers are all same-rank views of the parameters is recorded once and
    replayed as batched copies (no plan execution); after the trainer's weights move the
    replay brings the new values, bit-exact; a layout with point-to-point transfers keeps
    megatron's path."""
    res = worker_groups(world).run("tests.cases_rl:weight_sync_exact", adp=adp, ep=ep,
                                   trainer_tp=trainer_tp, perturb=0.5)
    for r in res:
        assert r["checked"] > 10 and r["mismatched"] == []
        assert r["version"] == 3
        assert r["replayed"] == replay and r["replays_left"] == int(replay)
    assert res[0]["mismatches"] == [] and res[0]["max_logprob_diff"] < LOGPROB_TOL


def test_local_replay_merges_halves_and_keeps_whole_parameters_static():
    """LocalReplay's recording, without processes: a GLU weight moved as its two halves (as
    megatron's plan does) replays as one whole-parameter copy from lists made once; a slice
    of a larger parameter stays a view rebuilt per replay; both bring the trainer's new
    values; a parameter whose storage is replaced with the same layout (the engine's memory
    release) is followed, and one whose layout changed makes the replay invalid."""
    import torch

    from colo_rollout.rl.weight_sync import LocalReplay

    torch.manual_seed(0)
    trainer = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(8, 4)),
                                      torch.nn.Parameter(torch.randn(3, 4))])
    stack = torch.zeros(2, 8, 4)
    inference = torch.nn.ParameterList([torch.nn.Parameter(stack[0]),
                                        torch.nn.Parameter(torch.zeros(6, 4))])
    t0, t1 = trainer[0], trainer[1]
    i0, i1 = inference[0], inference[1]
    pairs = [(t0.data[:4], i0.data[:4]), (t0.data[4:], i0.data[4:]),  # gate, up halves
             (t1.data, i1.data[2:5])]  # into a slice
    rep = LocalReplay(pairs, trainer, inference)
    assert sum(len(d) for d, _, _ in rep.static) == 1 and len(rep.views) == 1
    assert rep.valid() and rep.run() == (32 + 12) * 4
    assert torch.equal(i0.data, t0.data) and torch.equal(i1.data[2:5], t1.data)
    assert not i1.data[:2].any() and not i1.data[5:].any()
    with torch.no_grad():
        t0.mul_(3.0)
        t1.add_(1.0)
    i1.data = torch.zeros(6, 4)  # released and restored: a new storage, the same layout
    assert rep.valid() and rep.run() > 0
    assert torch.equal(i0.data, t0.data) and torch.equal(i1.data[2:5], t1.data)
    assert torch.equal(stack[0], t0.data)  # written through the stack's view
    i1.data = torch.zeros(7, 4)  # another layout: the recording no longer applies
    assert not rep.valid()


def test_a_sync_per_step_closed_after_it_frees_its_process_group(worker_groups):
    for r in worker_groups(2).run("tests.cases_rl:weight_sync_closed", timeout=300):
        assert r["fds"][-1] <= r["fds"][4] + 2, r["fds"]  # was ~5 more a call
        assert r["after_close"] == "WeightSync: this sync was closed; build a new one"
        assert r["exact"]


def test_misuse_is_refused_before_any_tensor_moves(worker_groups):
    r = worker_groups(1).run("tests.cases_rl:weight_sync_misuse", timeout=300)[0]
    e = r["errors"]
    assert "the first argument is the engine's model -- swapped arguments" in e["swapped"]
    assert e["none"] == ("WeightSync: trainer_model must be a megatron model (a torch module "
                         "with a config), got NoneType")
    assert e["layers"].startswith("WeightSync: the trainer's num_layers is 3, the inference "
                                  "model's 2"), e["layers"]
    assert e["mla"].startswith("WeightSync: the trainer's multi_latent_attention is True, "
                               "the inference model's False"), e["mla"]
    assert e["mla_rank"].startswith("WeightSync: the trainer's kv_lora_rank is 16, the "
                                    "inference model's 24"), e["mla_rank"]
    assert e["topk"].startswith("WeightSync: the trainer's moe_router_topk is 1, the "
                                "inference model's 2: the two models must compute one "
                                "function"), e["topk"]
    assert e["eps"].startswith("WeightSync: the trainer's layernorm_epsilon is 0.1"), e["eps"]
    assert e["rope"].startswith("WeightSync: the trainer's rotary frequencies"), e["rope"]
    assert "call engine.resume_memory() before the sync" in e["released"]
    assert r["path"] == "plan"
    assert e["unwritten"].startswith("weights_loaded(): ") and "was not written since " \
        "resume_memory() after a discard" in e["unwritten"], e["unwritten"]
    assert e["kinds"].startswith("WeightSync: the trainer has ") and "layernorm" in e["kinds"]
    assert "the engine has requests in flight" in e["busy"]
    assert e["nan"].startswith("WeightSync: the trainer's ") and "is not finite" in e["nan"]
    assert r["paused"] == {"ends": ("length", 2), "unsent": ("cancelled", 0)}, r["paused"]
    reason, n, error = r["nan_out"]
    assert (reason, n) == ("error", 0) and "the model's logits are not finite at output " \
        "token 0" in error, r["nan_out"]
    assert r["after_nan"] == ("length", 3)
    for name in ("closed_cancel", "closed_release", "closed_loaded"):
        assert "this engine is closed" in e[name], (name, e)


def test_a_refusal_on_one_rank_raises_on_every_rank(worker_groups):
    """Memory released on rank 0 alone: generate() and rollout() raise on both ranks naming
    rank 0 (rank 0 refused alone before, and rank 1's call paired with rank 0's next one);
    the engine serves again once rank 0 resumes."""
    res = worker_groups(2).run("tests.cases_rl:one_rank_released", timeout=120)
    for r in res:
        assert r["generate"].startswith("generate(): rank 0: engine memory is released")
        assert r["rollout"].startswith("rollout(): rank 0: engine memory is released")
        assert r["after"] == ["b"]
