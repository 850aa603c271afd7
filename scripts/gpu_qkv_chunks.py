"""GPU probe: P's QKV projection (cuBLAS) and the rope + KV-store kernel (model/rope_kv.py) over
the step's rows in chunks, each chunk's rope right after its GEMM -- whether the rope's read
of the projection then comes from L2 instead of HBM, and what the smaller GEMMs cost. Per
shape and token count: the GEMM alone, GEMM then rope over all rows (the engine's order), and
the chunked order at several chunk sizes (CUDA-graph replays, medians of rounds in turn).
  PYTHONPATH=$PWD python3 scripts/gpu_qkv_chunks.py [TOKENS ...]   (repo root, a CUDA host)
"""
import statistics
import sys; sys.path.insert(0, ".")
import torch
from scripts.gpu_timing import graph_time
from colo_rollout.model import rope_kv

dev, bf = "cuda", torch.bfloat16
TOKENS = [int(a) for a in sys.argv[1:]] or [4096, 8192]
SHAPES = (("first (16 q / 4 KV)", 2048, 4, 4, False), ("Qwen3 (32 q / 4 KV)", 2048, 4, 8, True))
CHUNKS = (4096, 2048, 1024, 512)


def main() -> None:
    print("| shape | T | order | us | vs GEMM then rope |")
    print("|---|---|---|---|---|")
    for name, H, G, n, norm in SHAPES:
        D = 128
        for T in TOKENS:
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
            buf = torch.empty(T, G * (n + 2) * D, device=dev, dtype=bf)

            def run(chunk):
                outs = []
                for c0 in range(0, T, chunk):
                    c1 = min(T, c0 + chunk)
                    torch.matmul(x[c0:c1], w.t(), out=buf[c0:c1])
                    qkv = buf[c0:c1].view(c1 - c0, G, n + 2, D)
                    outs.append(rope_kv.rope_and_store(
                        qkv[:, :, :n], qkv[:, :, n], qkv[:, :, n + 1], cos, sin, kc, vc,
                        slots[c0:c1], "triton", qk, pos[c0:c1], (ko[c0:c1], vo[c0:c1])))
                return outs

            paths = {"GEMM alone": lambda: torch.matmul(x, w.t(), out=buf),
                     "GEMM then rope (all rows)": lambda: run(T)}
            for c in CHUNKS:
                if c < T:
                    paths[f"chunks of {c}"] = lambda c=c: run(c)
            times = {k: [] for k in paths}
            for _ in range(5):
                for k, fn in paths.items():
                    times[k].append(graph_time([fn]))
            base = statistics.median(times["GEMM then rope (all rows)"])
            for k in paths:
                t = statistics.median(times[k])
                print(f"| {name} | {T} | {k} | {t * 1e6:.1f} | {base / t:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
