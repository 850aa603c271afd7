"""CUDA graphs of P's MoE blocks: one graph per (layer, token bucket).

Why: P's host enqueue is what a P epoch's length is made of on the GPU host (docs/benchmarks.md,
sessions 4-6: a P step dispatches ~110 torch ops per layer, and the GPU sits idle between
them). The MoE block -- pre-MLP norm, megatron's router, the grouped experts -- is half of
those ops and all of megatron's router Python, and it has no collective inside: P's
collectives sit at the boundaries around it (the attention gather before, the combine
AllReduce after), where the turnstile orders them. So it can be captured per token count
without any cross-rank agreement, and a P segment then enqueues one replay per layer for it.

Attention's core stays eager: its batched calls are shaped by the epoch's sequences (the
kernel's plan, cuDNN's dense calls of one padded length each), which a static graph cannot
follow. Its input half -- the QKV projection, the q/k norms, the rotation and the K/V store
(``PagedSelfAttention.project_rotate``) -- is row-wise, so where every layer's MoE block is a
"normed" graph (one rank) it replays as graph ("attn", layer, bucket) too: it reads the
layer's normed input where the previous block's graph wrote it (layer 0: where the embedding
kernel wrote it) and the step's positions and KV slots, which the runner stages once per step
into a static buffer (``stage_rows``; padding rows: position 0 and the sink block's first
slot), and writes q and qkv into static buffers that the eager attention reads. Per layer the
host then enqueues a replay, the attention call, the output projection, the fused add and the
MoE replay (the rope launch and the projection's matmul were ~0.1 ms of host per layer, which
layer 0 waits for on the GPU).

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
  * An attention graph writes K/V at the staged slots of all T rows: padding rows' slots are
    the sink block's (never read), rewritten by every ``stage_rows``; ``capture_all`` stages
    sink slots before it captures (its warm-up runs write K/V too), and a lazy capture runs
    inside a step whose rows are staged (the warm-up computes what the replay will).
"""

from __future__ import annotations

import torch

from colo_rollout.model.attention import AttnMetadata, KVStorage
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

    def __init__(self, model, max_tokens: int, capture_stream: torch.cuda.Stream,
                 kv: KVStorage | None = None) -> None:
        self.model = model
        self.kv = kv  # the KV storage the attention graphs write (None: no attention graphs)
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
        # attention input graphs: staged positions and slots (bucket T: positions at [0, T),
        # slots at [T, 2T)), the q and qkv outputs; made at the first stage
        self._attention: bool | None = None  # whether the model allows them (decided once)
        self._rows: torch.Tensor | None = None
        self._q: torch.Tensor | None = None
        self._qkv: torch.Tensor | None = None

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

    @property
    def attention_graphs(self) -> bool:
        """Whether P's attention input halves replay as graphs: a KV storage to write and
        every layer a "normed" MoE block whose attention module ``graphable_input_half``
        (``InferenceGPT.p_attention_graphable``)."""
        if self._attention is None:
            self._attention = (self.kv is not None
                               and self.model.p_attention_graphable(self._in[:1]))
        return self._attention

    def bucket(self, n: int) -> int | None:
        """The token bucket the runner pads a P step of n rows to for the attention graphs
        (``stage_rows``), or None: those graphs are off or n past the largest bucket."""
        if n == 0 or n > self.max_tokens or not self.attention_graphs:
            return None
        return token_bucket(n, self.max_tokens)

    def stage_rows(self, rows: torch.Tensor) -> None:
        """Stage a P step's positions and KV slots for the attention graphs: ``rows`` [2T]
        int64 (device) -- the positions padded to the bucket T (``bucket``) with 0, then the
        slots padded with the sink block's first slot. One copy on P's stream."""
        T = rows.shape[0] // 2
        self._rows_buffer()[: 2 * T].copy_(rows)

    def _rows_buffer(self) -> torch.Tensor:
        if self._rows is None:
            self._rows = torch.zeros(2 * self.max_tokens, dtype=torch.int64, device=self.device)
        return self._rows

    def attention_x(self, n: int) -> torch.Tensor:
        """Where layer 0's normed rows [n, H] go (the attention graphs' x: the "normed"
        graphs' next-norm output buffer, which layers >= 1 read as it is)."""
        self._out("normed")
        return self._outs["normed_next"][:n]

    def attention_input(self, i: int, x: torch.Tensor, inp, kv: KVStorage
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer i's attention input half on x [n, H] by the replay of graph ("attn", i, T)
        -> (q [n, heads, D], qkv [n, G, n_q + 2, D]), views of the static outputs (consumed on
        this stream before the next replay); None where the step's rows were not staged
        (``PrefillInputs.graph_rows``) or past the largest bucket."""
        n = x.shape[0]
        if inp.graph_rows != n or kv is not self.kv:
            return None
        T = token_bucket(n, self.max_tokens)
        xs = self.attention_x(n)
        if x.data_ptr() != xs.data_ptr():  # written there already (attention_x): no copy
            xs.copy_(x)
        g = self._graphs.get(("attn", i, T))
        if g is None:
            g = self._capture_graph(("attn", i, T), lambda: self._attention_half(i, T))
        g.replay()
        self.replays += 1
        att = self.model.decoder.layers[i].self_attention
        q = self._q[: T * att.heads * att.head_dim].view(T, att.heads, att.head_dim)
        qkv = self._qkv[: T * self._qkv_width(att)].view(T, att.groups, att.q_per_group + 2,
                                                        att.head_dim)
        return q[:n], qkv[:n]

    @staticmethod
    def _qkv_width(att) -> int:
        return att.groups * (att.q_per_group + 2) * att.head_dim

    def _attention_half(self, i: int, T: int) -> None:
        """The captured body: layer i's ``project_rotate`` on the static rows of bucket T."""
        m = self.model
        att = m.decoder.layers[i].self_attention
        if self._q is None:  # outside the capture (warm-up runs first): not the pool's
            self._q = torch.zeros(self.max_tokens * att.heads * att.head_dim,
                                  dtype=m.dtype, device=self.device)
            self._qkv = torch.zeros(self.max_tokens * self._qkv_width(att), dtype=m.dtype,
                                    device=self.device)
        rows = self._rows_buffer()
        pos, slots = rows[:T], rows[T : 2 * T]
        meta = AttnMetadata(is_prefill=True, positions=pos, slot_mapping=slots,
                            block_tables=rows[:0], context_lens=rows[:0], seq_lens_new=[],
                            context_lens_host=[])
        x = self.attention_x(T)
        att.project_rotate(
            x, m.rope_angles(pos), meta, self.kv, i,
            qkv_out=self._qkv[: T * self._qkv_width(att)].view(T, -1),
            q_out=self._q[: T * att.heads * att.head_dim].view(T, att.groups, att.q_per_group,
                                                              att.head_dim))

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

    def _capture(self, kind: str, i: int, T: int) -> torch.cuda.CUDAGraph:
        self._out(kind)  # outside the capture: the shared buffer is not the pool's

        def body():
            self._n.fill_(T)
            self._n_host = T
            self._block(kind, i, T)
        return self._capture_graph((kind, i, T), body, once=lambda: self._block(kind, i, T))

    @torch.inference_mode()
    def _capture_graph(self, key, body, once=None) -> torch.cuda.CUDAGraph:
        """Graph ``key`` of ``once`` (default ``body``), after two warm-up runs of ``body``
        outside the capture (allocator, lazy inits), all on the capture stream."""
        stream = torch.cuda.current_stream()
        side = self.capture_stream
        side.wait_stream(stream)
        with torch.cuda.stream(side):  # warm-up outside capture (allocator, lazy inits)
            for _ in range(2):
                body()
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
                (once or body)()
            finally:
                g.capture_end()
        stream.wait_stream(side)
        self._graphs[key] = g
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
            if self.attention_graphs:  # warm-ups write K/V at the staged slots: the sink's
                self._rows_buffer()[:T].zero_()
                self._rows_buffer()[T : 2 * T].fill_(self.kv.sink_block * self.kv.block_size)
                for i in range(len(self.model.decoder.layers)):
                    if ("attn", i, T) not in self._graphs:
                        self._capture_graph(("attn", i, T),
                                            lambda i=i, T=T: self._attention_half(i, T))
        return self.captures - before

    def release(self) -> None:
        if self._graphs:
            torch.cuda.synchronize(self.device)
        self._graphs.clear()
        self._pool = None  # later captures start a fresh pool

    @property
    def keys(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)
