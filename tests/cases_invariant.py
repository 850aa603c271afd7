"""Rank-side cases of tests/test_batch_invariant.py (engine.batch_invariant on CPU ranks)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from colo_rollout.engine.engine import Engine
from colo_rollout.model.mtp_oracle import oracle_state_dict
from colo_rollout.model.weights import random_state_dict
from colo_rollout.runtime.cpu_compat import install_cpu_compat
from colo_rollout.runtime.parallel import init_parallel
from tests.cases_engine import mixed_requests, tiny_config

# GEMMs whose algorithm (on a GPU: cuBLAS's pick) may follow the row count
_VARIANT = {torch.nn.functional.linear, torch.mm, torch.addmm, torch._grouped_mm}
_MATMULS = {torch.matmul, torch.Tensor.__matmul__}


class VariantGemms(TorchFunctionMode):
    """Records every GEMM called whose rows form one 2-D operand (F.linear, mm, addmm,
    grouped_mm, a matmul of a 2-D left operand of more than one row): the GEMMs a batch-
    invariant D must not call. Batched products over a leading row axis (the per-row GEMVs,
    attention's [B, ...] matmuls) are per row and pass."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VARIANT or (func in _MATMULS and args and args[0].dim() == 2
                                and args[0].shape[0] > 1):
            self.calls.append(f"{getattr(func, '__name__', func)} {tuple(args[0].shape)}")
        return func(*args, **kwargs)


def invariant_tokens(rank: int, world: int, adp: int, ep: int, mtp: bool,
                     invariant: bool = True, dtype: str = "bfloat16",
                     weights: str = "random", dispatch: str = "gather",
                     mode: str = "normal") -> dict:
    """The same greedy requests on a model with an MTP layer, drafting (``mtp``) or not, with
    engine.batch_invariant ``invariant``; every D forward watched for batch-variant GEMMs.
    Returns tokens, logprobs, the GEMMs and reducing collectives seen in D, acceptance
    counts. ``mode``: engine.mode (Fine: D iterations between P's segments)."""
    model_kw = {"mtp_num_layers": 1, "norm_epsilon": 1e-6, "params_dtype": dtype,
                "moe_dispatch": dispatch}
    cfg = tiny_config(world, adp, ep, max_batch_size=6, decode_buckets=[1, 2, 4, 8],
                      mtp=mtp, batch_invariant=invariant, model_kw=model_kw, mode=mode)
    groups = init_parallel(cfg.parallel)
    install_cpu_compat()
    sd = oracle_state_dict(cfg.model) if weights == "oracle" else random_state_dict(cfg.model)
    engine = Engine(cfg, groups, sd)
    runner = engine.runner
    watch = VariantGemms()
    plain = runner.run_decode
    sums: list[str] = []  # the reducing collectives D called (NCCL's order follows the size)
    dist = torch.distributed
    reducing = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_tensor")}

    def counted(name):
        def call(*args, **kwargs):
            sums.append(name)
            return reducing[name](*args, **kwargs)
        return call

    def watched(*args, **kwargs):
        for name in reducing:
            setattr(dist, name, counted(name))
        try:
            with watch:
                return plain(*args, **kwargs)
        finally:
            for name, fn in reducing.items():
                setattr(dist, name, fn)

    runner.run_decode = watched  # this instance only: every D iteration, MTP's pass too
    requests = mixed_requests(12, 3, cfg.model.vocab_size)
    outs = engine.generate(requests)
    sched = engine.scheduler
    res = {"tokens": {r.request_id: outs[r.request_id].tokens for r in requests},
           "logprobs": {r.request_id: outs[r.request_id].logprobs for r in requests},
           "variant_gemms": sorted(set(watch.calls)), "d_sums": sorted(set(sums)),
           "verified": sched.drafts_verified, "accepted": sched.drafts_accepted}
    engine.close()
    return res
