"""The trainer colocated with the engine: a megatron GPTModel in a layout of its own -- TP x DP,
EP x DP, or TP x EP x DP, the expert groups derived from TP, EP and DP as megatron's
``initialize_model_parallel`` derives them (``trainer_pg_collection``).

Owns the training model, megatron's DistributedDataParallel wrapper and the optimizer, and one
GRPO or PPO update from trajectories (PPO adds a value head on the final hidden states). Its
layout (trainer TP, EP; DP = world / TP) is independent of the inference layout
(ADP/ATP/EP): ``WeightSync`` reshards after every step.

TP > 1 runs under megatron's sequence parallelism (megatron trains MoE with TP only so:
``MoELayer.forward`` refuses it otherwise). The TP ranks of a replica take the same
trajectories and compute the same loss (the logits are gathered whole); each forward's sequence
length is padded to a multiple of TP (SP splits the sequence over the TP group; the padding is
causal-masked out of every real token and out of the loss). What each TP rank trains on its
own sequence shard only -- the norms, the routers, a shared-expert gate
(``sequence_parallel``-marked) and q/k norms (their heads split over TP) -- has its gradient
summed over TP, megatron's finalize-grads rule.

The experts: with EP 1 they are TP-sharded over the TP group (ETP = TP, megatron's default).
With EP > 1 they are whole (ETP = 1, megatron's usual MoE choice: the expert GEMMs stay whole
and need no TP collectives, and EP can span the whole TP x DP world, e.g. TP2 x EP4 on 4 ranks,
where ETP = TP would cap EP at DP); megatron carves the EP groups out of TP x DP in its expert
rank order ("tp-ep-dp": EP groups of EP consecutive ranks), and each expert is data-parallel
over the ranks holding it (expt_dp). megatron's allgather token dispatcher gathers every
rank's sequence shard over tp_ep (= the EP group) and reduce-scatters the expert output, so
every rank of a tp_ep group forwards one shape (``_batch_shape``). EP must be a multiple of TP
(an EP group is whole TP groups; ``shard_layout`` in model/megatron_gpt.py says why).

Optimizer and gradient sync: on GPUs megatron-core's ``DistributedDataParallel`` and
``get_megatron_optimizer`` (NOT yet run on a GPU -- see docs/status.md). On CPU ranks neither
can run (megatron's DDP grad sync is CUDA-stream bound, its FP32Optimizer allocates on CUDA), so
the CPU tier all-reduces gradients itself -- dense ones over the DP group, expert ones over
expt_dp, both then divided by DP, as megatron's DDP scales them -- and steps
``torch.optim.AdamW``: the same update, spelled out. The TP sum of the sequence-shard gradients
runs on both (``_sum_sequence_shard_grads``: on GPUs on megatron DDP's ``main_grad`` -- not yet
run on a GPU either).

Must not go in here: rollout, weight resharding (weight_sync.py), the model's construction
(model/megatron_gpt.py), the loss arithmetic (grpo.py).
"""

from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist

from colo_rollout.config import Config
from colo_rollout.config.schema import trainer_tp_widths
from colo_rollout.checkpoint.loader import load_checkpoint
from colo_rollout.model.megatron_gpt import (
    build_reference,
    shard_layout,
    singleton_pg_collection,
)
from colo_rollout.rl.grpo import (
    LOCAL,
    MismatchCorrection,
    Totals,
    clipped_loss,
    group_advantages,
    mismatch_metrics,
    ppo_advantages,
    value_loss,
)
from colo_rollout.rl.rollout import Trajectory


def check_trainer_tp(model, tp: int, ep: int = 1) -> None:
    """Refuse a trainer TP width the model's shapes cannot be split by (megatron would fail
    deep inside a layer constructor): heads and KV groups, the vocab-parallel embedding, the
    column/row-parallel FFN widths (the experts' only with EP 1, where ETP = TP)."""
    if tp == 1:
        return
    widths = {k.removeprefix("model."): v for k, v in trainer_tp_widths(model, ep).items()}
    bad = {k: v for k, v in widths.items() if v % tp}
    if bad:
        raise ValueError(f"rl.trainer_tp {tp} does not divide model {bad} (the trainer's TP "
                         "splits heads, KV groups, the vocabulary and the FFN widths)")


def check_trainer_layout(world: int, tp: int, ep: int) -> None:
    """Refuse the trainer widths ``trainer_pg_collection`` cannot lay out over ``world``
    ranks (the same rules as the door's, config/schema.py and config/loader.py)."""
    if world % tp:
        raise ValueError(f"rl.trainer_tp {tp} does not divide the world size {world}")
    if world % ep:
        raise ValueError(f"rl.trainer_ep {ep} does not divide the world size {world}")
    if tp > 1 and ep > 1 and ep % tp:
        raise ValueError(f"rl.trainer_ep {ep} is not a multiple of rl.trainer_tp {tp} (with "
                         "both above 1 an EP group must be whole TP groups)")


def trainer_pg_collection(world: int, tp: int, ep: int = 1, timeout_s: float | None = None):
    """Megatron's groups for a TP-``tp`` x DP-``world/tp`` trainer with its experts over EP
    ``ep``, laid out by megatron's own rank arithmetic (``parallel_state.RankGenerator`` in
    its default order "tp-cp-ep-dp-pp", as ``initialize_model_parallel`` builds them; no
    global parallel state is touched). Dense: TP groups of ``tp`` consecutive ranks, DP
    groups of stride ``tp``. Experts: expert TP ``etp`` = ``tp`` with EP 1, else 1 (module
    docstring); EP groups of ``ep`` consecutive ranks at ETP 1 (megatron carves EP out of
    TP x DP, expert TP varying fastest); tp_ep = expert TP x EP (the dispatcher's group);
    expt_dp = the ranks holding the same experts (world / (etp x ep) of them).
    ``timeout_s``: the groups' collective timeout (parallel.timeout_s; None: the backend's
    default -- gloo's 30 minutes: found by probing, a rank that failed in a training step left
    its peers in the gradient all-reduce for that long).

    Collective: every rank walks every group of every kind in the same order and creates each
    distinct multi-rank group once (identical lists -- e.g. tp_ep and ep at ETP 1, or EP and
    TP groups at TP = EP -- share one group); single-rank groups are this rank's singleton."""
    from megatron.core.parallel_state import RankGenerator

    check_trainer_layout(world, tp, ep)
    etp = tp if ep == 1 else 1
    order = "tp-cp-ep-dp-pp"  # megatron's default
    dense = RankGenerator(tp=tp, ep=1, dp=world // tp, pp=1, cp=1, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep), pp=1, cp=1, order=order)
    pgc = singleton_pg_collection()
    single, me = pgc.pp, dist.get_rank()
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)

    def mine(gen, token: str):
        own = None
        for ranks in gen.get_ranks(token):
            key = tuple(ranks)
            if len(key) > 1 and key not in made:
                made[key] = dist.new_group(list(key), timeout=timeout)
            if me in key:
                own = made[key] if len(key) > 1 else single
        return own

    groups = {"tp": mine(dense, "tp"), "dp": mine(dense, "dp"), "tp_dp": mine(dense, "tp-dp"),
              "expt_tp": mine(expert, "tp"), "ep": mine(expert, "ep"),
              "tp_ep": mine(expert, "tp-ep"), "expt_dp": mine(expert, "dp")}
    fields = {"tp": ("tp", "mp", "tp_cp"), "dp": ("dp", "dp_cp", "intra_dp_cp"),
              "tp_dp": ("tp_dp_cp",), "expt_tp": ("expt_tp",), "ep": ("ep",),
              "tp_ep": ("tp_ep", "tp_ep_pp"), "expt_dp": ("expt_dp", "intra_expt_dp")}
    for kind, names in fields.items():
        for f in names:
            setattr(pgc, f, groups[kind])
    return pgc


class Trainer:
    def __init__(self, cfg: Config, state_dict: dict[str, torch.Tensor] | None,
                 device: torch.device) -> None:
        """``state_dict``: full megatron-named weights; None = ``cfg.model.checkpoint``
        (each rank reads its TP slices)."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )

        self.cfg = cfg
        world = dist.get_world_size()
        self.tp = cfg.rl.trainer_tp
        self.dp = world // self.tp
        self.dp_rank = dist.get_rank() // self.tp
        self.ep = cfg.rl.trainer_ep
        check_trainer_tp(cfg.model, self.tp, self.ep)
        if cfg.model.num_experts % self.ep:
            raise ValueError(f"rl.trainer_ep {self.ep} does not divide model.num_experts "
                             f"{cfg.model.num_experts}")
        self.pgc = trainer_pg_collection(world, self.tp, self.ep, cfg.parallel.timeout_s)
        weights = state_dict if state_dict is not None else self._checkpoint_loader(cfg)
        self.recompute = cfg.rl.recompute == "full"
        # TP > 1: sequence parallel (megatron's MoE refuses to train under TP without it)
        model = build_reference(cfg.model, weights, self.pgc, device,
                                routing_replay=cfg.rl.routing_replay, recompute=self.recompute,
                                sequence_parallel=self.tp > 1)
        self.module = model  # megatron GPTModel (or Float16Module), what WeightSync reads
        self.module.train()
        self.train_mtp = setup_mtp(model, cfg.rl.mtp_loss_scale)
        if device.type == "cuda":
            ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=False,
                                                    overlap_grad_reduce=False)
            self.ddp = DistributedDataParallel(model.config, ddp_cfg, model,
                                               pg_collection=self.pgc)
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            self.opt = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=cfg.rl.lr, weight_decay=0.0,
                                use_distributed_optimizer=False,
                                bf16=cfg.model.params_dtype == "bfloat16"), [self.ddp])
            self._megatron_opt = True
        else:
            self.ddp = model
            self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                         lr=cfg.rl.lr, weight_decay=0.0)
            self._megatron_opt = False
        self.device = device
        rl = cfg.rl
        # the mismatch correction (None: the rollout's logprobs are PPO's old policy)
        self.correction = (None if rl.is_level == "none" else MismatchCorrection(
            rl.is_level, rl.is_mode, rl.is_cap, rl.is_floor))
        # rl.kl_coef > 0: the reference policy's weights (this rank's shard), taken at the
        # first step -- the weights before any update (``_ref_logprobs``)
        self._ref: list[torch.Tensor] | None = None
        self.value_head = None
        if cfg.rl.algorithm == "ppo":
            # PPO's baseline: a linear value head on the final hidden states (trainer only;
            # it is not part of the policy and is never synced to the engine)
            self.value_head = torch.nn.Linear(cfg.model.hidden_size, 1).to(device)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
            self._hidden = None
            final_norm = next(m for n, m in self.module.named_modules()
                              if n.endswith("decoder.final_layernorm"))
            final_norm.register_forward_hook(lambda _m, _i, out: setattr(self, "_hidden", out))
            if self._megatron_opt:
                self.value_opt = torch.optim.AdamW(self.value_head.parameters(), lr=cfg.rl.lr)
            else:
                self.opt.add_param_group({"params": list(self.value_head.parameters())})

    def _checkpoint_loader(self, cfg: Config):
        """``cfg.model.checkpoint``'s shards of this rank (``shard_layout``: its TP slices of
        the dense tensors, its EP rank's experts), read straight into the model."""
        if cfg.model.checkpoint is None:
            raise ValueError("trainer: no state dict and model.checkpoint is not set")
        layout, rank = shard_layout(self.pgc)
        return lambda model: load_checkpoint(model, cfg.model, layout, rank)

    def _sum_sequence_shard_grads(self, attr: str) -> None:
        """TP > 1: sum over the TP group the gradients each TP rank took from its part of the
        tokens or heads alone -- parameters marked ``sequence_parallel`` (norms, routers,
        shared-expert gates: they see the rank's sequence shard) and the q/k norms (shared by
        the heads TP splits). megatron's rule, ``_allreduce_non_tensor_model_parallel_grads``
        (distributed/finalize_model_grads.py), which its DDP's ``finish_grad_sync`` does not
        run. ``attr``: where the gradient lives ("grad"; "main_grad" under megatron's DDP).
        One all-reduce of the flattened gradients per dtype (parameter order: the same on
        every TP rank)."""
        if self.tp == 1:
            return
        qk = self.module.config.qk_layernorm
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for n, p in self.module.named_parameters():
            g = getattr(p, attr, None)
            if g is not None and (getattr(p, "sequence_parallel", False)
                                  or (qk and ("q_layernorm" in n or "k_layernorm" in n))):
                by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.pgc.tp)
            for g, synced in zip(grads, torch.split(flat, [g.numel() for g in grads])):
                g.copy_(synced.view_as(g))

    def export(self, directory: str) -> list:
        """Write the trainer's weights as a Hugging Face checkpoint (checkpoint/export.py).
        Collective over the world; DP replica 0's TP group gathers (with EP: the EP group of
        rank 0, each expert broadcast from its EP rank), global rank 0 writes."""
        from colo_rollout.checkpoint.export import export_checkpoint

        files, failed = [], None
        try:  # (a write that fails -- disk full, a folder gone -- comes after the gathers)
            if self.ep > 1:  # the EP group holding rank 0 (consecutive ranks): every expert
                if dist.get_rank() < self.ep:
                    files = export_checkpoint(self.module, self.cfg.model, directory,
                                              tp_group=self.pgc.tp, ep_group=self.pgc.ep)
            elif self.dp_rank == 0:
                files = export_checkpoint(self.module, self.cfg.model, directory,
                                          tp_group=self.pgc.tp)
        except Exception as e:  # (any failure: the other ranks wait in the flag's all-reduce)
            failed = e
        # every rank learns whether a writer failed (a barrier alone left the others waiting
        # on the failed rank forever)
        flag = torch.tensor([0 if failed is None else 1],
                            device=next(self.module.parameters()).device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()):
            why = f": {failed}" if failed is not None else " on another rank"
            raise RuntimeError(f"export to {directory} failed{why}") from failed
        return files

    @property
    def totals(self) -> Totals:
        """The batch's sums and maxima over the DP ranks (each holds its share of the
        trajectories; TP ranks hold the same ones): all-reduces over the DP group."""
        if self.dp == 1:
            return LOCAL
        group = self.pgc.dp

        def reduce(op):
            def f(t: torch.Tensor) -> torch.Tensor:
                t = t.detach().clone()
                dist.all_reduce(t, op=op, group=group)
                return t
            return f
        return Totals(sum=reduce(dist.ReduceOp.SUM), max=reduce(dist.ReduceOp.MAX))

    def routers(self) -> list:
        """The decoder's MoE routers in layer order (megatron TopKRouter modules) -- not the
        MTP layer's: the rollout records the decoder's layers only (the MTP layer, when it
        trains, routes on its own; ``setup_mtp``)."""
        from megatron.core.transformer.moe.router import TopKRouter

        return [m for n, m in self.module.named_modules() if isinstance(m, TopKRouter)
                and "mtp" not in n.split(".")]

    def replay_routing(self, trajs: list[Trajectory], length: int,
                       rows: int | None = None) -> None:
        """Routing replay: every router of the next forward routes each token to the experts
        the rollout engine chose for it (``Trajectory.routing``: [positions, MoE layers, k]).
        Positions the rollout never computed -- a trajectory's last token, the batch's
        padding -- route to experts 0..k-1: their outputs reach no loss term (causal
        attention, per-token experts). Megatron's ``RouterReplay`` gathers the router's own
        scores at the replayed ids, so the probabilities still train the router."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routers = self.routers()
        k, B = self.cfg.model.moe_router_topk, rows or len(trajs)
        E = self.cfg.model.num_experts
        ids = torch.arange(k, dtype=torch.long).repeat(length, B, len(routers), 1)
        for b, t in enumerate(trajs):
            r = t.routing
            if r is None:
                raise ValueError(f"routing replay: trajectory (group {t.group}, sample "
                                 f"{t.sample}) has no recorded routing (engine.record_routing "
                                 "off, or it failed before any forward)")
            if not isinstance(r, np.ndarray) or r.dtype.kind not in "iu":
                raise ValueError(f"routing replay: trajectory (group {t.group}, sample "
                                 f"{t.sample}): routing must be an integer numpy array "
                                 f"[positions, MoE layers, k], got "
                                 f"{getattr(r, 'dtype', type(r).__name__)}")
            if r.ndim != 3 or r.shape[1:] != (len(routers), k) or r.shape[0] > length:
                raise ValueError(f"routing replay: recorded routing {tuple(r.shape)} does not "
                                 f"fit the trainer's {len(routers)} MoE layers x top-{k} for "
                                 f"{len(t.tokens)} tokens")
            got = torch.from_numpy(r.astype("int64"))
            if got.numel() and (int(got.max()) >= E or int(got.min()) < 0):
                bad = int(got.max()) if int(got.max()) >= E else int(got.min())
                raise ValueError(f"routing replay: an expert id {bad} outside the trainer's "
                                 f"{E} experts [0, {E})")
            ids[: r.shape[0], b] = got
        # megatron's router sees [S, B] tokens flattened sequence-first: row = s * B + b; under
        # sequence parallelism only this TP rank's shard of S
        ids = ids[self._sequence_shard(length)]
        for j, router in enumerate(routers):
            rep = router.router_replay
            rep.clear_indices()
            rep.set_target_indices(ids[:, :, j].reshape(-1, k).to(self.device))
            rep.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _batch_shape(self, batch: list[Trajectory]) -> tuple[int, int]:
        """(rows, tokens) of this rank's forward: its trajectories and the longest of them;
        with the experts split over EP, the largest over the tp_ep group -- megatron's
        allgather dispatcher gathers equal token counts from every rank of it (at TP > 1 a
        tp_ep group spans EP / TP replicas), so they all pad to the same shape (padding rows
        are masked out of the loss); with TP, tokens rounded up to a multiple of TP
        (``_padded_length``)."""
        shape = [max(len(batch), 1),
                 self._padded_length(max((len(t.tokens) for t in batch), default=2))]
        if self.ep > 1:
            agreed = torch.tensor(shape, dtype=torch.long, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.pgc.tp_ep)
            shape = agreed.tolist()
        return shape[0], shape[1]

    def _padded_length(self, length: int) -> int:
        """``length`` rounded up to a multiple of TP: sequence parallelism splits the sequence
        over the TP group in equal shards. The extra positions come last, so causal attention
        keeps them out of every real token; their logprobs are masked."""
        return -(-length // self.tp) * self.tp

    def _sequence_shard(self, length: int) -> slice:
        """The positions of a ``length``-token forward this TP rank's routers see: under
        sequence parallelism each TP rank routes its own contiguous shard (megatron scatters
        the sequence dimension in TP-rank order); TP 1 routes them all."""
        if self.tp == 1:
            return slice(0, length)
        n = length // self.tp
        r = self.pgc.tp.rank()
        return slice(r * n, (r + 1) * n)

    def _ref_logprobs(self, batch: list[Trajectory], shape: tuple[int, int]) -> torch.Tensor:
        """The reference policy's logprobs of the batch (rl.kl_coef), no gradient: its weights
        -- this rank's parameters as the first step found them, kept apart -- copied into the
        model for one forward without routing replay (the reference routes as it would), the
        trained ones copied back exactly. One extra copy of the rank's weights is held."""
        params = [p.data for p in self.module.parameters()]
        if self._ref is None:
            self._ref = [p.clone() for p in params]
        held = [p.clone() for p in params]
        with torch.no_grad():
            torch._foreach_copy_(params, self._ref)
            try:
                logp, _ = self.token_logprobs(batch, replay=False, shape=shape)
            finally:
                torch._foreach_copy_(params, held)
        return logp

    def own_routing(self, trajs: list[Trajectory],
                    shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, float]:
        """The trainer's forward without replay (no gradient): (its logprobs [B, T-1], the
        share of (token, MoE layer) routing decisions -- top-k sets -- that differ from the
        rollout's recorded ones). What replay corrects, measured each step."""
        maps: list[torch.Tensor] = []
        hooks = [r.register_forward_hook(lambda _m, _a, out: maps.append(out[1].detach()))
                 for r in self.routers()]
        try:
            with torch.no_grad():
                logp, _ = self.token_logprobs(trajs, replay=False, shape=shape)
        finally:
            for h in hooks:
                h.remove()
        B, E = logp.shape[0], self.cfg.model.num_experts
        shard = self._sequence_shard(logp.shape[1] + 1)  # this TP rank's routed positions
        differ = total = 0
        for j, m in enumerate(maps):
            m = m.view(-1, B, E)  # megatron's rows: s * B + b, s in this rank's shard
            for b, t in enumerate(trajs):
                r = t.routing
                if r is None:
                    continue
                r = r[shard.start: shard.stop]
                if r.shape[0] == 0:
                    continue
                ids = torch.from_numpy(r[:, j].astype("int64")).to(m.device)
                want = torch.zeros((r.shape[0], E), dtype=torch.bool, device=m.device)
                want.scatter_(1, ids, True)
                differ += int((want != m[: r.shape[0], b]).any(dim=1).sum())
                total += r.shape[0]
        if dist.get_world_size() > 1:
            # TP ranks hold disjoint sequence shards, DP ranks disjoint trajectories: the sum
            # over every rank counts each (token, MoE layer) once -- the whole batch's share
            counts = torch.tensor([differ, total], dtype=torch.long, device=self.device)
            dist.all_reduce(counts)
            differ, total = counts.tolist()
        return logp, differ / max(total, 1)

    def end_replay(self) -> None:
        for router in self.routers():
            if router.router_replay is not None:
                router.router_replay.clear_router_replay_action()
                router.router_replay.clear_indices()

    def token_logprobs(self, trajs: list[Trajectory], replay: bool | None = None,
                       shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(token_t | tokens_<t) under the trainer at ``rl.temperature`` (the logits
        divided by it, as the RL loop's rollouts draw and report: SamplingParams
        ``tempered_logprobs``) for every position t >= 1, padded:
        returns (logp [B, T-1], valid [B, T-1]); ``shape`` (rows B, tokens T): at least the
        trajectories' (default: exactly), the rest padding. ``replay`` (default
        ``rl.routing_replay``): the forward routes as the rollout did (``replay_routing``).
        With TP the tokens are padded to a multiple of TP (``_padded_length``): T may exceed
        the longest trajectory."""
        rows, L = shape or (len(trajs), self._padded_length(max(len(t.tokens) for t in trajs)))
        if L % self.tp:
            raise ValueError(f"trainer forward of {L} tokens: sequence parallelism needs a "
                             f"multiple of rl.trainer_tp {self.tp}")
        replay = self.cfg.rl.routing_replay if replay is None else replay
        if replay:
            self.replay_routing(trajs, L, rows)
        ids = torch.zeros(rows, L, dtype=torch.long, device=self.device)
        valid = torch.zeros(rows, L - 1, dtype=torch.bool, device=self.device)
        real = torch.zeros(rows, L, device=self.device)  # the MTP loss's mask: real tokens
        for i, t in enumerate(trajs):
            ids[i, : len(t.tokens)] = torch.tensor(t.tokens, device=self.device)
            valid[i, : len(t.tokens) - 1] = True
            real[i, : len(t.tokens)] = 1.0
        pos = torch.arange(L, device=self.device)[None].expand(rows, L)
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=self.device), 1)
        grad = torch.is_grad_enabled()
        # the MTP layer's loss (setup_mtp) over real tokens only: padding predicts nothing
        extra = {"loss_mask": real} if self.train_mtp else {}
        try:
            logits = self.ddp(ids, pos, attention_mask=mask[None, None], **extra).float()
        except BaseException:
            if replay:
                self.end_replay()
            raise
        if replay:
            if self.recompute and grad:
                # the backward re-runs every layer's forward: its routers take the same ids
                # again (megatron's REPLAY_BACKWARD pops them); step() ends it after backward
                from megatron.core.transformer.moe.router_replay import RouterReplayAction

                for router in self.routers():
                    router.router_replay.set_router_replay_action(
                        RouterReplayAction.REPLAY_BACKWARD)
            else:  # the forward's saved tensors hold the replayed routing
                self.end_replay()
        x = logits[:, :-1]
        if self.cfg.rl.temperature != 1.0:  # the policy the rollout drew from: pi_T
            # shifted by the row max first (the sampler's way; log_softmax is shift-invariant,
            # the max detached): x / T alone overflows for a tiny T
            x = (x - x.max(dim=-1, keepdim=True).values.detach()) / self.cfg.rl.temperature
        logp = torch.log_softmax(x, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        return logp, valid

    def step(self, trajs: list[Trajectory]) -> dict:
        """One GRPO or PPO update on this DP rank's share of the (replicated) trajectories. A
        collective of the update that fails in its backend (a peer exited or stalled past the
        timeout) is a ControlError naming this rank and what it means (found by fault
        injection: gloo's own text, as the engine's steps had been)."""
        from colo_rollout.runtime.control import (ControlError, transport_failure,
                                                  transport_problem)

        try:
            return self._step(trajs)
        except RuntimeError as e:
            if isinstance(e, ControlError) or not transport_failure(e):
                raise
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise ControlError(f"trainer step, rank {rank}: a collective of the update "
                               f"failed: {transport_problem(e, 'a process group of the trainer')}"
                               ) from e

    def _step(self, trajs: list[Trajectory]) -> dict:
        for t in trajs:  # replicated on every rank: every rank refuses alike
            lp, lm = np.asarray(t.logprobs[1:], dtype=np.float64), np.asarray(t.loss_mask[1:])
            if not np.isfinite(lp[lm.astype(bool)]).all():
                # (found by probing: masked IS dropped such a token silently, truncated IS
                # capped it, the metrics went NaN)
                raise ValueError(f"trainer step: trajectory (group {t.group}, sample "
                                 f"{t.sample}) has a rollout logprob that is not finite at a "
                                 "trained position")
        adv_all = group_advantages([t.reward for t in trajs], [t.group for t in trajs])
        mine = [i for i in range(len(trajs)) if i % self.dp == self.dp_rank]
        batch = [trajs[i] for i in mine]
        shape = self._batch_shape(batch)
        rows, T = shape[0], shape[1] - 1
        adv = torch.zeros(rows, device=self.device)
        adv[: len(batch)] = torch.tensor([adv_all[i] for i in mine], device=self.device)
        rewards = torch.zeros(rows, device=self.device)
        rewards[: len(batch)] = torch.tensor([t.reward for t in batch], device=self.device)
        old = torch.zeros(rows, T, device=self.device)
        lmask = torch.zeros(rows, T, device=self.device)
        for i, t in enumerate(batch):
            n = len(t.tokens) - 1
            old[i, :n] = torch.tensor(t.logprobs[1:], device=self.device)
            lmask[i, :n] = torch.tensor(t.loss_mask[1:], device=self.device, dtype=torch.float)

        totals = self.totals
        replay_stats = {}
        if self.cfg.rl.routing_replay:  # the mismatch replay removes, measured without it
            own, differ = self.own_routing(batch, shape)
            own = own[:, :T]
            gap = (own - old).abs() * lmask
            gap_sum, count = totals.sum(torch.stack([gap.sum(), lmask.sum()])).tolist()
            replay_stats = {"routing_disagree_frac": differ,
                            "logprob_gap_max_no_replay": float(totals.max(gap.max())),
                            "logprob_gap_mean_no_replay": gap_sum / max(count, 1.0)}
        kl_coef = self.cfg.rl.kl_coef
        ref = self._ref_logprobs(batch, shape)[:, :T] if kl_coef else None
        if self._megatron_opt:
            self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        new, valid = self.token_logprobs(batch, shape=shape)
        new = new[:, :T]
        m = lmask * valid[:, :T]
        clip = self.cfg.rl.clip
        # PPO's old policy and the importance weights (rl/grpo.py: MismatchCorrection): one
        # update per rollout, so the trainer's old logprobs are this forward's, detached
        weights, base = None, old
        corr = self.correction
        if corr is not None:
            weights, kept = corr.weights(new, old, m)
            base = new.detach()
            metrics = mismatch_metrics(new, old, m, clip, weights, kept,
                                       corr.cap if corr.mode == "truncate" else None,
                                       totals=totals)
            m = m * kept
        else:
            metrics = mismatch_metrics(new, old, m, clip, totals=totals)
        extra = {}
        if ref is not None:  # KL(policy || reference) by the k3 estimator, as the loss has it
            d = (ref - new.detach()).double()
            kl_sum, count = totals.sum(torch.stack([((torch.exp(d) - d - 1) * m).sum(),
                                                    m.sum().double()])).tolist()
            extra["kl_ref"] = kl_sum / max(count, 1.0)
        # every loss below is this rank's rows' sum over the whole batch's token count: the
        # DP ranks' losses add up to the batch's token mean, whatever the split
        if self.value_head is None:
            loss = clipped_loss(new, base, adv, m, clip=clip, weights=weights, kl_coef=kl_coef,
                                ref_logp=ref, totals=totals, dual_clip=self.cfg.rl.dual_clip)
        else:
            # hidden [S, B, H] (megatron is sequence-first): V(h_j) scores the token at j+1
            h = self._hidden
            if self.tp > 1:
                # sequence parallel: the final norm's output is this TP rank's shard of S.
                # Every TP rank computes the same value loss from the gathered whole, so the
                # backward takes its own shard of the gradient (no reduce-scatter sum)
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False,
                                                         group=self.pgc.tp)
            h = h.transpose(0, 1)[:, :-1][:, :T].float()
            values = self.value_head(h)[..., 0]
            tok_adv, returns = ppo_advantages(rewards, values.detach(), m, totals=totals)
            v_loss = value_loss(values, returns, m, totals=totals)
            loss = clipped_loss(new, base, tok_adv, m, clip=clip, weights=weights,
                                kl_coef=kl_coef, ref_logp=ref, totals=totals,
                                dual_clip=self.cfg.rl.dual_clip) \
                + self.cfg.rl.vf_coef * v_loss
            extra["value_loss"] = float(totals.sum(v_loss.detach()))
        # the gradients are summed over DP, then divided by dp (megatron's DDP and the loop
        # below): scaled by dp, the sum of the ranks' shares
        try:
            (loss * self.dp).backward()
        finally:
            if self.cfg.rl.routing_replay and self.recompute:
                self.end_replay()  # the recompute took its replayed ids
        head = list(self.value_head.parameters()) if self.value_head is not None else []
        if self.dp > 1:  # the value head is outside megatron's DDP: average it here
            for p in head:
                dist.all_reduce(p.grad, group=self.pgc.dp)
                p.grad /= self.dp
        if self._megatron_opt:
            self.ddp.finish_grad_sync()
            self._sum_sequence_shard_grads("main_grad")
            self._check_finite(loss, "main_grad")
            self.opt.step()
            if head:
                self.value_opt.step()
                self.value_opt.zero_grad()
        else:
            self._sum_sequence_shard_grads("grad")
            for p in self.module.parameters():
                if p.grad is None:
                    continue
                # a dense parameter holds its replica's gradient: summed over DP. An expert
                # split over EP (megatron marks it allreduce=False) holds the gradient of its
                # tp_ep group's tokens (EP / TP replicas' worth): summed over the ranks
                # holding the same experts (expt_dp), every token counted once. Either way
                # the sum over every replica's (dp-scaled) loss, then the mean: / dp, as
                # megatron's DDP scales both (expt_dp may be 1 while DP is not)
                expert = not getattr(p, "allreduce", True)
                group = self.pgc.expt_dp if expert else self.pgc.dp
                if group.size() > 1:
                    dist.all_reduce(p.grad, group=group)
                if self.dp > 1:
                    p.grad /= self.dp
            self._check_finite(loss, "grad")
            self.opt.step()
        return {"loss": float(totals.sum(loss.detach())), **metrics, **replay_stats, **extra}

    def _check_finite(self, loss: torch.Tensor, attr: str) -> None:
        """Before the optimizer moves anything: the loss and every gradient (``attr``: grad or
        megatron's main_grad) finite on every rank, else FloatingPointError on every rank (one
        MAX all-reduce of a flag) -- a diverged step would otherwise write NaN weights that
        the engine then samples from, and the run would go on reporting them."""
        grads = [g for p in self.module.parameters()
                 if (g := getattr(p, attr, None)) is not None]
        grads += [p.grad for p in (self.value_head.parameters() if self.value_head is not None
                                   else ()) if p.grad is not None]
        from colo_rollout.runtime.device import fp32_norms

        norms = fp32_norms(grads) if grads else loss.new_zeros(0, dtype=torch.float32)
        bad = ~torch.isfinite(torch.cat([loss.detach().float().reshape(1), norms.to(
            loss.device)]))
        flag = bad.any().to(torch.int32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()):
            rl = self.cfg.rl
            knobs = [f"rl.lr {rl.lr:g}"] + [f"rl.{k} {getattr(rl, k):g}" for k in
                                            ("kl_coef", "vf_coef", "mtp_loss_scale")
                                            if getattr(rl, k)]
            raise TrainingDiverged(
                f"rl step: the loss or a gradient is not finite on some rank (this rank's "
                f"loss {float(loss.detach()):.4g}); the optimizer step was skipped and the "
                f"weights are the previous step's -- lower the step's coefficients "
                f"({', '.join(knobs)}) or check the rewards")


class TrainingDiverged(FloatingPointError):
    """A step's loss or gradients were not finite on some rank (raised on every rank before
    the optimizer moved anything): the run's coefficients or rewards, a user's to change."""

    user_facing = True  # raised on a rank: the command's one error line (runtime/spawn.py)


def setup_mtp(model: torch.nn.Module, scale: float) -> bool:
    """The MTP layer (model.mtp_num_layers) in training; returns whether it trains.

    ``scale`` > 0 (rl.mtp_loss_scale): megatron's own MTP loss -- from the batch's input ids
    rolled left (process_mtp_loss: the layer at position i predicts token i + 2, what it
    drafts), masked by the forward's ``loss_mask`` -- scaled by ``scale`` and added to the
    policy loss through megatron's MTPLossAutoScaler, so the drafts follow the policy. One
    shim: megatron's vocab-parallel cross entropy subtracts the row max from its input in
    place, and fp32 logits are the output layer's own tensor (a view at TP 1), which autograd
    refuses; those are copied first (bf16 logits are copied by its own cast).
    ``scale`` 0: the layer's forward and loss are skipped and its parameters frozen (synced
    unchanged; the drafts are the checkpoint's)."""
    core = getattr(model, "module", model)
    if not getattr(core, "mtp_process", False):
        return False
    if scale > 0:
        core.config.mtp_loss_scaling_factor = scale
        base = type(core).compute_language_model_loss

        def compute_language_model_loss(labels, logits):
            return base(core, labels, logits.clone() if logits.dtype == torch.float32
                        else logits)

        core.compute_language_model_loss = compute_language_model_loss
        return True
    # both: GPTModel runs the block by mtp_process and its loss by config.mtp_num_layers
    core.mtp_process = False
    core.config.mtp_num_layers = None
    for name, p in core.named_parameters():
        if name.startswith("mtp."):
            p.requires_grad_(False)
    return False
