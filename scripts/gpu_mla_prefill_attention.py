"""MLA's P attention kernels on one GPU: a causal call with DeepSeek's head widths (query/key
192, value 128) through each kernel the engine could use -- SDPA with the bucket path's
explicit mask (model/mla_attention.py), SDPA's memory-efficient / cuDNN / flash backends,
cuDNN's op as model/dense_prefill.py calls it, FlashAttention-4 (where flash_attn.cute is
installed) -- and the key decompression they all need. Prints ms (CUDA-event medians of 20)
and TFLOP/s of the causal FLOPs, and each library kernel's max error to fp32 (small shapes).

    PYTHONPATH=$PWD python3 scripts/gpu_mla_prefill_attention.py

Results: docs/benchmarks.md, session 30."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(16, 1, 4096), (16, 1, 8192), (16, 8, 1024), (128, 1, 4096)]  # (heads, S, L)
NOPE, ROPE, V, LATENT = 128, 64, 128, 512


def bench(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[n // 2]


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as ex:  # not installed here
        print(f"FlashAttention-4 not importable ({type(ex).__name__}): its rows are skipped")
        flash_attn_func = None
    scale = (NOPE + ROPE) ** -0.5
    for H, S, L in SHAPES:
        lat = torch.randn(S * L, LATENT, device=dev, dtype=dt)
        kpe = torch.randn(S * L, ROPE, device=dev, dtype=dt)
        w = torch.randn(H * (NOPE + V), LATENT, device=dev, dtype=dt) * 0.03
        q = torch.randn(S, L, H, NOPE + ROPE, device=dev, dtype=dt)

        def build():
            up = F.linear(lat, w).view(S * L, H, NOPE + V)
            k = torch.cat((up[..., :NOPE], kpe[:, None].expand(S * L, H, ROPE)), -1)
            return k.view(S, L, H, NOPE + ROPE), up[..., NOPE:].view(S, L, H, V)

        k, v = build()
        flops = 2 * S * L * L / 2 * H * (NOPE + ROPE + V)
        rows = {"decompress + key concat": bench(build)}
        mask = (torch.arange(L, device=dev)[None, :]
                <= torch.arange(L, device=dev)[:, None])[None, None]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        rows["SDPA, explicit mask"] = bench(
            lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale))
        for name, be in (("SDPA memory-efficient", SDPBackend.EFFICIENT_ATTENTION),
                         ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
                         ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel([be]):
                    rows[name] = bench(lambda: F.scaled_dot_product_attention(
                        qt, kt, vt, is_causal=True, scale=scale))
            except RuntimeError as ex:
                rows[name] = f"no kernel ({str(ex)[:60]})"
        ref = None
        if H * L <= 16 * 4096:
            ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(),
                                                 is_causal=True, scale=scale).transpose(1, 2)
        cudnn = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(  # noqa: E731
            qt, kt, vt, None, False, 0.0, True, False, scale=scale)[0]
        rows["cuDNN op (the engine's call)"] = bench(cudnn)
        if ref is not None:
            rows["cuDNN max error"] = (cudnn().transpose(1, 2).float() - ref).abs().max().item()
        if flash_attn_func is not None:
            fa = lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=True)  # noqa: E731
            rows["FlashAttention-4"] = bench(fa)
            if ref is not None:
                got = fa()
                got = got[0] if isinstance(got, tuple) else got
                rows["FlashAttention-4 max error"] = (got.float() - ref).abs().max().item()
        print(f"heads {H}, {S} x {L}: {flops / 1e12:.3f} causal TFLOP")
        for name, val in rows.items():
            if isinstance(val, str) or "error" in name:
                print(f"  {name:32s} {val}")
            else:
                print(f"  {name:32s} {val:8.3f} ms {flops / val / 1e9:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
