"""Release and resume of a worker's device memory between phases (colocated RL).

While the trainer runs on the same GPUs, rollout memory is dead weight. ``release`` gives back
the KV cache, the D and P graphs (their private memory pools, P's buffers) and, optionally, the
inference weights;
``resume`` brings them back before the next rollout.

Weights:
  * ``keep``     -- stay on the device (the cheap default when memory allows);
  * ``offload``  -- copied to pinned host memory and restored on resume (bit-identical);
  * ``discard``  -- dropped; resume allocates NaN-filled storage, which the weight-sync hook
    fills in place (every parameter is overwritten by a sync). Generating before that raises.

Owned by the worker (worker/worker.py: the memory is its model's, KV storage's and graphs');
the serving engine checks that it is idle, evicts its retained contexts and passes the drain of
its streams (``Engine.release_memory``).

Invariants:
  * release needs an idle engine (no request in flight, no P epoch): live KV would be lost.
    Retained multi-turn contexts are evicted (their next turn re-prefills; counted here).
  * Parameters keep their identity (``p.data`` is swapped, the Parameter object stays), so the
    weight-sync plan and optimizer-free inference modules stay valid; the grouped-expert stacks
    and the D and P graphs see replaced storage and are rebuilt lazily.
  * The host agreement (shared-memory control exchange, PD rendezvous) is not touched: the
    engine steps again after resume. (Release once closed it with the graphs, and every later
    step exchanged over gloo, ~7x slower on 2x H200.)
  * Device memory is returned to the driver (``empty_cache``) so the trainer can use it.
  * A release that raises part-way leaves a state ``resume`` undoes: ``released`` is set as
    soon as the KV storage is gone (to the weight policy before any weight moves), and resume
    restores what was moved and leaves what was not (a discard's weights are NaN-filled all
    the same: ``weights_loaded()`` stays the gate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_POLICIES = ("keep", "offload", "discard")


@dataclass
class MemoryReport:
    """torch.cuda allocator statistics (bytes) around one release/resume."""

    allocated: int
    reserved: int

    @staticmethod
    def now(device: torch.device) -> MemoryReport:
        if device.type != "cuda":
            return MemoryReport(0, 0)
        torch.cuda.synchronize(device)
        return MemoryReport(torch.cuda.memory_allocated(device),
                            torch.cuda.memory_reserved(device))


class WorkerMemory:
    def __init__(self, model, runner, device: torch.device) -> None:
        self.model, self.runner, self.device = model, runner, device
        self.released: str | None = None  # the weight policy of the current release
        self._host: dict[str, torch.Tensor] = {}
        self.weights_valid = True
        self.evicted = 0  # retained contexts the engines evicted for a release
        # what "discard" must re-allocate on resume (the parameters are empty until then)
        self._shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}

    def release(self, weights: str, drain) -> MemoryReport:
        """Give the KV storage, the graphs and (by ``weights``) the weights back. ``drain()``
        waits for the serving engine's streams: nothing may still use what is dropped."""
        if weights not in WEIGHT_POLICIES:
            raise ValueError(f"release weights={weights!r}: expected one of {WEIGHT_POLICIES}")
        if self.released is not None:
            raise RuntimeError("engine memory is already released")
        # both streams drained, then the KV storage and the graphs dropped; the host agreement
        # (control exchange, rendezvous) stays: the engine serves again after resume
        drain()
        self.runner.release_kv()
        self.released = weights  # from here, resume() undoes whatever this release did
        if weights != "keep":
            self.weights_valid = False
            for moe in self.model.moe_layers():
                moe.drop_stack()  # else the stacks keep the expert weights alive
            self.model.drop_fp8()  # model.fp8: remade from the weights on resume / sync
            pin = self.device.type == "cuda"
            for name, p in self.model.named_parameters():
                if weights == "offload":
                    self._host[name] = p.data.to("cpu", copy=True).pin_memory() if pin \
                        else p.data.to("cpu", copy=True)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if self.device.type == "cuda":
            # cuBLAS keeps a workspace per (handle, stream) in the caching allocator (32 MiB
            # each on sm90); they are re-created on the next GEMM
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
        return MemoryReport.now(self.device)

    def resume(self, drain) -> MemoryReport:
        if self.released is None:
            raise RuntimeError("engine memory is not released")
        if self.released != "keep":
            params = dict(self.model.named_parameters())
            shapes = self._shapes
            for name, p in params.items():
                if self.released == "offload":
                    if name in self._host:  # (a release that failed part-way moved not all)
                        p.data = self._host.pop(name).to(p.device, non_blocking=True)
                else:  # NaN until written: weights_loaded() names any left unwritten
                    p.data = torch.full(shapes[name], float("nan"), dtype=p.dtype,
                                        device=p.device)
            self.weights_valid = self.released == "offload"
            if self.weights_valid:
                self.model.weights_updated()  # model.fp8: the restored weights' FP8 copies
        self.runner.resume_kv()
        self.released = None
        drain()
        return MemoryReport.now(self.device)

    def check_ready(self) -> None:
        if self.released is not None:
            raise RuntimeError("engine memory is released: call resume_memory() first")
        if not self.weights_valid:
            raise RuntimeError("engine weights were discarded: sync weights into the engine "
                               "and call weights_loaded() before generating")
