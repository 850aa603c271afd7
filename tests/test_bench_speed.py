"""`colo-rollout bench-speed`: the roofline and FLOP formulas on hand-computed cases, the CPU
config end to end through the command line (one spawned rank: every decode and prefill row,
positive ratios, the breakdown, the peer, the JSON and the plot), and its config refused at the
door."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from colo_rollout.cli import main
from colo_rollout.config import ModelConfig, load_config
from colo_rollout.model.norm_add import NORM_RANGE
from colo_rollout.tools.bench_speed import (
    PARTS,
    _idle_lines,
    _is_span,
    _paired,
    attribute,
    decode_roofline,
    expected_experts,
    idle_gaps,
    kernel_table,
    prefill_flops,
)
from tests.test_door import at, door_error

CPU = str(Path(__file__).resolve().parents[1] / "configs" / "bench_speed_cpu.yaml")

# H 64, 4 heads of 16, 2 KV groups, 2 MoE layers of 8 experts (top-2) of width 128, vocab 256
TINY = dict(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4,
            num_query_groups=2, moe_ffn_hidden_size=128, num_experts=8, moe_router_topk=2)


def test_decode_roofline_bytes_of_a_hand_computed_case():
    m = ModelConfig(**TINY, params_dtype="float32")
    # per layer: qkv (4 + 2 x 2) x 16 x 64 = 8192 + proj 64 x 64 = 4096 -> 2 x 12288 x 4 B
    attention = 98_304
    router = 2 * 8 * 64 * 4  # 4096
    experts = (3 + 5) * 3 * 128 * 64 * 4  # 3 and 5 experts touched: 786432
    output = 256 * 64 * 4  # 65536
    kv = (10 + 20) * 2 * 2 * 16 * 2 * 4  # rows at 10 and 20 tokens: 15360
    r = decode_roofline(m, [10, 20], [3, 5], 4.0e12)
    assert r["weight_bytes_by_part"]["attention"] == attention
    assert r["weight_bytes_by_part"]["experts"] == experts
    assert r["kv_bytes"] == kv
    assert r["roofline_bytes"] == 969_728 == attention + router + experts + output + kv
    assert r["roofline_s"] == pytest.approx(969_728 / 4.0e12)
    # bfloat16 halves every byte; the bandwidth scales the time only
    r16 = decode_roofline(ModelConfig(**TINY, params_dtype="bfloat16"), [10, 20], [3, 5], 2e12)
    assert r16["roofline_bytes"] == 969_728 // 2
    assert r16["roofline_s"] == pytest.approx(969_728 / 2 / 2e12)
    with pytest.raises(ValueError):
        decode_roofline(m, [10], [3], 4.0e12)  # one count for two MoE layers


def test_prefill_flops_of_a_hand_computed_case():
    m = ModelConfig(**TINY)
    # active params per token: 2 x 12288 attention + 2 x (router 512 + top-2 x 24576)
    assert prefill_flops(m, [(0, 4)])["active_params_per_token"] == 123_904
    # 4 new tokens on an empty cache: 2 x 123904 x 4 + output layer 2 x 256 x 64 on the last
    # token; 1 + 2 + 3 + 4 = 10 causal pairs x 4 x 16 dims x 4 heads x 2 layers
    f = prefill_flops(m, [(0, 4)])
    assert (f["gemm_flops"], f["attention_flops"]) == (1_024_000, 5_120)
    # a continuation of 2 tokens on 6 cached: 2 x 6 + 3 = 15 pairs; two sequences add
    f = prefill_flops(m, [(0, 4), (6, 2)])
    assert f["attention_flops"] == 512 * (10 + 15)
    assert f["flops"] == 2 * 123_904 * 6 + 2 * 2 * 256 * 64 + 512 * 25


def test_expected_experts_touched():
    assert expected_experts(8, 2, 1) == pytest.approx(2.0)
    assert expected_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75 ** 2))
    assert expected_experts(64, 8, 10_000) == pytest.approx(64.0)


def _event(name, parent, start=0.0, kernels=(), self_us=0.0, dur=0.0):
    """A profiler FunctionEvent's fields that ``attribute`` reads."""
    return SimpleNamespace(name=name, cpu_parent=parent, self_cpu_time_total=self_us,
                           device_type=torch.autograd.DeviceType.CPU,
                           kernels=[SimpleNamespace(duration=k) for k in kernels],
                           time_range=SimpleNamespace(start=start, elapsed_us=lambda: dur))


def test_breakdown_attributes_kernels_to_layer_parts():
    """The GPU rule on a hand-built profile: kernels by innermost range (a Triton kernel on the
    range itself included), the MoE block split around its GEMMs, the logits GEMM outside every
    range as lm head, nothing outside a step."""
    step = _event("bs::step", None, dur=1000.0)
    att = _event("bs::attention", step, kernels=[50.0])  # a Triton launch: no aten op
    moe = _event("bs::moe", step, start=100.0)
    router = _event("bs::router", moe, start=101.0)
    lm = _event("aten::linear", step, start=200.0)
    events = [step, att, _event("aten::mm", att, kernels=[30.0]), moe, router,
              _event("aten::mm", router, start=102.0, kernels=[5.0]),
              _event("aten::sort", moe, start=110.0, kernels=[7.0]),
              _event("aten::_grouped_mm", moe, start=120.0, kernels=[40.0]),
              _event("aten::silu", moe, start=130.0, kernels=[3.0]),
              _event("aten::_grouped_mm", moe, start=140.0, kernels=[20.0]),
              _event("aten::index_add_", moe, start=150.0, kernels=[4.0]),
              lm, _event("aten::mm", lm, start=201.0, kernels=[11.0]),
              _event("aten::mm", None, kernels=[99.0])]  # outside the profiled steps
    parts, step_us = attribute(events, device_time=True)
    assert step_us == 1000.0
    assert parts == {"attention": 80.0, "router/top-k": 5.0, "permutation": 7.0,
                     "expert GEMMs": 60.0, "activation": 3.0, "combine": 4.0, "lm head": 11.0}
    # CPU: self time of ops only (a range's own time is the gaps)
    step.self_cpu_time_total = att.self_cpu_time_total = 500.0
    events[2].self_cpu_time_total = 30.0
    assert attribute(events[:3], device_time=False) == ({"attention": 30.0}, 1000.0)


def test_breakdown_credits_each_kernel_where_its_launch_sits():
    """The same profile as torch 2.11 reports it on a GPU: no op lists its kernels; each CUDA
    kernel shares its correlation id with the host call that launched it (a Triton launch
    straight under a range, library kernels under their aten op) -- the same parts."""
    cuda = torch.autograd.DeviceType.CUDA
    calls, kernels = [], []

    def launch(parent, us, api="cuLaunchKernelEx"):
        i = len(calls) + 1
        start = parent.time_range.start + 0.5
        calls.append(SimpleNamespace(**{**vars(_event(api, parent, start=start)), "id": i}))
        kernels.append(SimpleNamespace(name="k", id=i, cpu_parent=None, kernels=[],
                                       device_type=cuda,
                                       time_range=SimpleNamespace(start=start,
                                                                  elapsed_us=lambda: us)))

    step = _event("bs::step", None, dur=1000.0)
    att = _event("bs::attention", step)
    moe = _event("bs::moe", step, start=100.0)
    router = _event("bs::router", moe, start=101.0)
    lm = _event("aten::linear", step, start=200.0)
    mm_att = _event("aten::mm", att)
    mm_router = _event("aten::mm", router, start=102.0)
    sort = _event("aten::sort", moe, start=110.0)
    fc1 = _event("colo.moe_gemm", moe, start=120.0)  # the range around the Triton launches
    silu = _event("aten::silu", moe, start=130.0)
    fc2 = _event("aten::_grouped_mm", moe, start=140.0)
    add = _event("aten::index_add_", moe, start=150.0)
    mm_lm = _event("aten::mm", lm, start=201.0)
    norm = _event(NORM_RANGE, step, start=90.0)  # a layer's fused add + norm, in no module
    outside = _event("aten::mm", None)
    for parent, us in ((att, 50.0), (mm_att, 30.0), (mm_router, 5.0), (sort, 7.0),
                       (fc1, 40.0), (silu, 3.0), (fc2, 20.0), (add, 4.0), (mm_lm, 11.0),
                       (norm, 6.0), (outside, 99.0)):
        launch(parent, us, "cudaLaunchKernel" if parent.name.startswith("aten") else
               "cuLaunchKernelEx")
    # the ranges' spans on the GPU (user annotations), one sharing a launch's id: not kernels
    spans = [SimpleNamespace(name=r.name, id=i, cpu_parent=None, kernels=[], device_type=cuda,
                             is_user_annotation=True,
                             time_range=SimpleNamespace(start=0.0, elapsed_us=lambda: 500.0))
             for i, r in ((1, att), (2, moe))]
    events = [step, att, mm_att, moe, router, mm_router, sort, fc1, silu, fc2, add, lm, mm_lm,
              norm, outside, *calls, *kernels, *spans]
    parts, step_us = attribute(events, device_time=True)
    assert step_us == 1000.0
    assert parts == {"attention": 80.0, "router/top-k": 5.0, "permutation": 7.0,
                     "expert GEMMs": 60.0, "activation": 3.0, "combine": 4.0, "lm head": 11.0,
                     "norms": 6.0}


def test_idle_gaps_are_the_gpus_waits_inside_each_step():
    """A hand-built timeline of two profiled steps: the gaps between a step's kernels (a
    kernel covering a later one's start closes no gap; the sync between the steps is no
    gap), each with its neighbours, offset and how late the host launched the kernel after
    it; the floor's small gaps counted apart; kernels outside the steps ignored."""
    cuda = torch.autograd.DeviceType.CUDA
    events = []

    def kernel(step, name, start, us, launched):
        i = len(events) + 1
        events.append(SimpleNamespace(**{**vars(_event("cuLaunchKernelEx", step,
                                                       start=launched)), "id": i}))
        events.append(SimpleNamespace(name=name, id=i, cpu_parent=None, kernels=[],
                                      device_type=cuda, time_range=SimpleNamespace(
                                          start=start, elapsed_us=lambda: us)))

    s1, s2 = _event("bs::step", None, start=0.0), _event("bs::step", None, start=1000.0)
    kernel(s1, "copy", 10.0, 5.0, 1.0)
    kernel(s1, "embed", 265.0, 10.0, 250.0)  # 250 us idle: launched 235 us after it went idle
    kernel(s1, "gemm", 277.0, 100.0, 200.0)  # 2 us: under the floor, queued before
    kernel(s1, "rope", 300.0, 10.0, 210.0)  # inside gemm's span: no gap
    kernel(s1, "attn", 407.0, 50.0, 220.0)  # 30 us after gemm's end, queued before
    kernel(s2, "copy", 2000.0, 5.0, 1001.0)  # the sync between the steps: no gap
    kernel(s2, "embed", 2105.0, 10.0, 1100.0)  # 100 us
    kernel(None, "outside", 2200.0, 1.0, 2150.0)
    got = idle_gaps(events, steps=2, top=3)
    assert got["idle_ms"] == pytest.approx((250 + 2 + 30 + 100) / 2 / 1e3)
    assert got["small_gaps"] == 0.5 and got["small_ms"] == pytest.approx(0.001)
    assert [(g["us"], g["after"], g["before"]) for g in got["largest"]] == [
        (250.0, "copy", "embed"), (100.0, "copy", "embed"), (30.0, "gemm", "attn")]
    assert got["largest"][0]["at_ms"] == pytest.approx(0.255)
    assert got["largest"][0]["host_late_us"] == pytest.approx(235.0)
    assert got["largest"][2]["host_late_us"] < 0
    assert idle_gaps([e for e in events if e.device_type != cuda], steps=1) == {}
    lines = _idle_lines({"shape": "prefill 1 x 8", "idle": got})
    assert "GPU idle inside an eager step 0.191 ms" in lines[0]
    assert "launched 235 us after the GPU went idle" in lines[1]
    assert "queued before it" in lines[3]


def test_replayed_kernel_table_counts_kernels_not_range_spans():
    """The replayed step's kernel table (``kernel_table`` over ``_paired``): the profiler
    lists a range's span on the GPU as a CUDA event too -- one named like the fused norm's
    range (colo.norm) was counted as 24 kernels of a Qwen3 P step on an H100 (2026-12-06) --
    so only launched work is tabled; and its idle gaps print under their own heading."""
    cuda = torch.autograd.DeviceType.CUDA
    step = _event("bs::step", None, dur=1000.0)
    events = [step]
    for i, (name, start, us) in enumerate((("gemm", 10.0, 50.0), ("norm_kernel", 70.0, 5.0),
                                           ("gemm", 80.0, 50.0)), start=1):
        events.append(SimpleNamespace(**{**vars(_event("cudaGraphLaunch", step, start=1.0)),
                                         "id": i}))
        events.append(SimpleNamespace(name=name, id=i, cpu_parent=None, kernels=[],
                                      device_type=cuda, time_range=SimpleNamespace(
                                          start=start, elapsed_us=lambda us=us: us)))
    for name, annotated in ((NORM_RANGE, False), ("bs::step", True)):
        events.append(SimpleNamespace(name=name, id=2, cpu_parent=None, kernels=[],
                                      device_type=cuda, is_user_annotation=annotated,
                                      time_range=SimpleNamespace(start=60.0,
                                                                 elapsed_us=lambda: 40.0)))
    table = kernel_table([ev for _, ev in _paired(events)], steps=1)
    assert table["per_step"] == 3
    # where nothing pairs (no launch calls recorded): the CUDA events that are no span
    unpaired = [ev for ev in events if ev.device_type == cuda and not _is_span(ev)]
    assert kernel_table(unpaired, steps=1) == table
    assert [(r["name"], r["count"], r["us"]) for r in table["top"]] == [
        ("gemm", 2, 100.0), ("norm_kernel", 1, 5.0)]
    idle = idle_gaps(events, steps=1)
    assert idle["idle_ms"] == pytest.approx(0.015)
    lines = _idle_lines({"shape": "prefill 8 x 1024", "graph_idle": idle}, "graph_idle",
                        "a replayed step")
    assert lines[0].startswith("prefill 8 x 1024: GPU idle inside a replayed step 0.015 ms")
    assert _idle_lines({"shape": "x", "idle": idle}, "graph_idle", "a replayed step") == []


def test_cpu_config_end_to_end(tmp_path, capsys):
    out_dir = tmp_path / "speed"
    assert main(["bench-speed", CPU, "--set", f"bench_speed.out_dir={out_dir}",
                 "--set", "bench_speed.iters=2", "--set", "bench_speed.prefill_iters=1"]) == 0
    table = capsys.readouterr().out
    cfg = load_config(CPU).bench_speed
    res = json.loads((out_dir / "bench_speed.json").read_text())
    assert res["fp8"] is None and res["layer_spec"] == "local"  # bf16, the engine's own layers
    assert "with FP8 GEMMs" not in table and "Transformer Engine" not in table
    shapes = [(r["batch"], r["context"]) for r in res["decode"]]
    assert shapes == ([(b, cfg.short_context) for b in cfg.decode_batches]
                      + [(b, c) for c in cfg.long_contexts for b in cfg.long_batches])
    E, k = 8, 2
    for r in res["decode"]:
        assert r["step_s"] > 0 and r["tok_s"] > 0 and r["ratio"] > 0
        assert r["roofline_bytes"] == r["weight_bytes"] + r["kv_bytes"]
        assert all(1 <= n <= min(E, k * r["bucket"]) for n in r["experts_touched"])
        assert f"\n{r['batch']:>5} {r['context']:>7} " in table  # its table row
    # the sampled rows (temperature 1) against the greedy step of the same shape
    assert [r["batch"] for r in res["decode_sampled"]] == cfg.sampled_batches
    greedy = {r["batch"]: r["step_s"] for r in res["decode"] if r["context"] == cfg.short_context}
    for r in res["decode_sampled"]:
        assert r["step_s"] > 0 and r["greedy_step_s"] == greedy[r["batch"]]
        assert r["truncated_step_s"] > 0 and (r["top_k"], r["top_p"]) == (50, 0.95)
        assert not r["in_graph"]  # CPU: no graphs
    assert ("sampled decode: every row drawn at temperature 1, then also with top-k 50 / top-p "
            "0.95 (eagerly)") in table
    assert [r["shape"] for r in res["prefill"]] == [
        "1 x 64", "1 x 128", "1 x 256", "4 x 64", "fresh 96+40+40+16", "4 x 16-64 on 128-256"]
    mixed = res["prefill"][-2]
    assert (mixed["kind"], mixed["seqs"], mixed["tokens"], mixed["cached_tokens"]) == (
        "mixed", 4, 192, 0)
    for r in res["prefill"]:
        assert r["frac_peak"] > 0 and r["tok_s"] > 0 and r["shape"] in table
        # every fresh row also as P steps back to back through Engine.step (the overlap is
        # off on CPU: "auto"), a continuation row not
        fresh = r["cached_tokens"] == 0
        assert ("burst_step_s" in r) == fresh and "burst_note" not in r
        if fresh:
            assert r["burst_step_s"] > 0 and r["burst_steps"] == res["prefill_burst"] == 10
            assert r["burst_frac_peak"] == pytest.approx(
                r["frac_peak"] * r["step_s"] / r["burst_step_s"])
    assert res["overlap_prefill"] is False
    assert "b2b: per step of 10 such P steps back to back through Engine.step " \
           "(engine.overlap_prefill off; wall time over the steps)" in table
    cont = res["prefill"][-1]
    assert (cont["seqs"], cont["tokens"], cont["cached_tokens"]) == (4, 16 + 32 + 48 + 64,
                                                                       128 + 171 + 213 + 256)
    for kind in ("decode", "prefill"):
        bd = res["breakdown"][kind]
        assert set(bd["parts_ms"]) <= set(PARTS)
        for part in ("attention", "norms", "router/top-k", "expert GEMMs", "launch gaps"):
            assert bd["parts_ms"][part] > 0, (kind, part)
        assert sum(bd["parts_ms"].values()) == pytest.approx(bd["wall_ms"])
    assert [r["batch"] for r in res["hf"]["decode"]] == cfg.decode_batches
    assert [r["tokens"] for r in res["hf"]["prefill"]] == cfg.hf_prefill_lengths
    assert all(r["tok_s"] > 0 for r in res["hf"]["decode"] + res["hf"]["prefill"])
    png = out_dir / "bench_speed_breakdown.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_speed_config_is_checked_at_the_door(capsys, tmp_path):
    line = door_error(capsys, "bench-speed", CPU, "--set", "bench_speed.decode_batchez=[1]")
    assert line.startswith(f"error: {CPU}: bench_speed.decode_batchez: unknown override key")
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(CPU).read_text().replace("short_context: 32", "short_context: 0"))
    line = door_error(capsys, "bench-speed", str(bad))
    n = bad.read_text().splitlines().index("  short_context: 0") + 1  # the key's line
    assert line == f"error: {bad}:{n}: bench_speed.short_context: must be >= 2, got 0"
    line = door_error(capsys, "bench-speed", CPU, "--set", "bench_speed.long_contexts=[128, 600]")
    assert line.startswith(f"error: {at(CPU, 'bench_speed.long_batches')}: "
                           "bench_speed.long_batches: decode of 2 rows at 600 "
                           "tokens of context: a sequence of 600 tokens exceeds "
                           "engine.max_seq_len 512")
    line = door_error(capsys, "bench-speed", CPU, "--set", "bench_speed.prefill_mixed=[600, 8]")
    assert line.startswith(f"error: {CPU}: bench_speed.prefill_mixed: the mixed prefill of 2 "
                           "sequences: a sequence of 600 tokens exceeds engine.max_seq_len 512")
    # a P step the engine would never schedule (found by probing: it was timed)
    line = door_error(capsys, "bench-speed", CPU, "--set", "engine.max_prefill_tokens=64",
                      "--set", "bench_speed.prefill_lengths=[256]")
    assert line == (f"error: {CPU}: bench_speed.prefill_lengths: a prefill of 256 tokens: 256 "
                    "new tokens in one P step exceed engine.max_prefill_tokens 64")
    line = door_error(capsys, "bench-speed", CPU, "--set", "engine.max_prefill_tokens=200",
                      "--set", "bench_speed.prefill_lengths=[64]")
    assert line.startswith(f"error: {at(CPU, 'bench_speed.prefill_batch_seqs')}: "
                           "bench_speed.prefill_batch_seqs: 4 prefills of 64 "
                           "tokens: 256 new tokens in one P step exceed")
    line = door_error(capsys, "bench-speed", CPU, "--set", "bench_speed.prefill_mixed=[0]")
    assert "bench_speed.prefill_mixed: every value must be >= 1, got [0]" in line
    line = door_error(capsys, "bench-speed", CPU, "--set", "bench_speed.sampled_batches=[16]")
    assert "bench_speed.sampled_batches: 16 rows exceed engine.max_batch_size 8" in line
    line = door_error(capsys, "bench-speed", CPU, "--set", "bench_speed.decode_batches=[64]")
    assert "bench_speed.decode_batches: 64 rows exceed engine.max_batch_size 8" in line
    line = door_error(capsys, "bench-speed", CPU, "--set", "engine.num_kv_blocks=40")
    assert "needs 64 KV blocks of 16 tokens; engine.num_kv_blocks is 40" in line
    line = door_error(capsys, "bench-speed", CPU, "--set", "parallel.world_size=2",
                      "--set", "parallel.ep=2")
    assert "parallel.world_size: bench-speed runs on one rank; got 2" in line


def test_versus_measures_a_variant_on_the_same_rows_in_the_same_process(tmp_path, capsys):
    """--versus: a variant's rows beside the base's, each with its ratio (variant / base)."""
    out_dir = tmp_path / "vs"
    rows = ["--set", "bench_speed.decode_batches=[1, 2]", "--set", "bench_speed.long_contexts=[]",
            "--set", "bench_speed.long_batches=[]",
            "--set", "bench_speed.sampled_batches=[2]", "--set", "bench_speed.prefill_lengths=[64]",
            "--set", "bench_speed.prefill_batch_seqs=0", "--set", "bench_speed.prefill_mixed=[]",
            "--set", "bench_speed.continuation_seqs=0", "--set", "bench_speed.hf_peer=false",
            "--set", "bench_speed.profile=false", "--set", "bench_speed.iters=2",
            "--set", "bench_speed.prefill_iters=1", "--set", f"bench_speed.out_dir={out_dir}"]
    assert main(["bench-speed", CPU, *rows, "--versus", "model.moe_compute=megatron"]) == 0
    table = capsys.readouterr().out
    res = json.loads((out_dir / "bench_speed.json").read_text())
    (v,) = res["versus"]
    assert v["set"] == {"model.moe_compute": "megatron"}
    base = {("decode", r["batch"], r["context"]): r["step_s"] for r in res["decode"]}
    # the sampled rows too (found by probing: their key was read as a prefill row's)
    base |= {("decode_sampled", r["batch"], r["context"]): r["step_s"]
             for r in res["decode_sampled"]}
    base |= {("prefill", r["shape"]): r["step_s"] for r in res["prefill"]}
    assert any(k[0] == "decode_sampled" for k in base)
    assert [(r["kind"], *r["row"]) for r in v["rows"]] == list(base)  # every row, in order
    for r in v["rows"]:
        assert r["base_step_s"] == base[(r["kind"], *r["row"])] and r["step_s"] > 0
        assert r["ratio"] == pytest.approx(r["step_s"] / r["base_step_s"])
        what = (f"decode B={r['row'][0]} ctx {r['row'][1]}" if r["kind"] == "decode"
                else f"sampled B={r['row'][0]} ctx {r['row'][1]}"
                if r["kind"] == "decode_sampled" else f"prefill {r['row'][0]}")
        assert f"{what:<34} {r['base_step_s'] * 1e3:>9.3f} {r['step_s'] * 1e3:>9.3f}" in table
    assert 'versus (same process' in table and 'model.moe_compute="megatron"' in table


def test_the_profiled_prefill_can_be_a_batched_step(tmp_path, capsys):
    """profile_prefill_seqs: the breakdown's P step is that many sequences (the 8 x 1k row's
    shape), its wall time the timed batch row's; a step the engine cannot take is refused."""
    out_dir = tmp_path / "bd"
    rows = ["--set", "bench_speed.decode_batches=[1]", "--set", "bench_speed.long_contexts=[]",
            "--set", "bench_speed.long_batches=[]", "--set", "bench_speed.sampled_batches=[]",
            "--set", "bench_speed.prefill_lengths=[48]",
            "--set", "bench_speed.prefill_batch_seqs=3",
            "--set", "bench_speed.prefill_batch_len=16", "--set", "bench_speed.prefill_mixed=[]",
            "--set", "bench_speed.continuation_seqs=0", "--set", "bench_speed.hf_peer=false",
            "--set", "bench_speed.prefill_burst=0", "--set", "bench_speed.iters=2",
            "--set", "bench_speed.prefill_iters=1", "--set", f"bench_speed.out_dir={out_dir}"]
    assert main(["bench-speed", CPU, *rows, "--set", "bench_speed.profile_prefill=16",
                 "--set", "bench_speed.profile_prefill_seqs=3"]) == 0
    capsys.readouterr()
    res = json.loads((out_dir / "bench_speed.json").read_text())
    bd = res["breakdown"]["prefill"]
    batch = next(r for r in res["prefill"] if r["shape"] == "3 x 16")
    single = next(r for r in res["prefill"] if r["shape"] == "1 x 48")  # same tokens, 1 seq
    assert bd["shape"] == "prefill 3 x 16"
    assert bd["measured_ms"] == pytest.approx(batch["step_s"] * 1e3)
    assert bd["measured_ms"] != pytest.approx(single["step_s"] * 1e3)
    assert bd["parts_ms"]["attention"] > 0 and bd["parts_ms"]["expert GEMMs"] > 0
    line = door_error(capsys, "bench-speed", CPU, "--set", "engine.max_prefill_tokens=100",
                      "--set", "bench_speed.prefill_lengths=[64]",
                      "--set", "bench_speed.prefill_batch_seqs=0",
                      "--set", "bench_speed.prefill_mixed=[]",
                      "--set", "bench_speed.continuation_seqs=0",
                      "--set", "bench_speed.profile_prefill_seqs=3")
    assert line == (f"error: {CPU}: bench_speed.profile_prefill: the profiled prefill of 3 x 64 "
                    "tokens: 192 new tokens in one P step exceed engine.max_prefill_tokens 100")
    line = door_error(capsys, "bench-speed", CPU, "--set", "bench_speed.profile_prefill_seqs=0")
    assert "bench_speed.profile_prefill_seqs: must be >= 1, got 0" in line


def test_versus_variants_are_checked_at_the_door(capsys):
    line = door_error(capsys, "bench-speed", CPU, "--versus", "bench_speed.iters=3")
    assert line.startswith("error: --versus bench_speed.iters: a variant changes the model or "
                           "the engine (model.*, engine.*)"), line
    line = door_error(capsys, "bench-speed", CPU, "--versus", "")
    assert line == "error: --versus: an empty variant (give KEY=VALUE pairs)"
    # the variant's refusal names the variant (found by probing: it read as the file's own)
    line = door_error(capsys, "bench-speed", CPU, "--versus", "model.moe_compute=fast")
    assert line.startswith(f"error: --versus 'model.moe_compute=fast': {CPU}: "
                           "model.moe_compute: expected one of"), line
