"""CUDA graphs of P's MoE blocks: one graph per (layer, token bucket).

Why: P's host enqueue is what a P epoch's length is made of on the GPU host (docs/benchmarks.md,
sessions 4-6: a P step dispatches ~110 torch ops per layer, and the GPU sits idle between
them). The MoE block -- pre-MLP norm, megatron's router, the grouped experts -- is half of
those ops and all of megatron's router Python, and it has no collective inside: P's
collectives sit at the boundaries around it (the attention gather before, the combine
AllReduce after), where the turnstile orders them. So it can be captured per token count
without any cross-rank agreement, and a P segment then enqueues one replay per layer for it.

Attention stays eager: its batched calls are shaped by the epoch's context buckets, which a
static graph cannot follow.

Owns: two input buffers [max_tokens, H] (model dtype: h, and u -- h through the pre-MLP norm,
read by "normed" graphs only), an output buffer [max_tokens, H] per kind of graph --
"partial": fp32, the combine dtype, summed by P's AllReduce; "residual" (the combine is the
identity: one rank, no shared experts): the model dtype, the new residual rows, the k slots
summed into the input inside the graph; "normed" (the same, with the norms around the block
fused into the adds: ``InferenceGPT.p_fusion``): the new residual rows and a second buffer of
their next norm -- and one row-count scalar, all shared by every graph (graph g of bucket T
reads and writes rows [:T] of them), and a private memory pool.

Invariants:
  * Shared buffers are safe because every replay, its input copy and the consumers of its
    output are on P's stream, in order: a layer's combine AllReduce (in place on the output
    rows; routed collectives hand back with an event edge) and the residual add that reads
    it -- or, for a residual graph, the next layer's norm and attention residual add, which
    make a new tensor -- are enqueued before the next layer's input copy and replay.
  * Rows [n:T] of a bucket are padding (stale activations of earlier epochs, always finite):
    the grouped experts exclude rows >= n from every expert group (``GatherMoE(n_valid=)``),
    so padding costs router and norm work only, and the returned rows [:n] are those the
    eager block computes (same kernels, row-independent math; GEMM shapes differ with the
    bucket, so bits may too -- within bf16 rounding).
  * The pool is private to P: D graphs replay concurrently on D's stream and must never share
    memory with P's. P graphs never run concurrently with each other (one P stream).
  * Graphs read the weights through the addresses they captured: the runner releases them
    with the D graphs whenever a parameter was replaced (checked when a step starts from idle).
  * Capture needs no other rank (no collective inside), so it happens lazily at the first use
    of a (layer, bucket) on each rank, or ahead of serving in ``capture_all``.
"""

from __future__ import annotations

import torch

from colo_rollout.model.model import ModulesMoE
from colo_rollout.model.norm_add import add_slots_rms_norm
from colo_rollout.model.residual import add_rounded_slots

MIN_TOKENS = 32  # smallest token bucket
# Largest P step (tokens over all replicas) that replays graphs; larger steps run the modules.
# The shared buffers (6 bytes per token and hidden unit) and the pool of the largest bucket's
# intermediates scale with it, while the host time a graph saves is fixed per layer: at 16k
# tokens a MoE layer's GPU time already matches its eager enqueue on the bench's larger model.
MAX_TOKENS = 16384


def token_bucket(n: int, max_tokens: int) -> int:
    """Smallest bucket >= n: MIN_TOKENS, then two per octave (2^j, 1.5 * 2^j), capped at
    ``max_tokens`` (padding at most 50% of the rows, 33% on average over an octave)."""
    if n > max_tokens:
        raise ValueError(f"{n} P tokens exceed the P graphs' capacity of {max_tokens}")
    b = MIN_TOKENS  # a power of two
    while b < n:
        b = b * 3 // 2 if b & (b - 1) == 0 else b // 3 * 4  # 2^j -> 1.5 * 2^j -> 2^(j+1)
    return min(b, max_tokens)


def token_buckets(max_tokens: int) -> list[int]:
    """Every bucket a P step of 1..max_tokens tokens can map to, ascending."""
    out, n = [], 1
    while True:
        b = token_bucket(n, max_tokens)
        out.append(b)
        if b >= max_tokens:
            return out
        n = b + 1


class PrefillMoEGraphs:
    """P's MoE blocks as graph replays; a ``MoEBlock`` (model/model.py): ``partial`` (this
    rank's fp32 partial, which P's combine collective sums) and ``residual`` (the new residual
    stream: the k slots summed into h inside the graph, where the combine is the identity --
    ``InferenceGPT.p_moe_into_residual``) or ``normed`` (that, fed h's pre-MLP norm by the
    caller and giving the next norm's rows too -- ``InferenceGPT.p_fusion``). Graphs are kept
    per (kind, layer, bucket)."""

    def __init__(self, model, max_tokens: int, capture_stream: torch.cuda.Stream) -> None:
        self.model = model
        self._modules = ModulesMoE(model)  # past the largest bucket
        self.max_tokens = max_tokens
        self.capture_stream = capture_stream
        self.device = model.device
        H = model.cfg.hidden_size
        self._in = torch.zeros(max_tokens, H, dtype=model.dtype, device=self.device)
        self._u = None  # made at the first "normed" graph
        # the outputs, made at a kind's first use (a one-rank model needs only "residual")
        self._outs: dict[str, torch.Tensor] = {}
        self._out_dtypes = {"partial": torch.float32, "residual": model.dtype,
                            "normed": model.dtype}
        self._n = torch.zeros((), dtype=torch.int64, device=self.device)
        self._n_host = 0  # what _n holds (every write is this object's, on P's stream)
        self._graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None  # made at the first capture (a fresh one after release)
        self.captures = 0
        self.replays = 0

    def partial(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """MoE layer i's routed experts on h [n, H] -> this rank's fp32 partial [n, H] (a view
        of the shared output buffer: consume it on this stream before the next replay; the
        caller may add its shared-expert rows into it in place)."""
        if h.shape[0] > self.max_tokens:  # larger than any bucket: the modules themselves
            return self._modules.partial(i, h)
        return self._replay("partial", i, h)

    def residual(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """h [n, H] + MoE layer i's k slots summed and rounded -> the new residual rows [n, H]
        (a view of the shared output buffer: consume it on this stream before the next
        replay). Saves the partial's fp32 sum, its copy out of the graph and the add that
        reads it back: one kernel over the slots, inside the graph."""
        if h.shape[0] > self.max_tokens:
            return self._modules.residual(i, h)
        return self._replay("residual", i, h)

    def normed(self, i: int, h: torch.Tensor, u: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [n, H] + the k slots of the experts on u (h's pre-MLP norm) -> (the new residual
        rows, their next norm: ``InferenceGPT.p_fusion(i).after``), views of the shared
        output buffers (consume them on this stream before the next replay)."""
        if h.shape[0] > self.max_tokens:
            return self._modules.normed(i, h, u)
        self._u_buffer()
        if u.data_ptr() != self._u.data_ptr():
            self._u[: u.shape[0]].copy_(u)
        out = self._replay("normed", i, h)
        return out, self._outs["normed_next"][: h.shape[0]]

    def input(self, n: int, normed: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Rows [:n] of the graphs' shared inputs (h, u), for the caller to write the next
        block's h and u into (the replay then copies nothing); None past the largest
        bucket."""
        if n > self.max_tokens:
            return None
        # u only for "normed" graphs: a model that never fuses its norms keeps no u buffer
        return self._in[:n], (self._u_buffer()[:n] if normed else None)

    def _u_buffer(self) -> torch.Tensor:
        if self._u is None:
            self._u = torch.zeros_like(self._in)
        return self._u

    def _replay(self, kind: str, i: int, h: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        T = token_bucket(n, self.max_tokens)
        g = self._graphs.get((kind, i, T))
        if g is None:
            g = self._capture(kind, i, T)
        if h.data_ptr() != self._in.data_ptr():  # written there already (``input``): no copy
            self._in[:n].copy_(h)
        if self._n_host != n:  # one fill per P step, not per layer
            self._n.fill_(n)
            self._n_host = n
        g.replay()
        self.replays += 1
        return self._outs[kind][:n]

    def _out(self, kind: str) -> torch.Tensor:
        if kind not in self._outs:
            self._outs[kind] = torch.zeros(self.max_tokens, self._in.shape[1],
                                           dtype=self._out_dtypes[kind], device=self.device)
            if kind == "normed":
                self._outs["normed_next"] = torch.zeros_like(self._outs[kind])
                self._u_buffer()
        return self._outs[kind]

    def _block(self, kind: str, i: int, T: int) -> None:
        m = self.model
        layer = m.decoder.layers[i]
        h = self._in[:T]
        x = layer.pre_mlp_layernorm(h) if kind != "normed" else None
        record = m.route_record("P", i, T)
        if kind == "partial":
            self._out(kind)[:T].copy_(layer.mlp(x, n_valid=self._n, record=record))
        elif kind == "residual":  # padding rows' slots are zero (given to no expert): their
            pairs = layer.mlp(x, n_valid=self._n, record=record, pairs=True)  # sums stay finite
            add_rounded_slots(h, pairs, m.residual_kernel, out=self._out(kind)[:T])
        else:  # "normed": the caller wrote u (h's pre-MLP norm) with h
            pairs = layer.mlp(self._u[:T], n_valid=self._n, record=record, pairs=True)
            add_slots_rms_norm(h, pairs, m.p_fusion(i).after, m.residual_kernel,
                               out=(self._out(kind)[:T], self._outs["normed_next"][:T]))

    @torch.inference_mode()
    def _capture(self, kind: str, i: int, T: int) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.current_stream()
        side = self.capture_stream
        side.wait_stream(stream)
        self._out(kind)  # outside the capture: the shared buffer is not the pool's
        with torch.cuda.stream(side):  # warm-up outside capture (allocator, lazy inits)
            self._n.fill_(T)
            self._n_host = T
            for _ in range(2):
                self._block(kind, i, T)
        stream.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        # capture_begin/end directly: ``torch.cuda.graph`` would also synchronize the device,
        # collect garbage and empty the cache around each of the hundreds of captures.
        # Thread-local: the NCCL watchdog thread keeps polling the events of P's eager and D's
        # graphed collectives, which may be in flight on other streams during the capture.
        with torch.cuda.stream(side):
            g.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                self._block(kind, i, T)
            finally:
                g.capture_end()
        stream.wait_stream(side)
        self._graphs[(kind, i, T)] = g
        self.captures += 1
        return g

    def capture_all(self, max_tokens: int | None = None) -> int:
        """Capture every (layer, bucket) for P steps of up to ``max_tokens`` tokens (all
        replicas together) ahead of serving. Returns the number captured now."""
        limit = self.max_tokens if max_tokens is None else min(max_tokens, self.max_tokens)
        before = self.captures
        for T in token_buckets(limit):
            for i, layer in enumerate(self.model.decoder.layers):
                if not layer.is_moe:
                    continue
                kind = self.model.p_moe_kind(i, self._in[:T])
                if kind is not None and (kind, i, T) not in self._graphs:
                    self._capture(kind, i, T)
        return self.captures - before

    def release(self) -> None:
        if self._graphs:
            torch.cuda.synchronize(self.device)
        self._graphs.clear()
        self._pool = None  # later captures start a fresh pool

    @property
    def keys(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)
