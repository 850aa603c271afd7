"""Greedy tokens and their logprobs from full-vocabulary logits in a split reduction.

Owns ``greedy_pick`` (worker/sampler.py's ``greedy_tensors`` on CUDA): each row's argmax and
``log_softmax(row)[argmax]`` without the [n, V] fp32 log-softmax the torch ops write. Why: at
one row torch's log_softmax runs the whole 151936-wide Qwen3 vocabulary in one thread block
(35 us of an H200 in P's tail and in D's B = 1 step, docs/benchmarks.md session 19), and at 64
rows it writes and reads back 39 MB. Here a row is cut into chunks of ``BLOCK`` columns, one
program each (the whole GPU at one row): per chunk its max, the first column holding it and
the sum of exp(x - max); then one program per row combines the chunks.

Semantics: the token is the first column of the row's maximum (``torch.argmax``'s), read in
fp32 from the logits' dtype (exact: bf16 and fp16 widen exactly); the logprob is
``x[token] - logsumexp(x)`` = ``-log(sum_c s_c * exp(m_c - max))`` in fp32 -- torch's
log_softmax at the argmax up to the sum's rounding order (~1e-7 relative). Columns at -inf
(masked) count as torch counts them, whole chunks of them too; a row holding NaN or only
-inf gives what it gives (torch's is NaN as well).

Imports only torch (and triton when present).
"""

from __future__ import annotations

import torch

from colo_rollout.model.kernel_backend import pow2, tl, triton

BLOCK = 4096  # columns per program of the first pass (37 programs per Qwen3 row)
MAX_CHUNKS = 4096  # chunks one combining program holds: vocabularies up to 16M columns


def supports(logits: torch.Tensor) -> bool:
    """Whether ``greedy_pick`` computes these logits: a CUDA (or interpreted) 2-D tensor with
    contiguous rows, triton importable, the vocabulary within ``MAX_CHUNKS`` chunks."""
    return (triton is not None and logits.dim() == 2 and logits.stride(-1) == 1
            and logits.shape[0] > 0 and 0 < logits.shape[1] <= BLOCK * MAX_CHUNKS
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16))


def greedy_pick(logits: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] -> (tokens [n] int64, logprobs [n] fp32); see the module docstring.
    Fixed shapes and no host read: a CUDA graph captures it. ``block``: columns per chunk (a
    power of two; tests use small ones)."""
    if not supports(logits):
        raise ValueError(f"greedy_pick: logits {tuple(logits.shape)} {logits.dtype} with row "
                         f"stride {logits.stride(-1)}: see supports()")
    return pick(logits, block)


def pick(logits: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``greedy_pick`` for a caller that has asked ``supports`` already (the sampler: no
    second check on the step's path)."""
    n, V = logits.shape
    chunks = -(-V // block)
    dev = logits.device
    part_max = torch.empty((n, chunks), dtype=torch.float32, device=dev)
    part_sum = torch.empty((n, chunks), dtype=torch.float32, device=dev)
    part_idx = torch.empty((n, chunks), dtype=torch.int64, device=dev)
    _chunk_kernel[(n, chunks)](logits, logits.stride(0), V, part_max, part_sum, part_idx,
                               chunks, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    logprobs = torch.empty(n, dtype=torch.float32, device=dev)
    _combine_kernel[(n,)](part_max, part_sum, part_idx, chunks, tokens, logprobs,
                          C_PAD=pow2(chunks), num_warps=1 if chunks <= 256 else 4)
    return tokens, logprobs


def warm(vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile the variants a model's logits [n, vocab] of ``dtype`` need, now (at model
    build: a first compile while serving stalls the host ~1 s): rows at a tensor's start and
    a row slice after its first row -- whose pointer loses the 16-byte alignment Triton
    specialises on where a row's bytes are not a multiple of 16 (P's rows of another
    replica)."""
    x = torch.zeros(2, vocab, dtype=dtype, device=device)
    if supports(x):
        greedy_pick(x)
        greedy_pick(x[1:])


if triton is not None:

    @triton.jit
    def _chunk_kernel(X, stride_row, V, PMax, PSum, PIdx, C, BLOCK: tl.constexpr):
        """Program (row, c): columns [c * BLOCK, (c + 1) * BLOCK) of the row -> their max, the
        first column holding it, and sum(exp(x - max)) (0 terms past V)."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + row.to(tl.int64) * stride_row + cols, mask=cols < V,
                    other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        # the first column at the max: the least index among those equal to it
        first = tl.min(tl.where(x == m, cols, 2147483647), axis=0)
        # a chunk of -inf only (masked columns) adds nothing: exp(-inf - -inf) would be NaN
        s = tl.where(m == float("-inf"), 0.0, tl.sum(tl.exp(x - m), axis=0))
        tl.store(PMax + row * C + c, m)
        tl.store(PSum + row * C + c, s)
        tl.store(PIdx + row * C + c, first.to(tl.int64))

    @triton.jit
    def _combine_kernel(PMax, PSum, PIdx, C, Tokens, Logprobs, C_PAD: tl.constexpr):
        """Program row: the row's max over its chunks, the first chunk reaching it (its first
        column is the row's argmax: chunks are in column order), and -log of the chunks'
        sums rescaled to that max."""
        row = tl.program_id(0)
        c = tl.arange(0, C_PAD)
        ok = c < C
        m = tl.load(PMax + row * C + c, mask=ok, other=float("-inf"))
        s = tl.load(PSum + row * C + c, mask=ok, other=0.0)
        top = tl.max(m, axis=0)
        first = tl.min(tl.where(ok & (m == top), c, C_PAD), axis=0)
        idx = tl.load(PIdx + row * C + first)
        total = tl.sum(tl.where(ok, s * tl.exp(m - top), 0.0), axis=0)
        tl.store(Tokens + row, idx)
        tl.store(Logprobs + row, -tl.log(total))
