"""megatron's top-k routing of a few rows in one Triton launch: the gating GEMM, the score
function, the top-k and the probabilities' normalisation.

Owns ``route_rows``: x [N, H] and a ``TopKRouter``'s parameters -> (probabilities [N, k] in the
router dtype, expert ids [N, k] int64), what ``topk_routing_with_score_function(gating(x),
dense_output=True)`` returns -- ~7 kernels on the torch path (x and the weight cast to fp32,
the GEMM or GEMV in two kernels, softmax, top-k, the cast back), each a few microseconds of
latency at decode sizes. For the routers it covers (``supports``): softmax (top-k on the logits
then softmax over the k, or softmax first: ``moe_router_pre_softmax``) and sigmoid (top-k on
scores + expert bias, the k scores normalised), an optional gate bias and scaling factor; no
group-limited top-k, no routing replay.

Numerics, as megatron computes them: the logits accumulate in fp32 (megatron: an fp32 GEMM, or
TE's bf16 GEMM with fp32 output, on the same bf16 values) and are rounded to the router dtype;
the score functions run in fp32; the probabilities are rounded to the router dtype. The sum's
order differs from cuBLAS's, so the logits agree to fp32 rounding, not bitwise: a choice can
differ only between experts tied to that rounding. Ties pick the lower expert id; the k slots
come in descending score order (torch's unsorted top-k: unspecified).

Used for decode-sized row counts (``MAX_ROWS``): every program reads the whole gate weight,
and the fp32 FMA GEMM is no match for cuBLAS on a prefill's thousands of rows.

Imports only torch (and triton when present): no megatron.
"""

from __future__ import annotations

import torch

from colo_rollout.model.kernel_backend import pow2, rne_bf16, tl, triton

MAX_ROWS = 256  # rows at or under this take the kernel (decode buckets)
MAX_EXPERTS = 512  # the logits of a row block live in registers
SCORES = {"softmax": 0, "sigmoid": 1}
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BLOCK_M = 16


def supports(score_function: str, topk: int, experts: int, num_groups, group_topk,
             router_replay) -> bool:
    """Whether the kernel computes this router's routing (else megatron's function does)."""
    return (score_function in SCORES and not num_groups and not group_topk
            and router_replay is None and 1 <= topk <= experts <= MAX_EXPERTS)


def route_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               expert_bias: torch.Tensor | None, topk: int, *, score_function: str,
               pre_softmax: bool, scaling_factor: float | None,
               router_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H]; weight [E, H] (the router's parameter, any float dtype); bias [E] or None;
    expert_bias [E] (sigmoid routing's) or None -> (probs [N, k] in ``router_dtype``,
    expert ids [N, k] int64). CPU tensors run under TRITON_INTERPRET=1 only (the tests)."""
    if triton is None:
        raise RuntimeError("triton is not importable: use the torch moe kernel backend")
    N, H = x.shape
    E = weight.shape[0]
    if weight.shape[1] != H or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"router kernel: x {tuple(x.shape)}, weight {tuple(weight.shape)} "
                         "with contiguous rows expected")
    if router_dtype not in _ROUND:
        raise ValueError(f"router kernel: router dtype {router_dtype} (fp64: megatron's path)")
    probs = torch.empty((N, topk), dtype=router_dtype, device=x.device)
    ids = torch.empty((N, topk), dtype=torch.int64, device=x.device)
    if N == 0:
        return probs, ids
    upcast = not x.is_cuda  # the interpreter: bf16 rounding by hand
    b = bias if bias is not None else weight
    eb = expert_bias if expert_bias is not None else weight
    block_e = pow2(E, 16)
    _router_kernel[(triton.cdiv(N, _BLOCK_M),)](
        x, weight, b, eb, probs, ids, N, H, E, x.stride(0), weight.stride(0),
        float(scaling_factor or 1.0),
        K=topk, K_PAD=pow2(topk), SCORE=SCORES[score_function], PRE_SOFTMAX=pre_softmax,
        HAS_BIAS=bias is not None, HAS_EBIAS=expert_bias is not None,
        ROUND=_ROUND[router_dtype], RNE_BF16=upcast, BLOCK_M=_BLOCK_M, BLOCK_E=block_e,
        BLOCK_H=max(16, min(128, 8192 // block_e)), num_warps=4,
    )
    return probs, ids


if triton is not None:

    @triton.jit
    def _to_router_dtype(v, ROUND: tl.constexpr, RNE_BF16: tl.constexpr):
        """fp32 -> the router dtype's values (still fp32 tensors), to nearest even."""
        if ROUND == 1:
            if RNE_BF16:
                v = rne_bf16(v)
            v = v.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            v = v.to(tl.float16).to(tl.float32)
        return v

    # the row count, hidden size and expert count change nothing in the code
    @triton.jit(do_not_specialize=["N", "H", "E", "scale"])
    def _router_kernel(X, W, Bias, EBias, Probs, Ids, N, H, E, stride_x, stride_w, scale,
                       K: tl.constexpr, K_PAD: tl.constexpr, SCORE: tl.constexpr,
                       PRE_SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_EBIAS: tl.constexpr, ROUND: tl.constexpr, RNE_BF16: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < N
        e = tl.arange(0, BLOCK_E)
        emask = e < E
        # the gating GEMM: fp32 products of the stored values, fp32 sums
        acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            hmask = hh < H
            xv = tl.load(X + rows[:, None].to(tl.int64) * stride_x + hh[None, :],
                         mask=rmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
            wv = tl.load(W + e[None, :].to(tl.int64) * stride_w + hh[:, None],
                         mask=emask[None, :] & hmask[:, None], other=0.0).to(tl.float32)
            acc = tl.dot(xv, wv, acc, input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(Bias + e, mask=emask, other=0.0).to(tl.float32)[None, :]
        logits = _to_router_dtype(acc, ROUND, RNE_BF16)
        neg = float("-inf")
        if SCORE == 0:  # softmax
            logits = tl.where(emask[None, :], logits, neg)
            if PRE_SOFTMAX:
                p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
                vals = p / tl.sum(p, axis=1)[:, None]
            else:
                vals = logits
            rank = vals
        else:  # sigmoid; the expert bias steers the choice, not the probabilities
            vals = 1.0 / (1.0 + tl.exp(-logits))
            rank = vals
            if HAS_EBIAS:
                rank = vals + tl.load(EBias + e, mask=emask, other=0.0).to(tl.float32)[None, :]
            rank = tl.where(emask[None, :], rank, neg)
        kk = tl.arange(0, K_PAD)
        top_v = tl.zeros([BLOCK_M, K_PAD], dtype=tl.float32)
        top_i = tl.zeros([BLOCK_M, K_PAD], dtype=tl.int32)
        for j in tl.static_range(K):  # k rounds of argmax (ties: the lower id)
            best = tl.max(rank, axis=1)
            idx = tl.min(tl.where(rank == best[:, None], e[None, :], BLOCK_E), axis=1)
            hit = e[None, :] == idx[:, None]
            v = tl.sum(tl.where(hit, vals, 0.0), axis=1)
            top_v = tl.where(kk[None, :] == j, v[:, None], top_v)
            top_i = tl.where(kk[None, :] == j, idx[:, None], top_i)
            rank = tl.where(hit, neg, rank)
        kmask = kk[None, :] < K
        if SCORE == 0:
            if not PRE_SOFTMAX:  # softmax over the k chosen logits
                t = tl.where(kmask, top_v, neg)
                p = tl.exp(t - tl.max(t, axis=1)[:, None])
                top_v = p / tl.sum(p, axis=1)[:, None]
        elif K > 1:
            t = tl.where(kmask, top_v, 0.0)
            top_v = t / (tl.sum(t, axis=1)[:, None] + 1e-20)
        top_v = _to_router_dtype(top_v * scale, ROUND, RNE_BF16)
        out = rows[:, None].to(tl.int64) * K + kk[None, :]
        smask = rmask[:, None] & kmask
        tl.store(Probs + out, top_v.to(Probs.dtype.element_ty), mask=smask)
        tl.store(Ids + out, top_i.to(tl.int64), mask=smask)
