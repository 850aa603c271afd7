"""The DeepEP dispatch backend (``model.moe_dispatch: deepep``): P on a normal-mode Buffer with
the split-phase dispatch, D on a low-latency Buffer that D's graphs capture.

Owns the two phase-owned DeepEP states and their dispatchers (model/dispatch.py's contract):

  * D (``LowLatencyDispatch``): a low-latency ``deep_ep.Buffer`` (NVSHMEM; peers over NVLink,
    ``allow_nvlink_for_low_latency_mode``) of its own, sized for D's largest bucket per rank
    (``num_max_dispatch_tokens_per_rank``). Dispatch and combine launch on the current stream
    with no host sync, so a D graph captures them; the received rows arrive expert-major and
    padded ([local experts, ranks x max tokens, H] with a per-expert count), and the local
    experts run on them in place (``grouped_rows``: no sort). The combine applies the router
    probabilities (DeepEP's weighted reduce), so the experts compute unweighted.
  * P (``NormalSplitDispatch``): a normal-mode Buffer of its own (intranode NVLink, 2/4/8
    ranks) with the split-phase dispatch of the paper's section 5, through colo_rollout's
    DeepEP patch (scripts/deepep/colo_patches.py): ``notify`` launches only DeepEP's expert
    notification (peers learn the counts; no host wait); the safe turnstile boundary sits
    after it; resuming polls the landed counts on the host (bounded by
    ``parallel.timeout_s``) and only then submits the routed data movement in the same
    buffer. At most one pending dispatch per buffer; a pending dispatch that is abandoned
    (its generator closed) retires the buffer -- device-initiated notification cannot be
    retracted, so the buffer is not reused until ``quiesce`` (its comm stream drained, a
    barrier over P's group) at a quiescent point.
  * P with one EP rank (``LocalPrefill``): DeepEP's intranode kernels take 2, 4 or 8 ranks and
    a single rank has no peer to send to, so P computes its routed experts in place (the
    same grouped path as the gather backend: bitwise its result); D still runs low-latency.

Nothing mutable is shared between the phases: two Buffers (so two comm streams, counters and
workspaces), each on its own PhaseState communicator. The P Buffer's SM budget
(``model.deepep_p_sms``) is a Config of its own, not DeepEP's class-wide default.
``report()`` gives each phase's buffer bytes and SM budget per rank.

DeepEP's Buffer constructor exchanges IPC handles with ``dist.all_gather_object`` (pickle)
over the phase's group; the peers are this job's own ranks, started together.

Must not go in here: the router's and experts' parameters (``GatherMoE``), scheduling, the
turnstile (the runner publishes the boundary the P generator yields).
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from colo_rollout.config.schema import deepep_layout_problem
from colo_rollout.model.dispatch import (Dispatcher, ExpertInputs, PhaseState, local_experts,
                                         route)
from colo_rollout.model.fused_moe import moe_experts
from colo_rollout.model.moe import COMBINE_DTYPE, GatherMoE

NORMAL_RANKS = (2, 4, 8)  # intranode kernels' rank counts
# DeepEP's intranode tuning (Buffer.get_dispatch_config / get_combine_config at 567632d):
# (nvl chunked send tokens, nvl chunked recv tokens) per rank count; the SM count is ours.
_DISPATCH_TUNING = {2: (24, 256), 4: (6, 256), 8: (6, 256)}
_COMBINE_TUNING = {2: (10, 256), 4: (9, 256), 8: (4, 256)}
_SPLIT_PATCH = "intranode_notify"  # what colo_rollout's patch adds to deep_ep_cpp.Buffer


class DeepEPUnavailable(RuntimeError):
    """``model.moe_dispatch: deepep`` where deep_ep (with our patch) cannot be used."""


class DispatchRetired(RuntimeError):
    """A P buffer with an abandoned (notified, never sent) dispatch was used again before
    ``quiesce``."""


class DispatchTimeout(RuntimeError):
    """P's notified receive counts did not land within the bound (a peer did not notify)."""


def load_deep_ep():
    """The deep_ep module, built with colo_rollout's split-dispatch patch; raises
    DeepEPUnavailable with the reason in one line."""
    try:
        import deep_ep
        import deep_ep_cpp
    except ImportError as e:
        raise DeepEPUnavailable(
            f"model.moe_dispatch 'deepep' needs the deep_ep package ({e}); on the GPU host: "
            "bash scripts/deepep_setup.sh here, carry .deepep, bash .deepep/build.sh build, "
            "PYTHONPATH=/tmp/deepep/site") from None
    if not hasattr(deep_ep_cpp.Buffer, _SPLIT_PATCH):
        raise DeepEPUnavailable(
            f"deep_ep at {deep_ep.__file__} lacks colo_rollout's split-phase dispatch patch "
            f"(deep_ep_cpp.Buffer.{_SPLIT_PATCH}); build it with scripts/deepep_setup.sh")
    return deep_ep


@dataclass(frozen=True)
class BufferReport:
    """One phase's DeepEP state on this rank."""

    phase: str
    mode: str  # "normal" | "low_latency" | "local"
    nvl_bytes: int
    rdma_bytes: int
    sms: int  # SMs the phase's communication kernels may occupy (0: not fixed by us)

    def row(self) -> dict:
        return {"phase": self.phase, "mode": self.mode,
                "nvl_MiB": round(self.nvl_bytes / 2**20, 1),
                "rdma_MiB": round(self.rdma_bytes / 2**20, 1), "sms": self.sms}


# ---------------------------------------------------------------------------------- D
def grouped_rows(count: torch.Tensor, rows_per_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The low-latency receive layout as sorted pairs, with no sort: expert e's rows are
    e*M .. e*M + count[e] (M = ``rows_per_expert``), the rest of its M rows are padding.
    Returns (order [E*M] int64: the row at each sorted position -- valid rows expert by
    expert, then every padding row --, offs [E] int32: the groups' ends). ``order`` is a
    permutation, so it is both the rows' gather index and their scatter-back index."""
    E, M = count.shape[0], rows_per_expert
    count = count.to(torch.int64)
    offs = torch.cumsum(count, 0)
    r = torch.arange(E * M, device=count.device)
    e, c = r // M, r % M
    n_e = count[e]
    # a valid row's sorted position: its expert's start + c; a padding row's: after every
    # valid row, in row order (padding rows before r: r - offs[e], as c >= count[e] there)
    pos = torch.where(c < n_e, offs[e] - n_e + c, offs[-1] + r - offs[e])
    order = torch.empty_like(r).scatter_(0, pos, r)
    return order, offs.to(torch.int32)


class LowLatencyDispatch(Dispatcher):
    """D on a low-latency Buffer: graph-capturable dispatch/combine, no host sync."""

    def __init__(self, state: PhaseState, num_local: int, num_experts: int, hidden: int,
                 max_tokens: int) -> None:
        super().__init__(state, num_local)
        deep_ep = load_deep_ep()
        self.num_experts, self.hidden = num_experts, hidden
        # TMA needs ranks x max tokens % 4 == 0; every rank must pass the same value
        self.max_tokens = -(-max(max_tokens, 1) // 4) * 4
        # DeepEP skips its work-queue slot check: the QP depth must exceed the in-flight
        # requests, 2 x (max tokens + 1) (NVSHMEM reads it at initialisation, i.e. below)
        depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
        need = 2 * (self.max_tokens + 1)
        if depth < need:
            os.environ["NVSHMEM_QP_DEPTH"] = str(1 << (need - 1).bit_length())
        self.rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            self.max_tokens, hidden, state.size, num_experts)
        self.buffer = deep_ep.Buffer(
            state.group, num_nvl_bytes=0, num_rdma_bytes=self.rdma_bytes,
            low_latency_mode=True, num_qps_per_rank=max(num_local, 1),
            allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True)
        self._ones: dict[torch.device, torch.Tensor] = {}

    def report(self) -> BufferReport:
        return BufferReport("D", "low_latency", 0, self.rdma_bytes, 0)

    def dispatch(self, x, chosen, weight, layer):
        n = x.shape[0]
        if n > self.max_tokens:
            raise ValueError(f"D dispatch at layer {layer}: {n} rows > the low-latency "
                             f"buffer's {self.max_tokens} tokens per rank")
        self.state.collectives += 1
        recv, count, handle, _, _ = self.buffer.low_latency_dispatch(
            x.contiguous(), chosen.contiguous(), self.max_tokens, self.num_experts,
            use_fp8=False)
        return ExpertInputs(recv, count, None), (handle, chosen, weight)

    def experts(self, moe: GatherMoE, inputs: ExpertInputs) -> torch.Tensor:
        """The local experts on the padded expert-major rows [E, M, H] -> [E, M, H] (padding
        rows zero), unweighted: the combine applies the router probabilities."""
        recv, count = inputs.rows, inputs.expert
        E, M, H = recv.shape
        rows = recv.view(E * M, H)
        order, offs = grouped_rows(count, M)
        ones = self._ones.get(rows.device)
        if ones is None or ones.shape[0] != E * M:
            ones = self._ones[rows.device] = torch.ones(E * M, dtype=torch.float32,
                                                        device=rows.device)
        fc1, fc2 = moe.expert_weights()
        y = moe_experts(rows, order, offs, ones, fc1, fc2, moe.config.activation_func,
                        moe.config.gated_linear_unit, moe.kernel_for(rows), order=order)
        return y.view(E, M, H)

    def combine(self, y, handle):
        handle, chosen, weight = handle
        self.state.collectives += 1
        out, _, _ = self.buffer.low_latency_combine(y, chosen.contiguous(),
                                                    weight.contiguous(), handle)
        return out.to(COMBINE_DTYPE)

    def routed(self, moe, x, layer, record=None):
        chosen, weight = route(moe, x, record)
        inputs, handle = self.dispatch(x, chosen, weight, layer)
        return self.combine(self.experts(moe, inputs), handle)

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None


# ---------------------------------------------------------------------------------- P
@dataclass
class Notice:
    """A P dispatch between its notification and its data movement: the layout DeepEP
    computed (per-rank and per-expert counts, token-in-rank map) and the notify's prefix
    matrices. Holds its tensors until the send."""

    layer: int
    chosen: torch.Tensor
    weight: torch.Tensor
    per_rank: torch.Tensor
    per_expert: torch.Tensor
    in_rank: torch.Tensor
    rank_prefix: torch.Tensor
    channel_prefix: torch.Tensor


class NormalSplitDispatch(Dispatcher):
    """P on a normal-mode Buffer, its dispatch split after the expert notification."""

    def __init__(self, state: PhaseState, num_local: int, num_experts: int, hidden: int,
                 num_sms: int, timeout_s: float) -> None:
        super().__init__(state, num_local)
        deep_ep = load_deep_ep()
        S = state.size
        if S not in NORMAL_RANKS:
            raise ValueError(f"DeepEP normal mode takes 2, 4 or 8 ranks, not {S}")
        if num_sms < 2 or num_sms % 2:
            raise ValueError(f"model.deepep_p_sms must be even and >= 2, got {num_sms}")
        self.num_experts, self.hidden, self.sms = num_experts, hidden, num_sms
        self.timeout_s = timeout_s
        self.dispatch_config = deep_ep.Config(num_sms, *_DISPATCH_TUNING[S], 6, 128)
        self.combine_config = deep_ep.Config(num_sms, *_COMBINE_TUNING[S], 6, 128)
        hidden_bytes = hidden * 2  # bf16 rows
        self.nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, S)
                             for c in (self.dispatch_config, self.combine_config))
        self.buffer = deep_ep.Buffer(state.group, self.nvl_bytes, 0, explicitly_destroy=True)
        self.pending: Notice | None = None
        self.retired: Notice | None = None  # the abandoned dispatch, until quiesce

    def report(self) -> BufferReport:
        return BufferReport("P", "normal", self.nvl_bytes, 0, self.sms)

    # -- the two halves
    def notify(self, chosen: torch.Tensor, weight: torch.Tensor, layer: int) -> Notice:
        """First half: DeepEP's layout and expert notification, launched on the buffer's
        comm stream; peers learn this rank's counts. No host wait."""
        if self.retired is not None:
            raise DispatchRetired(
                f"P's DeepEP buffer holds an abandoned dispatch (layer {self.retired.layer}) "
                "and is retired until quiesce()")
        if self.pending is not None:
            raise RuntimeError(f"a P dispatch (layer {self.pending.layer}) is already pending "
                               "on this buffer: at most one per buffer")
        chosen = chosen.contiguous()
        per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            chosen, self.num_experts)
        self.state.collectives += 1
        rank_prefix, channel_prefix = self.buffer.runtime.intranode_notify(
            per_rank, in_rank, per_expert, 1, self.dispatch_config)
        self.pending = Notice(layer, chosen, weight.contiguous(), per_rank, per_expert,
                              in_rank, rank_prefix, channel_prefix)
        return self.pending

    def counts(self, notice: Notice) -> list[int]:
        """The notified receive counts on the host ([tokens, per local expert...]), polled
        within ``timeout_s``; raises DispatchTimeout naming the layer."""
        self.state.host_reads += 1
        poll = self.buffer.runtime.intranode_notified_counts
        got = poll(self.num_local)
        deadline = time.monotonic() + self.timeout_s
        while not got:
            if time.monotonic() > deadline:
                raise DispatchTimeout(
                    f"P's DeepEP dispatch at layer {notice.layer}: the notified receive counts "
                    f"did not land within {self.timeout_s:g} s on rank "
                    f"{self.state.ranks[self.state.rank]} (a peer did not notify)")
            time.sleep(0)
            got = poll(self.num_local)
        return got

    def send(self, x: torch.Tensor, notice: Notice, counts: list[int]):
        """Second half: the routed data movement, as the landed counts say."""
        if notice is not self.pending:
            raise RuntimeError("send of a dispatch that is not this buffer's pending one")
        self.state.collectives += 1
        (recv_x, _, recv_idx, recv_w, _, rank_prefix, channel_prefix, recv_channel_prefix,
         recv_src, send_head, _) = self.buffer.runtime.intranode_dispatch(
            x.contiguous(), None, notice.chosen, notice.weight, notice.per_rank,
            notice.in_rank, notice.per_expert, counts[0], notice.rank_prefix,
            notice.channel_prefix, 1, 0, self.dispatch_config, None, False, False)
        self.pending = None
        handle = (rank_prefix, channel_prefix, recv_channel_prefix, recv_src, notice.in_rank,
                  send_head)
        # DeepEP gives local expert ids, -1 where a slot's expert lives on another rank
        local = torch.where(recv_idx >= 0, recv_idx, self.num_local)
        return ExpertInputs(recv_x, local, recv_w), handle

    # -- the contract
    def dispatch(self, x, chosen, weight, layer):
        notice = self.notify(chosen, weight, layer)
        return self.send(x, notice, self.counts(notice))

    def combine(self, y, handle):
        """y [R, H]: each received row's local experts summed (model dtype) -> this rank's
        rows [n, H] fp32, reduced over the ranks by DeepEP's combine."""
        self.state.collectives += 1
        out, _, _ = self.buffer.combine(y.contiguous(), handle, config=self.combine_config)
        return out.to(COMBINE_DTYPE)

    def routed_split(self, moe: GatherMoE, x: torch.Tensor, layer: int,
                     record: torch.Tensor | None = None) -> Generator[None, None, torch.Tensor]:
        """``routed`` in two steps: the first ``next`` routes and notifies, then stops (the
        safe boundary: peers know the dispatch shape, no data has moved); resuming polls the
        counts, sends, runs the local experts and the combine, and returns the routed output
        [n, H] fp32. Closing it while stopped retires the buffer."""
        chosen, weight = route(moe, x, record)
        notice = self.notify(chosen, weight, layer)
        try:
            yield
        except GeneratorExit:
            self.retire()
            raise
        inputs, handle = self.send(x, notice, self.counts(notice))
        return self.combine(local_experts(moe, inputs), handle)

    # -- abandonment
    def retire(self) -> None:
        """The pending dispatch is abandoned after its notification: keep the buffer out of
        use (its counters and peers' views are partially advanced) until ``quiesce``."""
        if self.pending is not None:
            self.retired, self.pending = self.pending, None

    def quiesce(self) -> None:
        """A quiescent point (collective over P's group: every rank calls it): the buffer's
        comm stream drained, every rank past its abandoned work, then the buffer is usable
        again (the next notification resets DeepEP's counters and flags)."""
        if torch.cuda.is_available():
            from colo_rollout.runtime.device import wait_event

            ev = torch.cuda.Event()
            ev.record(self.buffer.get_comm_stream())
            wait_event(ev, self.timeout_s, "P's DeepEP comm stream at a quiescent point")
        dist.barrier(group=self.state.group)
        self.retired = self.pending = None

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None


class LocalPrefill(Dispatcher):
    """P with one EP rank: every expert is local, nothing to send; the routed experts run in
    place (the gather backend's grouped path, so its result bitwise). Yields at the same
    point as the split dispatch so the epoch's boundaries do not depend on the EP size."""

    def report(self) -> BufferReport:
        return BufferReport("P", "local", 0, 0, 0)

    def dispatch(self, x, chosen, weight, layer):
        return ExpertInputs(x, chosen, weight), None

    def combine(self, y, handle):
        return y.to(COMBINE_DTYPE)

    def routed_split(self, moe, x, layer, record=None):
        chosen, weight = route(moe, x, record)
        yield
        return self.combine(local_experts(moe, ExpertInputs(x, chosen, weight)), None)

    def close(self) -> None:
        pass


def new_deepep_dispatchers(states: dict[str, PhaseState], num_local: int, num_experts: int,
                           hidden: int, topk: int, max_decode_tokens: int, p_sms: int,
                           timeout_s: float) -> tuple[Dispatcher, Dispatcher]:
    """(P's, D's) DeepEP dispatchers on their phase states (collective over the EP group:
    each Buffer exchanges handles at construction)."""
    why = deepep_layout_problem(states["D"].size, hidden, topk)
    if why:
        raise DeepEPUnavailable(f"model.moe_dispatch 'deepep': {why}")
    load_deep_ep()
    if states["P"].size == 1:
        p = LocalPrefill(states["P"], num_local)
    else:
        p = NormalSplitDispatch(states["P"], num_local, num_experts, hidden, p_sms, timeout_s)
    d = LowLatencyDispatch(states["D"], num_local, num_experts, hidden, max_decode_tokens)
    return p, d
