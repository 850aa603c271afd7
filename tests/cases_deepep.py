"""Rank bodies of the DeepEP GPU checks (tests/test_gpu.py): the split-phase normal dispatch
with 2 ranks sharing one GPU (gloo group), against a reference computed from the routing."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _routing(rank: int, n: int, hidden: int, k: int, experts: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(1000 * seed + rank)
    x = (torch.randn(n, hidden, generator=g, device="cuda") * 0.5).bfloat16()
    chosen = torch.rand(n, experts, generator=g, device="cuda").topk(k, dim=1).indices
    weight = torch.rand(n, k, generator=g, device="cuda") + 0.1
    return x, chosen.contiguous(), weight.contiguous()


def _experts(inputs, rank: int, per_rank: int) -> torch.Tensor:
    """A rank's 'experts' on its received rows: expert e scales a row by e + 1 (global id);
    each row's local slots summed with their weights, in the rows' dtype -- the same
    contract as local_experts (model/dispatch.py)."""
    valid = inputs.expert < per_rank
    scale = torch.where(valid, (inputs.expert + rank * per_rank + 1).float() * inputs.weight,
                        0.0).sum(dim=1)
    return (inputs.rows.float() * scale[:, None]).to(inputs.rows.dtype)


def deepep_normal_split_shared_gpu(rank: int, world: int, n: int = 96, hidden: int = 2048,
                                   k: int = 4, per_rank: int = 8) -> dict:
    torch.cuda.set_device(0)
    from colo_rollout.model.deepep import DispatchRetired, NormalSplitDispatch
    from colo_rollout.model.dispatch import PhaseState

    group = dist.new_group(list(range(world)), backend="gloo")
    st = PhaseState("P", group, list(range(world)), rank)
    experts = per_rank * world
    d = NormalSplitDispatch(st, per_rank, experts, hidden, num_sms=20, timeout_s=60.0)
    res = {"report": d.report().row()}

    def expected(x, chosen, weight):
        return x.float() * ((chosen + 1).float() * weight).sum(dim=1, keepdim=True)

    def err(out, ref):
        return float((out - ref).abs().max() / ref.abs().max())

    # round 1: the split halves with a gap between them (the safe boundary)
    x, chosen, weight = _routing(rank, n, hidden, k, experts, 1)
    notice = d.notify(chosen, weight, layer=0)
    try:
        d.notify(chosen, weight, layer=1)
        res["second_pending"] = None
    except RuntimeError as e:
        res["second_pending"] = str(e)
    counts = d.counts(notice)
    inputs, handle = d.send(x, notice, counts)
    out = d.combine(_experts(inputs, rank, per_rank), handle)
    torch.cuda.synchronize()
    res["err_split"] = err(out, expected(x, chosen, weight))
    every = [torch.empty_like(chosen).cpu() for _ in range(world)]
    dist.all_gather(every, chosen.cpu(), group=group)
    res["counts"] = counts
    res["expected_counts"] = (
        [sum(int((c // per_rank == rank).any(dim=1).sum()) for c in every)]
        + [sum(int((c == rank * per_rank + i).sum()) for c in every) for i in range(per_rank)])
    # round 2: abandoned after its notification -> the buffer is retired until quiesce
    x2, chosen2, weight2 = _routing(rank, n, hidden, k, experts, 2)
    d.notify(chosen2, weight2, layer=0)
    d.retire()
    try:
        d.notify(chosen2, weight2, layer=0)
        res["retired"] = None
    except DispatchRetired as e:
        res["retired"] = str(e)
    d.quiesce()
    # round 3: usable again after the quiescent point; the whole dispatch back to back
    x3, chosen3, weight3 = _routing(rank, n, hidden, k, experts, 3)
    inputs, handle = d.dispatch(x3, chosen3, weight3, layer=0)
    out3 = d.combine(_experts(inputs, rank, per_rank), handle)
    torch.cuda.synchronize()
    res["err_after_quiesce"] = err(out3, expected(x3, chosen3, weight3))
    res["collectives"], res["host_reads"] = st.collectives, st.host_reads
    dist.barrier(group=group)
    d.close()
    return res
