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

import collections

import contextlib
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.resharding import planner as _planner
from megatron.core.resharding import refit as _refit
from megatron.core.resharding import swap_model_weights
from megatron.core.resharding.copy_services.base import (
    CopyService,
    RecvOp,
    SendOp,
    match_local_ops_by_task_id,
)

from colo_rollout.model.weights import DUPLICATED
from colo_rollout.rl.multi_copy import MultiCopy, eligible


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


# the sync's own gloo group's timeout where the caller names none (WeightSync(timeout_s=);
# the train loop passes parallel.timeout_s) and the default process group does not say its
# own (init_parallel makes it parallel.timeout_s): far below gloo's 30-minute default
DEFAULT_TIMEOUT_S = 300.0


def _timeout_s(timeout_s: float | None) -> float:
    """The sync group's timeout: the caller's, else the default process group's (found by
    probing: WeightSync() as the README builds it waited 300 s for a peer that had failed
    within parallel.timeout_s), else DEFAULT_TIMEOUT_S."""
    if timeout_s is not None:
        return timeout_s
    from colo_rollout.runtime.parallel import default_timeout_s

    return default_timeout_s() or DEFAULT_TIMEOUT_S


class CpuCopyService(CopyService):
    """Batched send/recv of CPU tensors over a gloo group; same-rank pairs copy locally."""

    def __init__(self, group=None, timeout_s: float | None = None) -> None:
        import datetime

        super().__init__(group=group)
        timeout_s = _timeout_s(timeout_s)
        # (a collective: a rank that never makes it times the others out within timeout_s)
        self.own_pg = group is None  # made here: close() destroys it
        try:
            self.pg = group if group is not None else dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:  # (found by probing: gloo's bare 'Wait timeout')
            text = " ".join(str(e).split())[:200]
            if "Too many open files" in text:  # (found by probing: blamed on a late rank)
                raise RuntimeError(f"WeightSync(): this process is out of file handles for "
                                   f"the sync's process group ({text}); each WeightSync() "
                                   "makes one: build one and reuse it for every step, or "
                                   "close() the ones done with") from e
            raise RuntimeError(f"WeightSync(): building it is collective (its process group) "
                               f"and not every rank took part within {timeout_s:g} s: "
                               f"{text}") from e
        self.send_ops: list[SendOp] = []
        self.recv_ops: list[RecvOp] = []
        self.bytes_moved = 0  # remote bytes of the last run
        self.bytes_local = 0  # same-rank bytes of the last run
        self.record: list | None = None  # LocalReplay's recording of the same-rank pairs
        self.remote_ops = 0  # point-to-point ops of the runs since the recording started

    def close(self) -> None:
        """The process group this service made, destroyed (its sockets and file handles)."""
        if self.own_pg and self.pg is not None:
            dist.destroy_process_group(self.pg)
        self.pg = None

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


@contextlib.contextmanager
def _duplicated_whole():
    """megatron's planner, for the duration of one plan, with the parameters an inference
    model holds whole on every attention-TP rank (``weights.DUPLICATED``: MLA's down
    projections) described as a TP group of their own rank. The planner sizes a tensor that
    is not TP-split by its model's TP group (local rows x group size), so a whole tensor on an
    ATP-2 rank would read as twice its size; a group of one makes it whole, and a TP
    trainer's row shards are gathered into it."""
    inner = _planner.extract_param_metadata

    def described(param, name, owner_rank, *args, **kwargs):
        meta = inner(param, name, owner_rank, *args, **kwargs)
        if getattr(param, DUPLICATED, False):
            meta.is_tp, meta.tensor_parallel_group_ranks = False, [owner_rank]
        return meta

    _planner.extract_param_metadata = described
    try:
        yield
    finally:
        _planner.extract_param_metadata = inner


def _unwrapped(name: str) -> str:
    """A parameter or buffer name without megatron's wrappers (Float16Module, DDP: 'module.')."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


class BufferSync:
    """Copies the persistent buffers that are weights -- the routers' score-correction bias
    (megatron's ``expert_bias``, which aux-loss-free balancing updates in training) -- from the
    trainer into the inference model. megatron's refit plans parameters only. Both models hold
    the whole buffer on every rank (the router is replicated), so this is a local copy.

    The pairs are found once (a walk over both models' modules costs milliseconds at thousands
    of modules); each call reads the buffers from their modules by name, so a buffer that was
    re-assigned is still the one copied."""

    SUFFIX = ".router.expert_bias"

    def __init__(self, trainer_model: torch.nn.Module, inference_model: torch.nn.Module) -> None:
        src = {_unwrapped(n): n for n, _ in trainer_model.named_buffers()
               if n.endswith(self.SUFFIX)}
        t_mods, i_mods = dict(trainer_model.named_modules()), dict(inference_model.named_modules())
        self.pairs = []
        for name, dst in inference_model.named_buffers():
            if not name.endswith(self.SUFFIX):
                continue
            got = src.get(_unwrapped(name))
            if got is None or trainer_model.get_buffer(got).shape != dst.shape:
                raise KeyError(f"weight sync: the trainer has no router buffer matching "
                               f"{name!r} {tuple(dst.shape)}")
            leaf = self.SUFFIX.rsplit(".", 1)[1]
            self.pairs.append((t_mods[got.rsplit(".", 1)[0]], i_mods[name.rsplit(".", 1)[0]],
                               leaf))
        if len(self.pairs) != len(src):
            raise KeyError(f"weight sync: the trainer has {len(src)} router expert-bias "
                           f"buffers, the inference model {len(self.pairs)}")

    def __call__(self) -> int:
        """Copies every pair; returns how many."""
        with torch.no_grad():
            for t_mod, i_mod, leaf in self.pairs:
                getattr(i_mod, leaf).copy_(getattr(t_mod, leaf))
        return len(self.pairs)


@dataclass
class SyncStats:
    version: int
    seconds: float
    bytes_remote: int
    bytes_local: int
    path: str = "plan"  # "replay": LocalReplay's batched copies; "plan": megatron's refit


def _layout(params: list[torch.Tensor]) -> list[tuple]:
    """Each parameter's shape, strides, storage offset and dtype, in parameter order."""
    return [(tuple(p.shape), p.stride(), p.storage_offset(), p.dtype) for p in params]


class LocalReplay:
    """A refit whose every transfer was same-rank and straight between parameters: each
    (trainer slice, inference slice) pair a view of the parameters themselves (no staging
    buffer, no write-back, no transform, no point-to-point op). Replaying those pairs is the
    whole sync -- the plan's per-op Python (views, submits, matching) is gone, one batched
    copy per dtype is left -- for as long as both models' parameters keep their layouts.

    Per call the host work, not the bytes, sets the time (thousands of tensors against ~9 ms
    of bytes at HBM speed), so at the recording:
      * pairs that continue each other in both storages merge (megatron's plan moves a GLU
        weight as its gate and up halves: two copies become one);
      * a merged pair that is a whole parameter of the same shape on both sides is kept as
        the two Parameter objects -- they outlive ``p.data`` replacements, which is how the
        engine frees and restores memory (worker/memory.py) -- in lists made once, so a
        replay of such pairs is one launch per dtype pair: rl/multi_copy.py's table of
        chunks on CUDA (no host work per tensor; its addresses re-read when a pointer
        moved), else one ``torch._foreach_copy_``;
      * any other pair is kept as (parameter index, size, stride, offset) and rebuilt as a
        view at each replay (holding views would keep alive storages the engine frees).
    The layouts are re-read only when a data pointer moved; nothing walks the modules.
    Invariant: the models' Parameter objects are the ones listed at the recording (a model
    that replaces its Parameters needs a new WeightSync)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 trainer: torch.nn.Module, inference: torch.nn.Module) -> None:
        self.params = (list(trainer.parameters()), list(inference.parameters()))
        self.layouts = (_layout(self.params[0]), _layout(self.params[1]))
        self.ptrs = self._ptrs()
        src, dst = _owners(self.params[0]), _owners(self.params[1])
        static: dict[tuple, tuple[list, list]] = {}
        self.views: list[tuple[tuple, tuple]] = []  # (src, dst) descriptors built per replay
        self.static_bytes = 0
        for s_, d_ in _merged([(_describe(s_, src), _describe(d_, dst)) for s_, d_ in pairs]):
            ws, wd = _whole(s_, src), _whole(d_, dst)
            if ws is not None and wd is not None \
                    and self.params[0][ws].shape == self.params[1][wd].shape:
                ps, pd = self.params[0][ws], self.params[1][wd]
                d_list, s_list = static.setdefault((pd.device, pd.dtype, ps.dtype), ([], []))
                d_list.append(pd)
                s_list.append(ps)
                self.static_bytes += pd.numel() * pd.element_size()
            else:
                self.views.append((s_, d_))
        # per (device, dtypes) group: its lists and, where every pair is a same-dtype
        # contiguous copy on CUDA, the one-launch copy of them
        self.static = [(d_list, s_list, _multi_copy(d_list, s_list))
                       for d_list, s_list in static.values()]
        self._moved = False  # a data pointer moved since the copy tables were built

    def _ptrs(self) -> tuple[list[int], list[int]]:
        return [p.data_ptr() for p in self.params[0]], [p.data_ptr() for p in self.params[1]]

    @staticmethod
    def direct(pairs: list, trainer: torch.nn.Module, inference: torch.nn.Module) -> bool:
        """Every pair is a view of a trainer parameter into a view of an inference one."""
        src, dst = _owners(list(trainer.parameters())), _owners(list(inference.parameters()))
        return bool(pairs) and all(s.untyped_storage().data_ptr() in src
                                   and d.untyped_storage().data_ptr() in dst
                                   for s, d in pairs)

    def valid(self) -> bool:
        """The parameters still have the recorded layouts (re-read when a pointer moved)."""
        ptrs = self._ptrs()
        if ptrs == self.ptrs:
            return True
        if (_layout(self.params[0]), _layout(self.params[1])) != self.layouts:
            return False
        self.ptrs = ptrs
        self._moved = True
        return True

    def run(self) -> int:
        src, dst = self.params
        moved, self._moved = self._moved, False
        with torch.no_grad():
            for d_list, s_list, multi in self.static:
                if multi is None:
                    torch._foreach_copy_(d_list, s_list)
                    continue
                if moved:
                    multi.refresh()
                multi.run()
        return self.static_bytes + copy_tensors(
            [(_view(src, a), _view(dst, b)) for a, b in self.views])


def _multi_copy(d_list: list, s_list: list) -> MultiCopy | None:
    if all(eligible(d, s) for d, s in zip(d_list, s_list)):
        return MultiCopy(d_list, s_list)
    return None


def _owners(params: list[torch.Tensor]) -> dict:
    """Storage address -> the index of a parameter in it (parameters may share a storage: the
    engine's experts are views of one stack); (address, offset, numel) -> the index of the
    contiguous parameter that spans exactly that range."""
    owners: dict = {}
    for i, p in enumerate(params):
        ptr = p.untyped_storage().data_ptr()
        owners[ptr] = i
        if p.is_contiguous():
            owners[(ptr, p.storage_offset(), p.numel())] = i
    return owners


def _describe(view: torch.Tensor, owners: dict) -> tuple:
    """(storage address, index of a parameter in that storage, size, stride, offset):
    as_strided on any tensor of a storage addresses all of it."""
    ptr = view.untyped_storage().data_ptr()
    return (ptr, owners[ptr], tuple(view.shape), view.stride(), view.storage_offset())


def _flat(d: tuple) -> tuple | None:
    """(address, offset, numel) of a descriptor that is one contiguous range, else None."""
    ptr, _, size, stride, offset = d
    n, want = 1, 1
    for sz, st in zip(reversed(size), reversed(stride)):
        if sz != 1 and st != want:
            return None  # not row-major dense
        want *= sz
        n *= sz
    return (ptr, offset, n)


def _merged(pairs: list[tuple[tuple, tuple]]) -> list[tuple[tuple, tuple]]:
    """Consecutive pairs whose source and destination ranges both continue the previous
    pair's, as one flat pair."""
    out: list[tuple[tuple, tuple]] = []
    for s_, d_ in pairs:
        fs, fd = _flat(s_), _flat(d_)
        if out and fs is not None and fd is not None:
            ps, pd = _flat(out[-1][0]), _flat(out[-1][1])
            if (ps is not None and pd is not None and ps[0] == fs[0] and pd[0] == fd[0]
                    and ps[1] + ps[2] == fs[1] and pd[1] + pd[2] == fd[1]):
                n = ps[2] + fs[2]
                out[-1] = ((ps[0], out[-1][0][1], (n,), (1,), ps[1]),
                           (pd[0], out[-1][1][1], (n,), (1,), pd[1]))
                continue
        out.append((s_, d_))
    return out


def _whole(d: tuple, owners: dict) -> int | None:
    """The index of the parameter that ``d`` spans exactly, or None."""
    f = _flat(d)
    return None if f is None else owners.get(f)


def _view(params: list[torch.Tensor], d: tuple) -> torch.Tensor:
    _, i, size, stride, offset = d
    return params[i].data.as_strided(size, stride, offset)


# megatron config fields that fix the tensors a sync moves: equal in both models, or the plan
# drops or misses tensors (megatron's own errors name neither model)
SHAPE_FIELDS = ("multi_latent_attention", "num_layers", "hidden_size", "num_attention_heads",
                "num_query_groups", "kv_channels", "num_moe_experts", "moe_ffn_hidden_size",
                "mtp_num_layers", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                "qk_pos_emb_head_dim", "v_head_dim")
# megatron config fields that change what the weights compute without changing a shape: a
# trainer that differs in one trains another function than the engine serves (found by
# probing: a top-1 trainer beside a top-2 engine synced without a word, logprob gaps to 1.9)
MATH_FIELDS = ("layernorm_epsilon", "normalization", "gated_linear_unit", "moe_router_topk",
               "moe_router_score_function", "moe_router_pre_softmax",
               "moe_router_topk_scaling_factor", "moe_router_num_groups",
               "moe_router_group_topk", "rope_type", "rotary_base", "rotary_scaling_factor",
               "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
               "mscale_all_dim", "yarn_rotary_scaling_factor",
               "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
               "yarn_mscale", "yarn_mscale_all_dim")


def check_pair(trainer_model, inference_model) -> None:
    """The two arguments are a megatron trainer model and the engine's model (in that order),
    with equal shapes (``SHAPE_FIELDS``), the same function of their weights (``MATH_FIELDS``,
    and the rotary frequencies: base, partial rotary, scaling): a TypeError or ValueError
    naming the argument or the field otherwise. (Swapped, the sync would overwrite the trainer with the engine's weights;
    a trainer of more layers lost the extra ones silently.)"""
    from colo_rollout.model.model import InferenceGPT

    for name, m in (("trainer_model", trainer_model), ("inference_model", inference_model)):
        if not isinstance(m, torch.nn.Module) or getattr(m, "config", None) is None:
            raise TypeError(f"WeightSync: {name} must be a megatron model (a torch module with "
                            f"a config), got {type(m).__name__}")
    if isinstance(trainer_model, InferenceGPT):
        raise TypeError("WeightSync(trainer_model, inference_model): the first argument is the "
                        "engine's model -- swapped arguments (the sync would overwrite the "
                        "trainer)")
    if not isinstance(inference_model, InferenceGPT):
        raise TypeError(f"WeightSync: inference_model must be the engine's model "
                        f"(engine.model), got {type(inference_model).__name__}")
    tc, ic = trainer_model.config, inference_model.config
    for field in SHAPE_FIELDS:
        a, b = getattr(tc, field, None), getattr(ic, field, None)
        if field == "num_query_groups":  # None: one group per head
            a, b = a or tc.num_attention_heads, b or ic.num_attention_heads
        if field == "mtp_num_layers":  # the layers the models hold: a trainer that freezes
            # its MTP layer (rl.mtp_loss_scale 0) sets the config's count to None
            a, b = _mtp_layers(trainer_model), _mtp_layers(inference_model)
        if (a or 0) != (b or 0):
            raise ValueError(f"WeightSync: the trainer's {field} is {a}, the inference "
                             f"model's {b}: the two models must have one shape")
    for field in MATH_FIELDS:
        a, b = getattr(tc, field, None), getattr(ic, field, None)
        if a != b:
            raise ValueError(f"WeightSync: the trainer's {field} is {a!r}, the inference "
                             f"model's {b!r}: the two models must compute one function")
    core = trainer_model
    while hasattr(core, "module"):  # DDP(Float16Module(GPTModel)): every wrapper
        core = core.module
    mine = getattr(getattr(core, "rotary_pos_emb", None), "inv_freq", None)
    theirs = getattr(getattr(inference_model, "rotary_pos_emb", None), "inv_freq", None)
    if mine is not None and theirs is not None and (
            mine.shape != theirs.shape
            or not torch.allclose(mine.float().cpu(), theirs.float().cpu(), rtol=1e-6)):
        raise ValueError("WeightSync: the trainer's rotary frequencies (rotary_base, "
                         "rotary_percent or RoPE scaling) are not the inference model's: the "
                         "two models must compute one function")
    vocab = getattr(core, "vocab_size", None)
    if vocab is not None and vocab != inference_model.cfg.vocab_size:
        raise ValueError(f"WeightSync: the trainer's vocab_size is {vocab}, the inference "
                         f"model's {inference_model.cfg.vocab_size}: the two models must have "
                         "one shape")
    # a tensor the trainer has and the engine lacks (a q/k norm, a q/k/v bias, a shared
    # expert) would be dropped by the planner without a word: the engine would serve another
    # model than the trainer's
    lost = sorted(_kinds(trainer_model) - _kinds(inference_model))
    if lost:
        raise ValueError(f"WeightSync: the trainer has {lost[0]} (and {len(lost) - 1} more "
                         "kinds of tensor) that the inference model does not: the two models "
                         "must be one architecture")


def _mtp_layers(model: torch.nn.Module) -> int:
    """How many MTP layers the model's parameters hold (``mtp.layers.{j}.``)."""
    return len({_unwrapped(n).split(".")[2] for n, _ in model.named_parameters()
                if _unwrapped(n).startswith("mtp.layers.")})


def _kinds(model: torch.nn.Module) -> set[str]:
    """The model's parameter names with expert and layer indices starred: what kinds of
    tensor it holds, whatever its layout (each rank holds other experts)."""
    return {re.sub(r"\.\d+\.", ".*.", re.sub(r"weight\d+$", "weight*", n))
            for n, _ in RefitView(model).named_parameters()}


def check_resident(inference_model) -> None:
    """The engine's weights are in place: after ``engine.release_memory`` (offload, discard)
    the parameters are empty tensors until ``resume_memory`` (worker/memory.py)."""
    for p in inference_model.parameters():
        if p.numel() == 0:
            raise RuntimeError("WeightSync: the inference model's weights are released "
                               "(engine.release_memory): call engine.resume_memory() before "
                               "the sync")


class WeightSync:
    """Refits ``inference_model`` from ``trainer_model`` (collective on every rank).

    The inference model must expose megatron's ``config`` and ``pg_collection`` (its groups
    decide which shard each rank holds); the plan is built on the first call and cached."""

    def __init__(self, group=None, timeout_s: float | None = None,
                 check_finite: bool = False) -> None:
        # timeout_s: the sync's waits on its peers (CPU ranks' gloo group); None: the default
        # process group's timeout (parallel.timeout_s under init_parallel)
        # check_finite: refuse a trainer whose weights hold NaN or inf (a pass over every
        # trainer byte: ~half the sync's own time, so off by default -- rl/trainer.py refuses
        # a non-finite step before its optimizer writes, which is where they come from)
        self.check_finite = check_finite
        if torch.cuda.is_available():
            self.service = new_gpu_copy_service(group)
        else:
            self.service = CpuCopyService(group, timeout_s)
        self.version = 0
        # the latest syncs' stats (bounded: a long run syncs every step)
        self.history: collections.deque[SyncStats] = collections.deque(maxlen=1024)
        self._views: dict = {}  # (trainer id, inference id) -> views
        self._plans: dict = {}  # (trainer id, inference id) -> megatron's plan-cache entries
        self._replays: dict = {}  # (trainer id, inference id) -> LocalReplay
        self._buffers: dict = {}  # (trainer id, inference id) -> BufferSync
        self.group = group
        self.closed = False

    def close(self) -> None:
        """Free what this sync holds: its plans and buffers, and the process group it made
        (CPU ranks: a gloo group per WeightSync -- one built per step without close() ran a
        run out of file handles; build one and reuse it). Using it afterwards raises."""
        closing = getattr(self.service, "close", None)
        if closing is not None:
            closing()
        self._views.clear()
        self._plans.clear()
        self._replays.clear()
        self._buffers.clear()
        self.closed = True

    def __enter__(self) -> "WeightSync":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _everywhere(self, ok: bool, device: torch.device) -> bool:
        """``ok`` on every rank (collective: a replay skips megatron's collective plan, so all
        ranks must take the same path)."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return ok
        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _agree(self, trainer_model, inference_model, first: bool) -> None:
        """Before anything is written, on every rank alike: the pair is one architecture
        (first call), the engine's weights are resident and it serves nothing (a sync under
        requests in flight would mix the two models in their tokens), and the trainer's
        weights are finite. One all-gather of each rank's verdict over the engine's control
        group: a problem on any rank raises on every rank, naming it -- a rank-local refusal
        would leave the others waiting in the sync's collectives. (The finiteness check runs
        with ``check_finite`` only.)"""
        problem = None
        try:
            if first:
                check_pair(trainer_model, inference_model)
            check_resident(inference_model)
            serving = getattr(inference_model, "serving", None)
            if serving is not None and serving():
                raise RuntimeError("WeightSync: the engine has requests in flight; finish them "
                                   "or engine.pause() before the sync (their tokens would mix "
                                   "the old and the new weights)")
            params = [p for p in trainer_model.parameters() if p.numel()
                      and self.check_finite]
            if params:
                from colo_rollout.runtime.device import fp32_norms

                if not bool(torch.isfinite(fp32_norms(params)).all()):
                    name = next(n for n, p in trainer_model.named_parameters()
                                if p.numel() and not bool(torch.isfinite(p).all()))
                    raise ValueError(f"WeightSync: the trainer's {_unwrapped(name)} is not "
                                     "finite (NaN or inf): not synced into the engine")
        except (TypeError, ValueError, RuntimeError) as e:
            problem = [type(e).__name__, str(e)]
        from colo_rollout.runtime.control import first_problem

        groups = getattr(inference_model, "groups", None)
        got = first_problem(problem, groups.control if groups else None,
                            groups.layout.world_size if groups else 1, "WeightSync")
        if got is not None:
            r, p = got
            kind = {"TypeError": TypeError, "ValueError": ValueError}.get(p[0], RuntimeError)
            raise kind(p[1] if p == problem else f"rank {r}: {p[1]}")

    def __call__(self, trainer_model, inference_model) -> SyncStats:
        if self.closed:
            raise RuntimeError("WeightSync: this sync was closed; build a new one")
        t0 = time.perf_counter()
        pair = (id(trainer_model), id(inference_model))  # the views keep both alive: ids stay
        self._agree(trainer_model, inference_model, first=pair not in self._views)
        if pair not in self._views:
            self._views[pair] = (RefitView(trainer_model), RefitView(inference_model))
        views = self._views[pair]
        device = next(inference_model.parameters()).device
        replay = self._replays.get(pair)
        if replay is not None and self._everywhere(replay.valid(), device):
            moved = replay.run()  # the whole sync, batched
            self.service.bytes_moved, self.service.bytes_local = 0, moved
            path = "replay"
        else:
            path = "plan"
            self._replays.pop(pair, None)
            self.service.record, self.service.remote_ops = [], 0
            # megatron caches plans in one process-wide dict keyed by rank and group sizes,
            # not by model: a plan built for another pair of the same layout (another
            # architecture, or the same shapes in other objects) would be replayed on this
            # one. Install this pair's own plans around the call.
            _refit._plan_cache.clear()
            _refit._plan_cache.update(self._plans.get(pair, {}))
            try:
                with _duplicated_whole():
                    swap_model_weights(views[0], views[1], self.service)
            except RuntimeError as e:  # gloo / NCCL's own words: say whose operation it was
                raise RuntimeError(f"WeightSync: the sync's transfers failed on this rank "
                                   f"(a rank that did not join the sync, or left it?): "
                                   f"{' '.join(str(e).split())[:300]}") from e
            finally:
                record, self.service.record = self.service.record, None
            self._plans[pair] = dict(_refit._plan_cache)
            direct = (self.service.remote_ops == 0
                      and LocalReplay.direct(record, trainer_model, inference_model))
            if self._everywhere(direct, device):
                self._replays[pair] = LocalReplay(record, trainer_model, inference_model)
        if pair not in self._buffers:
            self._buffers[pair] = BufferSync(trainer_model, inference_model)
        self._buffers[pair]()
        refresh = getattr(inference_model, "weights_updated", None)
        if refresh is not None:  # model.fp8: re-quantise the FP8 copies of what was written
            refresh()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.version += 1
        # the engine's count of weight writes: a partial rollout's carry checks its resume's
        # weight_version against it (rl/rollout.py)
        inference_model.weight_epoch = getattr(inference_model, "weight_epoch", 0) + 1
        stats = SyncStats(self.version, time.perf_counter() - t0,
                          getattr(self.service, "bytes_moved", -1),
                          getattr(self.service, "bytes_local", -1), path)
        self.history.append(stats)
        return stats
