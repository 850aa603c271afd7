"""GPU micro-benchmark of P's fused QKV projection + q/k norms + rope + KV store
(model/qkv_rope.py) against what the attention layer runs without it: cuBLAS's projection
(``torch.matmul``) then the rope + KV-store kernel (model/rope_kv.py). Per shape and token
count: each path's time (CUDA-graph replays, median of rounds in turn), the Triton GEMM alone
(the fused kernel's plain epilogue) against cuBLAS's, and the fused outputs against the
two-launch path's on the Triton projection (bitwise but the norms' sums) and cuBLAS's
projection (elements that differ). ``--tiles``: the fused launch at other tiles too.
  PYTHONPATH=$PWD python3 scripts/gpu_qkv_rope.py [--tiles] [TOKENS ...]   (repo root, sm90+)
"""
import statistics
import sys; sys.path.insert(0, ".")
import torch
from scripts.gpu_timing import graph_time
from colo_rollout.model import qkv_rope, rope_kv

dev, bf = "cuda", torch.bfloat16
PEAK = 989e12
args = sys.argv[1:]
TILES = "--tiles" in args
TOKENS = [int(a) for a in args if a != "--tiles"] or [4096, 8192]
SHAPES = (("first (16 q / 4 KV)", 2048, 4, 4, False), ("Qwen3 (32 q / 4 KV)", 2048, 4, 8, True))
TILE_VARIANTS = [(128, 64, 8, 4)] + ([(128, 64, 8, 3), (128, 64, 8, 5), (128, 128, 8, 3),
                                      (64, 64, 4, 4), (128, 64, 4, 4)] if TILES else [])


def main() -> None:
    print("| shape | T | path | us | TFLOP/s (GEMM) | vs cuBLAS + rope |")
    print("|---|---|---|---|---|---|")
    for name, H, G, n, norm in SHAPES:
        D = 128
        for T in TOKENS:
            torch.manual_seed(T)
            x = torch.randn(T, H, device=dev).to(bf)
            w = (torch.randn(G * (n + 2) * D, H, device=dev) / H ** 0.5).to(bf)
            ang = torch.randn(32768, D, device=dev)
            cos, sin = torch.cos(ang).to(bf), torch.sin(ang).to(bf)
            pos = torch.randperm(32768, device=dev)[:T]
            slots = torch.randperm(2 * T, device=dev)[:T]
            kc = torch.zeros(2 * T, G, D, device=dev, dtype=bf)
            vc = torch.zeros_like(kc)
            ko, vo = (torch.empty(T, G, D, device=dev, dtype=bf),
                      torch.empty(T, G, D, device=dev, dtype=bf))
            qk = (rope_kv.QKRMSNorm(torch.randn(D, device=dev).to(bf),
                                    torch.randn(D, device=dev).to(bf), 1e-6) if norm else None)

            def two_launch(qkv_fn=lambda: torch.matmul(x, w.t())):
                qkv = qkv_fn().view(T, G, n + 2, D)
                return rope_kv.rope_and_store(qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1],
                                              cos, sin, kc, vc, slots, "triton", qk, pos,
                                              (ko, vo))

            def fused():
                return qkv_rope.qkv_rope_and_store(x, w, G, n, cos, sin, pos, kc, vc, slots,
                                                   qk, (ko, vo))

            def plain():
                return qkv_rope.qkv_rope_and_store(x, w, G, n, cos, sin, pos, kc, vc, slots,
                                                   epilogue=qkv_rope.EPI_PLAIN)

            # outputs: fused against the two launches on the Triton projection, and the
            # Triton projection against cuBLAS's
            ref_q = two_launch(plain)
            ref = [t.clone() for t in (ref_q, kc, vc, ko, vo)]
            got_q = fused()
            got = [got_q, kc, vc, ko, vo]
            diffs = [int((a != b).sum()) for a, b in zip(got, ref)]
            pl, mm = plain(), torch.matmul(x, w.t())
            print(f"  {name} T={T}: fused vs two launches on its projection: elements differing "
                  f"(q, k cache, v cache, k rows, v rows) {diffs}; its projection vs cuBLAS's: "
                  f"{int((pl != mm).sum())} of {mm.numel()} differ, max "
                  f"{float((pl.float() - mm.float()).abs().max()):.3g}", flush=True)
            flops = 2 * T * H * G * (n + 2) * D
            paths = {"cuBLAS + rope kernel": two_launch, "cuBLAS GEMM alone": lambda: mm.copy_(
                torch.matmul(x, w.t())), "rope kernel alone": lambda: rope_kv.rope_and_store(
                mm.view(T, G, n + 2, D)[:, :, :n], mm.view(T, G, n + 2, D)[:, :, n],
                mm.view(T, G, n + 2, D)[:, :, n + 1], cos, sin, kc, vc, slots, "triton", qk,
                pos, (ko, vo)), "Triton GEMM alone (plain epilogue)": plain}
            for bm, bk, warps, stages in TILE_VARIANTS:
                def f(bm=bm, bk=bk, warps=warps, stages=stages):
                    qkv_rope.BM, qkv_rope.BK, qkv_rope.WARPS, qkv_rope.STAGES = (bm, bk, warps,
                                                                                 stages)
                    return fused()
                paths[f"fused {bm}x{D}x{bk}, {warps} warps, {stages} stages"] = f
            times = {k: [] for k in paths}
            for _ in range(5):
                for k, fn in paths.items():
                    times[k].append(graph_time([fn]))
            qkv_rope.BM, qkv_rope.BK, qkv_rope.WARPS, qkv_rope.STAGES = TILE_VARIANTS[0]
            base = statistics.median(times["cuBLAS + rope kernel"])
            for k in paths:
                t = statistics.median(times[k])
                gemm = "" if "rope kernel alone" in k else f"{flops / t / 1e12:.0f}"
                print(f"| {name} | {T} | {k} | {t * 1e6:.1f} | {gemm} | {base / t:.3f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
