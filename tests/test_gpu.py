"""GPU tier: the engine on 1 and 2 GPUs (NCCL, bf16) against the megatron reference.

Skipped without CUDA (CI). scripts/gpu_check.sh runs this file on the GPU host; each test
appends its measurements to $COLO_GPU_REPORT (JSON lines) for the summary table.
"""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest
import torch

from colo_rollout.runtime.spawn import WorkerGroup

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(NGPU == 0, reason="needs CUDA GPUs")


def _record(name: str, row: dict) -> None:
    path = os.environ.get("COLO_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **row}) + "\n")


@pytest.fixture(scope="module")
def gpu_groups():
    groups: dict[int, WorkerGroup] = {}

    def get(world: int) -> WorkerGroup:
        if world > NGPU:
            pytest.skip(f"needs {world} GPUs, have {NGPU}")
        if world not in groups or not groups[world].alive:
            groups[world] = WorkerGroup(world, backend="nccl")
        return groups[world]

    yield get
    for g in groups.values():
        g.close()


def _check_against_reference(name: str, res: list, world: int, dtype: str) -> None:
    """Record the engine-vs-megatron row, then assert the acceptance: fp32 exact within
    FP32_TOL; bf16 no worse than megatron's own bf16 against fp32 (cases_gpu says why)."""
    from tests import cases_gpu as C

    r0 = res[0]
    if dtype == "float32":
        ok = not r0["mismatches"] and r0["max_logprob_diff"] < C.FP32_TOL
    else:
        ok = (r0["mean_logprob_diff"] <= C.BF16_RATIO * r0["megatron_bf16_mean_diff"]
              and r0["argmax_agreement"]
              >= r0["megatron_bf16_argmax_agreement"] - C.BF16_AGREE_DROP)
    _record(name, {
        "layout": r0["layout"], "gpus": world, "checked": r0["checked"],
        "max_logprob_diff": r0["max_logprob_diff"], "mean_logprob_diff": r0["mean_logprob_diff"],
        "megatron_bf16_mean_diff": r0.get("megatron_bf16_mean_diff"),
        "argmax_agreement": r0.get("argmax_agreement"),
        "megatron_argmax_agreement": r0.get("megatron_bf16_argmax_agreement"),
        "mismatches": len(r0["mismatches"]), "wall_s": r0["wall_s"],
        "tok_per_s": r0["generated"] / r0["wall_s"], "device": r0["device"], "passed": ok})
    assert r0["checked"] > 40
    if dtype == "float32":
        assert r0["mismatches"] == [], r0["mismatches"][:5]
        assert r0["max_logprob_diff"] < C.FP32_TOL
    else:
        assert r0["mean_logprob_diff"] <= C.BF16_RATIO * r0["megatron_bf16_mean_diff"]
        assert (r0["argmax_agreement"]
                >= r0["megatron_bf16_argmax_agreement"] - C.BF16_AGREE_DROP)
    for r in res[1:]:
        assert r["tokens"] == r0["tokens"]


def _have_te() -> bool:
    from colo_rollout.config.te_support import te_available

    return te_available()


@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("world,adp,ep", [(1, 1, 1), (2, 2, 2), (2, 1, 2), (2, 1, 1)])
def test_gpu_engine_matches_reference(gpu_groups, world, adp, ep, dtype, spec):
    if spec == "te" and (dtype != "bfloat16" or not _have_te()):
        pytest.skip("TE spec: bf16 only, and needs Transformer Engine installed")
    # bf16: 64 requests (~400 tokens). Both models' error is dominated by MoE routing flips
    # (a near-tied top-k choice that bf16 rounding tips the other way moves that token's
    # hidden state by O(the MoE output) and later tokens through attention), so the mean over
    # ~100 tokens is a handful of flips and too noisy to compare two models by.
    res = gpu_groups(world).run("tests.cases_gpu:gpu_engine_matches_reference", timeout=600,
                                adp=adp, ep=ep, dtype=dtype,
                                use_te="on" if spec == "te" else "off",
                                n_requests=16 if dtype == "float32" else 64)
    assert res[0]["te"] == (spec == "te")
    _check_against_reference(f"engine_vs_reference_{dtype}" + ("_te" if spec == "te" else ""),
                             res, world, dtype)


def test_gpu_on_demand_kv_preempts_and_matches_reference(gpu_groups):
    """engine.kv_reservation on_demand on 8 blocks of 16 for 16 requests of 40 new tokens
    (fp32, one GPU, D in its CUDA graphs): rows are preempted and prefilled again (12 times
    in the same run on CPU), and the tokens are still the reference's greedy ones with its
    logprobs."""
    res = gpu_groups(1).run("tests.cases_gpu:gpu_engine_matches_reference", timeout=600,
                            adp=1, ep=1, dtype="float32", max_tokens=40,
                            engine_kw={"kv_reservation": "on_demand", "num_kv_blocks": 8})
    assert res[0]["preemptions"] > 0
    _check_against_reference("engine_vs_reference_on_demand_kv", res, 1, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "glm", "tied"])
@pytest.mark.parametrize("world,adp,ep", [(1, 1, 1), (2, 2, 2)])
def test_gpu_architectures_match_reference(gpu_groups, world, adp, ep, arch, dtype):
    """The architecture surface (tests/cases_engine.py's family-shaped variants) on the
    GPU paths: bf16 takes the grouped experts, D's CUDA graphs and P's MoE graphs."""
    from tests.cases_engine import ARCHS

    res = gpu_groups(world).run("tests.cases_gpu:gpu_engine_matches_reference", timeout=600,
                                adp=adp, ep=ep, dtype=dtype, use_te="off",
                                n_requests=16 if dtype == "float32" else 64,
                                model_kw=ARCHS[arch])
    _check_against_reference(f"arch_{arch}_{dtype}", res, world, dtype)


@pytest.mark.parametrize("decode", ["torch", "triton"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("world,adp,ep", [(1, 1, 1), (2, 2, 2), (2, 1, 2)])
def test_gpu_mla_matches_reference(gpu_groups, world, adp, ep, dtype, decode):
    """DeepSeek-V3's attention (model.attention mla: the latent cache, P decompressed, D
    absorbed -- by its torch ops or its Triton kernel, inside D's CUDA graphs) against
    megatron's MLA GPTModel; EP2/ATP2 (session 31, not yet run): each GPU half the heads
    over the whole latent cache."""
    from tests.cases_engine import MLA_ARCH

    res = gpu_groups(world).run("tests.cases_gpu:gpu_engine_matches_reference", timeout=600,
                                adp=adp, ep=ep, dtype=dtype, use_te="off",
                                n_requests=16 if dtype == "float32" else 64,
                                model_kw={**MLA_ARCH, "num_attention_heads": 8,
                                          "num_query_groups": 8},
                                engine_kw={"decode_attention": decode})
    _check_against_reference(f"mla_{dtype}_{decode}", res, world, dtype)


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("arch", ["gqa", "mla"])
def test_gpu_dense_prefill_matches_reference(gpu_groups, arch, kernel):
    """P with its fresh sequences in dense calls (engine.prefill_attention cudnn / flash;
    from 12 tokens here, padded to 256), bf16, against megatron's GPTModel -- no worse than
    megatron's own bf16: the tier's GQA model (K and V from the rope kernel's contiguous
    rows) and MLA at DeepSeek's head widths (query/key 192, value 128)."""
    from colo_rollout.config.attention_support import dense_kernel_problem
    from tests.cases_engine import MLA_ARCH

    model_kw = None
    dims = (64, None)
    if arch == "mla":
        model_kw = {**MLA_ARCH, "num_attention_heads": 8, "num_query_groups": 8,
                    "kv_lora_rank": 64, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128}
        dims = (192, 128)
    why = dense_kernel_problem(kernel, "cuda", torch.bfloat16, *dims)
    if why is not None:
        pytest.skip(why)
    res = gpu_groups(1).run("tests.cases_gpu:gpu_engine_matches_reference", timeout=600,
                            adp=1, ep=1, dtype="bfloat16", use_te="off", n_requests=64,
                            model_kw=model_kw, engine_kw={"prefill_attention": kernel},
                            dense_from=12)
    assert res[0]["prefill_attention"] == kernel
    _check_against_reference(f"{arch}_dense_prefill_{kernel}", res, 1, "bfloat16")


def test_gpu_flash_varlen_is_attention_at_the_end_of_each_context():
    """FlashAttention-4's variable-length call as MLA's P makes it (``varlen_attention``: a
    fresh sequence, continuations on longer contexts, one row on a 3000-key context; query
    / key heads 192, value heads 128) against the same attention per sequence in fp32 on
    the CPU path: within bf16's error."""
    from colo_rollout.config.attention_support import dense_kernel_problem
    from colo_rollout.model import dense_prefill as dp

    why = dense_kernel_problem("flash", "cuda", torch.bfloat16, 192, 128)
    if why is not None:
        pytest.skip(why)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    new, ctx, heads = [700, 300, 1, 64], [700, 2300, 3000, 64], 16
    q = torch.randn(sum(new), heads, 192, device=dev, generator=gen).bfloat16()
    k = torch.randn(sum(ctx), heads, 192, device=dev, generator=gen).bfloat16()
    v = torch.randn(sum(ctx), heads, 128, device=dev, generator=gen).bfloat16()

    def cu(xs):
        return torch.tensor([0, *itertools.accumulate(xs)], dtype=torch.int32)

    call = dp.VarlenCall(None, cu(new).to(dev), cu(ctx).to(dev), max(new), max(ctx),
                         torch.zeros(0, dtype=torch.int64, device=dev))
    got = dp.varlen_attention(q, k, v, call, 192 ** -0.5).float().cpu()
    cpu = dp.VarlenCall(None, cu(new), cu(ctx), max(new), max(ctx), call.kv_slots.cpu())
    want = dp.varlen_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), cpu,
                               192 ** -0.5)
    err = (got - want).abs().max().item()
    _record("flash_varlen", {"gpus": 1, "max_err": err, "passed": err < 2e-2})
    assert err < 2e-2, err


@pytest.mark.parametrize("world,adp,ep", [(1, 1, 1), (2, 2, 2)])
def test_gpu_overlapped_prefill_matches_normal(gpu_groups, world, adp, ep):
    """engine.overlap_prefill on the GPU ("auto": on): P steps enqueued before the previous
    one's tokens are read, same greedy tokens as with it off."""
    g = gpu_groups(world)
    kw = {"max_prefill_tokens": 48, "max_batch_size": 8, "decode_buckets": [1, 2, 4, 8]}
    off = g.run("tests.cases_gpu:gpu_mode_tokens", timeout=600, adp=adp, ep=ep, mode="normal",
                overlap_prefill="never", **kw)[0]
    on = g.run("tests.cases_gpu:gpu_mode_tokens", timeout=600, adp=adp, ep=ep, mode="normal",
               overlap_prefill="auto", **kw)[0]
    _record(f"overlap_prefill_{world}", {"layout": f"adp{adp}/ep{ep}", "gpus": world,
                                         "read_late": on["read_late"],
                                         "p_after_late": on["p_after_late"],
                                         "passed": on["tokens"] == off["tokens"]})
    assert off["read_late"] == 0 and on["read_late"] > 0 and on["p_after_late"] > 0
    assert on["tokens"] == off["tokens"]


@pytest.mark.parametrize("world,adp,ep", [(2, 2, 2), (2, 1, 2)])
def test_gpu_pd_modes_match_normal(gpu_groups, world, adp, ep):
    """Every PD mode runs P and D on their own streams and gives Normal's greedy tokens;
    "always" also routes P's AllReduce onto D's stream (2 GPUs have no crossed path)."""
    g = gpu_groups(world)
    base = g.run("tests.cases_gpu:gpu_mode_tokens", timeout=600, adp=adp, ep=ep,
                 mode="normal")[0]
    assert not base["streams"]
    for mode, route, policy in (("global_complete", "auto", "fixed"),
                                ("global_enqueue", "auto", "fixed"), ("fine", "auto", "fixed"),
                                ("fine", "always", "fixed"), ("fine", "auto", "balanced")):
        r = g.run("tests.cases_gpu:gpu_mode_tokens", timeout=600, adp=adp, ep=ep, mode=mode,
                  stream_route=route, policy=policy)[0]
        _record(f"pd_{mode}_{route}_{policy}", {"layout": f"adp{adp}/ep{ep}", "gpus": world, "checked": 16,
                                       "max_logprob_diff": 0.0, "mean_logprob_diff": 0.0,
                                       "mismatches": int(r["tokens"] != base["tokens"]),
                                       "wall_s": 1.0, "tok_per_s": 0.0, "device": "cuda",
                                       "passed": r["tokens"] == base["tokens"],
                                       "routed": r["routed"]})
        assert r["streams"]
        assert r["tokens"] == base["tokens"], (mode, route)  # fp32: identical greedy tokens
        assert (r["routed"] > 0) == (route == "always")
        if mode == "fine":
            assert r["d_during_p"] > 0


@pytest.mark.parametrize("world,adp,ep", [(1, 1, 1), (2, 2, 2), (2, 1, 2)])
def test_gpu_d_advances_during_a_long_p_epoch(gpu_groups, world, adp, ep):
    """CUDA-event timing: in Fine mode D iterations run on the GPU while the long P epoch is in
    flight, with no host sync while either phase is enqueued; in Normal none can (same run)."""
    g = gpu_groups(world)
    normal = g.run("tests.cases_gpu:gpu_pd_overlap", timeout=600, adp=adp, ep=ep,
                   mode="normal")[0]
    fine = g.run("tests.cases_gpu:gpu_pd_overlap", timeout=600, adp=adp, ep=ep, mode="fine")[0]
    # the balanced span grows K until P's enqueue matches D; the long epoch's GPU tail must
    # still not hold D (its first tokens are committed when done, not waited for)
    bal = g.run("tests.cases_gpu:gpu_pd_overlap", timeout=600, adp=adp, ep=ep, mode="fine",
                policy="balanced")[0]
    _record("pd_overlap", {"layout": fine["layout"], "gpus": world, "normal": normal,
                           "fine": fine, "balanced": bal,
                           "passed": fine["d_inside"] >= 2 and bal["d_inside"] >= 2})
    assert normal["d_inside"] == 0
    for r in (fine, bal):
        assert r["syncs"] == {"P": 0, "D": 0}
        assert r["d_inside"] >= 2
        assert r["d_gap_max_ms"] < 0.5 * normal["d_gap_max_ms"], r


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("world,adp,ep", [(1, 1, 1), (2, 2, 2), (2, 1, 2)])
def test_gpu_decode_graphs_match_eager_and_follow_weights(gpu_groups, world, adp, ep, kernels):
    r = gpu_groups(world).run("tests.cases_gpu:gpu_graphs_vs_eager", timeout=600, adp=adp,
                              ep=ep, kernels=kernels)[0]
    _record("decode_graphs", {"layout": r["layout"], "gpus": world, "kernels": kernels,
                              "result": r,
                              "passed": r["first"]["identical"] >= 0.9})
    # D graphs: the same kernels up to the padded table width -- bf16 may differ in the last
    # bits of attention; with P graphs too, greedy streams may part at a near-tie later on
    assert r["first"]["identical"] >= 0.9 and r["first"]["max_dlogp"] < 0.05, r["first"]
    # P graphs: P's own output (the first token) equal but for near-ties (measured 7 or 8 of
    # 8), its logprob within bf16 rounding -- also after the reload and the replaced parameter,
    # where stale weights would change nearly all of them (random weights, 4096 tokens)
    # Tolerances: on one GPU every comparison below measured bitwise equal on both kernel
    # sets (1x H100, 2026-12-06: first tokens and whole streams identical, max dlogp 0.0;
    # per half-layer residuals equal too, docs/gpu.md session 41) -- session 9's 0.078 / 0.14
    # on an H200 did not recur; the one-GPU bounds leave room for another GPU's GEMM choices
    # by shape (ulp-level, a near-tied expert). Two GPUs: last measured at 0.1 / 0.2 (not
    # rerun since). Stale weights change nearly every token (changed_by_reload below), far
    # outside every bound.
    if world == 1:
        first_tol, stream_tol = 0.01, 0.05
    else:
        first_tol, stream_tol = (0.05, 0.2) if kernels == "torch" else (0.1, 0.2)
    for k in ("p_first_token", "reloaded_first_token", "after_replace_first_token"):
        assert r[k]["identical"] >= 0.75 and r[k]["max_dlogp"] < first_tol, (k, r[k])
    # eager P is deterministic: two eager runs agree bit for bit
    assert r["eager_vs_eager"]["identical"] == 1.0 and r["eager_vs_eager"]["max_dlogp"] == 0.0
    # both phases graphed: greedy streams part at near-ties (measured 25-100% identical on
    # 8-16 streams of 48 tokens); along the common prefix the logprobs stay within bf16 noise
    for k in ("all_graphs_vs_eager", "reloaded", "after_replace"):
        assert r[k]["max_dlogp"] < stream_tol, (k, r[k])
    assert r["warmup_captures"] > 0 and r["captured_after_warmup"] == 0
    assert r["recaptured_after_reload"] == 0  # in-place update: the captured addresses hold
    assert r["changed_by_reload"] < 0.5  # and the graphs really computed with the new weights
    assert r["recaptured_after_replace"] > 0 and r["p_recaptured_after_replace"] > 0
    assert r["p_graph_keys"] > 0 and r["p_replays"] > 0
    assert r["t_graph_s"] < r["t_eager_s"]


@pytest.mark.parametrize("world,adp,ep", [(1, 1, 1), (2, 2, 2)])
def test_gpu_memory_release_and_resume(gpu_groups, world, adp, ep):
    r = gpu_groups(world).run("tests.cases_gpu:gpu_memory_phases", timeout=600, adp=adp,
                              ep=ep)[0]
    _record("memory_phases", {"layout": r["layout"], "gpus": world, "result": r,
                              "passed": all(r[p]["equal_after_resume"]
                                            for p in ("keep", "offload", "discard"))})
    for policy in ("keep", "offload", "discard"):
        x = r[policy]
        assert x["equal_after_resume"], policy
        # the KV cache (and graph pool) is given back in every policy
        assert x["engine_mb"] - x["released_engine_mb"] >= 0.9 * r["kv_mb"], (policy, x)
    for policy in ("offload", "discard"):  # the weights too
        x = r[policy]
        assert x["released_engine_mb"] <= 0.1 * r["weights_mb"], (policy, x)


def test_gpu_grpo_learns(gpu_groups, tmp_path):
    """Colocated GRPO on 2 GPUs with megatron's DDP and optimizer."""
    res = gpu_groups(2).run("colo_rollout.rl.train:run_train", timeout=600,
                            config_path="configs/grpo_cpu.yaml",
                            overrides={"parallel.backend": "nccl", "rl.out_dir": str(tmp_path),
                                       "rl.release_memory": "discard"},
                            quiet=True)
    h = res[0]["history"]
    first = sum(x["reward"] for x in h[:3]) / 3
    last = sum(x["reward"] for x in h[-3:]) / 3
    _record("grpo_2gpu", {"layout": "EP2/ADP2 + trainer DP2", "gpus": 2, "checked": len(h),
                          "max_logprob_diff": max(x["logprob_gap_max"] for x in h),
                          "mean_logprob_diff": sum(x["logprob_gap_mean"] for x in h) / len(h),
                          "mismatches": 0, "wall_s": sum(x["rollout_s"] + x["train_s"] for x in h),
                          "tok_per_s": 0.0, "device": "cuda", "passed": last > first + 0.5})
    assert last > first + 0.5


@pytest.mark.parametrize("world,trainer_ep,recompute", [(1, 1, "none"), (1, 1, "full"),
                                                       (2, 2, "none")])
def test_gpu_routing_replay_in_bf16(gpu_groups, tmp_path, world, trainer_ep, recompute):
    """Issue 18's measurement: GRPO in bf16 with routing replay (the engine records its
    routing, the trainer replays it), per step the rollout/trainer logprob gap with replay and
    without (the trainer's own routing), and how many routing decisions differ. 1 GPU: trainer
    DP1; 2 GPUs: trainer EP2 beside the engine's EP2/ADP2."""
    layout = ({"parallel.world_size": 1, "parallel.adp": 1, "parallel.ep": 1}
              if world == 1 else {})
    res = gpu_groups(world).run(
        "colo_rollout.rl.train:run_train", timeout=600, config_path="configs/grpo_cpu.yaml",
        overrides={**layout, "parallel.backend": "nccl", "rl.out_dir": str(tmp_path),
                   "model.params_dtype": "bfloat16", "rl.steps": 8,
                   "engine.record_routing": True, "rl.routing_replay": True,
                   "rl.trainer_ep": trainer_ep, "rl.recompute": recompute}, quiet=True)
    h = res[0]["history"]
    mean = lambda k: sum(x[k] for x in h) / len(h)  # noqa: E731
    row = {"steps": len(h), "disagree_frac": mean("routing_disagree_frac"),
           "gap_max_replay": max(x["logprob_gap_max"] for x in h),
           "gap_mean_replay": mean("logprob_gap_mean"),
           "gap_max_no_replay": max(x["logprob_gap_max_no_replay"] for x in h),
           "gap_mean_no_replay": mean("logprob_gap_mean_no_replay")}
    _record("routing_replay_bf16", {"gpus": world, "trainer_ep": trainer_ep,
                                    "recompute": recompute, **row,
                                    "passed": row["gap_mean_replay"]
                                    <= row["gap_mean_no_replay"] + 1e-6})
    # replay removes the part of the gap that routing flips cause (the kernels' bf16 rounding
    # stays); with no flip at all both are the same
    assert row["gap_mean_replay"] <= row["gap_mean_no_replay"] + 1e-6, row
    assert all(math.isfinite(v) for v in row.values()), row


@pytest.mark.parametrize("variant", ["auto", "megatron", "loop"])
@pytest.mark.parametrize("world,adp,ep", [(1, 1, 1), (2, 1, 1), (2, 1, 2)])
def test_gpu_bf16_error_by_layer(gpu_groups, world, adp, ep, variant):
    """Diagnostic (prints; asserts the trace covers every block and that the ranks agree):
    where the engine's bf16 residual stream departs from megatron's bf16 model, against megatron
    fp32. variant: the default path, megatron's expert compute, the per-sequence P attention."""
    kw = {"moe_compute": "megatron"} if variant == "megatron" else {}
    if variant == "loop":
        kw["prefill_attention"] = "loop"
    r = gpu_groups(world).run("tests.cases_gpu:gpu_layer_errors", timeout=600, adp=adp,
                              ep=ep, **kw)[0]
    _record("bf16_by_layer", {"layout": r["layout"], "gpus": world, "variant": variant,
                              "rows": r["rows"], "passed": True})
    for x in r["rows"]:
        print(r["layout"], variant, json.dumps(x))
    assert len(r["rows"]) == 8  # 4 layers x (attention, MoE)
    assert all(x["ranks_max_diff"] == 0.0 for x in r["rows"])


def _have_deep_ep() -> bool:
    try:
        from colo_rollout.model.deepep import load_deep_ep

        load_deep_ep()
        return True
    except Exception:
        return False


DEEPEP_MODEL = {"moe_dispatch": "deepep", "hidden_size": 2048, "num_attention_heads": 16,
                "num_query_groups": 4, "moe_ffn_hidden_size": 512}


@pytest.mark.skipif(not _have_deep_ep(), reason="needs deep_ep with colo_rollout's patch "
                    "(scripts/deepep_setup.sh)")
def test_gpu_deepep_world1_low_latency_decode_matches_reference(gpu_groups):
    """model.moe_dispatch deepep on one GPU: D's MoE through DeepEP's low-latency
    dispatch/combine (captured in D's graphs), P's experts in place (one EP rank has no
    peer); the engine against megatron's GPTModel like the gather backend's row."""
    res = gpu_groups(1).run("tests.cases_gpu:gpu_engine_matches_reference", timeout=600,
                            adp=1, ep=1, dtype="bfloat16", n_requests=64,
                            model_kw=DEEPEP_MODEL)
    _record("deepep_buffers_world1", {"gpus": 1, "phases": res[0]["dispatch"]})
    assert [p["mode"] for p in res[0]["dispatch"]] == ["local", "low_latency"]
    _check_against_reference("deepep_world1_vs_reference_bf16", res, 1, "bfloat16")


@pytest.mark.parametrize("world,adp,ep", [(1, 1, 1), (2, 2, 2), (2, 1, 2)])
def test_gpu_alltoall_matches_reference(gpu_groups, world, adp, ep):
    """model.moe_dispatch alltoall on NCCL (issue 17 item 2 on a GPU): D's padded
    fixed-capacity all-to-all captured in D's graphs, P's count exchange then payload; the
    engine against megatron's GPTModel like the gather backend's row (written in session 13,
    not yet run on a GPU)."""
    res = gpu_groups(world).run("tests.cases_gpu:gpu_engine_matches_reference", timeout=600,
                                adp=adp, ep=ep, dtype="bfloat16", n_requests=32,
                                model_kw={"moe_dispatch": "alltoall"})
    _check_against_reference("alltoall_vs_reference_bf16", res, world, "bfloat16")


@pytest.mark.skipif(not _have_deep_ep(), reason="needs deep_ep with colo_rollout's patch "
                    "(scripts/deepep_setup.sh)")
def test_gpu_deepep_normal_split_dispatch_two_ranks_share_the_gpu():
    """P's split-phase normal dispatch (notify, a gap, counts, send) with 2 ranks on one GPU
    (gloo group): the notified counts are the true ones, the combined output is the
    routing's reference, a second pending dispatch is refused, an abandoned one retires
    the buffer until quiesce, after which it works again."""
    g = WorkerGroup(2, backend="gloo", fresh=True)
    try:
        res = g.run("tests.cases_deepep:deepep_normal_split_shared_gpu", timeout=300)
    finally:
        g.close()
    _record("deepep_normal_split_shared_gpu", {"gpus": 1, "ranks": 2, **{
        k: res[0][k] for k in ("err_split", "err_after_quiesce", "report")}})
    for r in res:
        assert r["counts"] == r["expected_counts"]
        assert r["err_split"] < 1e-2 and r["err_after_quiesce"] < 1e-2
        assert "already pending" in r["second_pending"]
        assert "retired" in r["retired"]
        assert r["report"]["mode"] == "normal" and r["report"]["sms"] == 20


@pytest.mark.skipif(not _have_deep_ep(), reason="needs deep_ep with colo_rollout's patch "
                    "(scripts/deepep_setup.sh)")
def test_gpu_deepep_d_runs_low_latency_while_p_dispatch_is_pending():
    """Phase-owned DeepEP state on one GPU (2 ranks, gloo): D's low-latency dispatch/combine
    runs, correct, while P's normal-mode dispatch is pending after its notification on P's
    own buffer; P then completes correctly. Records D's latency with P idle and pending."""
    g = WorkerGroup(2, backend="gloo", fresh=True)
    try:
        res = g.run("tests.cases_deepep:deepep_phase_isolation_shared_gpu", timeout=300)
    finally:
        g.close()
    _record("deepep_phase_isolation_shared_gpu", {"gpus": 1, "ranks": 2, **res[0]})
    for r in res:
        assert r["d_err_p_pending"] < 1e-2 and r["p_err"] < 1e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_mtp_keeps_the_greedy_tokens(gpu_groups, dtype):
    """engine.mtp on one GPU with D graphs (verify + draft in one graph): the greedy streams of
    the run without MTP -- in fp32 all of them; in bf16 the verify forward's GEMMs over 2B rows
    may round otherwise than over B, so a stream may part at a near-tie (as graphs vs eager
    do) -- P's first tokens always equal; the oracle's drafts accepted (>= 90%, D iterations
    cut), the random weights' almost never."""
    r = gpu_groups(1).run("tests.cases_gpu:gpu_mtp_tokens", timeout=600, adp=1, ep=1,
                          dtype=dtype)[0]
    _record("mtp_tokens", {"layout": r["layout"], "gpus": 1, "dtype": dtype, "result": r,
                           "passed": r["random"]["first_equal"]})
    for name in ("random", "oracle"):
        # fp32 runs eagerly (the grouped expert path, which graphs need, is bf16/fp16)
        assert r[name]["graphs"] == (dtype == "bfloat16"), (name, r[name])
        assert r[name]["first_equal"], (name, r[name])
        if dtype == "float32":
            assert r[name]["identical"] == 1.0, (name, r[name])
        else:
            assert r[name]["prefix"] >= 0.5, (name, r[name])
    assert r["oracle"]["acceptance"] >= 0.9, r["oracle"]
    assert r["oracle"]["d_iterations"][1] < 0.8 * r["oracle"]["d_iterations"][0]
    assert r["random"]["acceptance"] <= 0.1, r["random"]


@pytest.mark.parametrize("invariant", [True, False])
def test_gpu_batch_invariant_mtp_streams_are_the_plain_ones(gpu_groups, invariant):
    """engine.batch_invariant on one GPU in bf16 with D graphs, 32 sequences of 600-900
    prompt tokens (B and 2B = 64 verify rows: attention splits and cuBLAS's algorithms differ
    there): every greedy stream with MTP equals the one without, tokens and logprobs bitwise,
    on the oracle's accepted drafts and random weights' rejected ones. Without the option the
    same run is recorded (not asserted: how far the default parts)."""
    r = gpu_groups(1).run("tests.cases_gpu:gpu_mtp_tokens", timeout=600, adp=1, ep=1,
                          dtype="bfloat16", engine_kw={"batch_invariant": invariant},
                          prompt_len=600)[0]
    ok = all(r[n]["identical"] == 1.0 and r[n]["logprobs_identical"] == 1.0
             for n in ("random", "oracle"))
    _record("mtp_tokens_batch_invariant", {"layout": r["layout"], "gpus": 1, "result": r,
                                           "invariant": invariant, "passed": ok})
    if not invariant:
        return
    for name in ("random", "oracle"):
        assert r[name]["graphs"], (name, r[name])
        assert r[name]["identical"] == 1.0 and r[name]["logprobs_identical"] == 1.0, r[name]
    assert r["oracle"]["acceptance"] >= 0.9, r["oracle"]


@pytest.mark.parametrize("weights", ["random", "distilled"])
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_mtp_drafts_are_megatrons(gpu_groups, graphs, weights):
    """Every MTP draft of the bf16 engine (random weights, or a head distilled for 40 steps;
    D in graphs or eager) near the top of megatron's fp32 MTP row on the same weights
    (tests/cases_gpu.py: gpu_mtp_drafts). Added
    after a head fit to the model's own outputs (bench-mtp's distilled row) had training
    accuracy 0.71 and an acceptance of 0.000 on the H200, where CPU fp32 gives 0.51: the
    oracle's drafts cannot show a wrong hidden state or MTP attention (its eh_proj ignores the
    one and its attention adds nothing)."""
    r = gpu_groups(1).run("tests.cases_gpu:gpu_mtp_drafts", timeout=600, adp=1, ep=1,
                          graphs=graphs, weights=weights)[0]
    ok = r["checked"] > 50 and r["top5"] >= 0.9 and r["argmax"] >= 0.6
    _record("mtp_drafts", {"layout": r["layout"], "gpus": 1, "graphs": graphs,
                           "weights": weights, "result": r, "passed": ok})
    assert r["graphs"] == graphs, r
    assert r["checked"] > 50 and r["top5"] >= 0.9 and r["argmax"] >= 0.6, r


@pytest.mark.parametrize("dispatch", ["alltoall", "deepep"])
def test_gpu_mtp_with_a_dispatch_backend_keeps_the_greedy_tokens(gpu_groups, dispatch):
    """engine.mtp with the MTP layer's MoE through a dispatch backend on one GPU, bf16, D
    graphs: alltoall (D's padded all-to-all sized for the two verify rows per sequence) and
    deepep (DeepEP's low-latency buffer sized for them, in D's graphs); the checks of
    ``test_gpu_mtp_keeps_the_greedy_tokens``' bf16 row."""
    if dispatch == "deepep" and not _have_deep_ep():
        pytest.skip("needs deep_ep with colo_rollout's patch (scripts/deepep_setup.sh)")
    kw = DEEPEP_MODEL if dispatch == "deepep" else {"moe_dispatch": "alltoall"}
    r = gpu_groups(1).run("tests.cases_gpu:gpu_mtp_tokens", timeout=600, adp=1, ep=1,
                          dtype="bfloat16", model_kw=kw)[0]
    _record("mtp_tokens_dispatch", {"layout": r["layout"], "gpus": 1, "dispatch": dispatch,
                                    "result": r, "passed": r["random"]["first_equal"]})
    for name in ("random", "oracle"):
        assert r[name]["graphs"] and r[name]["first_equal"], (name, r[name])
        assert r[name]["prefix"] >= 0.5, (name, r[name])
    assert r["oracle"]["acceptance"] >= 0.9, r["oracle"]
    assert r["oracle"]["d_iterations"][1] < 0.8 * r["oracle"]["d_iterations"][0]
    assert r["random"]["acceptance"] <= 0.1, r["random"]


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("mtp", [False, True])
def test_gpu_temperature_rows_are_drawn_inside_the_d_graphs(gpu_groups, mtp, truncate):
    """Sampled rows by the draw graph (temperature only, or with top-k/top-p: ``truncate``):
    every sampled D iteration replays it (no eager sampling), a seed gives eager D's streams --
    but where bf16 graphs and eager D part at a near-tie (as greedy streams do:
    test_gpu_decode_graphs_match_eager_and_follow_weights) -- the draw really samples (streams
    unlike the greedy run's), and graphs stay faster."""
    r = gpu_groups(1).run("tests.cases_gpu:gpu_sampled_graphs", timeout=600, adp=1, ep=1,
                          mtp=mtp, truncate=truncate)[0]
    ok = r["draws"] > 0 and r["graph_vs_eager"]["identical"] >= 0.75
    _record("sampled_graphs", {"layout": r["layout"], "gpus": 1, "mtp": mtp,
                               "truncate": truncate, "result": r, "passed": ok})
    assert r["graphs"] and r["draws"] > 0, r
    assert r["graph_vs_eager"]["identical"] >= 0.75, r["graph_vs_eager"]
    assert r["graph_vs_eager"]["prefix"] >= 0.9 and r["graph_vs_eager"]["max_dlogp"] < 0.05, r
    assert r["sampled_vs_greedy"]["identical"] <= 0.25, r["sampled_vs_greedy"]
    assert r["t_graph_s"] < r["t_eager_s"], r
    if mtp:
        assert r["acceptance"] is not None and r["acceptance"] <= 0.2, r


def test_gpu_fp8_kernels_match_the_reference(gpu_groups):
    r = gpu_groups(1).run("tests.cases_gpu:gpu_fp8_kernels", timeout=300)[0]
    ok = (r["quantize_bitwise"] and r["linear_vs_reference"] < 1e-2
          and r["moe_vs_reference"] < 2e-2)
    _record("fp8_kernels", {"gpus": 1, "result": r, "passed": ok})
    assert r["quantize_bitwise"], r
    # fp32 accumulation in both; the kernels' sums run in another order
    assert r["linear_vs_reference"] < 1e-2 and r["moe_vs_reference"] < 2e-2, r
    assert 1e-4 < r["linear_vs_bf16"] < 0.1 and 1e-4 < r["moe_vs_bf16"] < 0.15, r
    assert all(row["triton_vs_scaled_mm"] < 1e-2 for row in r["linear_rows"].values()), r
    assert r["blockwise_quantize_bitwise"], r
    assert r["blockwise_linear_vs_reference"] < 1e-2 and r["blockwise_moe_vs_reference"] < 2e-2, r
    assert 1e-4 < r["blockwise_linear_vs_bf16"] < 0.1 and 1e-4 < r["blockwise_moe_vs_bf16"] < 0.15, r


def _have_te_fp8() -> bool:
    if not torch.cuda.is_available():
        return False
    from colo_rollout.config.te_support import te_fp8_problem

    return te_fp8_problem("tensorwise") is None


TE_FP8 = pytest.mark.skipif(not _have_te_fp8(), reason="needs Transformer Engine with FP8 "
                            "(carried as wheels: docs/gpu.md)")


@TE_FP8
def test_gpu_te_fp8_experts_follow_tes_recipes(gpu_groups):
    """The routed experts under model.fp8_backend te take TE's recipe: weights and inputs
    quantised to TE's own quantizers' values (per expert and per expert's rows for
    tensorwise, power-of-2 blocks for blockwise), the Triton quantisers' bytes = the torch
    paths', the experts near a te.GroupedLinear pair of the recipe."""
    r = gpu_groups(1).run("tests.cases_gpu:gpu_te_fp8_experts", timeout=300)[0]
    rows = [r["tensorwise"], r["blockwise"]]
    ok = all(row["weights_equal_te"] and row["inputs_equal_te"]
             and row["kernel_bytes_equal_torch"] for row in rows)
    _record("te_fp8_experts", {"gpus": 1, "result": r, "passed": ok})
    for row in rows:
        assert row["weights_equal_te"] and row["inputs_equal_te"], r
        assert row["kernel_bytes_equal_torch"], r
        assert row["vs_reference"] < 1e-2 and row["vs_te_grouped_linear"] < 2e-2, r
        assert 1e-3 < row["vs_bf16"] < 0.1, r


@TE_FP8
def test_gpu_te_fp8_linear_is_te_linears(gpu_groups):
    """model.fp8_backend te's dense GEMM is te.Linear's under te.autocast of the same recipe
    (bitwise), near the dequantised operands' product, and follows a weight refresh in place,
    inside a captured graph too."""
    r = gpu_groups(1).run("tests.cases_gpu:gpu_te_fp8_linear", timeout=300)[0]
    ok = all(row["vs_te_linear_bitwise"] and row["refresh_equals_fresh"]
             and row["graph_replay_after_refresh"] for row in r.values())
    _record("te_fp8_linear", {"gpus": 1, "result": r, "passed": ok})
    for recipe, row in r.items():
        assert row["vs_te_linear_bitwise"], (recipe, row)
        assert row["vs_dequantised_reference"] < 2e-2, (recipe, row)
        assert 1e-4 < row["vs_bf16"] < 0.1, (recipe, row)
        assert row["bias_fused_vs_added"] < 1e-2 and row["fp32_out_vs_bf16_out"] < 1e-2, row
        assert row["fp32_out_dtype"] == "torch.float32", row
        assert row["refresh_in_place"] and row["refresh_equals_fresh"], (recipe, row)
        assert row["graph_replay_after_refresh"] and row["graph_replay_vs_old"] > 0.1, row


_FP8_ENGINE_ROWS = [(1, 1, 1, "rowwise"), (2, 2, 2, "rowwise"), (2, 1, 2, "rowwise"),
                    (1, 1, 1, "blockwise"),
                    pytest.param(1, 1, 1, "te-tensorwise", marks=TE_FP8),
                    pytest.param(1, 1, 1, "te-blockwise", marks=TE_FP8)]


@pytest.mark.parametrize("world,adp,ep,recipe", _FP8_ENGINE_ROWS)
def test_gpu_fp8_engine_against_fp32_beside_bf16(gpu_groups, world, adp, ep, recipe):
    """model.fp8 on the GPU: the FP8 kernels, D graphs in FP8. Its logprobs against the fp32
    megatron model beside the bf16 engine's and megatron bf16's (docs/gpu.md). This random
    model is precision-sensitive (bf16 alone is 0.1 from fp32): FP8 measured 0.45, 4.5x the
    bf16 engine (on CPU's narrower model 5-9x, tests/test_fp8.py); the kernels themselves
    match the FP8 reference math (test_gpu_fp8_kernels_match_the_reference)."""
    backend, _, name = recipe.rpartition("-")  # "te-tensorwise": model.fp8_backend te
    r = gpu_groups(world).run("tests.cases_fp8:fp8_vs_reference", timeout=600, adp=adp,
                              ep=ep, backend="nccl", n_requests=16,
                              model_kw={"fp8_recipe": name,
                                        "fp8_backend": backend or "engine"})[0]
    b, f = r["bf16"], r["fp8"]
    ok = (b["mean_logprob_diff"] < f["mean_logprob_diff"] < 8 * b["mean_logprob_diff"]
          and f["argmax_agreement"] >= 0.35 and f["graphs"])
    _record("fp8_engine", {"layout": r["layout"], "gpus": world, "recipe": recipe, "result": r,
                           "passed": ok})
    assert f["graphs"] and f["fp8_bytes"] > 0, r
    assert b["mean_logprob_diff"] < f["mean_logprob_diff"] < 8 * b["mean_logprob_diff"], r
    assert f["argmax_agreement"] >= 0.35, r


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_gpu_fp8_mla_engine_against_fp32_beside_bf16(gpu_groups, recipe):
    """model.fp8 with MLA (the query, key/value-down and output projections in FP8, kv_b in
    bf16; D through MLA's Triton kernel in FP8 graphs) against fp32. Measured (session 29, one
    H200, rowwise): 0.488 mean |dlogp|, argmax 0.58 -- the level of the GQA FP8 rows on this
    precision-sensitive tier model (0.45-0.52, argmax 0.41-0.50) --, while MLA's bf16 engine is
    far closer than GQA's (0.023 against 0.10): bounded absolutely, not as a multiple of bf16.
    blockwise (session 31, not yet run): the heads' widths at 128 and the key/value down
    projection's 24 + 8 rows -- no whole block, as DeepSeek-V3's 576 -- kept bf16."""
    from tests.test_fp8 import MLA_FP8

    kw = MLA_FP8 if recipe == "rowwise" else {
        **MLA_FP8, "fp8_recipe": "blockwise", "q_lora_rank": 128, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8, "v_head_dim": 16}
    r = gpu_groups(1).run("tests.cases_fp8:fp8_vs_reference", timeout=600, adp=1, ep=1,
                          backend="nccl", n_requests=16, model_kw=kw)[0]
    b, f = r["bf16"], r["fp8"]
    ok = (b["mean_logprob_diff"] < f["mean_logprob_diff"] < 0.6
          and f["argmax_agreement"] >= 0.35 and f["graphs"])
    _record("fp8_mla_engine", {"layout": r["layout"], "gpus": 1, "recipe": recipe, "result": r,
                               "passed": ok})
    if recipe == "blockwise":
        assert all(g == [2] for g in f["bf16_gemms"]), r
    assert f["graphs"] and f["fp8_bytes"] > 0, r
    assert b["mean_logprob_diff"] < f["mean_logprob_diff"] < 0.6, r
    assert f["argmax_agreement"] >= 0.35, r


@pytest.mark.skipif(not _have_deep_ep(), reason="needs deep_ep with colo_rollout's patch "
                    "(scripts/deepep_setup.sh)")
def test_gpu_fp8_with_deepep_against_fp32_beside_gather(gpu_groups):
    """model.fp8 with model.moe_dispatch deepep on one GPU (D's FP8 experts on DeepEP's
    low-latency rows inside D's graphs, P's in place) against the fp32 reference, beside the
    gather backend's FP8 engine on the same model (DEEPEP_MODEL). This random model is
    FP8-hostile (session 21: gather FP8 1.68 mean |dlogp| against bf16's 0.22, argmax 0.21;
    deepep FP8 2.02 / 0.24, 0.19), so the yardstick is the gather backend's FP8, not a fixed
    bound: deepep's FP8 within 1.5x of it, D in graphs."""
    runs = {}
    for dispatch in ("gather", "deepep"):
        runs[dispatch] = gpu_groups(1).run(
            "tests.cases_fp8:fp8_vs_reference", timeout=600, adp=1, ep=1, backend="nccl",
            n_requests=16, model_kw={**DEEPEP_MODEL, "moe_dispatch": dispatch})[0]
    g, d = runs["gather"]["fp8"], runs["deepep"]["fp8"]
    ok = d["mean_logprob_diff"] < 1.5 * g["mean_logprob_diff"] and d["graphs"]
    _record("fp8_deepep", {"gpus": 1, "result": runs, "passed": ok})
    assert d["graphs"] and d["fp8_bytes"] > 0, runs
    assert runs["deepep"]["bf16"]["mean_logprob_diff"] < d["mean_logprob_diff"], runs
    assert d["mean_logprob_diff"] < 1.5 * g["mean_logprob_diff"], runs
    assert d["argmax_agreement"] >= g["argmax_agreement"] - 0.1, runs


@pytest.mark.parametrize("backend", ["engine", pytest.param("te", marks=TE_FP8)])
def test_gpu_fp8_graphs_match_eager(gpu_groups, backend):
    kw = {"fp8_backend": "te", "fp8_recipe": "tensorwise"} if backend == "te" else {}
    r = gpu_groups(1).run("tests.cases_gpu:gpu_fp8_graphs", timeout=600, model_kw=kw)[0]
    _record("fp8_graphs", {"gpus": 1, "backend": backend, "result": r,
                           "passed": r["identical"] >= 0.9})
    assert r["graphs"] and r["replays"] > 0, r
    assert r["first_equal"] == 1.0 and r["identical"] >= 0.75, r


def test_gpu_fp8_rollout_bf16_training_mismatch(gpu_groups, tmp_path):
    """FP8 rollouts, bf16 trainer (GRPO, 1 GPU, routing replay on): the per-step rollout/
    trainer logprob gap (issue 18's metrics), beside the same run with bf16 rollouts."""
    rows = {}
    runs = [("bf16", {"model.fp8": None}), ("e4m3", {"model.fp8": "e4m3"})]
    if _have_te_fp8():  # the dense GEMMs through TE's Float8CurrentScaling (model/fp8_te.py)
        runs.append(("e4m3-te", {"model.fp8": "e4m3", "model.fp8_backend": "te",
                                 "model.fp8_recipe": "tensorwise"}))
    for name, fp8 in runs:
        res = gpu_groups(1).run(
            "colo_rollout.rl.train:run_train", timeout=600, config_path="configs/grpo_cpu.yaml",
            overrides={"parallel.world_size": 1, "parallel.adp": 1, "parallel.ep": 1,
                       "parallel.backend": "nccl", "rl.out_dir": str(tmp_path / name),
                       "model.params_dtype": "bfloat16", **fp8, "rl.steps": 6,
                       "engine.record_routing": True, "rl.routing_replay": True}, quiet=True)
        h = res[0]["history"]
        rows[name] = {
            "gap_mean": sum(x["logprob_gap_mean"] for x in h) / len(h),
            "gap_max": max(x["logprob_gap_max"] for x in h),
            "mismatch_kl_k3": sum(x.get("mismatch_kl_k3", 0.0) for x in h) / len(h),
            "reward_first": h[0]["reward"], "reward_last": h[-1]["reward"]}
    _record("fp8_rl_mismatch", {"gpus": 1, "result": rows,
                                "passed": rows["e4m3"]["gap_mean"] > rows["bf16"]["gap_mean"]})
    assert all(math.isfinite(v) for r in rows.values() for v in r.values()), rows
    for name in rows.keys() - {"bf16"}:  # FP8 really rolled out
        assert rows[name]["gap_mean"] > rows["bf16"]["gap_mean"], rows


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_gpu_cudnn_prefill_rows_match_the_kernel(kernel):
    """engine.prefill_attention cudnn / flash on the GPU: a fresh 4k sequence and two fresh
    1100-token ones (one batched call, padded to 1280) through the dense kernel (cuDNN's,
    FlashAttention-4's) beside a continuation on the Triton kernel (one plan), against the
    fp32 reference -- no worse than the Triton kernel alone -- and both paths' times."""
    from colo_rollout.model import paged_prefill as pp
    from colo_rollout.model.dense_prefill import (cudnn_usable, dense_calls,
                                                  dense_prefill_attention, dense_sequences,
                                                  flash_usable)
    from colo_rollout.testing.attention_oracle import kv_from_cache

    dev = torch.device("cuda")
    why = (cudnn_usable if kernel == "cudnn" else flash_usable)(dev)
    if why is not None:
        pytest.skip(why)
    g, n, dim, bs = 4, 8, 128, 16
    new, ctx = [4096, 1100, 512, 1100], [4096, 1100, 4608, 1100]
    gen = torch.Generator(device=dev).manual_seed(0)
    nb = [-(-c // bs) for c in ctx]
    blocks = torch.randperm(sum(nb) + 1, generator=gen, device=dev)
    k = torch.randn(sum(nb) + 1, bs, g, dim, device=dev, generator=gen).bfloat16()
    v = torch.randn(sum(nb) + 1, bs, g, dim, device=dev, generator=gen).bfloat16()
    firsts = [sum(nb[:i]) for i in range(len(nb))]
    tables = torch.stack([torch.nn.functional.pad(blocks[a:a + m], (0, max(nb) - m))
                          for a, m in zip(firsts, nb)])
    q = torch.randn(sum(new), g * n, dim, device=dev, generator=gen).bfloat16()
    scale = dim ** -0.5
    ref = pp.torch_prefill_attention(q.float(), k.float(), v.float(), tables,
                                     pp.plan_prefill(new, ctx, n, dim, q.dtype, dev), scale)
    full = pp.plan_prefill(new, ctx, n, dim, q.dtype, dev)
    dense = dense_sequences(new, ctx)
    assert dense == (0, 1, 3)
    split = pp.plan_prefill(new, ctx, n, dim, q.dtype, dev, dense=dense)
    calls = dense_calls(split.dense, dev)
    assert [len(c.seqs) for c in calls] == [1, 2]
    slots = torch.cat([tables[s, torch.arange(c - m, c, device=dev) // bs] * bs
                       + torch.arange(c - m, c, device=dev) % bs
                       for s, (m, c) in enumerate(zip(new, ctx))])

    def triton_only():
        return pp.triton_prefill_attention(q, k, v, tables, full, scale)

    rows = kv_from_cache(k, v, slots)  # the step's rotated K and V rows (contiguous)

    def mixed():
        out = pp.triton_prefill_attention(q, k, v, tables, split, scale)
        for call in calls:
            dense_prefill_attention(q, *rows, call, scale, out, kernel)
        return out

    def ms(fn):
        for _ in range(3):
            fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 10

    err_kernel = (triton_only().float() - ref).abs().max().item()
    err_mixed = (mixed().float() - ref).abs().max().item()
    row = {"gpus": 1, "dense_kernel": kernel, "err_kernel": err_kernel, "err_dense": err_mixed,
           "kernel_ms": ms(triton_only), "dense_ms": ms(mixed),
           "cudnn": torch.backends.cudnn.version()}
    row["passed"] = err_mixed <= 2 * err_kernel + 1e-2
    _record(f"{kernel}_prefill", row)
    assert row["passed"], row
