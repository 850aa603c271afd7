"""Which part of the rope + KV kernel differs from the torch path (diagnosis; issue 16): the
kernel claims the torch path's roundings bit for bit (model/rope_kv.py), which the interpreted
CPU tests check; session 33's P-size probe (scripts/gpu_rope_prefill.py) found its GPU output
not bitwise. Every combination of the q/k norms, the angle tables, the dense calls' K/V rows
and the program layout, each output's differing elements and their largest gap.
  PYTHONPATH=$PWD python3 scripts/gpu_rope_bitwise.py     (a CUDA host: also a run compiled
                                                            without FP fusion; on CPU: the
                                                            interpreter, TRITON_INTERPRET=1)
"""
import sys; sys.path.insert(0, ".")
import itertools
import os
import torch
from colo_rollout.model import rope_kv
dev, bf = ("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
torch.manual_seed(0)
T, G, n, D = (512 if dev == "cuda" else 8), 4, 8, 128
qkv = torch.randn(T, G, n + 2, D, device=dev).to(bf)
q, k, v = qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1]
ang = torch.randn(4096, D, device=dev)
cos_t, sin_t = torch.cos(ang).to(bf), torch.sin(ang).to(bf)
pos = torch.randperm(4096, device=dev)[:T]
slots = torch.arange(T, device=dev) + 3
w = (torch.randn(D, device=dev) * 0.3 + 1).to(bf)
if os.environ.get("ROPE_FORCE_RNE") == "1" and dev == "cuda":
    # the kernel's roundings by bit arithmetic (rne_bf16, the interpreter's path) instead of
    # fp32 -> bf16 -> fp32 casts: a compiler that folds a cast pair away cannot fold these
    _bound = rope_kv._ROPE_KV
    rope_kv._ROPE_KV = lambda key, grid, args, warps: _bound(
        None if key is None else ("rne", key), grid, args[:-1] + (True,), warps)
for norm, tables, kvout, whole in itertools.product((False, True), (False, True), (False, True), (256, 1 << 30)):
    rope_kv.WHOLE_TOKEN_FROM = whole
    qk = rope_kv.QKRMSNorm(w, w, 1e-6) if norm else None
    cos, sin = (cos_t, sin_t) if tables else (cos_t[pos], sin_t[pos])
    p = pos if tables else None
    res = {}
    for backend in ("torch", "triton"):
        kc = torch.zeros(T + 8, G, D, device=dev, dtype=bf); vc = torch.zeros_like(kc)
        ko = torch.zeros(T, G, D, device=dev, dtype=bf); vo = torch.zeros_like(ko)
        out = rope_kv.rope_and_store(q, k, v, cos, sin, kc, vc, slots, backend, qk, p,
                                     (ko, vo) if kvout else None)
        res[backend] = (out, kc, vc, ko, vo)
    diffs = []
    for name, a, b in zip(("q", "kcache", "vcache", "kout", "vout"), res["torch"], res["triton"]):
        d = (a.float() - b.float()).abs()
        if (d > 0).any():
            rel = (d / a.float().abs().clamp(min=1e-30)).max()
            diffs.append(f"{name}: {int((d > 0).sum())}/{d.numel()} max {float(d.max()):.3g} rel {float(rel):.3g}")
    print(f"norm={norm} tables={tables} kv_out={kvout} whole_from={whole}: "
          + ("bitwise" if not diffs else "; ".join(diffs)))

# On a GPU the same combinations once more in a process compiled without Triton's floating-point
# fusion (ptxas --fmad=false, LLVM's contraction off): bitwise there names the cause as a product
# fused into the sum across the kernel's rounding casts (session 34's finding: ~24% of elements
# one bf16 step off under every combination).
if dev == "cuda" and "TRITON_DEFAULT_FP_FUSION" not in os.environ \
        and "ROPE_FORCE_RNE" not in os.environ:
    import subprocess  # noqa: E402
    print("--- again with TRITON_DEFAULT_FP_FUSION=0", flush=True)
    subprocess.run([sys.executable, __file__], env={**os.environ, "TRITON_DEFAULT_FP_FUSION": "0"},
                   check=False)
    # and with the roundings by bit arithmetic (the cast pairs not left to the compiler)
    print("--- again with the roundings by bit arithmetic (RNE_BF16 on the GPU)", flush=True)
    subprocess.run([sys.executable, __file__], env={**os.environ, "ROPE_FORCE_RNE": "1"},
                   check=False)
