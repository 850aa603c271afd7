"""Probe: cuDNN's fused attention against the engine's Triton P-attention kernel, for fresh
prefills (every sequence's keys are its own new tokens: K/V packed, no paging needed).

  PYTHONPATH=$PWD python3 scripts/gpu_cudnn_attention.py [--json PATH]

What it answers before an engine path is built on it (issue 16, P attention): does this
torch build have cuDNN's varlen forward (``aten::_cudnn_attention_forward`` with cumulative
sequence offsets) and which cuDNN; how fast is it on the bench shapes -- causal, bf16, head dim
128, the KV heads expanded to the query heads (torch's varlen wrapper does not hand GQA to
cuDNN; only with CUDNN_VARLEN=1: it rebuilt its plan on every call, ~50 ms) -- and dense SDPA
on the cuDNN backend (one sequence, or equal fresh ones as a batch; KV heads expanded, and
GQA handed to the kernel), with the first call's time (cuDNN builds a plan per shape);
FlashAttention-4's batched and variable-length calls where ``flash_attn.cute`` imports; and
the max abs error of each against an fp32 reference. The engine's kernel (model/
paged_prefill.py, K/V in a block cache with consecutive tables) is timed beside it. FLOPs: 4 x
heads x dim x causal pairs.

  PYTHONPATH=$PWD python3 scripts/gpu_cudnn_attention.py --fa4-sweep [SHAPE ...]

FlashAttention-4's Hopper forward at other tile shapes and pipelining choices than its
head-dim-128 default, beside cuDNN's batched call (``FA4_VARIANTS``; default shapes: both
8 x 1k).

Owns nothing of the engine; loads only paged_prefill.py and torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from colo_rollout.model.paged_prefill import plan_prefill, triton_prefill_attention
from gpu_timing import print_row  # (this script's folder is on sys.path when run)

SHAPES = [  # (name, q heads, kv groups, sequence lengths)
    ("first 1 x 4k", 16, 4, [4096]), ("first 1 x 8k", 16, 4, [8192]),
    ("first 8 x 1k", 16, 4, [1024] * 8),
    ("qwen3 1 x 4k", 32, 4, [4096]), ("qwen3 1 x 8k", 32, 4, [8192]),
    ("qwen3 8 x 1k", 32, 4, [1024] * 8),
]
D, BS = 128, 16


def _time(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def _reference(q, k, v, lens, scale):
    out, at = torch.empty_like(q, dtype=torch.float32), 0
    n = q.shape[1] // k.shape[1]
    for L in lens:
        qs = q[at:at + L].float().transpose(0, 1)
        ks = k[at:at + L].float().repeat_interleave(n, 1).transpose(0, 1)
        vs = v[at:at + L].float().repeat_interleave(n, 1).transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        out[at:at + L] = o.transpose(0, 1)
        at += L
    return out


# --fa4-sweep: FlashAttention-4's Hopper forward at configurations other than its default for
# head dim 128 (128 x 128 tiles, P @ V from registers, intra-warpgroup overlap, GQA packed) --
# whether any beats cuDNN's batched call on the equal fresh sequences (8 x 1k: issue 16)
FA4_VARIANTS = {
    "default": {},
    "no_pack_gqa": {"pack_gqa": False},
    "no_intra_wg_overlap": {"intra_wg_overlap": False},
    "pv_from_smem": {"mma_pv_is_rs": False},
    "tile_128x176": {"tile_mn": (128, 176)},
    "tile_128x64": {"tile_mn": (128, 64)},
    "tile_192x128_512t": {"tile_mn": (192, 128), "num_threads": 512, "mma_pv_is_rs": False},
}


def fa4_sweep(shapes: list[str]) -> list[dict]:
    """FA4's batched forward (``flash_attn.cute.interface._flash_attn_fwd``) at each of
    ``FA4_VARIANTS`` on the named equal-length shapes, beside cuDNN's batched GQA call: ms,
    TFLOP/s and max error against the fp32 reference; a variant that does not build or run is
    reported with its error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flash_attn.cute.interface import _flash_attn_fwd

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, hq, kvg, lens in SHAPES:
        if name not in shapes or len(set(lens)) != 1:
            continue
        S, L = len(lens), lens[0]
        T = S * L
        q = torch.randn(S, L, hq, D, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(S, L, kvg, D, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(S, L, kvg, D, device=dev, dtype=torch.bfloat16, generator=g)
        scale = D ** -0.5
        flops = 4 * hq * D * S * L * (L + 1) // 2
        ref = _reference(q.view(T, hq, D), k.view(T, kvg, D), v.view(T, kvg, D), lens, scale)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                    scale=scale, enable_gqa=True).transpose(1, 2)

        fns = {"cudnn_dense_gqa": cudnn}
        for label, kw in FA4_VARIANTS.items():
            fns["fa4_" + label] = (lambda kw=kw: _flash_attn_fwd(
                q, k, v, softmax_scale=scale, causal=True, **kw)[0])
        for label, fn in fns.items():
            row = {"shape": name, "variant": label}
            try:
                row["ms"] = _time(fn)
                row["tflops"] = flops / row["ms"] / 1e9
                row["err"] = (fn().reshape(T, hq, D).float() - ref).abs().max().item()
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
            rows.append(row)
            print_row(row)
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--fa4-sweep", nargs="*", metavar="SHAPE",
                    help="FlashAttention-4's configurations on these shapes (default: both "
                         "8 x 1k) instead of the kernel table")
    args = ap.parse_args(argv)
    if args.fa4_sweep is not None:
        rows = fa4_sweep(args.fa4_sweep or ["qwen3 8 x 1k", "first 8 x 1k"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"fa4_sweep": rows}, f, indent=1)
        return 0
    dev = torch.device("cuda")
    info = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
            "varlen_op": hasattr(torch.ops.aten, "_cudnn_attention_forward")}
    print(info)
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for name, hq, kvg, lens in SHAPES:
        T = sum(lens)
        q = torch.randn(T, hq, D, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(T, kvg, D, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(T, kvg, D, device=dev, dtype=torch.bfloat16, generator=g)
        scale = D ** -0.5
        pairs = sum(L * (L + 1) // 2 for L in lens)
        flops = 4 * hq * D * pairs
        ref = _reference(q, k, v, lens, scale)
        row = {"shape": name, "tflop": flops / 1e12}
        # the engine's kernel: K/V in a block cache, consecutive tables
        nb = [-(-L // BS) for L in lens]
        kc = torch.zeros(sum(nb), BS, kvg, D, device=dev, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        tables = torch.zeros(len(lens), max(nb), dtype=torch.int64, device=dev)
        at = blk = 0
        for s, L in enumerate(lens):
            kc.view(-1, kvg, D)[blk * BS: blk * BS + L] = k[at:at + L]
            vc.view(-1, kvg, D)[blk * BS: blk * BS + L] = v[at:at + L]
            tables[s, : nb[s]] = torch.arange(blk, blk + nb[s], device=dev)
            at += L
            blk += nb[s]
        plan = plan_prefill(lens, lens, hq // kvg, D, q.dtype, dev)
        ours = lambda: triton_prefill_attention(q, kc, vc, tables, plan, scale)  # noqa: E731
        row["triton_ms"] = _time(ours)
        row["triton_err"] = (ours().float() - ref).abs().max().item()
        # cuDNN varlen, the KV heads expanded to the q heads
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32,
                          device=dev)
        ke = k.repeat_interleave(hq // kvg, 1)
        ve = v.repeat_interleave(hq // kvg, 1)

        def cudnn_varlen(expand=False):
            kk, vv = (k.repeat_interleave(hq // kvg, 1), v.repeat_interleave(hq // kvg, 1)) \
                if expand else (ke, ve)
            return torch.ops.aten._cudnn_attention_forward(
                q, kk, vv, None, cu, cu, max(lens), max(lens), False, 0.0, True, False,
                scale=scale)[0]

        for key, fn in (() if os.environ.get("CUDNN_VARLEN") != "1" else
                        (("cudnn_varlen", cudnn_varlen),
                         ("cudnn_varlen_with_expand", lambda: cudnn_varlen(True)))):
            try:
                row[key + "_ms"] = _time(fn)
                row[key + "_err"] = (fn().float() - ref).abs().max().item()
            except Exception as e:  # the op or the shape is not supported here
                row[key + "_ms"] = None
                row[key + "_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
        if len(set(lens)) == 1:  # one sequence, or equal fresh ones: a batched dense call
            from torch.nn.attention import SDPBackend, sdpa_kernel

            S, L = len(lens), lens[0]

            def batched(t):  # [S * L, h, D] -> [S, h, L, D] (a view)
                return t.view(S, L, t.shape[1], D).transpose(1, 2)

            def dense(gqa=False):
                kk, vv = (k, v) if gqa else (ke, ve)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(
                        batched(q), batched(kk), batched(vv), is_causal=True, scale=scale,
                        enable_gqa=gqa)

            for key, fn in (("cudnn_dense", dense), ("cudnn_dense_gqa", lambda: dense(True))):
                try:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn()  # the first call of a shape builds cuDNN's plan
                    torch.cuda.synchronize()
                    row[key + "_first_call_ms"] = 1e3 * (time.perf_counter() - t0)
                    row[key + "_ms"] = _time(fn)
                    got = fn().transpose(1, 2).reshape(T, hq, D)
                    row[key + "_err"] = (got.float() - ref).abs().max().item()
                except Exception as e:
                    row[key + "_ms"] = None
                    row[key + "_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
        # FlashAttention-4 (flash_attn.cute, where carried): its dense call for equal fresh
        # sequences as a batch and its variable-length call over the packed rows -- GQA's k and
        # v as they are (whether either beats cuDNN's batched call at 8 x 1k: issue 16)
        try:
            from colo_rollout.config.attention_support import flash_attention, flash_varlen
            fa, fv = flash_attention(), flash_varlen()
        except ImportError as e:
            fa = fv = None
            row["flash_error"] = str(e)[:120]
        flash_fns = []
        if fv is not None:
            flash_fns.append(("flash_varlen", lambda: fv(
                q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                max_seqlen_k=max(lens), softmax_scale=scale, causal=True)))
        if fa is not None and len(set(lens)) == 1:
            S_, L_ = len(lens), lens[0]
            flash_fns.append(("flash_batched", lambda: fa(
                q.view(S_, L_, hq, D), k.view(S_, L_, kvg, D), v.view(S_, L_, kvg, D),
                softmax_scale=scale, causal=True)))
        for key, fn in flash_fns:
            try:
                row[key + "_ms"] = _time(fn)
                got = fn()
                got = (got[0] if isinstance(got, tuple) else got).reshape(T, hq, D)
                row[key + "_err"] = (got.float() - ref).abs().max().item()
            except Exception as e:  # a shape or build FA4 does not take
                row[key + "_ms"] = None
                row[key + "_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
        for key in ("triton", "cudnn_varlen", "cudnn_varlen_with_expand", "cudnn_dense",
                    "cudnn_dense_gqa", "flash_varlen", "flash_batched"):
            ms = row.get(key + "_ms")
            if ms:
                row[key + "_tflops"] = flops / ms / 1e9
        rows.append(row)
        print_row(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
