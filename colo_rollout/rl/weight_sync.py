"""Weight sync after each optimizer step: training layout -> inference layout.

Owns the hook that refits the inference model from the trainer through megatron-core's
resharding (``megatron.core.resharding.swap_model_weights``): megatron builds a transfer plan
from both models' parameter metadata (TP partition dims, expert ownership from their
``pg_collection``), caches it per model pair, and a copy service moves the bytes -- same-rank
slices are local copies, the rest point-to-point.

The trainer's layouts (rl/trainer.py): TP1 x DP, EP x DP, TP x DP under sequence
parallelism with the experts TP-sharded over the same group (ETP = TP) and the embedding and
output vocab-parallel, and TP x EP (ETP 1: whole experts over EP groups carved out of TP x DP;
the planner reads expert ownership from the groups). Sequence parallelism splits activations only: no parameter's shape or
partition metadata changes (its norms, routers and gates are replicated over TP, marked
``sequence_parallel`` for the gradient sum), so the plan is the TP model's; the replicated
copies are identical on every TP rank after each step, so any of them is a valid source.

``CpuCopyService`` is a megatron ``CopyService`` for CPU tensors over gloo: megatron's own
``GlooCopyService`` stages through pinned memory and CUDA streams, which a CPU rank does not
have. On GPUs the NCCL service is used.

Must not go in here: optimizer logic, rollout scheduling.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.resharding import refit as _refit
from megatron.core.resharding import swap_model_weights
from megatron.core.resharding.copy_services.base import (
    CopyService,
    RecvOp,
    SendOp,
    match_local_ops_by_task_id,
)


def copy_tensors(pairs) -> int:
    """(src, dst) tensor pairs copied, batched: one ``torch._foreach_copy_`` per (device,
    dtypes) group instead of a Python-level ``copy_`` per tensor (a sync touches thousands of
    tensors; per call the host cost, not the bytes, set the time). Returns the bytes."""
    groups: dict[tuple, tuple[list, list]] = {}
    moved = 0
    for src, dst in pairs:
        d, s_ = groups.setdefault((dst.device, dst.dtype, src.dtype), ([], []))
        d.append(dst)
        s_.append(src)
        moved += dst.numel() * dst.element_size()
    with torch.no_grad():
        for d, s_ in groups.values():
            torch._foreach_copy_(d, s_)
    return moved


def local_copies(pairs, record: list | None = None) -> int:
    """The same-rank (send op, recv op) pairs' copies (``copy_tensors``); with ``record``
    the (src, dst) tensors are appended to it (``LocalReplay``)."""
    tensors = [(s.tensor, r.tensor) for s, r in pairs]
    if record is not None:
        record.extend(tensors)
    return copy_tensors(tensors)


def new_gpu_copy_service(group=None) -> CopyService:
    """megatron's NCCL copy service with the same-rank copies batched (``local_copies``) on
    its copy stream, after the current stream's work (the trainer's update)."""
    from megatron.core.resharding.copy_services.nccl_copy_service import NCCLCopyService

    class BatchedNCCLCopyService(NCCLCopyService):
        record: list | None = None  # LocalReplay's recording of the same-rank pairs
        remote_ops = 0  # point-to-point ops of the runs since the recording started

        def run(self) -> None:
            local_s = [s for s in self.send_ops if s.dest_rank == self.rank]
            local_r = [r for r in self.recv_ops if r.src_rank == self.rank]
            if local_s or local_r:
                pairs = match_local_ops_by_task_id(local_s, local_r, "BatchedNCCLCopyService",
                                                   self.rank)
                self._copy_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self._copy_stream):
                    local_copies(pairs, self.record)
                self.send_ops = [s for s in self.send_ops if s.dest_rank != self.rank]
                self.recv_ops = [r for r in self.recv_ops if r.src_rank != self.rank]
            self.remote_ops += len(self.send_ops) + len(self.recv_ops)
            super().run()  # the point-to-point rest; waits for the copy stream

    return BatchedNCCLCopyService(group=group)


class CpuCopyService(CopyService):
    """Batched send/recv of CPU tensors over a gloo group; same-rank pairs copy locally."""

    def __init__(self, group=None) -> None:
        super().__init__(group=group)
        self.pg = group if group is not None else dist.new_group(backend="gloo")
        self.send_ops: list[SendOp] = []
        self.recv_ops: list[RecvOp] = []
        self.bytes_moved = 0  # remote bytes of the last run
        self.bytes_local = 0  # same-rank bytes of the last run
        self.record: list | None = None  # LocalReplay's recording of the same-rank pairs
        self.remote_ops = 0  # point-to-point ops of the runs since the recording started

    def submit_send(self, src_tensor: torch.Tensor, dest_rank: int, task_id=None) -> None:
        self.send_ops.append(SendOp(task_id=task_id, tensor=src_tensor, dest_rank=dest_rank))

    def submit_recv(self, dest_tensor: torch.Tensor, src_rank: int, task_id=None) -> None:
        self.recv_ops.append(RecvOp(task_id=task_id, tensor=dest_tensor, src_rank=src_rank))

    def run(self) -> None:
        local_s = [s for s in self.send_ops if s.dest_rank == self.rank]
        local_r = [r for r in self.recv_ops if r.src_rank == self.rank]
        self.bytes_local = self.bytes_moved = 0
        self.bytes_local = local_copies(
            match_local_ops_by_task_id(local_s, local_r, "CpuCopyService", self.rank),
            self.record)
        self.remote_ops += (len(self.send_ops) - len(local_s)) + (len(self.recv_ops)
                                                                  - len(local_r))
        ops, staged = [], []
        for s in self.send_ops:
            if s.dest_rank != self.rank:
                buf = s.tensor.detach().contiguous()
                ops.append(dist.P2POp(dist.isend, buf, group=self.pg, group_peer=s.dest_rank))
                self.bytes_moved += buf.numel() * buf.element_size()
        for r in self.recv_ops:
            if r.src_rank != self.rank:
                buf = torch.empty(r.tensor.shape, dtype=r.tensor.dtype)
                staged.append((buf, r.tensor))
                ops.append(dist.P2POp(dist.irecv, buf, group=self.pg, group_peer=r.src_rank))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        with torch.no_grad():
            for buf, dst in staged:
                dst.copy_(buf)
        self.send_ops.clear()
        self.recv_ops.clear()


_SEQ_EXPERT = re.compile(r"^(.*)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")


class RefitView(torch.nn.Module):
    """A model as megatron's refit planner should see it.

    The planner maps per-expert tensors to global experts only for TE's grouped naming
    (``experts.linear_fc1.weight{k}``); megatron's ``SequentialMLP`` names them
    ``experts.local_experts.{k}.linear_fc1.weight``, which the planner would match by *local*
    index across EP ranks. The view yields the same Parameter objects (shared storage, their
    TP/EP attributes intact) under the grouped names; everything else passes through. The
    wrapped model is held as a plain attribute, not a child, so the planner sees exactly these
    tensors. Names are unwrapped (megatron's Float16Module and DDP prefix ``module.``): a
    half-precision trainer is a Float16Module, the inference model is not, and the planner
    matches parameters by name."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["inner"] = model
        self.config = model.config
        self.pg_collection = model.pg_collection

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        for name, p in self.inner.named_parameters(prefix, recurse, remove_duplicate):
            name = _unwrapped(name)
            m = _SEQ_EXPERT.match(name)
            yield (f"{m.group(1)}.mlp.experts.linear_fc{m.group(3)}.weight{m.group(2)}"
                   if m else name), p


def _unwrapped(name: str) -> str:
    """A parameter or buffer name without megatron's wrappers (Float16Module, DDP: 'module.')."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def sync_buffers(trainer_model: torch.nn.Module, inference_model: torch.nn.Module) -> int:
    """Copy the persistent buffers that are weights -- the routers' score-correction bias
    (megatron's ``expert_bias``, which aux-loss-free balancing updates in training) -- from the
    trainer into the inference model. megatron's refit plans parameters only. Both models hold
    the whole buffer on every rank (the router is replicated), so this is a local copy.
    Returns the number of buffers copied."""
    src = {_unwrapped(n): b for n, b in trainer_model.named_buffers()
           if n.endswith(".router.expert_bias")}
    n = 0
    with torch.no_grad():
        for name, dst in inference_model.named_buffers():
            if not name.endswith(".router.expert_bias"):
                continue
            got = src.get(_unwrapped(name))
            if got is None or got.shape != dst.shape:
                raise KeyError(f"weight sync: the trainer has no router buffer matching "
                               f"{name!r} {tuple(dst.shape)}")
            dst.copy_(got)
            n += 1
    if n != len(src):
        raise KeyError(f"weight sync: the trainer has {len(src)} router expert-bias buffers, "
                       f"the inference model {n}")
    return n


@dataclass
class SyncStats:
    version: int
    seconds: float
    bytes_remote: int
    bytes_local: int


def _layout(model: torch.nn.Module) -> list[tuple]:
    """Each parameter's shape, strides, storage offset and dtype, in parameter order."""
    return [(tuple(p.shape), p.stride(), p.storage_offset(), p.dtype)
            for p in model.parameters()]


class LocalReplay:
    """A refit whose every transfer was same-rank and straight between parameters: each
    (trainer slice, inference slice) pair a view of the parameters themselves (no staging
    buffer, no write-back, no transform, no point-to-point op). Replaying those pairs is the
    whole sync -- the plan's per-op Python (views, submits, matching) is gone, one batched
    copy per dtype is left -- for as long as both models' parameters keep their shapes.

    The pairs are kept as (parameter index, size, stride, offset) descriptors, not tensors,
    and rebuilt on the live parameters at each replay: holding views would keep storages
    alive that the engine frees between RL phases (worker/memory.py replaces ``p.data``)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 trainer: torch.nn.Module, inference: torch.nn.Module) -> None:
        self.layouts = (_layout(trainer), _layout(inference))
        src, dst = _owners(trainer), _owners(inference)
        self.pairs = [(_describe(s, src), _describe(d, dst)) for s, d in pairs]

    @staticmethod
    def direct(pairs: list, trainer: torch.nn.Module, inference: torch.nn.Module) -> bool:
        """Every pair is a view of a trainer parameter into a view of an inference one."""
        src, dst = _owners(trainer), _owners(inference)
        return bool(pairs) and all(s.untyped_storage().data_ptr() in src
                                   and d.untyped_storage().data_ptr() in dst
                                   for s, d in pairs)

    def valid(self, trainer: torch.nn.Module, inference: torch.nn.Module) -> bool:
        return self.layouts == (_layout(trainer), _layout(inference))

    def run(self, trainer: torch.nn.Module, inference: torch.nn.Module) -> int:
        src, dst = list(trainer.parameters()), list(inference.parameters())
        return copy_tensors([(_view(src, a), _view(dst, b)) for a, b in self.pairs])


def _owners(model: torch.nn.Module) -> dict[int, int]:
    """Storage address -> the index of the parameter that owns it."""
    return {p.untyped_storage().data_ptr(): i for i, p in enumerate(model.parameters())}


def _describe(view: torch.Tensor, owners: dict[int, int]) -> tuple:
    return (owners[view.untyped_storage().data_ptr()], tuple(view.shape), view.stride(),
            view.storage_offset())


def _view(params: list[torch.Tensor], d: tuple) -> torch.Tensor:
    i, size, stride, offset = d
    return params[i].data.as_strided(size, stride, offset)


class WeightSync:
    """Refits ``inference_model`` from ``trainer_model`` (collective on every rank).

    The inference model must expose megatron's ``config`` and ``pg_collection`` (its groups
    decide which shard each rank holds); the plan is built on the first call and cached."""

    def __init__(self, group=None) -> None:
        if torch.cuda.is_available():
            self.service = new_gpu_copy_service(group)
        else:
            self.service = CpuCopyService(group)
        self.version = 0
        self.history: list[SyncStats] = []
        self._views: dict = {}  # (trainer id, inference id) -> views
        self._plans: dict = {}  # (trainer id, inference id) -> megatron's plan-cache entries
        self._replays: dict = {}  # (trainer id, inference id) -> LocalReplay
        self.group = group

    def _everywhere(self, ok: bool, device: torch.device) -> bool:
        """``ok`` on every rank (collective: a replay skips megatron's collective plan, so all
        ranks must take the same path)."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return ok
        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def __call__(self, trainer_model, inference_model) -> SyncStats:
        t0 = time.perf_counter()
        pair = (id(trainer_model), id(inference_model))  # the views keep both alive: ids stay
        views = self._views.setdefault(pair, (RefitView(trainer_model),
                                              RefitView(inference_model)))
        device = next(inference_model.parameters()).device
        replay = self._replays.get(pair)
        if replay is not None and self._everywhere(
                replay.valid(trainer_model, inference_model), device):
            moved = replay.run(trainer_model, inference_model)  # the whole sync, batched
            self.service.bytes_moved, self.service.bytes_local = 0, moved
        else:
            self._replays.pop(pair, None)
            self.service.record, self.service.remote_ops = [], 0
            # megatron caches plans in one process-wide dict keyed by rank and group sizes,
            # not by model: a plan built for another pair of the same layout (another
            # architecture, or the same shapes in other objects) would be replayed on this
            # one. Install this pair's own plans around the call.
            _refit._plan_cache.clear()
            _refit._plan_cache.update(self._plans.get(pair, {}))
            try:
                swap_model_weights(views[0], views[1], self.service)
            finally:
                record, self.service.record = self.service.record, None
            self._plans[pair] = dict(_refit._plan_cache)
            direct = (self.service.remote_ops == 0
                      and LocalReplay.direct(record, trainer_model, inference_model))
            if self._everywhere(direct, device):
                self._replays[pair] = LocalReplay(record, trainer_model, inference_model)
        sync_buffers(trainer_model, inference_model)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.version += 1
        stats = SyncStats(self.version, time.perf_counter() - t0,
                          getattr(self.service, "bytes_moved", -1),
                          getattr(self.service, "bytes_local", -1))
        self.history.append(stats)
        return stats
