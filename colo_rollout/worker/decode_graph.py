"""CUDA graphs of the D forward: one graph per (row bucket, block-table width bucket).

Why: an eager D iteration of an MoE model is launch-bound (hundreds of small kernels and
Python per layer); replaying a captured graph costs one launch. D is also what P/D
multiplexing protects, so its iteration time is what the turnstile interleaves with.

Owns: the static input buffer of each graph, capture (lazily, at the first D iteration that
uses a key -- every rank runs the same plan, so every rank captures the same key at the same
point, which the graph's collectives need), replay, and release.

Invariants:
  * The key (rows, width) is a function of the plan alone (bucket and the longest table over
    all replicas), so every rank captures and replays the same key at the same D iteration.
  * All inputs of one replay live in one device buffer (token ids, positions, slots, context
    lengths, block tables), filled by one pinned host->device copy on the replay stream.
  * Padding rows and table padding point at the KV sink block: replaying a wider table or a
    larger bucket than needed never touches a live reservation, and masked keys add exactly 0.
  * A graph reads weights through the addresses it captured. In-place weight updates (weight
    sync, load_state_dict) are seen by the next replay. A parameter may be *replaced* only while
    the engine is idle (weight sync and memory release already require it): the engine calls
    ``check_weights`` when a step starts from idle, which compares an address fingerprint and
    drops and re-captures the graphs if it changed. The fingerprint is O(parameters), so it is
    not paid per replay: every ``GUARD_EVERY`` replays it is compared again, and a parameter
    replaced while requests were in flight raises instead of replaying stale addresses for long.
  * The returned logits, and the greedy tokens with their logprobs (``packed``: row 0 token
    ids, row 1 logprobs, float64 -- both exact), are the graph's static outputs: consume them on
    the same stream before the next replay. Greedy sampling is captured with the forward (the
    sampler's greedy ops, so bitwise the sampler's result): an all-greedy D iteration then
    enqueues the replay and one device->host copy, nothing else.
  * Sampled rows are drawn by a second, small graph per (key, ``Draw``), the draw graph
    (``draw``): the sampler's ``draw_tensors`` on the D graph's logits with the rows'
    temperature, top-k and top-p in a static buffer -- with engine.mtp also the verify and the
    MTP draft on the drawn tokens. It draws from the runner's generator (registered with the
    graph, so each replay advances it as the same ops eagerly would): a seed gives the eager D
    path's tokens. Capturing one leaves the generator as it was. ``capture_all`` captures the
    temperature draw of every key; a truncated draw (a sort of every row) at its first use.
  * Graphs hold NCCL collectives: ``release`` (and synchronize) before process groups are
    destroyed, or the destroy hangs.
"""

from __future__ import annotations

import torch

from colo_rollout.model.attention import AttnMetadata
from colo_rollout.model.model import DecodeInputs, InferenceGPT
from colo_rollout.model.weights import loadable_tensors
from colo_rollout.worker.sampler import (Draw, draw_params, draw_tensors, greedy_tensors,
                                         logprob_temperatures)
from colo_rollout.worker.speculate import ROWS_PER_SEQUENCE, verify_and_draft
from colo_rollout.runtime.device import h2d

MIN_WIDTH = 4  # smallest block-table width bucket (blocks)
GUARD_EVERY = 256  # replays between in-flight checks of the weight fingerprint


def width_bucket(blocks: int, max_blocks: int) -> int:
    """Smallest power of two >= blocks (at least MIN_WIDTH), capped at max_blocks."""
    w = MIN_WIDTH
    while w < blocks:
        w *= 2
    return min(w, max_blocks)


def width_buckets(blocks: int, max_blocks: int) -> list[int]:
    """Every width bucket a table of 1..``blocks`` blocks can map to, ascending."""
    return sorted({width_bucket(b, max_blocks) for b in range(1, max(blocks, 1) + 1)})


def graphs_supported(model: InferenceGPT) -> bool:
    """Capture needs a host-sync-free D: CUDA and the grouped expert path in every layer."""
    if model.device.type != "cuda":
        return False
    probe = torch.empty(1, dtype=model.dtype, device=model.device)
    return all(moe.uses_grouped(probe) for moe in model.moe_layers())


class _Graph:
    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.rows, self.width = rows, width
        self.buf = torch.zeros(rows * (4 + width), dtype=torch.int64, device=device)
        B = rows
        self.inputs = DecodeInputs(
            token_ids=self.buf[0:B],
            attn=AttnMetadata(
                is_prefill=False, positions=self.buf[B : 2 * B],
                slot_mapping=self.buf[2 * B : 3 * B],
                context_lens=self.buf[3 * B : 4 * B],
                block_tables=self.buf[4 * B :].view(B, width),
                seq_lens_new=[], context_lens_host=[],
            ),
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None  # engine.mtp: the rows' final-normed output
        # [2, B] float64: greedy tokens, logprobs; engine.mtp: [6, B / 2], worker/speculate.py
        self.packed: torch.Tensor | None = None
        # the draw graphs (DecodeGraphs.draw): the rows' temperature, top_k, top_p (padding
        # rows greedy), and per Draw the graph and its packed output
        # rows 0-2: ``draw_params``'s; row 3: each row's logprob temperature (1: the model's
        # own distribution; sampler.py) -- one buffer, so a draw's parameters cross in one copy
        self.draw_params = torch.zeros(4, rows, dtype=torch.float32, device=device)
        self.draw_params[2:].fill_(1.0)
        self.draw_graphs: dict[Draw, torch.cuda.CUDAGraph] = {}
        self.drawn: dict[Draw, torch.Tensor] = {}


class DecodeGraphs:
    def __init__(self, model: InferenceGPT, kv, max_blocks: int,
                 capture_stream: torch.cuda.Stream | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.model = model
        self.generator = generator  # what the draw graphs draw from (the runner's)
        # one capture stream for the runner's lifetime: every new stream that runs a GEMM gets
        # its own cuBLAS workspace (32 MiB on sm90), so a stream per capture would leak them
        self.capture_stream = capture_stream or torch.cuda.Stream(model.device)
        self.kv = kv
        self.max_blocks = max_blocks
        self.device = model.device
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        # the Parameter objects are stable (memory release swaps their .data, never the
        # objects): list them once, so the per-replay check does not walk the module tree
        # parameters and persistent buffers (the router's expert bias): what graphs read in place
        self._params = list(loadable_tensors(model).values())
        self._fingerprint = self._settled_fingerprint()
        self.captures = 0  # graphs captured so far (re-captures included)
        self.replays = 0
        self.draws = 0  # draw-graph replays (sampled rows drawn inside a graph)

    def _weights_fingerprint(self) -> tuple[int, ...]:
        # model.fp8: the FP8 copies are read too (remade when a source moved device or shape)
        return (tuple(p.data_ptr() for p in self._params)
                + tuple(t.data_ptr() for t in self.model.fp8_tensors()))

    def check_weights(self) -> bool:
        """Idle engine only: drop (and later re-capture) the graphs if a parameter was
        replaced since they were captured. Returns whether one was (other graphs of this
        model, P's, are stale too)."""
        if self._weights_fingerprint() != self._fingerprint:
            # a parameter was replaced: captured addresses are stale
            self.release()
            self._fingerprint = self._settled_fingerprint()
            return True
        return False

    def _guard_weights(self) -> None:
        if self._weights_fingerprint() != self._fingerprint:
            raise RuntimeError("a model parameter was replaced while requests were in flight; "
                               "replace parameters only while the engine is idle (or update "
                               "them in place)")

    def _settled_fingerprint(self) -> tuple[int, ...]:
        """The fingerprint after the grouped experts have re-pointed any replaced expert
        parameter into a fresh stack (which their next forward would do): the addresses a graph
        captured now reads. Only needed when the cheap fingerprint changed."""
        for moe in self.model.moe_layers():
            moe.prepare()
        return self._weights_fingerprint()

    def run(self, ids: list[int], pos: list[int], slots: list[int], ctx: list[int],
            tables: list[list[int]], world_blocks: int) -> _Graph:
        """One D forward by graph replay on the current stream; returns the graph, whose
        ``logits`` [B, V] and ``packed`` greedy samples are its static outputs.

        ``world_blocks``: the longest block table of the D iteration over *all* replicas. The
        graph key must be the same on every rank: a rank that captures runs eager warm-up
        collectives, and a peer replaying an existing graph instead would never join them."""
        if self.replays % GUARD_EVERY == GUARD_EVERY - 1:
            self._guard_weights()
        B = len(ids)
        if max(len(t) for t in tables) > world_blocks:
            raise ValueError("a block table is longer than the world's maximum")
        width = width_bucket(world_blocks, self.max_blocks)
        g = self._graphs.get((B, width))
        if g is None:
            g = self._capture(B, width)
        sink = self.kv.sink_block
        flat = ids + pos + slots + ctx
        for t in tables:
            flat.extend(t)
            flat.extend([sink] * (width - len(t)))
        g.buf.copy_(h2d(flat, torch.int64, self.device), non_blocking=True)
        g.graph.replay()
        self.replays += 1
        return g

    def _capture(self, rows: int, width: int) -> _Graph:
        g = _Graph(rows, width, self.device)
        sink = self.kv.sink_block
        # every row a padding row: attends to and writes the sink block only
        g.buf[4 * rows :].fill_(sink)
        g.buf[2 * rows : 3 * rows].fill_(sink * self.kv.block_size)
        g.buf[3 * rows : 4 * rows].fill_(1)
        stream = torch.cuda.current_stream()
        side = self.capture_stream
        side.wait_stream(stream)
        with torch.cuda.stream(side):  # warm-up outside capture (allocator, lazy inits)
            for _ in range(2):
                self._step(g.inputs)
        stream.wait_stream(side)
        g.graph = torch.cuda.CUDAGraph()
        # thread-local capture: the NCCL watchdog thread keeps polling the events of P's eager
        # collectives, which may be in flight on other streams during the capture
        with torch.cuda.graph(g.graph, pool=self._pool, stream=side,
                              capture_error_mode="thread_local"):
            g.logits, g.hidden, g.packed = self._step(g.inputs)
        stream.wait_stream(side)
        self._graphs[(rows, width)] = g
        self.captures += 1
        return g

    def draw(self, g: _Graph, params, kind: Draw) -> torch.Tensor:
        """The sampled rows of the D iteration ``g`` just replayed, drawn (``kind``: TEMPERATURE
        or TRUNCATED) by g's draw graph on the current stream (captured at first use; with
        engine.mtp it holds the MTP pass's collectives, so every rank draws in the same
        iterations: ``Draw`` of every replica's rows). ``params``: the replica's rows'
        SamplingParams (graph rows; padding rows are greedy). Returns the packed result,
        g.packed's layout; a static output like g.packed."""
        if kind not in g.draw_graphs:
            self._capture_draw(g, kind)
        g.draw_params.copy_(h2d(draw_params(params, g.rows)
                                + logprob_temperatures(params, g.rows), torch.float32,
                                self.device).view(4, g.rows), non_blocking=True)
        g.draw_graphs[kind].replay()
        self.draws += 1
        return g.drawn[kind]

    def _capture_draw(self, g: _Graph, kind: Draw) -> None:
        gen = self.generator
        if gen is None:
            raise RuntimeError("these D graphs have no generator to draw from")
        state = gen.get_state()
        stream = torch.cuda.current_stream()
        side = self.capture_stream
        side.wait_stream(stream)
        with torch.cuda.stream(side):  # warm-up outside capture
            self._draw_step(g, kind)
        stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(gen)
        with torch.cuda.graph(graph, pool=self._pool, stream=side,
                              capture_error_mode="thread_local"):
            g.drawn[kind] = self._draw_step(g, kind)
        stream.wait_stream(side)
        gen.set_state(state)  # neither the warm-up nor the capture consumed the stream
        g.draw_graphs[kind] = graph
        self.captures += 1

    def _draw_step(self, g: _Graph, kind: Draw) -> torch.Tensor:
        """What a draw graph runs: the draw of g's logits (engine.mtp: then the verify and the
        MTP draft on the drawn tokens)."""
        tokens, logprobs = draw_tensors(kind, g.logits, g.draw_params[:3], self.generator,
                                        g.draw_params[3])
        if self.model.mtp_draft:
            return verify_and_draft(self.model, self.kv, g.inputs, g.logits, g.hidden,
                                    tokens, logprobs)
        return torch.stack([tokens.double(), logprobs.double()])

    def _step(self, inputs: DecodeInputs):
        """What a graph runs (and its warm-up): the D forward and the greedy sample --
        with engine.mtp the verify forward, then verify + draft (worker/speculate.py).
        Returns (logits, hidden or None, packed)."""
        if self.model.mtp_draft:
            logits, hidden = self.model.forward_decode(inputs, self.kv, hidden=True)
            tokens, logprobs = greedy_tensors(logits)
            return logits, hidden, verify_and_draft(self.model, self.kv, inputs, logits,
                                                    hidden, tokens, logprobs)
        logits = self.model.forward_decode(inputs, self.kv)
        tokens, logprobs = greedy_tensors(logits)
        return logits, None, torch.stack([tokens.double(), logprobs.double()])

    def capture_all(self, rows: list[int], max_blocks: int | None = None) -> int:
        """Capture every (row bucket -- sequences; 2 graph rows each with engine.mtp --, width
        bucket) key up to ``max_blocks`` table width ahead of serving, with its draw graph
        (collective: every rank calls it with the same arguments), so no capture lands inside
        a timed run. Returns the number of graphs captured now."""
        self.check_weights()
        limit = self.max_blocks if max_blocks is None else min(max_blocks, self.max_blocks)
        before = self.captures
        per = ROWS_PER_SEQUENCE if self.model.mtp_draft else 1  # graph rows per sequence
        for r in sorted({per * r for r in rows}):
            for w in width_buckets(limit, self.max_blocks):
                g = self._graphs.get((r, w)) or self._capture(r, w)
                if Draw.TEMPERATURE not in g.draw_graphs and self.generator is not None:
                    self._capture_draw(g, Draw.TEMPERATURE)
        return self.captures - before

    def release(self) -> None:
        """Drop every graph (their memory returns to the pool when unreferenced)."""
        if self._graphs:
            torch.cuda.synchronize(self.device)
        self._graphs.clear()

    @property
    def keys(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)
