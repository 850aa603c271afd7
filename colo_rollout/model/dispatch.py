"""MoE token dispatch backends: the dispatch/combine contract, per-phase state, the all-to-all.

Owns the interface every non-gather MoE dispatch backend implements (``Dispatcher``), the state
each phase owns (``PhaseState``: its own communicator, counters, workspaces, stream slot --
P's and D's are distinct instances, nothing mutable is shared between them), and the
torch.distributed backend ``alltoall`` (``model.moe_dispatch``), which runs on every
torch.distributed backend including gloo on CPU:

  * D (``PaddedAllToAll``): a fixed capacity of (token, expert) pairs per peer -- by default
    the worst case, rows x min(top-k, experts per rank), so nothing can overflow and there is
    no host sync: one equal-split ``all_to_all_single`` of the payload and one of the metadata
    (local expert id, router probability), the local experts, one equal-split all-to-all back.
    CUDA-graph capturable at the worst-case capacity. A smaller capacity
    (``model.moe_dispatch_capacity``) is checked on the host after the metadata exchange, on
    every rank from the same exchanged counts, so every rank raises the same error (naming
    the overflowing rank, the layer and the counts) -- tokens are never dropped silently.
  * P (``VariableAllToAll``): split-phase, as the paper's section 5. The expert-count
    exchange (``notify``: an all-to-all of per-peer pair counts, not read yet), then the host
    read of the counts (``read_counts``: the split sizes; a device sync on a GPU), then the
    variable-split payload all-to-all (``send``). ``routed_split`` is a generator that stops
    once between the count exchange and the host read: that point is a safe turnstile
    boundary (model.py yields its id there), so a D iteration can go between P's count
    notification and its data movement. ``dispatch``/``routed`` run the halves back to back.

Each rank dispatches only its own rows (D: its ATP chunk of its replica's rows; P: its share
of its replica's rows), routed with the replicated router; the combine returns those rows'
routed-expert output, the k slots summed in fp32 like the gather backend's combine.
Requires expert TP 1 (EP = world: every expert lives whole on one rank; config/loader.py
refuses other layouts).

The gather backend (``GatherComm`` + ``GatherMoE``) is not routed through this interface: it
computes every replica's rows on every rank, which has no dispatch step. The DeepEP backend
(``deepep``) implements the same contract in model/deepep.py (imported only when chosen).

Must not go in here: the router's and experts' parameters (``GatherMoE`` owns them; the
backends read its router, stacked weights and kernel choice), scheduling, sampling.
"""

from __future__ import annotations

import abc
from collections.abc import Generator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from colo_rollout.runtime import parallel
from colo_rollout.runtime.parallel import ParallelGroups
from colo_rollout.model.fused_moe import moe_experts
from colo_rollout.model.moe_align import align
from colo_rollout.model.moe import COMBINE_DTYPE, GatherMoE

PHASES = ("P", "D")


class DispatchOverflow(RuntimeError):
    """More (token, expert) pairs for a peer than the padded D path's capacity."""


@dataclass
class PhaseState:
    """What one phase owns of the dispatch: its communicator over the EP group, the rank's
    index in it, counters and workspaces. One instance per phase, made once at model build."""

    phase: str
    group: dist.ProcessGroup
    ranks: list[int]  # the group's global ranks, in group order (= EP index order)
    rank: int  # this rank's index in ``group``
    collectives: int = 0  # all-to-alls issued so far (monotone)
    host_reads: int = 0  # P: count exchanges read on the host so far (monotone)
    workspace: dict = field(default_factory=dict)
    stream: object = None  # the phase's stream on a GPU (set by the runner; unused on CPU)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None,
                   in_splits=None) -> torch.Tensor:
        self.collectives += 1
        dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=self.group)
        return out


def new_phase_states(groups: ParallelGroups) -> dict[str, PhaseState]:
    """P's and D's states, each with its own communicator over this rank's EP group.
    Collective over the world (``new_group``): every rank calls it, in the same order, once at
    model build."""
    lay = groups.layout
    states = {}
    for phase in PHASES:
        mine = None
        for ranks in lay.ep_groups():  # every rank creates every group (new_group is collective)
            g = parallel.new_layout_group(list(ranks))
            if groups.rank in ranks:
                mine = PhaseState(phase, g, list(ranks), ranks.index(groups.rank))
        states[phase] = mine
    if states["P"].group is states["D"].group:  # pragma: no cover - new_group always makes one
        raise RuntimeError("P and D dispatch share a communicator")
    return states


@dataclass
class ExpertInputs:
    """What a rank's local experts compute on: rows [R, H] (model dtype), each with one local
    expert id [R] (int64; ``num_local`` marks an empty padding slot) and its router
    probability [R] (fp32) -- or, where a row travels once per rank (DeepEP's normal mode),
    j slots per row: expert [R, j], weight [R, j], the rank's output being the row's slots
    summed. A backend with its own receive layout (DeepEP's low-latency one) documents
    what it puts here."""

    rows: torch.Tensor
    expert: torch.Tensor
    weight: torch.Tensor


def route(moe: GatherMoE, x: torch.Tensor, record: torch.Tensor | None = None,
          invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, H] (normalised) -> the k chosen global expert ids [n, k] and their router
    probabilities [n, k] (fp32), as the gather backend's grouped path reads the router.
    ``record`` [n, k] (routing replay): the chosen ids are written into it. ``invariant``:
    the gate batch-invariant (engine.batch_invariant's D)."""
    k = moe.topk
    if x.shape[0] == 0:
        return (torch.zeros((0, k), dtype=torch.int64, device=x.device),
                torch.zeros((0, k), dtype=torch.float32, device=x.device))
    weight, chosen = moe.route(x, invariant)
    if record is not None:
        record.copy_(chosen)
    return chosen, weight.float()


def local_experts(moe: GatherMoE, inp: ExpertInputs, invariant: bool = False) -> torch.Tensor:
    """The rank's local experts on the received rows -> y [R, H] (rows' dtype) in the rows'
    order; empty slots give zero. The gather backend's grouped math (fc1 -> activation ->
    * probability -> fc2); with j > 1 slots per row, the slots summed in fp32 (in slot
    order, as the gather backend's combine) and rounded to the rows' dtype once.
    ``invariant``: the expert GEMMs batch-invariant (engine.batch_invariant's D)."""
    E = moe.num_local
    rows = inp.rows
    if rows.shape[0] == 0:
        return rows.new_zeros(rows.shape)
    backend = moe.kernel_for(rows)
    expert = inp.expert if inp.expert.dim() == 2 else inp.expert.unsqueeze(1)
    weight = inp.weight if inp.weight.dim() == 2 else inp.weight.unsqueeze(1)
    # each slot's local expert id (E: an empty slot, sorted last)
    al = align(expert, weight.float(), 0, E, backend=backend,
               expert_ids=moe._expert_ids(rows.device))
    fc1, fc2 = moe.expert_weights()
    y = moe_experts(rows, al.token, al.offs, al.prob, fc1, fc2,
                    moe.config.activation_func, moe.config.gated_linear_unit, backend,
                    order=al.order, invariant=invariant)
    j = expert.shape[1]
    if j == 1:
        return y
    return y.view(-1, j, y.shape[-1]).sum(dim=1, dtype=COMBINE_DTYPE).to(rows.dtype)


class Dispatcher(abc.ABC):
    """A phase's MoE dispatch backend. The contract:

    * ``dispatch(x, chosen, weight, layer) -> (ExpertInputs, handle)``: x [n, H] are this
      rank's own (normalised) rows, ``chosen`` [n, k] their global expert ids and ``weight``
      [n, k] the router probabilities (``route``). Returns the rows this rank's local experts
      must compute on (from every peer) and an opaque handle for the way back. Collective over
      the phase's communicator: every rank of the EP group calls it, for the same layer.
    * ``combine(y, handle) -> [n, H] fp32``: y [R, H] are the local experts' outputs on the
      ExpertInputs' rows (same order); returns, for this rank's n rows, the sum over their k
      slots in fp32 -- the routed-expert output of those rows, complete (no further reduction
      over ranks). Collective like ``dispatch``.
    * A backend uses only its own ``PhaseState`` (communicator, workspaces); it keeps no state
      between a dispatch and its combine other than the handle, so P and D may interleave.
    * Bad input (a capacity overflow) raises on every rank alike, naming rank, layer, counts;
      no token is dropped silently.
    """

    def __init__(self, state: PhaseState, num_local: int) -> None:
        self.state = state
        self.num_local = num_local
        # engine.batch_invariant: D's dispatcher routes and computes with the batch-invariant
        # kernels (set by the model at build; P's never)
        self.invariant = False

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor,
                 layer: int) -> tuple[ExpertInputs, object]:
        ...

    @abc.abstractmethod
    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        ...

    def routed(self, moe: GatherMoE, x: torch.Tensor, layer: int,
               record: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' output [n, H] fp32 on this rank's rows x [n, H]: route,
        dispatch, local experts, combine. ``record``: see ``route``."""
        chosen, weight = route(moe, x, record, self.invariant)
        inputs, handle = self.dispatch(x, chosen, weight, layer)
        return self.combine(local_experts(moe, inputs, self.invariant), handle)


def _counts(dest: torch.Tensor, size: int) -> torch.Tensor:
    """How many of ``dest``'s entries name each of 0..size-1 (int64 [size]): torch.bincount's
    result without its host read of the maximum (CUDA's bincount syncs), so a D graph can
    capture it."""
    return torch.zeros(size, dtype=torch.int64, device=dest.device).scatter_add_(
        0, dest, torch.ones_like(dest, dtype=torch.int64))


def _meta(inp_expert: torch.Tensor, inp_weight: torch.Tensor) -> torch.Tensor:
    """[R, 2] fp32: the local expert id (exact in fp32) and the probability, one collective."""
    return torch.stack([inp_expert.to(torch.float32), inp_weight.to(torch.float32)], dim=1)


class PaddedAllToAll(Dispatcher):
    """D: fixed capacity per peer, equal splits, no host sync at the worst-case capacity."""

    def __init__(self, state: PhaseState, num_local: int, topk: int, capacity: int = 0) -> None:
        super().__init__(state, num_local)
        self.topk = topk
        self.capacity_setting = capacity  # 0: worst case

    def worst_case(self, n: int) -> int:
        """Most pairs n rows can send one peer: each row's k experts are distinct."""
        return n * min(self.topk, self.num_local)

    def capacity(self, n: int) -> int:
        worst = self.worst_case(n)
        if self.capacity_setting <= 0:
            return worst
        return min(self.capacity_setting, worst)

    def dispatch(self, x, chosen, weight, layer):
        st, E = self.state, self.num_local
        S, n, H = st.size, x.shape[0], x.shape[1]
        k = chosen.shape[1]
        cap = self.capacity(n)
        checked = cap < self.worst_case(n)
        if checked and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"model.moe_dispatch_capacity {cap} < the worst case "
                               f"{self.worst_case(n)}: its overflow check reads the host and "
                               "cannot be captured in a D graph")
        dest = (chosen // E).flatten()  # [n*k] peer (EP index) of each (token, slot) pair
        counts = _counts(dest, S)  # [S]
        sorted_dest, order = torch.sort(dest, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.empty_like(order)
        pos[order] = torch.arange(n * k, device=x.device) - starts[sorted_dest]
        fits = pos < cap
        slot = torch.where(fits, dest * cap + pos, S * cap)  # the overflow goes to a spare row
        token = torch.arange(n * k, device=x.device) // k
        send = x.new_zeros((S * cap + 1, H))
        send.index_copy_(0, slot, x[token])
        # metadata rows: peer p's pairs at p*(cap+1) + pos, its header at p*(cap+1) + cap;
        # one spare row last for the overflow (never sent)
        meta = torch.zeros((S * (cap + 1) + 1, 2), dtype=torch.float32, device=x.device)
        meta[:, 0] = E  # empty slots: no expert
        mrow = torch.where(fits, dest * (cap + 1) + pos, S * (cap + 1))
        meta.index_copy_(0, mrow, _meta(chosen.flatten() - dest * E, weight.flatten()))
        meta = meta[: S * (cap + 1)].view(S, cap + 1, 2)
        if checked:  # header: (pairs for this peer, this rank's largest count)
            meta[:, cap, 0] = counts.to(torch.float32)
            meta[:, cap, 1] = counts.max().to(torch.float32)
        recv = st.all_to_all(torch.empty_like(send[: S * cap]), send[: S * cap])
        rmeta = st.all_to_all(torch.empty_like(meta), meta)
        if checked:
            self._check(rmeta[:, cap], cap, layer)
        rmeta = rmeta[:, :cap].reshape(S * cap, 2)
        inputs = ExpertInputs(recv, rmeta[:, 0].to(torch.int64), rmeta[:, 1])
        return inputs, (slot.clamp(max=S * cap - 1), fits, n, k)

    def _check(self, header: torch.Tensor, cap: int, layer: int) -> None:
        """Every rank received every source's largest count: all raise the same error."""
        largest = [int(v) for v in header[:, 1].tolist()]
        over = [(self.state.ranks[s], c) for s, c in enumerate(largest) if c > cap]
        if over:
            mine = [int(v) for v in header[:, 0].tolist()]
            raise DispatchOverflow(
                f"MoE alltoall D dispatch overflow at layer {layer}: capacity {cap} pairs per "
                f"peer (model.moe_dispatch_capacity), but rank(s) "
                + ", ".join(f"{r} sent up to {c}" for r, c in over)
                + f" (seen on rank {self.state.ranks[self.state.rank]}, which received "
                f"{mine} from ranks {self.state.ranks}); raise the capacity or set 0 "
                "(the worst case, which cannot overflow)")

    def combine(self, y, handle):
        slot, fits, n, k = handle
        back = self.state.all_to_all(torch.empty_like(y), y)
        pairs = torch.where(fits.unsqueeze(-1), back[slot], 0.0)
        return pairs.view(n, k, y.shape[1]).sum(dim=1, dtype=COMBINE_DTYPE)


@dataclass
class CountNotice:
    """P's count exchange issued but not read: the per-peer pair counts sent and received
    (device tensors) and the pairs' order by peer."""

    sent: torch.Tensor  # [S] pairs for each peer
    received: torch.Tensor  # [S] pairs from each peer
    order: torch.Tensor  # [n*k] pair indices sorted by peer (stable)
    n: int
    k: int


@dataclass
class CountPlan:
    """P's count exchange: the per-peer pair counts sent and received (host lists) and the
    pairs' order by peer."""

    send_splits: list[int]
    recv_splits: list[int]
    order: torch.Tensor  # [n*k] pair indices sorted by peer (stable)
    n: int
    k: int


class VariableAllToAll(Dispatcher):
    """P: the expert-count exchange, then the variable-split payload all-to-all."""

    def notify(self, chosen: torch.Tensor) -> CountNotice:
        """First half, the notification: how many pairs go to each peer, exchanged (one
        collective on P's communicator); nothing is read on the host yet."""
        st, E = self.state, self.num_local
        n, k = chosen.shape
        dest = (chosen // E).flatten()
        counts = _counts(dest, st.size)
        recv = st.all_to_all(torch.empty_like(counts), counts)
        order = torch.sort(dest, stable=True).indices
        return CountNotice(counts, recv, order, n, k)

    def read_counts(self, notice: CountNotice) -> CountPlan:
        """The exchanged counts on the host: the payload collective's split sizes (on a GPU
        this waits for the count exchange)."""
        self.state.host_reads += 1
        return CountPlan(notice.sent.tolist(), notice.received.tolist(), notice.order,
                         notice.n, notice.k)

    def exchange_counts(self, chosen: torch.Tensor) -> CountPlan:
        """The notification and its host read, back to back."""
        return self.read_counts(self.notify(chosen))

    def send(self, x: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor,
             plan: CountPlan) -> tuple[ExpertInputs, CountPlan]:
        """Second half: the payload and its metadata, split as the counts say."""
        st, E = self.state, self.num_local
        token = plan.order // plan.k
        flat_chosen = chosen.flatten()[plan.order]
        rows = x[token]
        meta = _meta(flat_chosen % E, weight.flatten()[plan.order])
        R = sum(plan.recv_splits)
        recv = st.all_to_all(x.new_empty((R, x.shape[1])), rows, plan.recv_splits,
                             plan.send_splits)
        rmeta = st.all_to_all(meta.new_empty((R, 2)), meta, plan.recv_splits, plan.send_splits)
        return ExpertInputs(recv, rmeta[:, 0].to(torch.int64), rmeta[:, 1]), plan

    def dispatch(self, x, chosen, weight, layer):
        plan = self.exchange_counts(chosen)  # no stop between the halves (see routed_split)
        return self.send(x, chosen, weight, plan)

    def routed_split(self, moe: GatherMoE, x: torch.Tensor, layer: int,
                     record: torch.Tensor | None = None) -> Generator[None, None, torch.Tensor]:
        """``routed`` in two steps: the first ``next`` routes and issues the count exchange,
        then stops (the safe boundary: P's count notification is out, its data movement is
        not); resuming reads the counts on the host, sends the payload, runs the local
        experts and the combine, and returns the routed output [n, H] fp32."""
        chosen, weight = route(moe, x, record)
        notice = self.notify(chosen)
        yield
        inputs, handle = self.send(x, chosen, weight, self.read_counts(notice))
        return self.combine(local_experts(moe, inputs), handle)

    def combine(self, y, handle):
        plan = handle
        back = self.state.all_to_all(y.new_empty((plan.n * plan.k, y.shape[1])), y,
                                     plan.send_splits, plan.recv_splits)
        pairs = torch.empty_like(back)
        pairs.index_copy_(0, plan.order, back)
        return pairs.view(plan.n, plan.k, y.shape[1]).sum(dim=1, dtype=COMBINE_DTYPE)


def new_dispatchers(kind: str, groups: ParallelGroups, num_local: int, topk: int,
                    capacity: int = 0, *, hidden: int = 0, max_decode_tokens: int = 0,
                    p_sms: int = 20, timeout_s: float = 60.0
                    ) -> tuple[Dispatcher, Dispatcher] | None:
    """``model.moe_dispatch`` at model build: None for "gather" (GatherComm's path), else
    (P's, D's) dispatchers, each on its own PhaseState (collective: new communicators).
    "deepep" (model/deepep.py) also needs the hidden size, D's most rows per rank, P's SM
    budget and the host-wait bound."""
    if kind == "gather":
        return None
    if kind not in ("alltoall", "deepep"):
        raise ValueError(f"model.moe_dispatch {kind!r}: no such backend here (gather, "
                         "alltoall, deepep)")
    if groups.layout.etp != 1:
        raise ValueError(f"model.moe_dispatch {kind!r} needs expert TP 1 (parallel.ep == "
                         f"world_size), got {groups.layout.name}")
    states = new_phase_states(groups)
    if kind == "deepep":
        from colo_rollout.model.deepep import new_deepep_dispatchers  # imports deep_ep

        return new_deepep_dispatchers(states, num_local, num_local * states["D"].size,
                                      hidden, topk, max_decode_tokens, p_sms, timeout_s)
    return (VariableAllToAll(states["P"], num_local),
            PaddedAllToAll(states["D"], num_local, topk, capacity))
