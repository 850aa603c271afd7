"""The worker: one rank's device state, which outlives the engines that serve on it.

Owns the model with its weights, the KV storage and the captured D and P graphs (the
``ModelRunner``), their release and resume between RL phases (``WorkerMemory``), and the engine
settings that size them. An ``Engine`` is a serving session
over a worker: its own scheduler, control plane, turnstile, streams and span policy. A new
engine on the same worker (another mode, span or policy: what the bench does for every cell)
keeps the weights as they are, the KV storage and every captured graph; rebuilding the model
and re-capturing the graphs took most of a bench cell's time on the larger MoE.

Invariant: at most one engine serves on a worker at a time. ``Engine(cfg, groups,
worker=...)`` takes it over from the previous one (``Engine.hand_over``), which then refuses
to step.

Must not go in here: scheduling, host agreement, streams (per engine).
"""

from __future__ import annotations

import torch

from colo_rollout.model.routing_record import RoutingRecord
from colo_rollout.config import Config
from colo_rollout.worker.memory import WorkerMemory
from colo_rollout.model.model import InferenceGPT
from colo_rollout.runtime.parallel import ParallelGroups
from colo_rollout.sched.planner import pick_bucket
from colo_rollout.worker.runner import ModelRunner
from colo_rollout.worker.speculate import ROWS_PER_SEQUENCE
from colo_rollout.model.weights import DTYPES, random_state_dict

# engine settings that size the device state (KV storage, D graphs): an engine taking over a
# worker must have the same
SIZING_FIELDS = ("num_kv_blocks", "kv_block_size", "max_seq_len", "cuda_graphs",
                 "decode_attention", "prefill_attention",  # the model's attention: at its build
                 "moe_kernel",  # and its experts' GEMMs
                 "record_routing", "max_prefill_tokens", "decode_buckets",  # the routing record
                 "mtp")  # the MTP layer's KV and the model's drafting (model build)


def build_model(cfg: Config, groups: ParallelGroups,
                state_dict: dict[str, torch.Tensor] | None = None):
    """This rank's inference model with its weights: ``state_dict`` (full, megatron-named)
    when given, else ``model.checkpoint`` (each rank reads its slices, straight into the
    parameters on its device), else random weights from ``model.seed``. Returns (model, load
    stats or None)."""
    dtype = DTYPES[cfg.model.params_dtype]
    if state_dict is None and cfg.model.checkpoint is not None:
        from colo_rollout.checkpoint.loader import check_checkpoint, load_checkpoint
        from colo_rollout.checkpoint.store import CheckpointStore

        with CheckpointStore(cfg.model.checkpoint) as store:  # one open, one header read
            arch = check_checkpoint(cfg.model, store)  # before anything is allocated
            model = InferenceGPT(cfg.model, groups, dtype, cfg.engine.decode_attention,
                                 cfg.engine.prefill_attention, moe_kernel=cfg.engine.moe_kernel,
                                 **_dispatch_sizes(cfg)).to(groups.device)
            stats = load_checkpoint(model, cfg.model, groups.layout, groups.rank,
                                    te=model.use_te, store=store, arch=arch)
        model.weights_updated()  # model.fp8: the FP8 copies of what was loaded
        return model.eval(), stats
    model = InferenceGPT(cfg.model, groups, dtype, cfg.engine.decode_attention,
                         cfg.engine.prefill_attention, moe_kernel=cfg.engine.moe_kernel,
                         **_dispatch_sizes(cfg))
    model.load_full_state_dict(state_dict if state_dict is not None
                               else random_state_dict(cfg.model))
    model = model.to(groups.device).eval()
    model.weights_updated()  # model.fp8: the FP8 copies, on the device
    return model, None



def _dispatch_sizes(cfg: Config) -> dict:
    """The model's build options from the engine config: what a dispatch backend's buffers are
    sized by (D's most rows per replica -- the D batch is padded to a decode bucket -- and the
    bound of its host waits), whether the MTP layer drafts (engine.mtp: two verify rows per
    sequence, worker/speculate.py) and whether D is batch-invariant (engine.batch_invariant)."""
    per = ROWS_PER_SEQUENCE if cfg.engine.mtp else 1
    return {"max_decode_rows": per * max(cfg.engine.decode_buckets[-1],
                                         cfg.engine.max_batch_size),
            "timeout_s": cfg.parallel.timeout_s, "mtp_draft": cfg.engine.mtp,
            "batch_invariant": cfg.engine.batch_invariant}


class Worker:
    def __init__(self, cfg: Config, groups: ParallelGroups,
                 state_dict: dict[str, torch.Tensor] | None = None) -> None:
        self.cfg = cfg
        self.groups = groups
        self.model, self.load_stats = build_model(cfg, groups, state_dict)
        self.model.rope_table()  # made once on the default stream, read by both phases
        self.model.warm_kernels()  # every kernel variant compiled before serving starts
        e = cfg.engine
        if e.record_routing:  # the routers' expert ids of every P token and D row
            adp = groups.layout.adp
            # a replica's D batch: the largest bucket, padded to a multiple of attention TP as
            # the planner pads it (found by probing: an odd last bucket at ATP2 overflowed);
            # engine.mtp: two verify rows per sequence (worker/speculate.py)
            d_rows = pick_bucket(e.decode_buckets[-1], tuple(e.decode_buckets),
                                 groups.layout.atp)
            self.model.routing = RoutingRecord(
                [i for i in range(cfg.model.num_layers) if cfg.model.is_moe_layer(i)],
                p_rows=e.max_prefill_tokens * adp,
                d_rows=d_rows * adp * (ROWS_PER_SEQUENCE if e.mtp else 1),
                topk=cfg.model.moe_router_topk, device=groups.device)
        # the engine serving on it sets its streams, sampler seed and P settings (renew)
        self.runner = ModelRunner(self.model, e.num_kv_blocks, e.kv_block_size,
                                  seed=cfg.model.seed,
                                  graphs_max_blocks=(-(-e.max_seq_len // e.kv_block_size)
                                                     if e.cuda_graphs else 0),
                                  prefill_merge_pairs=e.prefill_merge_pairs)
        self.memory = WorkerMemory(self.model, self.runner, groups.device)  # release/resume
        self.engine = None  # the engine serving on it now

    def check_fits(self, cfg: Config) -> None:
        """ValueError unless an engine of ``cfg`` can serve on this worker: the same model,
        layout and device-state sizes."""
        changed = [k for k in ("model", "parallel") if getattr(cfg, k) != getattr(self.cfg, k)]
        changed += [f"engine.{k}" for k in SIZING_FIELDS
                    if getattr(cfg.engine, k) != getattr(self.cfg.engine, k)]
        if changed:
            raise ValueError(f"an engine on this worker keeps its model and device state; the "
                             f"config changes {', '.join(changed)}: build a new worker")
