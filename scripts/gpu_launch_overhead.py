"""Host time of one Triton launch, three ways, on the rope kernel at a Qwen3 4k P step's shapes
(issue 16: a launch cost 78 us of host on the GPU machine, session 18's --host-split, and the
rope launch sits in the P step's head, before layer 0's attention):

  * ``jit``: ``_rope_kv_kernel[grid](...)`` as model/rope_kv.py launches it (Triton's
    ``JITFunction.run``: its binder looks at every argument to find the compiled variant);
  * ``bound``: the ``CompiledKernel`` that call returned, launched through its ``[grid]`` runner
    with every argument in signature order (no binder; the variant picked once);
  * ``wrapper``: ``rope_and_store`` -- the kernel plus model/rope_kv.py's own checks and
    allocation, what the engine pays per layer.

  PYTHONPATH=$PWD python3 scripts/gpu_launch_overhead.py [--launches 200] [--json PATH]

(Under TRITON_INTERPRET=1 on a CPU, ``--tokens 8`` checks the argument wiring only: the jit
launch against the engine's call.)

Prints us of host per launch (the loop's host time over the launches, no sync inside it) and
whether the bound launch wrote the same bytes as the jit one (outputs compared bitwise). A
probe for the next lever, owns nothing of the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from colo_rollout.model import rope_kv as rk  # noqa: E402
from colo_rollout.model.kernel_backend import pow2  # noqa: E402


def _inputs(dev, T, G=4, n=8, D=128, blocks=512, bs=16):
    """Qwen3-30B-A3B's attention at one rank: 4 KV groups of 8 q heads, head dim 128."""
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(T, G, n + 2, D, device=dev, generator=g).bfloat16()
    q, k, v = qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1]
    P = 8192
    cos = torch.randn(P, D, device=dev, generator=g).bfloat16()
    sin = torch.randn(P, D, device=dev, generator=g).bfloat16()
    kc = torch.zeros(blocks * bs, G, D, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(blocks * bs, device=dev, generator=g)[:T]
    pos = torch.arange(T, device=dev)
    w = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).bfloat16()
    return q, k, v, cos, sin, kc, vc, slots, pos, rk.QKRMSNorm(w, w.clone(), 1e-6)


def _args(q, k, v, cos, sin, kc, vc, slots, pos, norm, out):
    """model/rope_kv.py's _launch arguments (P: one program per token, every group), in the
    kernel's signature order, constexprs included."""
    T, G, n, D = q.shape
    half = cos.shape[-1] // 2
    GB = G
    return (q, k, v, cos, sin, kc, vc, slots, out, norm.q_weight, norm.k_weight,
            float(norm.eps), pos, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), cos.stride(0), kc.stride(0), kc.stride(1),
            vc.stride(0), vc.stride(1), G, GB, n, D, half, pow2(GB * n), pow2(GB), pow2(half),
            pow2(D), cos.shape[-1] < D, True, True, False,
            not q.is_cuda and q.dtype == torch.bfloat16)  # (the interpreter rounds by hand)


def main() -> int:
    ap = argparse.ArgumentParser()
    # (few enough that the launch queue never fills: the loop must time the host alone)
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                   "launch_overhead.json"))
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q, k, v, cos, sin, kc, vc, slots, pos, norm = _inputs(dev, T=a.tokens)
    T, G, n, D = q.shape
    names = ("Q K V Cos Sin KC VC Slots Out QW KW eps Pos sq_t sq_g sq_h sk_t sk_g sv_t sv_g "
             "sc_t skc_s skc_g svc_s svc_g G GB n D half H_PAD G_PAD HALF_PAD D_PAD PASS "
             "HAS_NORM TABLES STORE_K RNE_BF16").split()
    out_jit = torch.empty(T, G, n, D, device=dev, dtype=q.dtype)
    out_bound = torch.empty_like(out_jit)
    args = _args(q, k, v, cos, sin, kc, vc, slots, pos, norm, out_jit)
    assert len(args) == len(names)
    kw = dict(zip(names[-9:], args[-9:]))
    block = pow2(G * n) * pow2(D // 2)
    warps = 8 if block >= 4096 else 4 if block >= 1024 else 2

    def jit():
        return rk._rope_kv_kernel[(T, 1)](*args[:-9], **kw, num_warps=warps)

    compiled = jit()
    want = rk.rope_and_store(q, k, v, cos, sin, kc, vc, slots, backend="triton",
                             qk_norm=norm, positions=pos)
    res = {"jit_same_as_engine": bool(torch.equal(out_jit.view(T, G * n, D), want))}
    if dev.type != "cuda":  # the interpreter: the wiring checked, nothing to time
        print(res)
        return 0 if res["jit_same_as_engine"] else 1
    torch.cuda.synchronize()
    runner = compiled[(T, 1, 1)]
    bound_args = _args(q, k, v, cos, sin, kc, vc, slots, pos, norm, out_bound)
    stream = torch.cuda.current_stream().cuda_stream

    def bound():
        runner(*bound_args, stream=stream)

    def wrapper():
        rk.rope_and_store(q, k, v, cos, sin, kc, vc, slots, backend="triton", qk_norm=norm,
                          positions=pos)

    try:
        bound()
        torch.cuda.synchronize()
        res["bound_same_bytes"] = bool(torch.equal(out_bound, out_jit))
    except Exception as e:  # noqa: BLE001 -- a probe: report the API mismatch, go on
        res["bound_error"] = f"{type(e).__name__}: {e}"
    for name, fn in (("jit", jit), ("bound", bound), ("wrapper", wrapper)):
        if name == "bound" and "bound_error" in res:
            continue
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.launches):
            fn()
        host = (time.perf_counter() - t0) / a.launches
        torch.cuda.synchronize()
        res[f"{name}_us"] = host * 1e6
    for key, val in res.items():
        print(f"{key:>18}: {val:.2f}" if isinstance(val, float) else f"{key:>18}: {val}")
    with open(a.json, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
