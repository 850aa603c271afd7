"""GPU host: a random Qwen3-30B-A3B-shaped checkpoint on disk, served through model.checkpoint,
against transformers in bf16 and fp32 (the issue-15 GPU check).

    python3 scripts/gpu_checkpoint.py --dir /root/qwen3_ckpt --layers 12 --json OUT.json

1. writes the checkpoint (config.json from checkpoint/export.hf_config_dict, safetensors shards
   of random bf16 weights drawn on the GPU) -- written by this project, read by transformers;
2. serves greedy requests with the engine (1 rank, bf16, CUDA graphs), timing the load (GB/s)
   and the generation;
3. scores the same sequences (teacher forcing) with transformers' Qwen3MoeForCausalLM in bf16
   and in fp32, and reports argmax agreement and mean |dlogp| of the engine and of transformers'
   bf16 against the fp32 ground truth (the yardstick: a bf16 model against itself in fp32).
Prints a table; writes every number to --json.

``--fp8-release``: the checkpoint is written as a block-scaled FP8 release instead ([128, 128]
e4m3 blocks with weight_scale_inv, quantization_config fp8; embeddings, norms, router and
lm_head in bf16: checkpoint/fp8_blocks.py), beside DIR_ref, its dequantised weights in bf16;
the engine serves the release (dequantised on the GPU at load) and transformers scores DIR_ref.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def qwen3_30b_shape(layers: int) -> dict:
    return {"vocab_size": 151936, "hidden_size": 2048, "num_layers": layers,
            "num_attention_heads": 32, "num_query_groups": 4, "head_dim": 128,
            "qk_layernorm": True, "norm_epsilon": 1e-6, "moe_ffn_hidden_size": 768,
            "num_experts": 128, "moe_router_topk": 8, "router_norm_topk": True,
            "max_position_embeddings": 40960, "rotary_base": 1e6, "init_method_std": 0.02}


def tiny_shape(layers: int) -> dict:
    """--tiny: the same families and code path at toy size (a CPU smoke run)."""
    return {**qwen3_30b_shape(layers), "vocab_size": 512, "hidden_size": 64,
            "num_attention_heads": 4, "num_query_groups": 2, "head_dim": 32,
            "moe_ffn_hidden_size": 32, "num_experts": 8, "moe_router_topk": 2}


DEV = "cuda" if torch.cuda.is_available() else "cpu"


FP8_BLOCK = (128, 128)


def _kept_in_float(name: str, t: torch.Tensor) -> bool:
    """What block-FP8 releases leave unquantised: 1-D tensors, embeddings, lm_head, routers."""
    return (t.dim() != 2 or "embed_tokens" in name or name.startswith("lm_head")
            or name.endswith("mlp.gate.weight"))


def write_random_checkpoint(directory: str, shape: dict, seed: int = 0,
                            fp8_release: bool = False) -> dict:
    from colo_rollout.checkpoint.export import hf_config_dict
    from colo_rollout.checkpoint.fp8_blocks import SCALE_SUFFIX, quantize_blocks
    from colo_rollout.config.hf_config import QWEN3
    from colo_rollout.checkpoint.hf_names import expected_hf_shapes
    from colo_rollout.checkpoint.store import write_checkpoint
    from colo_rollout.config import ModelConfig

    cfg = ModelConfig(**shape)
    g = torch.Generator(device=DEV).manual_seed(seed)

    ref: list = []  # --fp8-release: the dequantised twin's tensors, written after

    def tensors():
        for name, shape in expected_hf_shapes(cfg, QWEN3).items():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                t = 1.0 + 0.05 * torch.randn(shape, generator=g, device=DEV)
            else:
                t = 0.02 * torch.randn(shape, generator=g, device=DEV)
            if not fp8_release or _kept_in_float(name, t):
                yield name, t.to(torch.bfloat16).cpu()
                continue
            q, scale = quantize_blocks(t, FP8_BLOCK)
            yield name, q.cpu()
            yield name + SCALE_SUFFIX, scale.cpu()
            n, k = t.shape
            deq = (q.float() * scale.repeat_interleave(FP8_BLOCK[0], 0)[:n]
                   .repeat_interleave(FP8_BLOCK[1], 1)[:, :k])
            ref.append((name, deq.to(torch.bfloat16).cpu()))

    config = hf_config_dict(cfg, QWEN3, "bfloat16")
    if fp8_release:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                         "quant_method": "fp8",
                                         "weight_block_size": list(FP8_BLOCK)}
    t0 = time.perf_counter()
    files = write_checkpoint(directory, tensors(), config, max_shard_bytes=4 * 2**30)
    secs = time.perf_counter() - t0
    total = sum(os.path.getsize(f) for f in files)
    out = {"files": len(files), "bytes": total, "write_s": secs}
    if fp8_release:  # the float twin: every tensor, the quantised ones dequantised
        from safetensors import safe_open

        deq = dict(ref)
        ref.clear()

        def twin():
            for f in files:
                with safe_open(f, "pt") as h:
                    for name in h.keys():
                        if not name.endswith(SCALE_SUFFIX):
                            yield name, deq.pop(name) if name in deq else h.get_tensor(name)

        ref_files = write_checkpoint(directory + "_ref", twin(),
                                     hf_config_dict(cfg, QWEN3, "bfloat16"),
                                     max_shard_bytes=4 * 2**30)
        out["reference_bytes"] = sum(os.path.getsize(f) for f in ref_files)
    return out


def serve(directory: str, n_requests: int, new_tokens: int, seed: int = 0) -> dict:
    import torch.distributed as dist

    from colo_rollout.config import config_from_dict
    from colo_rollout.engine.engine import Engine
    from colo_rollout.runtime.parallel import init_parallel
    from colo_rollout.sched.request import Request, SamplingParams

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    backend = "nccl" if DEV == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=0, world_size=1)
    if DEV == "cpu":
        from colo_rollout.runtime.cpu_compat import install_cpu_compat

        install_cpu_compat()
    cfg = config_from_dict({
        "parallel": {"world_size": 1, "backend": backend},
        "model": {"checkpoint": directory, "params_dtype": "bfloat16" if DEV == "cuda"
                  else "float32", "use_te": "off"},
        "engine": {"max_batch_size": 64, "max_prefill_tokens": 8192, "kv_block_size": 16,
                   "num_kv_blocks": 2048, "max_seq_len": 1024,
                   "decode_buckets": [1, 2, 4, 8, 16, 32, 64]}})
    groups = init_parallel(cfg.parallel)
    _sync()
    t0 = time.perf_counter()
    engine = Engine(cfg, groups)
    _sync()
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(seed)
    reqs = [Request(f"r{i}", tuple(torch.randint(0, cfg.model.vocab_size,
                                                 (int(torch.randint(8, 200, (1,),
                                                                    generator=gen)),),
                                                 generator=gen).tolist()),
                    SamplingParams(max_tokens=new_tokens, ignore_eos=True))
            for i in range(n_requests)]
    engine.warmup()
    _sync()
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    _sync()
    gen_s = time.perf_counter() - t0
    st = engine.load_stats
    res = {"load_s": st.seconds, "load_bytes": st.bytes_read, "load_gb_s": st.gb_per_s,
           "engine_build_s": build_s, "generate_s": gen_s,
           "tok_s": sum(len(o.tokens) for o in outs.values()) / gen_s,
           "seqs": [(list(r.prompt), outs[r.request_id].tokens, outs[r.request_id].logprobs)
                    for r in reqs]}
    engine.close()
    del engine
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return res


@torch.no_grad()
def hf_scores(directory: str, dtype: torch.dtype, seqs) -> tuple[list, list, float]:
    """Per generated position: transformers' logprob of the engine's token, and its argmax."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    where = {"device_map": DEV} if DEV == "cuda" else {}  # (device_map needs accelerate)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **where).eval()
    load_s = time.perf_counter() - t0
    lps, argmax = [], []
    for prompt, toks, _ in seqs:
        full = prompt + toks
        logits = model(torch.tensor([full[:-1]], device=DEV)).logits[0].float()
        lp = torch.log_softmax(logits, -1)[len(prompt) - 1:]
        idx = torch.tensor(toks, device=DEV)
        lps.append(lp.gather(1, idx[:, None])[:, 0].tolist())
        argmax.append(lp.argmax(-1).tolist())
    del model
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return lps, argmax, load_s


def compare(seqs, ref_lp, ref_arg, lp=None, arg=None) -> dict:
    """``lp``/``arg`` None: the engine (its own logprobs and tokens)."""
    n = agree = 0
    dsum = 0.0
    for s, (prompt, toks, elp) in enumerate(seqs):
        for j, tok in enumerate(toks):
            mine_lp = elp[j] if lp is None else lp[s][j]
            mine_arg = tok if arg is None else arg[s][j]
            dsum += abs(mine_lp - ref_lp[s][j])
            agree += int(mine_arg == ref_arg[s][j])
            n += 1
    return {"positions": n, "argmax_agreement": agree / n, "mean_abs_dlogp": dsum / n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/root/qwen3_ckpt")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="toy shape (CPU smoke run)")
    ap.add_argument("--fp8-release", action="store_true",
                    help="write and serve a block-scaled FP8 release (transformers scores "
                         "its dequantised twin, DIR_ref)")
    args = ap.parse_args()
    out: dict = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                 "layers": args.layers}
    shape = (tiny_shape if args.tiny else qwen3_30b_shape)(args.layers)
    out["shape"] = shape
    out["write"] = write_random_checkpoint(args.dir, shape, fp8_release=args.fp8_release)
    out["fp8_release"] = args.fp8_release
    hf_dir = args.dir + "_ref" if args.fp8_release else args.dir
    print(f"checkpoint: {out['write']['files']} files, {out['write']['bytes'] / 1e9:.2f} GB "
          f"written in {out['write']['write_s']:.1f} s", flush=True)
    s = serve(args.dir, args.requests, args.new_tokens)
    seqs = s.pop("seqs")
    out["serve"] = s
    print(f"engine: load {s['load_bytes'] / 1e9:.2f} GB in {s['load_s']:.1f} s = "
          f"{s['load_gb_s']:.2f} GB/s; generate {s['tok_s']:.0f} tok/s", flush=True)
    lp32, arg32, l32 = hf_scores(hf_dir, torch.float32, seqs)
    lp16, arg16, l16 = hf_scores(hf_dir, torch.bfloat16, seqs)
    out["transformers_load_s"] = {"fp32": l32, "bf16": l16}
    out["engine_bf16_vs_hf_fp32"] = compare(seqs, lp32, arg32)
    out["hf_bf16_vs_hf_fp32"] = compare(seqs, lp32, arg32, lp16, arg16)
    out["engine_bf16_vs_hf_bf16"] = compare(seqs, lp16, arg16)
    print(f"{'pair':28s} {'positions':>9s} {'argmax agree':>13s} {'mean |dlogp|':>13s}")
    for k in ("engine_bf16_vs_hf_fp32", "hf_bf16_vs_hf_fp32", "engine_bf16_vs_hf_bf16"):
        r = out[k]
        print(f"{k:28s} {r['positions']:9d} {r['argmax_agreement']:13.4f} "
              f"{r['mean_abs_dlogp']:13.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
