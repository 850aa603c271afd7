"""Multi-head latent attention (``model.attention: mla``; DeepSeek-V3, Kimi-K2, Moonlight).

The engine's MLA (model/mla_attention.py: a latent cache, P through the decompressed keys and
values, D absorbed) against transformers' DeepseekV3ForCausalLM on tiny randomised
checkpoints saved by transformers (tests/cases_hf.py "deepseek": a query bottleneck, a value
head narrower than the nope head, YaRN with DeepSeek's mscale pair -- the softmax scale moves
too --, GLM's router, a dense first layer, a shared expert), on 1 rank and EP2/ADP2 in every
mode; config.json's fields; the cache's size; what the door refuses.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from colo_rollout.config import ConfigError, ModelConfig, config_from_dict
from colo_rollout.config.hf_config import hf_architecture
from tests.cases_hf import save_tiny_checkpoint
from tests.test_hf_import import check_equivalent, copy_ckpt, edit_config

CASES = "tests.cases_hf"
GLM_LITE = hasattr(__import__("transformers"), "Glm4MoeLiteConfig")
# check_equivalent: transformers' argmax and logprobs within 1e-3 (fp32: summation order only,
# ~5e-5 seen; a wrong row or scale moves > 1e-1), every rank the same


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """name -> a tiny DeepSeek-V3 checkpoint: "bottleneck" (q_lora_rank 48, YaRN factor 4
    with mscale 1.0 / mscale_all_dim 0.8), "full_q" (q_lora_rank null: q_proj; plain RoPE at
    another theta; saved in shards)."""
    root = tmp_path_factory.mktemp("mla")
    save_tiny_checkpoint(root / "bottleneck", "deepseek")
    save_tiny_checkpoint(root / "full_q", "deepseek", sharded=True, seed=1, q_lora_rank=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    # DeepSeek-V2(-Lite): softmax routing never renormalised, greedy or group-limited
    save_tiny_checkpoint(root / "v2", "deepseek2")
    save_tiny_checkpoint(root / "v2_groups", "deepseek2", seed=2, q_lora_rank=24,
                         topk_method="group_limited_greedy", n_group=4, topk_group=3)
    # GLM-4.7-Flash (Glm4MoeLite): dense layers 0 and 2 by mlp_layer_types; and its default
    # (layer 0 dense) from a config.json without the key
    names = ["bottleneck", "full_q", "v2", "v2_groups"]
    if GLM_LITE:
        save_tiny_checkpoint(root / "glm_lite", "glm_lite", seed=3)
        save_tiny_checkpoint(root / "glm_lite_default", "glm_lite", seed=4, sharded=True,
                             mlp_layer_types=None, num_hidden_layers=2)
        edit_config(str(root / "glm_lite_default"), mlp_layer_types=None)
        names += ["glm_lite", "glm_lite_default"]
    return {n: str(root / n) for n in names}


def _lite(*names):
    """``names`` as parameters that skip where transformers has no Glm4MoeLite."""
    return [pytest.param(n, marks=pytest.mark.skipif(not GLM_LITE, reason="transformers "
                                                     "without Glm4MoeLite")) for n in names]


@pytest.mark.parametrize("name", ["bottleneck", "full_q", "v2", "v2_groups",
                                  *_lite("glm_lite", "glm_lite_default")])
def test_one_rank_matches_transformers(worker_groups, ds, name):
    res = worker_groups(1).run(f"{CASES}:serve_checkpoint", directory=ds[name], adp=1, ep=1)
    check_equivalent(res)


@pytest.mark.parametrize("name,mode", [("bottleneck", "normal"), ("bottleneck", "fine"),
                                       ("bottleneck", "global_complete"), ("v2", "fine"),
                                       *[pytest.param(*p.values, "fine", marks=p.marks)
                                         for p in _lite("glm_lite")]])
def test_ep2_adp2_matches_transformers_in_each_mode(worker_groups, ds, name, mode):
    res = worker_groups(2).run(f"{CASES}:serve_checkpoint", directory=ds[name], adp=2,
                               ep=2, engine={"mode": mode})
    assert res[0]["layout"] == "EP2/ADP2"
    check_equivalent(res)


@pytest.mark.parametrize("name", ["bottleneck", "full_q", *_lite("glm_lite")])
def test_attention_tp_matches_transformers(worker_groups, ds, name):
    """EP2/ATP2: each rank reads its half of the heads' query, key/value-up and output rows
    from the checkpoint and the down projections whole (model/mla_attention.py)."""
    res = worker_groups(2).run(f"{CASES}:serve_checkpoint", directory=ds[name], adp=1, ep=2)
    assert res[0]["layout"] == "EP2/ATP2"
    check_equivalent(res)


# ---- against megatron's GPTModel with MLA (the local spec through model/mla_core_attention.py)
@pytest.mark.parametrize("world,adp,ep,mode,q_lora_rank", [
    (1, 1, 1, "normal", 32), (1, 1, 1, "normal", None), (2, 2, 2, "fine", 32),
    (4, 4, 4, "global_enqueue", 32),
    # attention TP: each rank its half of the heads over the whole latent cache
    (2, 1, 2, "normal", None), (4, 2, 4, "fine", 32)])
def test_engine_matches_megatron(worker_groups, world, adp, ep, mode, q_lora_rank):
    from tests.cases_engine import LOGPROB_TOL, MLA_ARCH

    res = worker_groups(world).run("tests.cases_engine:engine_matches_reference", adp=adp,
                                   ep=ep, n_requests=10, mode=mode, moe_compute="grouped",
                                   model_kw={**MLA_ARCH, "q_lora_rank": q_lora_rank})
    r0 = res[0]
    assert ("ATP" in r0["layout"]) == (adp < world), r0["layout"]
    assert r0["checked"] > 30 and r0["mismatches"] == []
    assert r0["max_logprob_diff"] < LOGPROB_TOL, r0["max_logprob_diff"]
    for r in res[1:]:
        assert r["tokens"] == r0["tokens"]


# ---- P's dense calls (engine.prefill_attention cudnn / flash; CPU: torch's SDPA in their place)
@pytest.mark.parametrize("world,adp,ep,mode,kernel", [(1, 1, 1, "normal", "cudnn"),
                                                     (2, 2, 2, "fine", "cudnn"),
                                                     (1, 1, 1, "normal", "flash"),
                                                     (2, 2, 2, "fine", "flash"),
                                                     (2, 1, 2, "normal", "flash")])
def test_dense_prefill_calls_match_megatron(worker_groups, world, adp, ep, mode, kernel):
    """Fresh sequences of >= 12 tokens through the dense calls (their own rows' latents
    decompressed, padded to 256, batched), the shorter ones in the same P steps through the
    buckets (cudnn) or one variable-length call over the cache (flash): every token and
    logprob megatron's."""
    from tests.cases_engine import LOGPROB_TOL, MLA_ARCH

    res = worker_groups(world).run("tests.cases_engine:engine_matches_reference", adp=adp,
                                   ep=ep, n_requests=12, mode=mode, moe_compute="grouped",
                                   model_kw=MLA_ARCH, dense_from=12, dense_kernel=kernel)
    r0 = res[0]
    assert sum(r["dense_calls"] for r in res) > 0
    assert r0["checked"] > 30 and r0["mismatches"] == []
    assert r0["max_logprob_diff"] < LOGPROB_TOL, r0["max_logprob_diff"]
    for r in res[1:]:
        assert r["tokens"] == r0["tokens"]


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_dense_prefill_beside_continuations_matches_megatron(worker_groups, kernel):
    """Multi-turn sessions: first turns (and re-prefills after evictions) fresh through the
    dense calls, continuations on the retained latent cache through the buckets (cudnn) or
    the variable-length call (flash)."""
    from tests.cases_engine import LOGPROB_TOL, MLA_ARCH

    res = worker_groups(1).run("tests.cases_engine:multi_turn_matches_reference", adp=1, ep=1,
                               num_kv_blocks=40, model_kw={**MLA_ARCH, "moe_compute": "grouped"},
                               dense_from=5, dense_kernel=kernel)
    r0 = res[0]
    assert r0["dense_calls"] > 0
    assert r0["checked"] > 30 and r0["mismatches"] == []
    assert r0["max_logprob_diff"] < LOGPROB_TOL, r0["max_logprob_diff"]


@pytest.mark.parametrize("lens, multiple", [([37], 16), ([64], 64), ([32, 32, 32], 16),
                                            ([20, 9, 32], 16), ([5], 256)])
def test_dense_mla_calls_are_per_sequence_attention(lens, multiple):
    """``dense_mla_attention``'s calls (views, padded gathers, batched, the output itself
    where one call covers every row) against each sequence's causal attention with keys
    [k_nope | shared rope key] and values decompressed per head."""
    from colo_rollout.model import dense_prefill as dp

    torch.manual_seed(0)
    heads, nope, rope, v_dim, rank = 3, 8, 4, 6, 5
    T = sum(lens)
    q = torch.randn(T, heads, nope + rope)
    entries = torch.randn(T, rank + rope)  # [latent | rope key] per row, as cached
    w_up = torch.randn(heads * (nope + v_dim), rank)
    up = (entries[:, :rank] @ w_up.T).view(T, heads, nope + v_dim)
    k_pe = entries[:, rank:]
    scale = 0.3
    want = torch.empty(T, heads, v_dim)
    at = 0
    for n in lens:
        rows = slice(at, at + n)
        k = torch.cat((up[rows, :, :nope], k_pe[rows, None].expand(n, heads, rope)), -1)
        s = torch.einsum("ihd,jhd->hij", q[rows], k) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        want[rows] = torch.einsum("hij,jhd->ihd", s.softmax(-1), up[rows, :, nope:])
        at += n
    calls = dp.dense_calls(dp.dense_held(lens, tuple(range(len(lens)))), "cpu", multiple)
    if len(calls) == 1 and calls[0].covers(T):
        got = dp.dense_mla_attention(q, entries, w_up, nope, calls[0], scale, None)
    else:
        got = torch.full((T, heads, v_dim), float("nan"))
        for call in calls:
            dp.dense_mla_attention(q, entries, w_up, nope, call, scale, got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_variable_length_call_is_per_sequence_attention_at_the_end_of_each_context():
    """``varlen_attention`` (CPU: its per-sequence path; the GPU test runs FlashAttention-4's
    against it): a fresh sequence, continuations with 3 and 1 new rows on longer contexts,
    GQA heads -- each query j of n new rows on c keys sees keys 0..c - n + j."""
    from colo_rollout.model import dense_prefill as dp

    torch.manual_seed(1)
    new, ctx, heads, g, dim, dv = [5, 3, 1], [5, 9, 4], 4, 2, 8, 6
    q = torch.randn(sum(new), heads, dim)
    k = torch.randn(sum(ctx), g, dim)
    v = torch.randn(sum(ctx), g, dv)
    cu_q = torch.tensor([0, 5, 8, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 14, 18], dtype=torch.int32)
    call = dp.VarlenCall(None, cu_q, cu_k, 5, 9, torch.zeros(0, dtype=torch.int64))
    got = dp.varlen_attention(q, k, v, call, 0.4)
    for i, (n, c) in enumerate(zip(new, ctx)):
        for j in range(n):
            row = int(cu_q[i]) + j
            for h in range(heads):
                keys = slice(int(cu_k[i]), int(cu_k[i]) + c - n + j + 1)
                p = torch.softmax(k[keys, h // (heads // g)] @ q[row, h] * 0.4, dim=0)
                torch.testing.assert_close(got[row, h], p @ v[keys, h // (heads // g)])


def test_mla_prefill_backends_resolve_by_what_runs():
    """auto is the bucketed SDPA where no dense kernel runs (CPU); cudnn / flash asked
    where they cannot run are one line naming the key; triton is no MLA kernel. The dense
    kernels' shape rules take MLA's wider query/key heads."""
    from colo_rollout.config import attention_support as sup
    from colo_rollout.model.mla_attention import resolve_prefill

    cpu = torch.device("cpu")
    assert resolve_prefill("auto", cpu, torch.bfloat16, 192, 128) == "torch"
    assert resolve_prefill("torch", cpu, torch.bfloat16, 192, 128) == "torch"
    for asked in ("cudnn", "flash"):
        with pytest.raises(RuntimeError, match=f"engine.prefill_attention: {asked} was "
                                               "requested but the device is cpu"):
            resolve_prefill(asked, cpu, torch.bfloat16, 192, 128)
    with pytest.raises(ValueError, match="no Triton kernel"):
        resolve_prefill("triton", cpu, torch.bfloat16, 192, 128)
    assert sup.cudnn_fits(torch.bfloat16, 192, 128) is None  # DeepSeek's heads
    assert "192/128" in sup.cudnn_fits(torch.bfloat16, 24, 12)
    assert "head_dim 192" in sup.cudnn_fits(torch.bfloat16, 192)  # GQA's rule unchanged
    assert sup.flash_fits(torch.bfloat16, 192, 128) is None
    assert "v_head_dim 100" in sup.flash_fits(torch.bfloat16, 192, 100)


def test_config_json_maps_onto_megatrons_mla(ds):
    """The fields, and YaRN's two scales as transformers computes them: cos and sin by the
    attention factor (megatron: m(mscale) / m(mscale_all_dim)), the softmax by
    m(mscale_all_dim)^2 / sqrt(q head) (DeepseekV3Attention.scaling)."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from colo_rollout.model.model import megatron_config, mla_softmax_scale

    f = hf_architecture(ds["bottleneck"]).fields
    assert (f["attention"], f["q_lora_rank"], f["kv_lora_rank"], f["qk_nope_head_dim"],
            f["qk_rope_head_dim"], f["v_head_dim"], f["head_dim"], f["num_query_groups"],
            f["qk_layernorm"]) == ("mla", 48, 32, 16, 8, 12, 24, 4, True)
    assert hf_architecture(ds["full_q"]).fields["q_lora_rank"] is None
    cfg = ModelConfig(**{k: v for k, v in f.items() if k != "mtp_num_layers"})
    hf_cfg = tf.AutoConfig.from_pretrained(ds["bottleneck"])
    _, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")

    def m(x):
        return 0.1 * x * math.log(cfg.rope_scaling_factor) + 1

    assert m(cfg.yarn_mscale) / m(cfg.yarn_mscale_all_dim) == pytest.approx(attention_factor)
    hf_attn = tf.AutoModelForCausalLM.from_config(hf_cfg).model.layers[0].self_attn
    assert mla_softmax_scale(megatron_config(cfg)) == pytest.approx(hf_attn.scaling)
    assert hf_attn.scaling != pytest.approx(24 ** -0.5)  # the case moves the softmax scale
    # config.json's mscale pair is kept as given (a recomputed 0.9999999999999999 made a YAML
    # that restated 1.0 contradict the checkpoint, and was exported so)
    assert (f["yarn_mscale"], f["yarn_mscale_all_dim"]) == (1.0, 0.8)
    assert hf_architecture(ds["v2"]).fields["yarn_mscale"] == 0.707
    from colo_rollout.checkpoint.export import hf_config_dict
    from colo_rollout.config.hf_config import merge_checkpoint_fields

    merge_checkpoint_fields({"checkpoint": ds["bottleneck"], "yarn_mscale": 1.0}, "<yaml>")
    rope = hf_config_dict(cfg)["rope_parameters"]
    assert (rope["mscale"], rope["mscale_all_dim"]) == (1.0, 0.8)


def test_the_cache_holds_one_latent_per_token():
    """MLA's cache: kv_lora_rank + qk_rope_head_dim values per token and layer, shared by
    every head (DeepSeek-V3: 576, against 2 x 128 heads x 192 = 49152 decompressed)."""
    v3 = ModelConfig(attention="mla", num_attention_heads=128, num_query_groups=128,
                     hidden_size=7168, qk_layernorm=True, q_lora_rank=1536)
    assert v3.kv_cache_elems() == 576
    assert v3.head_dim == 192
    gqa = ModelConfig(num_attention_heads=32, num_query_groups=4, hidden_size=4096,
                      head_dim=128)
    assert gqa.kv_cache_elems(atp=2) == 2 * 2 * 128


def _door(ds, tmp_path, parallel=None, engine=None, config=None, **model) -> ConfigError:
    d = ds["bottleneck"]
    if config:
        d = copy_ckpt(d, tmp_path / "edited")
        edit_config(d, **{k: v for k, v in config.items() if v is not None})
        path = os.path.join(d, "config.json")  # and the explicit nulls (edit_config drops)
        with open(path) as fh:
            c = json.load(fh)
        c.update({k: None for k, v in config.items() if v is None})
        with open(path, "w") as fh:
            json.dump(c, fh)
    with pytest.raises(ConfigError) as e:
        config_from_dict({"parallel": parallel or {}, "engine": {"max_seq_len": 128,
                                                                 **(engine or {})},
                          "model": {"checkpoint": d, **model}})
    return e.value


@pytest.mark.parametrize("parallel, engine, model, config, key, fragment", [
    ({"world_size": 8, "adp": 1, "ep": 8}, None, {}, None, "model.num_attention_heads",
     "4 is not divisible by parallel.atp 8"),
    (None, {"prefill_attention": "triton"}, {}, None, "engine.prefill_attention",
     "MLA's P has no Triton kernel"),
    (None, None, {"use_te": "on"}, None, "model.use_te", "local layer spec"),
    (None, None, {}, {"rope_interleave": False}, "model.checkpoint", "rope_interleave: false"),
    # null is false to transformers (`if config.rope_interleave`): not the default true
    (None, None, {}, {"rope_interleave": None}, "model.checkpoint", "rope_interleave: false"),
    (None, None, {}, {"kv_lora_rank": None}, "model.checkpoint", "kv_lora_rank: null"),
    # top-1 renormalised sigmoid routing: transformers weights the expert 1.0, megatron by
    # its score (found by probing: tokens differed)
    (None, None, {}, {"num_experts_per_tok": 1, "n_group": 1, "topk_group": 1},
     "model.checkpoint", "num_experts_per_tok: 1 with DeepseekV3ForCausalLM's renormalised "
     "sigmoid routing"),
    (None, None, {"head_dim": 64}, None, "model.head_dim",
     "config.json qk_nope_head_dim + qk_rope_head_dim = 24"),
    (None, None, {}, {"attention_bias": True}, "model.checkpoint", "attention_bias: true"),
])
def test_the_door_names_what_mla_cannot_run(ds, tmp_path, parallel, engine, model, config,
                                            key, fragment):
    e = _door(ds, tmp_path, parallel, engine, config, **model)
    assert e.key == key, (e.key, str(e))
    assert fragment in str(e), str(e)
    assert "\n" not in str(e)


def test_deepseek_v2_group_limited_routing_in_one_group_is_greedy(ds, tmp_path):
    """One group limits nothing (found by probing: it was refused)."""
    d = copy_ckpt(ds["v2"], tmp_path / "v2")
    want = config_from_dict({"engine": {"max_seq_len": 128}, "model": {"checkpoint": d}}).model
    edit_config(d, topk_method="group_limited_greedy", n_group=1, topk_group=1)
    got = config_from_dict({"engine": {"max_seq_len": 128}, "model": {"checkpoint": d}}).model
    assert got == want and got.router_num_groups is None
    edit_config(d, n_group=4, topk_group=4)  # every group kept
    got = config_from_dict({"engine": {"max_seq_len": 128}, "model": {"checkpoint": d}}).model
    assert got == want and got.router_num_groups is None


@pytest.mark.parametrize("config, key, fragment", [
    ({"norm_topk_prob": True}, "norm_topk_prob", "never renormalises"),
    ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1}, "topk_group",
     "ranks groups by their best expert"),
    ({"topk_method": "noaux_tc"}, "topk_method", "'noaux_tc'"),
    ({"mlp_bias": True}, "mlp_bias", "no bias"),
])
def test_deepseek_v2_routers_megatron_cannot_express_are_named(ds, tmp_path, config, key,
                                                                fragment):
    d = copy_ckpt(ds["v2"], tmp_path / "v2")
    edit_config(d, **config)
    with pytest.raises(ConfigError) as e:
        config_from_dict({"engine": {"max_seq_len": 128}, "model": {"checkpoint": d}})
    assert f"config.json: {key}: " in str(e.value) and fragment in str(e.value), str(e.value)


@pytest.mark.skipif(not GLM_LITE, reason="transformers without Glm4MoeLite")
@pytest.mark.parametrize("types, fragment", [
    (["dense", "sparse"], "2 entries for num_hidden_layers 3"),
    (["dense", "moe", "sparse"], "'moe': expected 'dense' or 'sparse'"),
    (["dense", {"a": 1}, "sparse"], "expected 'dense' or 'sparse'"),
    (["dense"] * 3, "every layer dense"),
    ("dense", "expected list"),
])
def test_glm_lite_layer_types_are_checked(ds, tmp_path, types, fragment):
    d = copy_ckpt(ds["glm_lite"], tmp_path / "lite")
    edit_config(d, mlp_layer_types=types)
    with pytest.raises(ConfigError) as e:
        config_from_dict({"engine": {"max_seq_len": 128}, "model": {"checkpoint": d}})
    assert "config.json: mlp_layer_types: " in str(e.value) and fragment in str(e.value), \
        str(e.value)


def test_mla_keys_without_mla_are_refused():
    """A latent width beside attention 'gqa' would be ignored (probing found runs training a
    GQA model with them): refused, naming the key."""
    for kw in ({"kv_lora_rank": 32}, {"q_lora_rank": 16}, {"v_head_dim": 8}):
        with pytest.raises(ConfigError) as e:
            config_from_dict({"model": kw})
        assert e.value.key == f"model.{next(iter(kw))}", str(e.value)
        assert "set model.attention: mla" in str(e.value)


def test_memory_release_and_resume_keep_the_tokens(worker_groups, ds):
    """release_memory (weights kept, then offloaded) and resume around MLA's latent cache:
    the same greedy tokens each round (it raised at the FP8-site walk before: found by
    probing)."""
    r = worker_groups(2).run(f"{CASES}:serve_across_releases", directory=ds["v2"], adp=2,
                             ep=2)[0]
    assert r["rounds"][0] == r["rounds"][1] == r["rounds"][2]


def test_a_yaml_mla_section_is_checked():
    for kw, key in (({"num_query_groups": 2}, "model.num_query_groups"),
                    ({"qk_layernorm": False}, "model.qk_layernorm"),
                    ({"head_dim": 32}, "model.head_dim"),
                    ({"qk_rope_head_dim": 7}, "model.qk_rope_head_dim"),
                    ({"rope_scaling": "llama3"}, "model.rope_scaling"),
                    ({"q_lora_rank": 0}, "model.q_lora_rank")):
        base = {"attention": "mla", "num_attention_heads": 4, "num_query_groups": 4,
                "qk_layernorm": True, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8, "v_head_dim": 12}
        with pytest.raises(ConfigError) as e:
            config_from_dict({"model": {**base, **kw}})
        assert e.value.key == key, (kw, e.value.key, str(e.value))


def test_the_model_builds_no_gqa_tensor_for_mla():
    from colo_rollout.config.tensor_shapes import tensor_shapes

    cfg = ModelConfig(attention="mla", num_attention_heads=4, num_query_groups=4,
                      qk_layernorm=True, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=12)
    names = tensor_shapes(cfg)
    assert not any("linear_qkv" in n or "k_layernorm" in n for n in names)
    assert names["decoder.layers.0.self_attention.linear_kv_up_proj.weight"] == (4 * 28, 32)
    assert names["decoder.layers.0.self_attention.linear_kv_down_proj.weight"] == (40, 64)
    assert names["decoder.layers.0.self_attention.linear_proj.weight"] == (64, 48)
    assert torch.Size(names["decoder.layers.0.self_attention.q_layernorm.weight"]) == (48,)


# ---- the RL side: weight sync into MLA, GRPO with MLA, export
MLA_OVERRIDES = {"model.attention": "mla", "model.num_query_groups": 4,
                 "model.qk_layernorm": True, "model.q_lora_rank": 32, "model.kv_lora_rank": 16,
                 "model.qk_nope_head_dim": 16, "model.qk_rope_head_dim": 8,
                 "model.v_head_dim": 12}


@pytest.mark.parametrize("world,adp,ep,trainer_ep", [(2, 2, 2, 1), (2, 2, 2, 2), (4, 4, 4, 2),
                                                     (2, 1, 2, 1)])
def test_sync_into_mla_is_bit_exact(worker_groups, world, adp, ep, trainer_ep):
    """Every MLA projection and latent norm (and the rest) from the trainer (TP1 x DP, or its
    experts over EP) into the engine, bit for bit; the engine then serves megatron's tokens
    of the new weights."""
    from tests.cases_engine import LOGPROB_TOL, MLA_ARCH

    res = worker_groups(world).run("tests.cases_rl:weight_sync_exact", adp=adp, ep=ep,
                                   trainer_tp=1, trainer_ep=trainer_ep, model_kw=MLA_ARCH)
    for r in res:
        assert r["checked"] > 20 and r["mismatched"] == []
    r0 = res[0]
    assert r0["mismatches"] == [] and r0["max_logprob_diff"] < LOGPROB_TOL


@pytest.mark.parametrize("world,adp,ep", [(2, 2, 2), (4, 4, 4), (2, 1, 2)])
def test_sync_from_a_sequence_parallel_trainer_into_mla_is_bit_exact(worker_groups, world,
                                                                     adp, ep):
    """The RL Trainer at rl.trainer_tp 2: megatron's MLA with its down projections' rows
    split over TP (gathered in its forward), sequence parallelism (the latents' norms marked
    sequence_parallel), into the engine's whole projections."""
    from tests.cases_engine import LOGPROB_TOL, MLA_ARCH

    res = worker_groups(world).run("tests.cases_rl:weight_sync_exact", adp=adp, ep=ep,
                                   trainer_tp=2, model_kw=MLA_ARCH, rl_trainer=True)
    for r in res:
        assert r["checked"] > 20 and r["mismatched"] == [], r["mismatched"]
        assert r["sp_params"] > 0
    r0 = res[0]
    assert r0["mismatches"] == [] and r0["max_logprob_diff"] < LOGPROB_TOL


def test_a_tensor_parallel_mla_trainer_takes_the_same_gradient(worker_groups):
    """rl.trainer_tp 2 with MLA: each TP rank's gradient is the TP1 trainer's cut to its
    shard (q/kv down and up projections by rows, the output projection by columns, the
    latents' norms summed over the sequence shards), with routing replay."""
    from tests.cases_engine import MLA_ARCH
    from tests.test_weight_sync import _gradient_problems

    res = worker_groups(2).run("tests.cases_rl:tensor_parallel_trainer_grads", tp=2,
                               model_kw=MLA_ARCH, replay=True, algorithm="grpo",
                               is_level="none")
    assert _gradient_problems(res, True, "grpo", sharded=20) == []


@pytest.mark.parametrize("trainer_tp,trainer_ep,adp", [(1, 2, 2), (2, 1, 1)])
def test_grpo_with_mla_learns_and_the_trainer_recomputes_the_rollouts_logprobs(
        worker_groups, tmp_path, trainer_tp, trainer_ep, adp):
    """Colocated GRPO on 2 ranks (engine EP2/ADP2 with the trainer's experts over EP2, or
    engine EP2/ATP2 with the trainer at TP2 under sequence parallelism) with routing replay:
    the reward rises from the random policy's ~1/64 and the trainer's logprobs of every
    rollout token are the engine's (fp32: summation order only)."""
    res = worker_groups(2).run("colo_rollout.rl.train:run_train", timeout=600,
                               config_path="configs/grpo_cpu.yaml",
                               overrides={"rl.out_dir": str(tmp_path),
                                          "rl.trainer_ep": trainer_ep,
                                          "rl.trainer_tp": trainer_tp,
                                          "parallel.adp": adp,
                                          "engine.record_routing": True,
                                          "rl.routing_replay": True, **MLA_OVERRIDES},
                               quiet=True)
    h = res[0]["history"]
    first = sum(x["reward"] for x in h[:3]) / 3
    last = sum(x["reward"] for x in h[-3:]) / 3
    assert first < 0.2 and last > first + 0.5, (first, last)
    assert max(x["logprob_gap_max"] for x in h) < 1e-4
    assert all(x["failed"] == 0 and x["routing_disagree_frac"] == 0.0 for x in h)


@pytest.mark.parametrize("family", ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM",
                                    *_lite("Glm4MoeLiteForCausalLM")])
def test_export_of_an_mla_model_is_exact_and_transformers_loads_it(worker_groups, tmp_path,
                                                                   family):
    """A megatron MLA model written as a DeepSeek-V3 (sigmoid router), DeepSeek-V2 (softmax)
    or GLM-4.7-Flash (a dense middle layer) checkpoint: the files hold the HF split of every tensor, this project's loader reads it
    back bit for bit, and transformers computes megatron's logprobs."""
    res = worker_groups(1).run("tests.cases_export:export_round_trip", family=family,
                               directory=str(tmp_path / "out"))
    r0 = res[0]
    assert r0["architectures"] == [family]
    assert r0["file_names_equal"] and r0["file_unequal"] == []
    assert r0["same_names"] and r0["unequal"] == []
    assert r0["max_diff_vs_transformers"] < 1e-4


@pytest.mark.parametrize("world,adp,name", [
    (1, 1, "bottleneck"), (2, 1, "bottleneck"),
    *[pytest.param(1, 1, *p.values, marks=p.marks) for p in _lite("glm_lite")]])
def test_deepseek_mtp_layer_loads_and_drafts_without_changing_the_tokens(worker_groups, ds,
                                                                        tmp_path, world, adp,
                                                                        name):
    """DeepSeek-V3's MTP layer stored at model.layers.{num_hidden_layers} (its own shard, with
    the embed_tokens / shared_head.head copies) loads as megatron's mtp.layers.0 with an MLA
    attention; engine.mtp drafts with it and the greedy tokens stay transformers' (1 rank,
    and EP2/ATP2: the MTP layer's heads split too; GLM-4.7-Flash's nextn layer alike)."""
    from tests.test_hf_mtp import add_mtp_layer

    d = str(tmp_path / "mtp")
    shutil.copytree(ds[name], d)
    add_mtp_layer(d, duplicates=True, own_shard=True)
    edit_config(d, num_nextn_predict_layers=1)  # GLM-4.7-Flash's config.json key (its
    # transformers config class has none: save_pretrained drops it)
    assert hf_architecture(d).fields["mtp_num_layers"] == 1
    res = worker_groups(world).run(f"{CASES}:serve_checkpoint", directory=d, adp=adp,
                                   ep=world, engine={"mtp": True})
    r0 = check_equivalent(res)
    plain = worker_groups(world).run(f"{CASES}:serve_checkpoint", directory=ds[name],
                                     adp=adp, ep=world)[0]
    assert r0["tokens"] == plain["tokens"]
