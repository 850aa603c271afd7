"""GPU micro-benchmark of the two B = 1 fusions (issue 16): the k-slot sum in the residual add
(model/residual.py add_rounded_slots) and the q/k RMSNorm in the rope + KV kernel (model/rope_kv.py),
each timed in a CUDA graph against the unfused launches, with bitwise checks.
  python3 scripts/gpu_fusions.py   (repo root, a CUDA host)
"""
import sys; sys.path.insert(0, ".")
import torch
from scripts.gpu_timing import graph_time
from colo_rollout.model.residual import add_rounded, add_rounded_slots, slot_sum
from colo_rollout.model import rope_kv
dev, bf = "cuda", torch.bfloat16
# 1. k-slot sum fused into the residual add (Qwen3-30B-A3B: H 2048, k 8), B = 1
for n in (1, 8, 64):
    res = torch.randn(n, 2048, device=dev).to(bf); pairs = torch.randn(n, 8, 2048, device=dev).to(bf)
    a = add_rounded_slots(res, pairs, "triton"); b = add_rounded_slots(res, pairs, "torch")
    c = add_rounded(res, pairs.sum(dim=1, dtype=torch.float32), "triton")  # the old path
    t_old = graph_time([lambda: add_rounded(res, pairs.sum(dim=1, dtype=torch.float32), "triton")])
    t_new = graph_time([lambda: add_rounded_slots(res, pairs, "triton")])
    print(f"slots n={n}: bitwise vs torch path {torch.equal(a, b)}, vs torch.sum path "
          f"{int((a != c).sum())} differ; old {t_old*1e6:.1f} us, fused {t_new*1e6:.1f} us")
# 2. q/k RMSNorm fused into rope+KV (T 1, 4 KV groups x 8 q heads, D 128)
T, G, n, D = 1, 4, 8, 128
qkv = torch.randn(T, G, n + 2, D, device=dev).to(bf)
qn, kn = (torch.nn.RMSNorm(D, eps=1e-6).to(dev, bf) for _ in range(2))
with torch.no_grad():
    qn.weight.normal_(1, 0.3); kn.weight.normal_(1, 0.3)
norm = rope_kv.QKRMSNorm(qn.weight.detach(), kn.weight.detach(), 1e-6)
cos, sin = (f(torch.randn(T, D, device=dev)).to(bf) for f in (torch.cos, torch.sin))
kc, vc = torch.zeros(64, G, D, device=dev, dtype=bf), torch.zeros(64, G, D, device=dev, dtype=bf)
slots = torch.tensor([5], device=dev)
q, k, v = qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1]
def unfused():
    qq = qn(q.reshape(T, G * n, D)).view(T, G, n, D); kk = kn(k.contiguous())
    return rope_kv.rope_and_store(qq, kk, v, cos, sin, kc, vc, slots, "triton")
def fused():
    return rope_kv.rope_and_store(q, k, v, cos, sin, kc, vc, slots, "triton", qk_norm=norm)
with torch.inference_mode():
    a, ka = unfused(), kc[slots].clone(); b, kb = fused(), kc[slots].clone()
    r = rope_kv.rope_and_store(q, k, v, cos, sin, kc, vc, slots, "torch", qk_norm=norm)
    print(f"norm: fused vs unfused q max {(a.float()-b.float()).abs().max().item():.3g} "
          f"({int((a != b).sum())} of {a.numel()} differ), k {int((ka != kb).sum())} differ; "
          f"vs torch path {int((b != r).sum())} differ")
    print(f"norm: unfused {graph_time([unfused])*1e6:.1f} us, fused {graph_time([fused])*1e6:.1f} us")
