"""`colo-rollout bench-speed CONFIG`: decode and prefill speed of one rank against the roofline.

Owns the speed benchmark of one rank (issue 16, item 1): the shapes it measures, the roofline
and FLOP formulas it holds them to, the kernel-time breakdown per layer part, the Hugging Face
peer, and the table, JSON and bar plot. ``run_bench_speed`` runs on the rank (a spawned CPU
process or torchrun's one process); ``report`` runs in the launching process.

How it measures. An ``Engine`` (Normal mode, random weights from ``model.seed``) is built once;
its runner is then driven with hand-built, self-contained ``StepPlan``s (sched/plan.py): every
sequence of a step gets consecutive KV blocks from block 0 and its context length set, so a
decode row at an 8k context costs no 8k prefill (the KV content is whatever the storage holds:
the timing does not depend on it). A step is ``runner.run`` / ``run_decode`` up to its sampled
tokens on the host -- on a GPU D replays the engine's CUDA graph of the row bucket and table
width and P its MoE-block graphs, exactly as the engine's steps do -- and its time is the
median of ``iters`` host-timed steps after ``warmup`` untimed ones (graph capture, allocator
growth and lazy initialisation land there, never in a timed step).

Prefill back to back (``prefill_burst``): each fresh prefill row's shape also as that many P
steps in a row through the engine's own loop -- its prompts submitted to the engine (random
ids, max_tokens 1), the step's P budget set to the row's tokens so each step takes one row's
worth, ``Engine.step`` called until idle. The row's "back to back" time is the steady state's
time per step: on a GPU, from the first P step's end to the last's over the steps between (CUDA
events around each step: the GPU's idle between steps counted -- the engine's planning,
exchange and commit where they are not hidden -- the burst's arrival, its first step's intake
and host head, not); on a CPU, the burst's wall time over its steps. Where
engine.overlap_prefill is on, each step's host head runs under the previous step's kernels
(engine/engine.py); with it off (the JSON's ``burst_sequential_s``, measured beside it) each
waits for the previous step's tokens. One step alone (the "step ms" column) pays its host
head in full, after a rest: a GPU at its power limit runs faster after one (docs/
benchmarks.md, sessions 21 and 36), so the steady state can be the slower of the two. On a GPU
each prefill row and its burst carry the SM clock and board power they ran at (``clock``: over
the row's warm-up and timed steps; ``burst_clock``: over the timed burst; tools/clock_watch.py,
through nvidia-ml-py where it is installed; the table says when none was read).

Formulas (``decode_roofline``, ``prefill_flops``; model section values, ``b`` = bytes per
parameter of params_dtype):
  * decode roofline bytes = weights the step must read + KV read. Weights: every layer's
    attention (linear_qkv weight and bias, linear_proj; MLA: its q, kv down / up and output
    projections), every MoE layer's router, the routed
    experts the step's rows touch (3 x moe_ffn x hidden each), shared experts and dense MLPs in
    full, and the output layer (V x H); norms and the embedding rows are left out (< 0.1%).
    "Experts touched" is measured: a forward hook on every router counts the distinct
    experts of that step's routing map (all computed rows, bucket padding included: the step
    reads their experts too), on one eager run of the same plan. The expectation
    E (1 - (1 - k/E)^rows) is reported beside it. KV read = sum over rows of context tokens x
    layers x the cache's values per token and layer (KV groups x head_dim x 2, K and V; MLA:
    kv_lora_rank + qk_rope_head_dim) x b. Roofline time = bytes / hbm_bytes_per_s;
    ratio = roofline time / measured step time (1.0 = at the bandwidth bound).
  * prefill FLOPs = 2 x active parameters per token x tokens (attention projections, router,
    top-k experts, shared experts, dense MLPs) + 2 x V x H per sequence (the output layer runs
    on each sequence's last token only, as the engine does) + attention scores and values,
    2 x (query/key head + value head) x heads x layers per (query, key) pair, a causal
    sequence of n new tokens on c cached ones having n c + n (n + 1) / 2 pairs (MLA's P also
    decompresses the c cached tokens' keys and values: not counted). Fraction of peak = FLOPs
    / time / peak_flops.
On a CPU the ratios are taken against the same (GPU) numbers: tiny, and labelled so.

Breakdown: torch.profiler over ``profile_steps`` decode steps (``breakdown_batch`` rows, short
context) and one prefill step (``profile_prefill_seqs`` sequences of ``breakdown_prefill``
tokens), run eagerly (graphs hide which op
launched a kernel). Forward hooks open a ``record_function`` range around the norms, the
attention, the router, the MoE block and its experts module, and wrapped methods around the
embedding, shared experts, dense MLPs and the runner's sampling; each op's time (GPU: the CUDA
kernels it launched; CPU: its self CPU time) goes to the part of its innermost range. Inside
the MoE block, ops are split by position: GEMMs are "expert GEMMs", what runs before the first
is "permutation", after the last "combine", elementwise ops between them "activation". Ops in no
range go by name: collectives, lm head (the one GEMM left: the logits), or other (residual adds,
RoPE angles, input copies). With Transformer Engine modules the input norm is fused into linear_qkv
and counts as attention. "launch gaps" = the step's
wall time minus the summed parts: on a GPU the wall time is the measured (graph-replay) step,
on a CPU the profiled steps' own wall time (Python and dispatch between ops). On a GPU the
graph replay's own kernel total is in the JSON (``graph_kernel_ms``) as a cross-check, and
where the GPU idled inside the eager steps and inside the graph-replay steps the rows time is
listed (``idle_gaps``; JSON ``idle``, ``graph_idle``): the idle between a step's
kernels and the largest gaps with the kernels around them and how late the host launched the
next one (the step head, a layer the host's Python fell behind in).

Peer: the same model section as a transformers model (``checkpoint/export.hf_config_dict``,
``AutoModelForCausalLM.from_config``, random weights, its default sdpa attention and grouped_mm
experts), decode with its own KV cache (one token per row on a cache of short_context - 1
tokens, cropped back after every step) at every decode_batches row, and one-sequence prefills
of hf_prefill_lengths; built after the engine is closed, in the same process.

Must not go in here: engine, runner or model changes (they are measured as they are).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import itertools
import json
import math
import os
import random
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

from colo_rollout.config import Config, ModelConfig, load_config
from colo_rollout.model.norm_add import NORM_RANGE
from colo_rollout.model.weights import DTYPES
from colo_rollout.config.tensor_shapes import mla_shapes
from colo_rollout.quiet import quiet_known_warnings
from colo_rollout.sched.plan import DecodeRow, Phase, PrefillItem, ReplicaWork, StepPlan
from colo_rollout.sched.planner import pick_bucket
from colo_rollout.sched.request import Request, SamplingParams
from colo_rollout.config.files import output_errors, strict_json, write_output
from colo_rollout.tools.clock_watch import ClockWatch

GREEDY = SamplingParams(max_tokens=1)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=1)  # the sampled decode rows' draw
# ... and the truncated one (top-k and top-p: the draw that sorts every row)
TRUNCATED = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=1)
# the breakdown's parts, in table and plot order
PARTS = ("attention", "norms", "router/top-k", "permutation", "expert GEMMs", "activation",
         "combine", "shared experts", "dense MLP", "embedding", "lm head", "sampling",
         "collectives", "other", "launch gaps")
_RANGE = "bs::"  # record_function prefix of the breakdown's ranges
_GEMM_OPS = ("aten::_grouped_mm", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
             "aten::linear", "aten::matmul")
_ACTIVATION_OPS = ("silu", "gelu", "sigmoid", "glu", "aten::mul", "aten::chunk", "aten::to",
                   "aten::_to_copy", "aten::copy_")
_SAMPLING_OPS = ("softmax", "argmax", "aten::max", "topk", "sort", "multinomial", "exponential",
                 "gather", "cumsum", "aten::div")


# --------------------------------------------------------------------------- formulas
def _itemsize(m: ModelConfig) -> int:
    return DTYPES[m.params_dtype].itemsize


def _moe_layers(m: ModelConfig) -> int:
    return sum(1 for i in range(m.num_layers) if m.is_moe_layer(i))


def attention_params(m: ModelConfig) -> int:
    """Parameters of one layer's attention projections (linear_qkv weight and bias,
    linear_proj; MLA: its down, up and output projections -- model/weights.py mla_shapes)."""
    if m.is_mla:
        return sum(math.prod(s) for s in mla_shapes(m, "").values() if len(s) == 2)
    qkv = (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim
    n = qkv * m.hidden_size + m.num_attention_heads * m.head_dim * m.hidden_size
    return n + (qkv if m.qkv_bias else 0)


def _mla_kv_up_params(m: ModelConfig) -> int:
    """MLA's linear_kv_up_proj parameters per layer (0 without MLA)."""
    if not m.is_mla:
        return 0
    return math.prod(mla_shapes(m, "")["self_attention.linear_kv_up_proj.weight"])


def expert_params(m: ModelConfig) -> int:
    """Parameters of one routed expert (SwiGLU: fc1 [2F, H], fc2 [H, F])."""
    return 3 * m.moe_ffn_hidden_size * m.hidden_size


def _shared_params(m: ModelConfig) -> int:
    f = m.shared_expert_ffn_hidden_size
    if f is None:
        return 0
    return 3 * f * m.hidden_size + (m.hidden_size if m.shared_expert_gate else 0)


def _dense_params(m: ModelConfig) -> int:
    return 3 * m.dense_ffn_hidden_size * m.hidden_size


def expected_experts(num_experts: int, topk: int, rows: int) -> float:
    """Distinct experts ``rows`` tokens touch in one layer when each picks ``topk`` of
    ``num_experts`` uniformly."""
    return num_experts * (1.0 - (1.0 - topk / num_experts) ** rows)


def decode_roofline(m: ModelConfig, contexts: list[int], experts_touched: list[float],
                    hbm_bytes_per_s: float) -> dict:
    """Bytes one decode step must read -- weights (attention, router, the touched experts of
    each MoE layer, shared experts, dense MLPs, output layer) and the rows' KV -- and their
    time at ``hbm_bytes_per_s``. ``contexts``: tokens each row attends; ``experts_touched``:
    distinct experts per MoE layer."""
    moe = _moe_layers(m)
    if len(experts_touched) != moe:
        raise ValueError(f"{len(experts_touched)} expert counts for {moe} MoE layers")
    b = _itemsize(m)
    g = 1 if m.fp8 else b  # model.fp8: the GEMM weights' FP8 copies, a byte each
    kv_up = _mla_kv_up_params(m)  # MLA's kv_b stays in params_dtype under model.fp8
    weights = {
        "attention": m.num_layers * ((attention_params(m) - kv_up) * g + kv_up * b),
        "router": moe * m.num_experts * m.hidden_size * b,
        "experts": sum(experts_touched) * expert_params(m) * g,
        "shared experts": moe * _shared_params(m) * g,
        "dense MLP": (m.num_layers - moe) * _dense_params(m) * g,
        "output layer": m.vocab_size * m.hidden_size * b,
    }
    kv = sum(contexts) * m.num_layers * m.kv_cache_elems() * b
    w = sum(weights.values())
    return {"weight_bytes": w, "weight_bytes_by_part": weights, "kv_bytes": kv,
            "roofline_bytes": w + kv, "roofline_s": (w + kv) / hbm_bytes_per_s}


def prefill_flops(m: ModelConfig, seqs: list[tuple[int, int]]) -> dict:
    """Model FLOPs of one prefill step over ``seqs`` (cached tokens, new tokens): the
    projections and experts of every new token, the output layer on each sequence's last
    token, and causal attention's scores and values."""
    moe = _moe_layers(m)
    per_token = (m.num_layers * attention_params(m)
                 + moe * (m.num_experts * m.hidden_size + m.moe_router_topk * expert_params(m)
                          + _shared_params(m))
                 + (m.num_layers - moe) * _dense_params(m))
    tokens = sum(n for _, n in seqs)
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in seqs)
    gemm = 2 * per_token * tokens + 2 * m.vocab_size * m.hidden_size * len(seqs)
    # scores over the query/key head, values over the value head (MLA's differ; P attends the
    # decompressed heads, model/mla_attention.py)
    v_dim = m.v_head_dim if m.is_mla else m.head_dim
    attn = 2 * (m.head_dim + v_dim) * m.num_attention_heads * m.num_layers * pairs
    # model.fp8: the GEMMs that run in FP8 (all but the router's, the output layer's and MLA's
    # kv_b)
    fp8 = (2 * (per_token - moe * m.num_experts * m.hidden_size
                - m.num_layers * _mla_kv_up_params(m)) * tokens if m.fp8 else 0)
    return {"gemm_flops": gemm, "attention_flops": attn, "flops": gemm + attn,
            "fp8_flops": fp8, "active_params_per_token": per_token}


# --------------------------------------------------------------------------- plans
def _tables(lengths: list[int], block_size: int) -> list[tuple[int, ...]]:
    """Consecutive KV blocks from block 0 for sequences of ``lengths`` tokens."""
    out, at = [], 0
    for n in lengths:
        k = -(-n // block_size)
        out.append(tuple(range(at, at + k)))
        at += k
    return out


def decode_plan(contexts: list[int], tokens: list[int], bucket: int,
                block_size: int, params: SamplingParams = GREEDY) -> StepPlan:
    """One D iteration: row i attends contexts[i] tokens (its input token at position
    contexts[i] - 1), padded to ``bucket`` rows, every row sampled by ``params``."""
    tables = _tables(contexts, block_size)
    rows = tuple(DecodeRow(lifetime=i, token=t, position=c - 1, table=tb, params=params)
                 for i, (c, t, tb) in enumerate(zip(contexts, tokens, tables)))
    return StepPlan(step=0, phase=Phase.DECODE, replicas=(ReplicaWork(decode=rows),),
                    bucket=bucket, table_blocks=max(len(t) for t in tables))


def prefill_plan(seqs: list[tuple[int, int]], rng: random.Random, vocab: int,
                 block_size: int) -> StepPlan:
    """One P step: sequence i prefills seqs[i][1] new tokens on seqs[i][0] cached ones. Each
    item carries its ids as an array, as the scheduler's do (a fresh prompt's converted at
    submit; a retained continuation's context tail + prompt)."""
    tables = _tables([c + n for c, n in seqs], block_size)
    toks = [tuple(rng.randrange(vocab) for _ in range(n)) for _, n in seqs]
    items = tuple(PrefillItem(lifetime=i, tokens=t, start=c, table=tb, params=GREEDY,
                              ids=np.array(t, dtype=np.int64))
                  for i, ((c, _), t, tb) in enumerate(zip(seqs, toks, tables)))
    return StepPlan(step=0, phase=Phase.PREFILL, replicas=(ReplicaWork(prefill=items),))


# --------------------------------------------------------------------------- the rank's run
# the sections a --versus variant may change: the model and the engine, not the rows measured
# (bench_speed) nor the layout (parallel)
VERSUS_SECTIONS = ("model", "engine")


def versus_overrides(text: str) -> dict:
    """A ``--versus`` variant ('KEY=VALUE KEY=VALUE ...', values read as YAML) as overrides;
    a ConfigError naming the key for a section other than ``VERSUS_SECTIONS``."""
    import shlex

    from colo_rollout.config import ConfigError
    from colo_rollout.config.loader import parse_override

    try:
        pairs = shlex.split(text)
    except ValueError as e:  # an unbalanced quote
        raise ConfigError(f"--versus {text}: {e} (a variant is KEY=VALUE pairs, shell-quoted)",
                          key="--versus") from None
    if not pairs:
        raise ConfigError("--versus: an empty variant (give KEY=VALUE pairs)", key="--versus")
    out = dict(parse_override(p, "--versus") for p in pairs)
    for key in out:
        if key.split(".")[0] not in VERSUS_SECTIONS:
            raise ConfigError(f"--versus {key}: a variant changes the model or the engine "
                              f"({', '.join(s + '.*' for s in VERSUS_SECTIONS)}); the rows and "
                              "the layout stay the base run's", key="--versus")
    return out


def run_bench_speed(rank: int, world: int, config_path: str,
                    overrides: dict | None = None, versus: list[dict] | None = None) -> dict:
    """Every measurement of the bench_speed section on this (the only) rank; plain values.
    ``versus``: variants (overrides on top of ``overrides``) measured after the base in this
    process, on the same rows -- without the breakdown and the peer -- into ``out["versus"]``
    with each row's ratio to the base's step."""
    quiet_known_warnings()
    from colo_rollout.runtime.parallel import init_parallel

    cfg = load_config(config_path, overrides)
    groups = init_parallel(cfg.parallel)
    bench = _Bench(cfg, groups)
    try:
        out = bench.run()
    finally:
        bench.close()
    out["versus"] = []
    for v in versus or []:
        vcfg = load_config(config_path, {**(overrides or {}), **v})
        vcfg = dataclasses.replace(vcfg, bench_speed=dataclasses.replace(
            vcfg.bench_speed, profile=False, hf_peer=False))
        bench = _Bench(vcfg, groups)
        try:
            got = bench.run()
        finally:
            bench.close()
        out["versus"].append(_versus_rows(v, out, got))
    if cfg.bench_speed.hf_peer:
        try:
            out["hf"] = hf_peer(cfg, groups.device)
        except Exception as e:  # the engine's rows are measured: report them without the peer
            out["hf"] = {"skipped": f"the peer failed: {type(e).__name__}: "
                                    f"{' '.join(str(e).split())[:300]}"}
    return out


def _row_key(kind: str, r: dict) -> tuple:
    # D rows (greedy and sampled) by batch and context, P rows by shape
    return (kind, r["shape"]) if kind == "prefill" else (kind, r["batch"], r["context"])


def _versus_rows(overrides: dict, base: dict, got: dict) -> dict:
    """A variant's rows beside the base's: its step and the ratio variant / base (> 1: the
    variant is slower), row by row."""
    rows = []
    for kind in ("decode", "decode_sampled", "prefill"):
        mine = {_row_key(kind, r): r for r in base.get(kind, [])}
        for r in got.get(kind, []):
            b = mine.get(_row_key(kind, r))
            if b is None:
                continue
            rows.append({"kind": kind, "row": list(_row_key(kind, r)[1:]),
                         "base_step_s": b["step_s"], "step_s": r["step_s"],
                         "ratio": r["step_s"] / b["step_s"]})
    return {"set": overrides, "rows": rows, "setup_s": got.get("setup_s"),
            "layer_spec": got.get("layer_spec"), "fp8": got.get("fp8")}


@contextlib.contextmanager
def _eager(runner):
    """The runner without its D and P graphs for a while (their kernels cannot be traced to
    the ops that launched them, and routers in a replay call no hooks)."""
    graphs, p_graphs = runner.graphs, runner.prefill_graphs
    runner.graphs = runner.prefill_graphs = None
    try:
        yield
    finally:
        runner.graphs, runner.prefill_graphs = graphs, p_graphs


class _Bench:
    def __init__(self, cfg: Config, groups) -> None:
        from colo_rollout.engine.engine import Engine
        from colo_rollout.model.weights import random_state_dict

        self.cfg, self.b, self.m = cfg, cfg.bench_speed, cfg.model
        self.device = groups.device
        self.gpu = self.device.type == "cuda"
        t0 = time.perf_counter()
        # drawn where the model runs (a multi-GB MoE takes minutes on one CPU thread), then
        # moved to the host a tensor at a time: held on the GPU beside the engine's weights
        # and KV cache it doubled the weights' share there (the Qwen3 shape ran out of an
        # H100's 80 GB); the engine loads through host memory anyway (worker.build_model)
        drawn = random_state_dict(cfg.model, device=self.device)
        sd = {name: drawn.pop(name).cpu() for name in list(drawn)} if self.gpu else drawn
        del drawn
        ecfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, mode="normal"))
        self.engine = Engine(ecfg, groups, sd)
        del sd
        self.runner = self.engine.runner
        self.model = self.engine.model
        self.wait_s = cfg.parallel.timeout_s
        self.rng = random.Random(self.b.seed)
        self._burst_ids = itertools.count()
        self.setup_s = time.perf_counter() - t0

    def close(self) -> None:
        self.engine.close()
        self.engine = self.runner = self.model = None
        gc.collect()
        if self.gpu:
            torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)

    def step(self, plan: StepPlan) -> None:
        """One step up to its sampled tokens on the host (what an engine step waits for)."""
        run = self.runner.run if plan.phase is Phase.PREFILL else self.runner.run_decode
        run(plan).resolve(self.wait_s, "bench-speed step")

    def timed(self, plan: StepPlan, iters: int) -> list[float]:
        for _ in range(self.b.warmup):
            self.step(plan)
        self.sync()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            self.step(plan)  # returns once its sampled tokens are on the host
            times.append(time.perf_counter() - t0)
            # untimed: a step's token copy is its last GPU work (this engine records no
            # routing), so this waits for nothing but costs ~55 us of host on the H200
            # machine (a device-wide synchronize) -- time an engine step never spends
            self.sync()
        return times

    def experts_touched(self, plan: StepPlan) -> list[int]:
        """Distinct experts each MoE layer routes to in one eager run of ``plan``: read from
        ``GatherMoE.route``'s expert ids (the grouped path) or the router's routing map (the
        megatron path; the router's own calls from inside ``route`` are not counted twice)."""
        counts: list[torch.Tensor] = []
        inside_route = [False]

        def hook(_mod, _args, out):
            if not inside_route[0]:
                counts.append(out[1].reshape(-1, out[1].shape[-1]).any(0).sum())

        def counting(moe):
            inner = moe.route

            def route(x, invariant=False):
                inside_route[0] = True
                try:
                    weight, chosen = inner(x, invariant)
                finally:
                    inside_route[0] = False
                seen = torch.zeros(moe.num_experts, dtype=torch.bool, device=chosen.device)
                counts.append(seen.index_fill_(0, chosen.flatten(), True).sum())
                return weight, chosen

            return route

        hooks = [moe.router.register_forward_hook(hook) for moe in self.model.moe_layers()]
        for moe in self.model.moe_layers():
            moe.route = counting(moe)  # an instance attribute over the method, removed below
        try:
            with _eager(self.runner):
                self.step(plan)
        finally:
            for h in hooks:
                h.remove()
            for moe in self.model.moe_layers():
                del moe.route
        return [int(c) for c in counts]

    # ------------------------------------------------------------------ shapes
    def decode_row(self, rows: int, context: int) -> dict:
        m, e = self.m, self.cfg.engine
        bucket = pick_bucket(rows, tuple(e.decode_buckets), 1)
        tokens = [self.rng.randrange(m.vocab_size) for _ in range(rows)]
        plan = decode_plan([context] * rows, tokens, bucket, e.kv_block_size)
        touched = self.experts_touched(plan)
        times = self.timed(plan, self.b.iters)
        step = statistics.median(times)
        roof = decode_roofline(m, [context] * rows, touched, self.b.hbm_bytes_per_s)
        return {"batch": rows, "context": context, "bucket": bucket, "step_s": step,
                "times_s": times, "tok_s": rows / step, "experts_touched": touched,
                "experts_expected": expected_experts(m.num_experts, m.moe_router_topk, bucket),
                **roof, "ratio": roof["roofline_s"] / step}

    def sampled_row(self, rows: int, greedy: dict) -> dict:
        """The short-context D step of ``rows`` rows all sampled at temperature 1 -- and with
        top-k 50 / top-p 0.95 (``truncated_*``) -- (the draw graphs where there are graphs),
        against ``greedy``, the same shape's greedy row."""
        e = self.cfg.engine
        steps = {}
        for name, params in (("", SAMPLED), ("truncated_", TRUNCATED)):
            tokens = [self.rng.randrange(self.m.vocab_size) for _ in range(rows)]
            plan = decode_plan([greedy["context"]] * rows, tokens, greedy["bucket"],
                               e.kv_block_size, params)
            steps[name] = statistics.median(self.timed(plan, self.b.iters))
        g = greedy["step_s"]
        return {"batch": rows, "context": greedy["context"], "temperature": SAMPLED.temperature,
                "step_s": steps[""], "greedy_step_s": g, "overhead": steps[""] / g - 1.0,
                "top_k": TRUNCATED.top_k, "top_p": TRUNCATED.top_p,
                "truncated_step_s": steps["truncated_"],
                "truncated_overhead": steps["truncated_"] / g - 1.0,
                "in_graph": self.runner.graphs is not None}

    def prefill_row(self, kind: str, shape: str, seqs: list[tuple[int, int]]) -> dict:
        e = self.cfg.engine
        plan = prefill_plan(seqs, self.rng, self.m.vocab_size, e.kv_block_size)
        with ClockWatch(self.device) as watch:  # the clock the steps ran at (power cap)
            times = self.timed(plan, self.b.prefill_iters)
        step = statistics.median(times)
        fl = prefill_flops(self.m, seqs)
        tokens = sum(n for _, n in seqs)
        # the step's time at the hardware limit: FP8 GEMMs (model.fp8) at twice the 16-bit peak
        peak = self.b.peak_flops
        limit_s = fl["fp8_flops"] / (2 * peak) + (fl["flops"] - fl["fp8_flops"]) / peak
        row = {"kind": kind, "shape": shape, "seqs": len(seqs), "tokens": tokens,
               "cached_tokens": sum(c for c, _ in seqs), "step_s": step, "times_s": times,
               "tok_s": tokens / step, **fl, "flops_per_s": fl["flops"] / step,
               "frac_peak": limit_s / step, "clock": watch.summary()}
        if watch.reason and self.gpu:
            row["clock_note"] = watch.reason
        burst, row["burst_clock"] = self.burst(seqs)
        if isinstance(burst, str):
            row["burst_note"] = burst
        elif burst is not None:
            row.update(burst_step_s=burst, burst_steps=self.b.prefill_burst,
                       burst_frac_peak=limit_s / burst)
            if self.engine.overlap_prefill:  # the same burst with every step read in its own
                self.engine.overlap_prefill = False
                try:
                    row["burst_sequential_s"] = self.burst(seqs)[0]
                finally:
                    self.engine.overlap_prefill = True
        return row

    def burst(self, seqs: list[tuple[int, int]]) -> tuple[float | str | None, dict | None]:
        """``prefill_burst`` P steps of ``seqs``'s shape in a row through ``Engine.step``
        (module docstring): (seconds per step -- or why the engine's config cannot take them
        (a note), or None (no burst asked, or a row on cached contexts); the GPU's clock
        during the timed burst, ``ClockWatch.summary``)."""
        n_steps, e = self.b.prefill_burst, self.cfg.engine
        if n_steps < 2 or any(c for c, _ in seqs):
            return None, None
        tokens = sum(n for _, n in seqs)
        eng = self.engine
        kv = eng.scheduler.kv[0]
        # what two steps' sequences hold at once: the step read late and the next one's
        # (the ones finishing are freed at the commit before the next plan)
        need = {"engine.max_prefill_tokens": (tokens, e.max_prefill_tokens),
                "engine.max_batch_size": (2 * len(seqs), e.max_batch_size),
                "engine.max_seq_len": (max(n for _, n in seqs) + 1, e.max_seq_len),
                "engine.num_kv_blocks": (2 * sum(kv.blocks_needed(n + 1) for _, n in seqs),
                                         e.num_kv_blocks)}
        short = [f"{k} {have} < {want}" for k, (want, have) in need.items() if have < want]
        if short:
            return "no back-to-back steps: " + ", ".join(short), None
        limits = eng.scheduler.limits
        # one row's worth of prompts per step
        eng.scheduler.limits = dataclasses.replace(limits, max_prefill_tokens=tokens)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        route, timing = eng.route, eng.route.timing
        try:
            for count in (2, n_steps):  # the first burst untimed: the engine loop's first use
                if self.gpu and count == n_steps:  # CUDA events around each P step
                    route.timing = True
                    route.clear_marks()
                ids = []
                for _ in range(count):
                    for _, n in seqs:
                        ids.append(f"bench-speed burst {next(self._burst_ids)}")
                        eng.submit(Request(ids[-1], tuple(
                            self.rng.randrange(self.m.vocab_size) for _ in range(n)), params))
                # until the last token is on the host: a step returns the requests its
                # exchange committed, whose tokens the step before it read
                with ClockWatch(self.device) as watch:
                    t0 = last = time.perf_counter()
                    while eng.has_unsent() or eng.busy():
                        if eng.step():
                            end = last
                        last = time.perf_counter()
                eng.forget(ids)
            spans = [sp for sp in route.gpu_spans() if sp.kind == "P"] if self.gpu else []
        finally:
            eng.scheduler.limits = limits
            route.timing = timing
        if len(spans) == n_steps:
            # on the GPU: from the first step's end to the last's, over the steps between --
            # the steady state, the GPU's idle between steps included (what the overlap
            # removes), the burst's arrival (the first step's intake and head) not
            return (spans[-1].end - spans[0].end) / (n_steps - 1), watch.summary()
        # CPU: the burst's wall time over its steps, the first step's host head included
        return (end - t0) / n_steps, watch.summary()

    def run(self) -> dict:
        b = self.b
        decode = [self.decode_row(B, b.short_context) for B in b.decode_batches]
        short = {r["batch"]: r for r in decode}
        sampled = [self.sampled_row(B, short.get(B) or self.decode_row(B, b.short_context))
                   for B in b.sampled_batches]
        decode += [self.decode_row(B, ctx) for ctx in b.long_contexts for B in b.long_batches]
        prefill = [self.prefill_row("single", f"1 x {n}", [(0, n)]) for n in b.prefill_lengths]
        if b.prefill_batch_seqs:
            n, k = b.prefill_batch_len, b.prefill_batch_seqs
            prefill.append(self.prefill_row("batch", f"{k} x {n}", [(0, n)] * k))
        if b.prefill_mixed:
            prefill.append(self.prefill_row(
                "mixed", "fresh " + "+".join(str(n) for n in b.prefill_mixed),
                [(0, n) for n in b.prefill_mixed]))
        if b.continuation_seqs:
            (nlo, nhi), (clo, chi) = b.continuation_new, b.continuation_context
            prefill.append(self.prefill_row(
                "continuation", f"{b.continuation_seqs} x {nlo}-{nhi} on {clo}-{chi}",
                b.continuation_shape()))
        out = {"device": str(self.device), "gpu": (torch.cuda.get_device_name(self.device)
                                                   if self.gpu else None),
               "dtype": self.m.params_dtype,
               "decode_path": "CUDA graphs" if self.runner.graphs is not None else "eager",
               "prefill_path": ("eager attention, MoE-block CUDA graphs"
                                if self.runner.prefill_graphs is not None else "eager"),
               "moe_dispatch": self.m.moe_dispatch,
               # model.fp8's format, recipe and who runs the dense FP8 GEMMs (None: bf16)
               "fp8": ({"format": self.m.fp8, "recipe": self.m.fp8_recipe,
                        "backend": self.m.fp8_backend} if self.m.fp8 else None),
               # the engine's layer spec (model.use_te 'on': Transformer Engine's layers)
               "layer_spec": "te" if self.runner.model.use_te else "local",
               # the dispatch backend's per-phase state on this rank (buffer bytes, SMs)
               "dispatch_state": [d.report().row() for d in (self.runner.model.dispatch_p,
                                                             self.runner.model.dispatch_d)
                                  if hasattr(d, "report")],
               "threads": torch.get_num_threads(), "setup_s": self.setup_s,
               "hbm_bytes_per_s": b.hbm_bytes_per_s, "peak_flops": b.peak_flops,
               "decode": decode, "decode_sampled": sampled, "prefill": prefill,
               "prefill_burst": b.prefill_burst,
               "overlap_prefill": self.engine.overlap_prefill,
               "breakdown": {}}
        if b.profile:
            out["breakdown"] = self.breakdowns(decode, prefill)
        return out

    # ------------------------------------------------------------------ breakdown
    def breakdowns(self, decode: list[dict], prefill: list[dict]) -> dict:
        b, e = self.b, self.cfg.engine
        rows = b.breakdown_batch
        d_row = next(r for r in decode if r["batch"] == rows and r["context"] == b.short_context)
        tokens = [self.rng.randrange(self.m.vocab_size) for _ in range(rows)]
        d_plan = decode_plan([b.short_context] * rows, tokens, d_row["bucket"], e.kv_block_size)
        n, k = b.breakdown_prefill, b.profile_prefill_seqs
        p_plan = prefill_plan([(0, n)] * k, self.rng, self.m.vocab_size, e.kv_block_size)
        # the timed row of this shape, if there is one (its median is the step's wall time)
        p_row = next((r for r in prefill if r["kind"] in ("single", "batch")
                      and r["seqs"] == k and r["tokens"] == n * k), None)
        p_wall = (p_row["step_s"] if p_row is not None
                  else statistics.median(self.timed(p_plan, b.prefill_iters)))
        return {"decode": {"shape": f"decode B={rows}, context {b.short_context}",
                           **self.breakdown(d_plan, b.profile_steps, d_row["step_s"])},
                "prefill": {"shape": f"prefill {k} x {n}", **self.breakdown(p_plan, 1, p_wall)}}

    def breakdown(self, plan: StepPlan, steps: int, wall_s: float) -> dict:
        """Per-step time of each part (ms) over ``steps`` profiled eager steps of ``plan``;
        ``wall_s``: the measured step (GPU: the launch gaps are taken against it)."""
        from torch.profiler import ProfilerActivity, profile, record_function

        # libkineto's start/stop lines (and, on CPU, its failed GPU probe) on stderr: read
        # when the profiler first starts
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.gpu else [])
        hooks = _label_modules(self.model, self.runner)
        try:
            with _eager(self.runner):
                self.step(plan)  # the eager path's own first-use costs stay out
                self.sync()
                with profile(activities=acts) as prof:
                    for _ in range(steps):
                        with record_function(_RANGE + "step"):
                            self.step(plan)
                            self.sync()
        finally:
            for h in hooks:
                h.remove()
        parts_us, step_us = attribute(prof.events(), device_time=self.gpu)
        parts = {k: v / steps / 1e3 for k, v in parts_us.items()}
        profiled_ms = step_us / steps / 1e3
        wall_ms = 1e3 * wall_s if self.gpu else profiled_ms
        out = {"parts_ms": parts, "wall_ms": wall_ms, "profiled_step_ms": profiled_ms,
               "measured_ms": 1e3 * wall_s, "steps": steps,
               "time": "CUDA kernel time" if self.gpu else "self CPU time"}
        if self.gpu and not parts:
            out["note"] = ("no CUDA kernel was recorded (CUPTI unavailable?); set "
                           "KINETO_LOG_LEVEL=0 to see the profiler's messages")
        out["parts_ms"]["launch gaps"] = max(0.0, wall_ms - sum(parts.values()))
        if self.gpu:
            out["idle"] = idle_gaps(prof.events(), steps)
        if self.gpu and (self.runner.graphs is not None or self.runner.prefill_graphs is not None):
            for _ in range(self.b.warmup):
                self.step(plan)
            self.sync()
            with profile(activities=acts) as prof:
                for _ in range(steps):
                    with record_function(_RANGE + "step"):
                        self.step(plan)
                        self.sync()
            # the replayed step's kernels, copies and sets -- not the ranges' GPU spans,
            # which the profiler lists as CUDA events too (``_paired``; where nothing pairs,
            # the CUDA events that are no range's span)
            kernels = [ev for _, ev in _paired(prof.events())] or [
                ev for ev in prof.events()
                if ev.device_type == torch.autograd.DeviceType.CUDA and not _is_span(ev)]
            out["graph_kernel_ms"] = sum(ev.time_range.elapsed_us() for ev in kernels) / steps / 1e3
            out["graph_kernels"] = kernel_table(kernels, steps)
            # where the timed (graph-replay) step's GPU waits: its head, a layer whose host
            # falls behind
            out["graph_idle"] = idle_gaps(prof.events(), steps)
        return out


def kernel_table(kernels, steps: int, top: int = 20) -> dict:
    """The replayed step's kernels: how many per step, and the ``top`` names by time (count and
    microseconds per step) -- which kernels a fused path would remove, and what they cost."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in kernels:
        row = by_name[ev.name]
        row[0] += 1
        row[1] += ev.time_range.elapsed_us()
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {"per_step": len(kernels) / steps,
            "top": [{"name": name, "count": n / steps, "us": us / steps}
                    for name, (n, us) in rows[:top]]}


class _Wrapped:
    """``obj.name`` (a bound method) run inside a profiler range, as an instance attribute
    that shadows the class's method until ``remove``: for the parts the model computes by
    method calls rather than module calls (the embedding, shared experts, dense MLPs) and the
    runner's sampling."""

    def __init__(self, obj, name: str, label: str) -> None:
        from torch.profiler import record_function

        self.obj, self.name = obj, name
        inner = getattr(obj, name)

        def run(*args, **kwargs):
            with record_function(_RANGE + label):
                return inner(*args, **kwargs)

        setattr(obj, name, run)

    def remove(self) -> None:
        delattr(self.obj, self.name)


def _label_modules(model, runner=None) -> list:
    """Forward hooks that open a profiler range (``bs::<label>``) around the modules of each
    layer part, and wrapped methods for the rest; returns their handles."""
    from torch.profiler import record_function

    open_ranges: list = []

    def hooks(module, label):
        def pre(_mod, _args):
            r = record_function(_RANGE + label)
            r.__enter__()
            open_ranges.append(r)

        def post(_mod, _args, _out):
            open_ranges.pop().__exit__(None, None, None)

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    pairs = []
    for layer in model.decoder.layers:
        att = layer.self_attention
        pairs += [(layer.input_layernorm, "norm"), (layer.pre_mlp_layernorm, "norm"),
                  (att, "attention")]
        norms = (getattr(att, k, None) for k in ("q_layernorm", "k_layernorm", "kv_layernorm"))
        pairs += [(n, "norm") for n in norms if n is not None]  # (MLA: the latents')
        if layer.is_moe:
            pairs += [(layer.mlp, "moe"), (layer.mlp.router, "router"),
                      (layer.mlp.experts, "experts")]
    pairs.append((model.decoder.final_layernorm, "norm"))
    out = [h for mod, label in pairs for h in hooks(mod, label)]
    methods = [(model.embedding, "partial", "embedding")]
    for layer in model.decoder.layers:
        methods.append((layer.mlp, "add_shared", "shared") if layer.is_moe
                       else (layer, "dense_partial", "dense"))
    if runner is not None:
        methods.append((runner, "_sample", "sampling"))
    return out + [_Wrapped(obj, name, label) for obj, name, label in methods
                  if callable(getattr(obj, name, None))]


def _is_gemm(chain: list[str]) -> bool:
    # colo.moe_gemm: the range around the Triton fused-MoE launches (model/fused_moe.py)
    return any(name in _GEMM_OPS or name == "colo.moe_gemm" for name in chain)


def _named(chain: list[str], fragments: tuple[str, ...]) -> bool:
    return any(f in name for name in chain for f in fragments)


def _classify(label: str | None, chain: list[str]) -> str:
    """The part of an op outside the MoE block: by its innermost range, else by its name."""
    by_label = {"attention": "attention", "norm": "norms", "router": "router/top-k",
                "shared": "shared experts", "dense": "dense MLP", "embedding": "embedding",
                "sampling": "sampling"}
    if label in by_label:
        return by_label[label]
    if NORM_RANGE in chain:  # the layers' fused add + norm kernels (model/norm_add.py)
        return "norms"
    if _named(chain, ("c10d::", "nccl")):
        return "collectives"
    if _named(chain, ("embedding",)):
        return "embedding"
    if _is_gemm(chain):  # the one GEMM outside every range: the logits
        return "lm head"
    if _named(chain, _SAMPLING_OPS):
        return "sampling"
    return "other"


# host API calls that put work on a stream (the CPU events CUPTI pairs with their kernels)
_LAUNCHES = ("cudaLaunch", "cuLaunch", "cudaMemcpy", "cudaMemset", "cudaGraphLaunch")


def _paired(events) -> list[tuple[object, object]]:
    """[(the host call that launched it, the GPU event)] for each CUDA kernel, copy or set of a
    profile -- paired by CUPTI's correlation id, which the launching call and the kernel share."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    calls = {ev.id: ev for ev in events
             if ev.device_type == cpu and ev.name.startswith(_LAUNCHES)}
    # the profiler also lists each range's span on the GPU as a CUDA event (a user
    # annotation, ids of its own): a span, not work -- never a kernel here
    return [(calls[ev.id], ev) for ev in events
            if ev.device_type == cuda and ev.id in calls and not _is_span(ev)]


def _is_span(ev) -> bool:
    """Whether a profiler event is a range's span (bench-speed's ``bs::`` ranges, the
    engine's ``colo.`` ones), not a kernel, copy or set."""
    return getattr(ev, "is_user_annotation", False) or ev.name.startswith((_RANGE, "colo."))


def launched_kernels(events) -> list[tuple[object, float]]:
    """[(the host call that launched it, microseconds)] for each CUDA kernel, copy or set of a
    profile (``_paired``). Empty when the profile pairs none (then ``attribute`` reads the
    ops' own kernel lists)."""
    return [(call, ev.time_range.elapsed_us()) for call, ev in _paired(events)]


def _step_of(call) -> object | None:
    """The ``bs::step`` range a host call ran in (None: outside every profiled step)."""
    node = call
    while node is not None and node.name != _RANGE + "step":
        node = node.cpu_parent
    return node


def idle_gaps(events, steps: int, top: int = 5, floor_us: float = 20.0) -> dict:
    """Where the GPU idled inside the profiled steps: the gaps between a step's consecutive
    kernels (copies and sets included; the time between steps -- their synchronisations --
    is not counted). Per step: the idle in all (ms) and in gaps under ``floor_us`` (the
    launch-to-launch floor of kernels queued back to back); the ``top`` largest gaps over
    the steps, each with the kernels around it, its offset from its step's first kernel and
    how late the host launched the kernel after it (``host_late_us``: its launch call's start
    less the GPU's going idle -- positive, the GPU waited for the host's Python; negative,
    the kernel was queued already and waited for something else). Empty without pairs."""
    by_step: dict[int, list] = defaultdict(list)
    for call, ev in _paired(events):
        step = _step_of(call)
        if step is not None:
            by_step[id(step)].append((ev.time_range.start,
                                      ev.time_range.start + ev.time_range.elapsed_us(), ev, call))
    if not by_step:
        return {}
    gaps, n_small, small_us = [], 0, 0.0
    for kernels in by_step.values():
        kernels.sort(key=lambda k: k[0])
        first, end, prev = kernels[0][0], kernels[0][1], kernels[0][2]
        for start, stop, ev, call in kernels[1:]:
            if start > end:
                gap = start - end
                if gap < floor_us:
                    n_small, small_us = n_small + 1, small_us + gap
                gaps.append({"us": gap, "at_ms": (start - first) / 1e3, "after": prev.name,
                             "before": ev.name,
                             "host_late_us": call.time_range.start - end})
            if stop > end:
                end, prev = stop, ev
    gaps.sort(key=lambda g: -g["us"])
    return {"idle_ms": sum(g["us"] for g in gaps) / steps / 1e3,
            "small_gaps": n_small / steps, "small_ms": small_us / steps / 1e3,
            "floor_us": floor_us, "largest": gaps[:top]}


def attribute(events, device_time: bool) -> tuple[dict[str, float], float]:
    """({part: microseconds}, microseconds of the ``bs::step`` ranges) of a profile.

    Each op inside a step range counts its CUDA kernels (``device_time``) or its self CPU time
    once, for the part of its innermost ``bs::`` range; ops of a MoE block (its own range or its
    experts') are split by position around the block's GEMMs. With ``device_time`` each kernel
    counts where the host call that launched it sits (``launched_kernels``): under an aten op,
    or directly under a range (Triton's launches, which no aten op makes). Profiles that pair no
    kernel with its call fall back to the kernels torch attached to each op and range -- which
    on torch 2.11 left every Triton kernel out (issue 16's breakdown, 2026-12-06: a Qwen3 8 x 1k
    step's fused-MoE, norm, rope and router kernels, 33 ms, counted as launch gaps)."""
    parts: dict[str, float] = defaultdict(float)
    moe: dict[int, list] = defaultdict(list)
    step_us = 0.0
    items = []  # (the event a kernel's or op's time is credited at, its time)
    for ev in events:
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        if ev.name == _RANGE + "step":
            step_us += ev.time_range.elapsed_us()
    launched = launched_kernels(events) if device_time else []
    if launched:
        items = launched
    else:
        for ev in events:
            if ev.device_type != torch.autograd.DeviceType.CPU:
                continue
            # a range's own CPU time is the Python between its ops (the gaps), but kernels
            # launched outside any aten op -- Triton's -- may be attached to the innermost range
            if ev.name.startswith(_RANGE) and not device_time:
                continue
            items.append((ev, sum(k.duration for k in ev.kernels) if device_time
                          else ev.self_cpu_time_total))
    for ev, t in items:
        if t <= 0:
            continue
        chain, label, block, node = [], None, None, ev
        while node is not None:
            name = node.name
            if name == _RANGE + "step":
                break
            if name.startswith(_RANGE):
                label = label or name[len(_RANGE):]
                if name == _RANGE + "moe":
                    block = node
            elif label is None:
                chain.append(name)
            node = node.cpu_parent
        if node is None:  # outside the profiled steps
            continue
        if label in ("moe", "experts") and block is not None:
            moe[id(block)].append((ev.time_range.start, chain, t))
        else:
            parts[_classify(label, chain)] += t
    for ops in moe.values():
        ops.sort(key=lambda o: o[0])
        gemms = [i for i, (_, chain, _) in enumerate(ops) if _is_gemm(chain)]
        for i, (_, chain, t) in enumerate(ops):
            if i in gemms:
                part = "expert GEMMs"
            elif not gemms or i < gemms[0]:
                part = "permutation"
            elif i > gemms[-1]:
                part = "combine"
            elif _named(chain, _ACTIVATION_OPS):
                part = "activation"
            else:
                part = "permutation"
            parts[part] += t
    return dict(parts), step_us


# --------------------------------------------------------------------------- the peer
def _crop(cache, length: int) -> None:
    """Cut a transformers cache back to ``length`` tokens (a negative crop removes that many
    tokens in transformers 4.x and 5.x alike)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def hf_peer(cfg: Config, device: torch.device) -> dict:
    """The decode and prefill shapes through Hugging Face transformers (random weights of the
    same model section); {"skipped": why} when it cannot be built."""
    try:
        import transformers
    except ImportError:
        return {"skipped": "transformers is not installed"}
    from colo_rollout.checkpoint.export import hf_config_dict

    b, m = cfg.bench_speed, cfg.model
    try:
        conf = dict(hf_config_dict(m, dtype=m.params_dtype))
    except ValueError as e:
        return {"skipped": f"no Hugging Face family holds this model section: {e}"}
    arch = conf.pop("architectures")
    hf_conf = transformers.AutoConfig.for_model(conf.pop("model_type"), **conf)
    hf_conf.architectures = arch
    dtype = DTYPES[m.params_dtype]
    gpu = device.type == "cuda"
    torch.manual_seed(m.seed)
    t0 = time.perf_counter()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_conf, dtype=dtype).eval()
    setup_s = time.perf_counter() - t0
    # transformers 5 renames past_key_values to cache
    cache_kw = ("cache" if "cache" in inspect.signature(model.forward).parameters
                else "past_key_values")
    g = torch.Generator().manual_seed(b.seed)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(device)

    def timed(fn, iters: int, after=None) -> list[float]:
        times = []
        for i in range(b.warmup + iters):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= b.warmup:
                times.append(time.perf_counter() - t0)
            if after is not None:
                after()
        return times

    decode, prefill = [], []
    try:
        with torch.inference_mode():
            L = b.short_context
            for B in b.decode_batches:
                ids = torch.randint(0, m.vocab_size, (B, L - 1), generator=g).to(device)
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                cache = out.cache if getattr(out, "cache", None) is not None \
                    else out.past_key_values
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                del out

                def step(tok=tok, cache=cache):
                    o = model(input_ids=tok, use_cache=True, logits_to_keep=1,
                              **{cache_kw: cache})
                    o.logits[:, -1].argmax(-1).cpu()

                times = timed(step, b.iters, after=lambda cache=cache: _crop(cache, L - 1))
                s = statistics.median(times)
                decode.append({"batch": B, "context": L, "step_s": s, "times_s": times,
                               "tok_s": B / s})
                del cache, tok, ids
            for n in b.hf_prefill_lengths:
                ids = torch.randint(0, m.vocab_size, (1, n), generator=g).to(device)

                def run(ids=ids):
                    o = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                    o.logits[:, -1].argmax(-1).cpu()

                times = timed(run, b.prefill_iters)
                s = statistics.median(times)
                prefill.append({"tokens": n, "step_s": s, "times_s": times, "tok_s": n / s})
    finally:
        model = None  # the peer's weights go before the report
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    return {"model": arch[0], "transformers": transformers.__version__,
            "attention": hf_conf._attn_implementation,
            "experts": getattr(hf_conf, "_experts_implementation", None), "setup_s": setup_s,
            "decode": decode, "prefill": prefill}


# --------------------------------------------------------------------------- the report
def report(res: dict, cfg: Config, source: str = "<config>") -> None:
    """The table on stdout, ``bench_speed.json`` and ``bench_speed_breakdown.png`` in
    bench_speed.out_dir."""
    b = cfg.bench_speed
    print(table(res, cfg, source))
    path = os.path.join(b.out_dir, "bench_speed.json")
    write_output(path, strict_json({"config": source, **res}, indent=1), "the report")
    plot = os.path.join(b.out_dir, "bench_speed_breakdown.png")
    if res.get("breakdown"):
        with output_errors(plot, "the breakdown plot"):
            plot_breakdown(res["breakdown"], plot)
        print(f"JSON: {path}; breakdown plot: {plot}")
    else:
        print(f"JSON: {path}")


def _hf_index(res: dict) -> tuple[dict, dict]:
    hf = res.get("hf") or {}
    return ({r["batch"]: r for r in hf.get("decode", [])},
            {r["tokens"]: r for r in hf.get("prefill", [])})


def table(res: dict, cfg: Config, source: str) -> str:
    m = cfg.model
    hbm, peak = res["hbm_bytes_per_s"], res["peak_flops"]
    where = res["gpu"] or f"CPU ({res['threads']} thread{'s' if res['threads'] > 1 else ''})"
    hf_d, hf_p = _hf_index(res)
    hf = res.get("hf") or {}
    lines = [f"bench-speed {source}: 1 rank on {where}, {m.params_dtype}"
             + (f" with FP8 GEMMs ({m.fp8}, {m.fp8_recipe}"
                + (", dense GEMMs through Transformer Engine" if m.fp8_backend == "te" else "")
                + ")" if m.fp8 else "")
             + (", Transformer Engine's layers" if res.get("layer_spec") == "te" else "")
             + f", {m.num_layers} layers, "
             f"hidden {m.hidden_size}, {m.num_experts} experts top-{m.moe_router_topk}; "
             f"decode path {res['decode_path']}, prefill path {res['prefill_path']}",
             f"ratios against bench_speed.hbm_bytes_per_s {hbm / 1e12:.2f} TB/s and "
             f"peak_flops {peak / 1e12:.0f} TFLOP/s"
             + (" -- GPU numbers: on this CPU the ratios are tiny by construction"
                if res["gpu"] is None else "")]
    if res.get("dispatch_state"):
        lines.append(f"MoE dispatch {res['moe_dispatch']}: " + "; ".join(
            f"{d['phase']} {d['mode']} (NVLink buffer {d['nvl_MiB']} MiB, RDMA buffer "
            f"{d['rdma_MiB']} MiB, {d['sms'] or 'unfixed'} SMs)" for d in res["dispatch_state"]))
    if hf.get("skipped"):
        lines.append(f"Hugging Face peer skipped: {hf['skipped']}")
    elif hf:
        lines.append(f"Hugging Face peer: {hf['model']} (transformers {hf['transformers']}, "
                     f"{hf['attention']} attention, {hf['experts']} experts, its own KV cache)")
    lines += ["", "decode: median host time of one step, all rows running; roofline = "
              "(weights the step reads + KV read) / HBM bandwidth; ratio = roofline / step;",
              "experts/layer = distinct experts the step's rows touch, measured (expected "
              "for uniform routing); HF/ours = the peer's step time / ours (> 1: ours faster)",
              f"{'B':>5} {'context':>7} {'step ms':>9} {'tok/s':>10} {'experts/layer':>14} "
              f"{'weights MB':>10} {'KV MB':>8} {'roofline ms':>11} {'ratio':>8} "
              f"{'HF ms':>9} {'HF tok/s':>10} {'HF/ours':>7}"]
    for r in res["decode"]:
        touched = statistics.fmean(r["experts_touched"]) if r["experts_touched"] else 0.0
        peer = hf_d.get(r["batch"]) if r["context"] == cfg.bench_speed.short_context else None
        lines.append(
            f"{r['batch']:>5} {r['context']:>7} {1e3 * r['step_s']:>9.3f} {r['tok_s']:>10.1f} "
            f"{touched:>6.1f} ({r['experts_expected']:>5.1f}) {r['weight_bytes'] / 1e6:>10.2f} "
            f"{r['kv_bytes'] / 1e6:>8.2f} {_num(1e3 * r['roofline_s']):>11} {_num(r['ratio']):>8} "
            + _peer_cols(peer, r["step_s"]))
    if res.get("decode_sampled"):
        r0 = res["decode_sampled"][0]
        lines += ["", "sampled decode: every row drawn at temperature 1, then also with top-k "
                  f"{r0['top_k']} / top-p {r0['top_p']} ("
                  + ("inside the D graphs' draw graphs" if r0["in_graph"] else "eagerly")
                  + "), short context, against the greedy step",
                  f"{'B':>5} {'greedy ms':>10} {'sampled ms':>11} {'overhead':>9} "
                  f"{'top-k/p ms':>11} {'overhead':>9}"]
        lines += [f"{r['batch']:>5} {1e3 * r['greedy_step_s']:>10.3f} "
                  f"{1e3 * r['step_s']:>11.3f} {100 * r['overhead']:>8.1f}% "
                  f"{1e3 * r['truncated_step_s']:>11.3f} {100 * r['truncated_overhead']:>8.1f}%"
                  for r in res["decode_sampled"]]
    lines += ["", "prefill: median host time of one step; FLOPs = 2 x active params x tokens "
              "+ attention (output layer on last tokens); frac = FLOP/s / peak"
              + (" (model.fp8: time at the limit / step, FP8 GEMMs at 2 x peak)"
                 if m.fp8 else ""),
              f"{'shape':<30} {'tokens':>7} {'step ms':>9} {'tok/s':>10} {'TFLOP':>9} "
              f"{'TFLOP/s':>9} {'frac':>8} {'b2b ms':>8} {'b2b frac':>8} "
              f"{'HF ms':>9} {'HF tok/s':>10} {'HF/ours':>7}"]
    for r in res["prefill"]:
        peer = hf_p.get(r["tokens"]) if r["kind"] == "single" else None
        b2b = (f"{1e3 * r['burst_step_s']:>8.2f} {_num(r['burst_frac_peak']):>8} "
               if "burst_step_s" in r else f"{'-':>8} {'-':>8} ")
        lines.append(
            f"{r['shape']:<30} {r['tokens']:>7} {1e3 * r['step_s']:>9.2f} {r['tok_s']:>10.1f} "
            f"{_num(r['flops'] / 1e12):>9} {_num(r['flops_per_s'] / 1e12):>9} "
            f"{_num(r['frac_peak']):>8} {b2b}"
            + _peer_cols(peer, r["step_s"]))
    notes = sorted({r["burst_note"] for r in res["prefill"] if "burst_note" in r})
    lines += [f"  ({n})" for n in notes]
    if any("burst_step_s" in r for r in res["prefill"]):
        lines.append(f"  b2b: per step of {res['prefill_burst']} such P steps back to back "
                     f"through Engine.step (engine.overlap_prefill "
                     f"{'on' if res['overlap_prefill'] else 'off'}; "
                     + ("the steady state: first step's end to the last's, CUDA events)"
                        if res["gpu"] else "wall time over the steps)"))
    seq = [r for r in res["prefill"] if "burst_sequential_s" in r]
    if seq:
        lines.append("  the same with each step's tokens read in its own step (overlap off): "
                     + ", ".join(f"{r['shape']} {1e3 * r['burst_sequential_s']:.2f} ms "
                                 f"({r['burst_sequential_s'] / r['burst_step_s']:.3f}x)"
                                 for r in seq))
    lines += _clock_lines(res["prefill"])
    bd = res.get("breakdown") or {}
    if bd:
        kinds = [k for k in ("decode", "prefill") if k in bd]
        lines += ["", f"breakdown per step ({bd[kinds[0]]['time']} of eager steps by layer part; "
                  "launch gaps = step wall time - the parts)",
                  f"{'part':<16}" + "".join(f" {bd[k]['shape']:>28}" for k in kinds)]
        for part in PARTS:
            vals = [bd[k]["parts_ms"].get(part, 0.0) for k in kinds]
            if not any(vals):
                continue
            lines.append(f"{part:<16}" + "".join(
                f" {v:>18.3f} ms {100 * v / max(bd[k]['wall_ms'], 1e-12):>5.1f}%"
                for v, k in zip(vals, kinds)))
        lines.append(f"{'step wall':<16}" + "".join(f" {bd[k]['wall_ms']:>18.3f} ms {'':>6}"
                                                   for k in kinds))
        lines.append(f"{'(measured step)':<16}" + "".join(
            f" {bd[k]['measured_ms']:>18.3f} ms {'':>6}" for k in kinds))
        if res["gpu"] is None:
            lines.append("(CPU: the step wall is the profiled steps' own; the profiler's per-op "
                         "cost is in it)")
        for k in kinds:
            if bd[k].get("note"):
                lines.append(f"{k}: {bd[k]['note']}")
        for k in kinds:
            lines += _idle_lines(bd[k])
            lines += _idle_lines(bd[k], "graph_idle", "a replayed step")
        for k in kinds:
            gk = bd[k].get("graph_kernels")
            if not gk:
                continue
            lines += ["", f"{bd[k]['shape']}, replayed: {gk['per_step']:.0f} kernels per step, "
                      f"{bd[k]['graph_kernel_ms']:.3f} ms of kernel time; the longest by name "
                      "(per step)", f"{'count':>7} {'us':>9}  kernel"]
            lines += [f"{r['count']:>7.0f} {r['us']:>9.1f}  {r['name'][:100]}" for r in gk["top"]]
    lines += _versus_lines(res.get("versus") or [])
    return "\n".join(lines)


def _clock_lines(prefill: list[dict]) -> list[str]:
    """The SM clock and board power each prefill row ran at (``ClockWatch``), or why none was
    read: under sustained P the chip clocks down at its power cap."""
    def fmt(c: dict) -> str:
        return (f"{c['sm_mhz_median']:.0f} MHz (min {c['sm_mhz_min']:.0f}), "
                f"{c['power_w_median']:.0f} W (max {c['power_w_max']:.0f})")
    got = [f"{r['shape']} " + "; ".join(
        f"{what} {fmt(c)}" for what, c in (("single", r.get("clock")),
                                           ("b2b", r.get("burst_clock"))) if c)
        for r in prefill if r.get("clock") or r.get("burst_clock")]
    if got:
        return ["  SM clock and board power while the rows ran (median): " + " | ".join(got)]
    notes = sorted({r["clock_note"] for r in prefill if r.get("clock_note")})
    return [f"  (no SM clock read: {n})" for n in notes]


def _idle_lines(bd: dict, key: str = "idle", what: str = "an eager step") -> list[str]:
    """A breakdown's GPU idle inside its eager steps (``idle_gaps``; ``key`` "graph_idle":
    its graph-replay steps'): the total, the share under the floor, and the largest gaps
    with the kernels around them."""
    idle = bd.get(key)
    if not idle:
        return []
    out = [f"{bd['shape']}: GPU idle inside {what} {idle['idle_ms']:.3f} ms "
           f"({idle['small_gaps']:.0f} gaps under {idle['floor_us']:.0f} us: "
           f"{idle['small_ms']:.3f} ms); the largest:"]
    for g in idle["largest"]:
        late = g["host_late_us"]
        why = (f"launched {late:.0f} us after the GPU went idle" if late > 0
               else "queued before it")
        out.append(f"  {g['us']:8.1f} us at {g['at_ms']:8.3f} ms, {g['after'][:40]} -> "
                   f"{g['before'][:40]} ({why})")
    return out


def _versus_lines(versus: list[dict]) -> list[str]:
    """The --versus variants' rows: base step, variant step, ratio (> 1: the variant slower)."""
    if not versus:
        return []
    out = ["", "versus (same process, measured after the base; ratio = variant / base step, "
               "> 1: the variant is slower)"]
    for v in versus:
        label = " ".join(f"{k}={json.dumps(x)}" for k, x in v["set"].items())
        out += [f"  {label}", f"    {'row':<34} {'base ms':>9} {'ms':>9} {'ratio':>7}"]
        for r in v["rows"]:
            what = (f"decode B={r['row'][0]} ctx {r['row'][1]}" if r["kind"] == "decode"
                    else f"sampled B={r['row'][0]} ctx {r['row'][1]}"
                    if r["kind"] == "decode_sampled" else f"prefill {r['row'][0]}")
            out.append(f"    {what:<34} {r['base_step_s'] * 1e3:>9.3f} {r['step_s'] * 1e3:>9.3f}"
                       f" {r['ratio']:>7.3f}")
    return out


def _num(v: float) -> str:
    """Four decimals, or three significant digits when that would print zeros."""
    return f"{v:.4f}" if v == 0 or abs(v) >= 1e-3 else f"{v:.2e}"


def _peer_cols(peer: dict | None, ours_s: float) -> str:
    if peer is None:
        return f"{'-':>9} {'-':>10} {'-':>7}"
    return (f"{1e3 * peer['step_s']:>9.3f} {peer['tok_s']:>10.1f} "
            f"{peer['step_s'] / ours_s:>7.2f}")


def plot_breakdown(breakdown: dict, path: str) -> None:
    """Bars of each part's time per step (ms), one panel per profiled shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in ("decode", "prefill") if k in breakdown]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5), squeeze=False)
    for ax, k in zip(axes[0], kinds):
        bd = breakdown[k]
        parts = [p for p in PARTS if bd["parts_ms"].get(p, 0.0) > 0]
        vals = [bd["parts_ms"][p] for p in parts]
        ax.barh(parts[::-1], vals[::-1], color="tab:blue")
        ax.set_xlabel(f"ms per step ({bd['time']}; gaps vs step wall)")
        ax.set_title(f"{bd['shape']}: {bd['wall_ms']:.3f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
