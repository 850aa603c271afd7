"""GPU micro-benchmark of the rope + KV-store kernel at P sizes (issue 16): q rotated, k and v
into their cache slots and the dense calls' contiguous K/V rows, with Qwen3's q/k RMSNorms --
time per call against the bytes it must move (HBM roofline at 4.8 TB/s), for the program
layouts the kernel can take (every group of a token in one program, or one per group).
  PYTHONPATH=$PWD python3 scripts/gpu_rope_prefill.py   (repo root, a CUDA host; with
  ROPE_FP_FUSION=1 the launch compiled with FMA contraction, as before session 37)
"""
import os
import sys; sys.path.insert(0, ".")
import torch
from scripts.gpu_timing import graph_time
from colo_rollout.model import rope_kv

dev, bf = "cuda", torch.bfloat16
HBM = 4.8e12
if os.environ.get("ROPE_FORCE_RNE") == "1":  # the roundings by bit arithmetic (RNE_BF16)
    _bound = rope_kv._ROPE_KV
    rope_kv._ROPE_KV = lambda key, grid, args, warps: _bound(
        None if key is None else ("rne", key), grid, args[:-1] + (True,), warps)
if os.environ.get("ROPE_FP_FUSION") == "1":  # the launch as before session 37: FMA contraction
    rope_kv._ROPE_KV = rope_kv.BoundKernel(rope_kv._rope_kv_kernel)
TOKENS = [int(a) for a in sys.argv[1:]] or [1024, 4096, 8192]
print("| shape | T | layout | us | GB moved | TB/s | x roofline |")
print("|---|---|---|---|---|---|---|")
for name, G, n, norm in (("first (16 q / 4 KV)", 4, 4, False), ("Qwen3 (32 q / 4 KV)", 4, 8, True)):
    D = 128
    for T in TOKENS:
        qkv = torch.randn(T, G, n + 2, D, device=dev).to(bf)  # megatron's per-group layout
        q, k, v = qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1]
        cos = torch.cos(torch.randn(16384, D, device=dev)).to(bf)
        sin = torch.sin(torch.randn(16384, D, device=dev)).to(bf)
        kc = torch.zeros(T + 64, G, D, device=dev, dtype=bf)
        vc = torch.zeros_like(kc)
        slots = torch.arange(T, device=dev) + 17
        pos = torch.arange(T, device=dev)
        ko, vo = torch.empty(T, G, D, device=dev, dtype=bf), torch.empty(T, G, D, device=dev, dtype=bf)
        qk = rope_kv.QKRMSNorm(torch.ones(D, device=dev, dtype=bf), torch.ones(D, device=dev, dtype=bf), 1e-6) if norm else None
        ref = rope_kv.rope_and_store(q, k, v, cos, sin, kc, vc, slots, "torch", qk, pos, (ko, vo))
        kref = kc.clone()
        # bytes: q, k, v read; q out, k/v cache, k/v rows written; angles read per token
        moved = 2 * T * (G * (n + 2) * D * 2 + G * 4 * D) + 2 * T * 2 * D * 2
        for layout, whole in (("token per program", 0), ("group per program", 1 << 30)):
            rope_kv.WHOLE_TOKEN_FROM = whole
            kc.zero_()
            out = rope_kv.rope_and_store(q, k, v, cos, sin, kc, vc, slots, "triton", qk, pos, (ko, vo))
            ok = torch.equal(out, ref) and torch.equal(kc, kref)
            if not ok:  # how far from the torch path (the kernel claims its roundings)
                dq = (out.float() - ref.float()).abs()
                dk = (kc.float() - kref.float()).abs()
                print(f"  {name} T={T}: q differs at {int((dq > 0).sum())} of {dq.numel()} "
                      f"(max {float(dq.max()):.3g}), k at {int((dk > 0).sum())} (max "
                      f"{float(dk.max()):.3g})")
            t = graph_time([lambda: rope_kv.rope_and_store(q, k, v, cos, sin, kc, vc, slots, "triton",
                                                          qk, pos, (ko, vo))])
            print(f"| {name} | {T} | {layout}{'' if ok else ' (NOT bitwise)'} | {t*1e6:.1f} | "
                  f"{moved/1e9:.3f} | {moved/t/1e12:.2f} | {t/(moved/HBM):.2f} |")
        rope_kv.WHOLE_TOKEN_FROM = 256
