"""GPU check of P attention (colo_rollout/model/paged_prefill.py): the Triton varlen paged
flash-attention kernel against the bucketed SDPA path (``PagedSelfAttention._prefill``'s torch
backend, restated here) on realistic shapes, on one CUDA device.

Owns nothing of the engine; it loads only paged_prefill.py and torch (no megatron), so it runs
on a bare CUDA host with torch and triton:

  PYTHONPATH=$PWD python3 scripts/gpu_prefill_attention.py [--no-sweep] [--json PATH]

Shapes (32 q heads, 4 KV groups, head dim 128, block size 16 as configs/bench_gpu_large.yaml,
bf16, shuffled block tables): one fresh sequence of 1k, 4k, 8k tokens; 8 fresh sequences of
1k; 16 continuation prefills of 512 new tokens on 4k and on 8k contexts. For each: the max
abs and relative error of the kernel and of the SDPA path against the SDPA path on fp32
inputs, the time of each (CUDA graphs of R calls, median of the replays), the kernel's
TFLOP/s and fraction of the 989 TFLOP/s bf16 dense peak, and for the fresh single sequences
SDPA's flash kernel (is_causal, K/V contiguous and already repeated: a ceiling, not a path the
engine has). FLOPs counted: 4 * heads * head_dim * sum over sequences of the causal (query,
key) pairs, new * ctx - new * (new - 1) / 2 (QK^T and PV, 2 FLOPs per multiply-add).

The sweep (on by default) first times tile configs -- rows per tile, keys per step, warps,
stages, one head or the whole KV group per program -- on three of the shapes and uses the best
for the table (the engine's defaults are printed beside it). Then fp32/fp16/bf16 and head dims
64/128 on a ragged mix (new = 1, continuations, exact and ragged block multiples).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.nn.attention  # noqa: F401  (sdpa_kernel, for the flash ceiling)
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_timing  # noqa: E402
from colo_rollout.model import paged_prefill as pp  # noqa: E402

HEADS, GROUPS, DIM, BS = 32, 4, 128, 16
N_Q = HEADS // GROUPS
PEAK = 989e12
CASES = (  # name, new tokens, contexts
    ("1 x 1k", [1024], [1024]),
    ("1 x 4k", [4096], [4096]),
    ("1 x 8k", [8192], [8192]),
    ("8 x 1k", [1024] * 8, [1024] * 8),
    ("16 x 512 on 4k", [512] * 16, [4096] * 16),
    ("16 x 512 on 8k", [512] * 16, [8192] * 16),
)
SWEEP_CASES = ("1 x 4k", "8 x 1k", "16 x 512 on 4k")


def flops(new: list[int], ctx: list[int], heads: int = HEADS, dim: int = DIM) -> float:
    return 4.0 * heads * dim * sum(n * c - n * (n - 1) / 2 for n, c in zip(new, ctx))


class Cache:
    """One layer's paged cache, big enough for the largest case, random."""

    def __init__(self, blocks: int, dev, dtype=torch.bfloat16, groups=GROUPS, dim=DIM,
                 gen=None) -> None:
        shape = (blocks + 1, BS, groups, dim)
        self.k = torch.randn(shape, generator=gen, device=dev).to(dtype)
        self.v = torch.randn(shape, generator=gen, device=dev).to(dtype)
        self.blocks, self.sink, self.dev = blocks, blocks, dev
        self.k[self.sink] = 50.0  # the sink: never attended
        self.v[self.sink] = 1e4

    def tables(self, ctx: list[int], gen) -> torch.Tensor:
        """[S, width] distinct shuffled blocks, sink padding past each sequence's blocks."""
        need = [-(-c // BS) for c in ctx]
        width = max(need) + 1
        perm = torch.randperm(self.blocks, generator=gen, device=self.dev)[: sum(need)].tolist()
        rows = []
        for nb in need:
            rows.append(perm[:nb] + [self.sink] * (width - nb))
            perm = perm[nb:]
        return torch.tensor(rows, dtype=torch.int64, device=self.dev)


class SdpaPath:
    """``PagedSelfAttention._prefill``'s torch backend for one context bucket (every case here
    is one bucket of attention.prefill_buckets): queries padded to the longest sequence, K/V
    gathered from the table and repeated to every q head, an explicit causal mask (made once
    per P epoch, as the bucket caches it), SDPA, the real rows copied back."""

    def __init__(self, new: list[int], ctx: list[int], tables: torch.Tensor, dev) -> None:
        starts = [sum(new[:i]) for i in range(len(new))]
        self.n_max = n_max = max(new)
        self.blocks = max(-(-c // BS) for c in ctx)
        q_rows, slots, out_rows = [], [], []
        for s, (n, st) in enumerate(zip(new, starts)):
            q_rows += list(range(st, st + n)) + [0] * (n_max - n)
            slots += range(s * n_max, s * n_max + n)
            out_rows += range(st, st + n)
        i64 = torch.int64
        self.q_rows = torch.tensor(q_rows, dtype=i64, device=dev).view(len(new), n_max)
        self.slots = torch.tensor(slots, dtype=i64, device=dev)
        self.out_rows = torch.tensor(out_rows, dtype=i64, device=dev)
        self.tables = tables[:, : self.blocks]
        c = torch.tensor(ctx, device=dev)
        qpos = (c - torch.tensor(new, device=dev))[:, None] + torch.arange(n_max, device=dev)
        kpos = torch.arange(self.blocks * BS, device=dev)
        self.mask = (kpos[None, None, :] <= qpos[:, :, None])[:, None]

    def __call__(self, q, kc, vc, scale):
        out = q.new_empty(q.shape)
        Sb, heads, dim = self.q_rows.shape[0], q.shape[1], q.shape[2]
        n = heads // kc.shape[2]
        k = kc[self.tables].flatten(1, 2).repeat_interleave(n, dim=2)
        v = vc[self.tables].flatten(1, 2).repeat_interleave(n, dim=2)
        o = F.scaled_dot_product_attention(
            q[self.q_rows].transpose(1, 2), k.to(q.dtype).transpose(1, 2),
            v.to(q.dtype).transpose(1, 2), attn_mask=self.mask, scale=scale)
        o = o.transpose(1, 2).reshape(Sb * self.n_max, heads, dim)
        out.index_copy_(0, self.out_rows, o.index_select(0, self.slots))
        return out


def graph_time(fn, est_s: float, reps: int = 10, target_s: float = 5e-3) -> float:
    """Median seconds of one call: R calls of fn (about ``target_s`` of work, from the eager
    estimate ``est_s``) captured in one CUDA graph, replayed (scripts/gpu_timing.py)."""
    R = max(1, min(50, int(target_s / max(est_s, 1e-6))))
    return gpu_timing.graph_time([fn] * R, reps=reps, warm=1)


def eager_time(fn) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = got.float() - ref
    return d.abs().max().item(), (d.norm() / ref.norm()).item()


class Case:
    def __init__(self, name, new, ctx, cache: Cache, gen) -> None:
        self.name, self.new, self.ctx = name, new, ctx
        self.tables = cache.tables(ctx, gen)
        self.q = torch.randn(sum(new), HEADS, DIM, device=cache.dev, generator=gen).to(
            torch.bfloat16)
        self.sdpa = SdpaPath(new, ctx, self.tables, cache.dev)
        self.cache = cache
        self._ref = None

    def ref(self) -> torch.Tensor:
        """The SDPA path on fp32 inputs (the gathered blocks only upcast)."""
        if self._ref is None:
            c = self.cache
            self._ref = self.sdpa(self.q.float(), c.k.float(), c.v.float(), DIM ** -0.5)
            torch.cuda.empty_cache()
        return self._ref

    def kernel(self, cfg: pp.TileConfig | None):
        plan = pp.plan_prefill(self.new, self.ctx, N_Q, DIM, torch.bfloat16, self.cache.dev, cfg)
        c = self.cache
        return lambda: pp.triton_prefill_attention(self.q, c.k, c.v, self.tables, plan,
                                                   DIM ** -0.5)


def sweep_configs() -> list[pp.TileConfig]:
    out = []
    for bm, bn, warps, pack in itertools.product((64, 128), (64, 128), (4, 8), (True, False)):
        stages = 3 if (3 * 2 * bn + bm) * DIM * 2 + bm * bn * 4 <= 227 * 1024 else 2
        out.append(pp.TileConfig(bm, bn, warps, stages, pack))
    return out


def sweep(cases: dict, deadline: float) -> tuple[pp.TileConfig, list[dict]]:
    rows, by_cfg = [], {}
    todo = sweep_configs()
    extra_done = False
    while todo:
        cfg = todo.pop(0)
        if time.time() > deadline:
            print("sweep: budget spent, stopping", flush=True)
            break
        rec = dict(cfg=cfg._asdict(), ms={}, err={})
        try:
            for name in SWEEP_CASES:
                case = cases[name]
                fn = case.kernel(cfg)
                out = fn()
                err = errors(out, case.ref())[1]
                est = eager_time(fn)
                sec = graph_time(fn, est, reps=5, target_s=3e-3)
                rec["ms"][name], rec["err"][name] = sec * 1e3, err
                if err > 2e-2:
                    raise RuntimeError(f"wrong: rel err {err:.2e} on {name}")
        except Exception as e:  # a config that does not compile (shared memory) or is wrong
            print(f"  skip {tuple(cfg)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        rows.append(rec)
        by_cfg[cfg] = rec
        print(f"  {tuple(cfg)}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in rec["ms"].items()),
              flush=True)
        if not todo and not extra_done and by_cfg:  # stages 2 / 4 around the best so far
            extra_done = True
            best = _best(by_cfg)
            for st in (2, 3, 4):
                c = best._replace(num_stages=st)
                if c not in by_cfg:
                    todo.append(c)
    best = _best(by_cfg)
    return best, rows


def _best(by_cfg: dict) -> pp.TileConfig:
    """Geometric mean over the sweep's shapes of the time relative to each shape's best."""
    fastest = {n: min(r["ms"][n] for r in by_cfg.values()) for n in SWEEP_CASES}

    def score(cfg):
        r = by_cfg[cfg]["ms"]
        return math.exp(sum(math.log(r[n] / fastest[n]) for n in SWEEP_CASES) / len(SWEEP_CASES))

    ranked = sorted(by_cfg, key=score)
    for cfg in ranked[:5]:
        print(f"  rank: {tuple(cfg)} {score(cfg):.3f} x the per-shape best", flush=True)
    return ranked[0]


def table(cases: dict, cfg: pp.TileConfig, deadline: float) -> list[dict]:
    hdr = (f"{'case':>16} {'TFLOP':>7} {'kernel ms':>9} {'TFLOP/s':>7} {'% peak':>6} "
           f"{'sdpa ms':>8} {'speedup':>7} {'flash ms':>8} {'err kernel':>10} "
           f"{'rel':>8} {'err sdpa':>9} {'plan ms':>7}")
    print(hdr, flush=True)
    rows = []
    for name, case in cases.items():
        if time.time() > deadline:
            print("budget spent: stopping", flush=True)
            break
        fl = flops(case.new, case.ctx)
        fn = case.kernel(cfg)
        out = fn()
        e_k, r_k = errors(out, case.ref())
        sd = lambda: case.sdpa(case.q, case.cache.k, case.cache.v, DIM ** -0.5)  # noqa: E731
        e_s, _ = errors(sd(), case.ref())
        t_k = graph_time(fn, eager_time(fn))
        t_s = graph_time(sd, eager_time(sd), reps=5)
        t_f = None
        if len(case.new) == 1 and case.new == case.ctx:  # SDPA flash ceiling, fresh only
            c = case.cache
            k = c.k[case.tables[0, : -(-case.ctx[0] // BS)]].flatten(0, 1)[: case.ctx[0]]
            v = c.v[case.tables[0, : -(-case.ctx[0] // BS)]].flatten(0, 1)[: case.ctx[0]]
            k = k.repeat_interleave(N_Q, dim=1).transpose(0, 1)[None].contiguous()
            v = v.repeat_interleave(N_Q, dim=1).transpose(0, 1)[None].contiguous()
            qf = case.q.transpose(0, 1)[None].contiguous()
            fa = lambda: F.scaled_dot_product_attention(qf, k, v, is_causal=True,  # noqa: E731
                                                        scale=DIM ** -0.5)
            try:
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                    t_f = graph_time(fa, eager_time(fa))
            except Exception as e:  # no flash kernel in this build
                print(f"  flash: {type(e).__name__}: {str(e)[:100]}", flush=True)
        t0 = time.perf_counter()
        for _ in range(10):
            pp.plan_prefill(case.new, case.ctx, N_Q, DIM, torch.bfloat16, case.cache.dev, cfg)
        t_plan = (time.perf_counter() - t0) / 10
        rec = dict(case=name, tflop=fl / 1e12, kernel_ms=t_k * 1e3, tflops=fl / t_k / 1e12,
                   peak=fl / t_k / PEAK, sdpa_ms=t_s * 1e3, speedup=t_s / t_k,
                   flash_ms=t_f and t_f * 1e3, err_kernel=e_k, rel_kernel=r_k, err_sdpa=e_s,
                   plan_host_ms=t_plan * 1e3)
        rows.append(rec)
        fms = f"{t_f * 1e3:8.3f}" if t_f else f"{'-':>8}"
        print(f"{name:>16} {fl / 1e12:7.2f} {t_k * 1e3:9.3f} {fl / t_k / 1e12:7.0f} "
              f"{100 * fl / t_k / PEAK:6.1f} {t_s * 1e3:8.3f} {t_s / t_k:7.1f} {fms} "
              f"{e_k:10.2e} {r_k:8.1e} {e_s:9.2e} {t_plan * 1e3:7.3f}", flush=True)
        case._ref = None
        torch.cuda.empty_cache()
    return rows


def other_dtypes(dev, gen, new=(1, 1, 300, 77, 16, 129, 512),
                 ctx=(1, 999, 300, 400, 16, 2048, 1000)) -> list[dict]:
    """fp32/fp16/bf16 x head dims 64/128 x GQA 1/4/8 on a ragged mix, the engine's default
    tiling for each: errors against the fp32 torch reference (one call each, eager)."""
    new, ctx = list(new), list(ctx)
    out = []
    for dtype, dim, heads, groups in ((torch.float32, 128, 32, 4), (torch.float16, 128, 32, 4),
                                      (torch.bfloat16, 64, 16, 2), (torch.float16, 64, 8, 8),
                                      (torch.float32, 64, 8, 1), (torch.bfloat16, 128, 8, 1)):
        c = Cache(sum(-(-x // BS) for x in ctx) + 4, dev, dtype, groups, dim, gen)
        tables = c.tables(ctx, gen).to(torch.int32)
        q = torch.randn(sum(new), heads, dim, device=dev, generator=gen).to(dtype)
        plan = pp.plan_prefill(new, ctx, heads // groups, dim, dtype, dev)
        got = pp.triton_prefill_attention(q, c.k, c.v, tables, plan, dim ** -0.5)
        ref = pp.torch_prefill_attention(q.float(), c.k.float(), c.v.float(), tables, plan,
                                         dim ** -0.5)
        e, r = errors(got, ref)
        rec = dict(dtype=str(dtype), dim=dim, heads=heads, groups=groups, err=e, rel=r,
                   cfg=plan.cfg._asdict())
        out.append(rec)
        print(f"{str(dtype):15s} dim {dim:3d} heads {heads:2d} groups {groups} "
              f"{tuple(plan.cfg)}: max abs err vs fp32 {e:.2e}, rel {r:.1e}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                   "gpu_prefill_attention.json"))
    ap.add_argument("--budget-s", type=float, default=185.0)
    args = ap.parse_args()
    t0 = time.time()
    if not torch.cuda.is_available() or not pp.triton_available():
        print("needs CUDA and triton")
        return 2
    import triton
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}"
          f" SMs {torch.cuda.get_device_properties(dev).multi_processor_count}", flush=True)
    gen = torch.Generator(device=dev).manual_seed(1)
    cache = Cache(max(sum(-(-c // BS) for c in ctx) for _, _, ctx in CASES) + 8, dev, gen=gen)
    cases = {name: Case(name, new, ctx, cache, gen) for name, new, ctx in CASES}
    dflt = pp.tile_config(dev, DIM, torch.bfloat16)
    print(f"engine default tiling (bf16, dim {DIM}): {dflt}", flush=True)
    report: dict = {"default": dflt._asdict()}
    best = dflt
    if not args.no_sweep:
        best, report["sweep"] = sweep(cases, deadline=t0 + args.budget_s * 0.5)
        print(f"sweep best: {best} (done at {time.time() - t0:.0f} s)", flush=True)
    report["best"] = best._asdict()
    print(f"--- table with {best}", flush=True)
    report["rows"] = rows = table(cases, best, deadline=t0 + args.budget_s * 0.85)
    if best != dflt and time.time() < t0 + args.budget_s * 0.85:
        print(f"--- the engine's default {dflt}, for comparison", flush=True)
        report["rows_default"] = table({n: cases[n] for n in ("1 x 8k", "16 x 512 on 8k")},
                                       dflt, deadline=t0 + args.budget_s * 0.85)
    other = []
    if time.time() < t0 + args.budget_s * 0.92:
        report["other_dtypes"] = other = other_dtypes(dev, gen)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    bad = ([r for r in rows if r["rel_kernel"] > 1e-2]
           or [r for r in other if r["rel"] > (1e-4 if "32" in r["dtype"] else 1e-2)])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
