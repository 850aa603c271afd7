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


def deepep_phase_isolation_shared_gpu(rank: int, world: int, n_p: int = 512, n_d: int = 32,
                                      hidden: int = 2048, k: int = 8, per_rank: int = 8,
                                      iters: int = 20) -> dict:
    """Phase-owned state on one GPU: each of 2 ranks (gloo, one GPU) holds P's normal-mode
    Buffer over both ranks and its own D low-latency Buffer (world 1: NVSHMEM takes one PE
    per GPU). D's low-latency dispatch + combine is timed (CUDA events) with P idle, and
    again while a P dispatch is pending on the other state (notified, its data not sent);
    then P completes and is checked. D never waits for P: it owns its buffers."""
    torch.cuda.set_device(0)
    from colo_rollout.model.deepep import LowLatencyDispatch, NormalSplitDispatch
    from colo_rollout.model.dispatch import PhaseState

    pg = dist.new_group(list(range(world)), backend="gloo")
    singles = [dist.new_group([r], backend="gloo") for r in range(world)]
    p = NormalSplitDispatch(PhaseState("P", pg, list(range(world)), rank), per_rank,
                            per_rank * world, hidden, num_sms=20, timeout_s=60.0)
    d_experts = per_rank * world
    d = LowLatencyDispatch(PhaseState("D", singles[rank], [rank], 0), d_experts, d_experts,
                           hidden, n_d)
    xd, cd, wd = _routing(rank, n_d, hidden, k, d_experts, 7)

    def d_round() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        recv, count, handle, _, _ = d.buffer.low_latency_dispatch(xd, cd, d.max_tokens,
                                                                  d_experts, use_fp8=False)
        out, _, _ = d.buffer.low_latency_combine(recv, cd, wd, handle)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3, out

    for _ in range(3):
        d_round()
    idle = sorted(d_round()[0] for _ in range(iters))
    x, chosen, weight = _routing(rank, n_p, hidden, k, per_rank * world, 8)
    notice = p.notify(chosen, weight, layer=0)  # P pending on its own buffer
    during = []
    for _ in range(iters):
        t, out = d_round()
        during.append(t)
    # the D result while P was pending: each row summed over its k experts' copies, weighted
    ref = xd.float() * wd.sum(dim=1, keepdim=True)
    d_err = float((out.float() - ref).abs().max() / ref.abs().max())
    counts = p.counts(notice)
    inputs, handle = p.send(x, notice, counts)
    p_out = p.combine(_experts(inputs, rank, per_rank), handle)
    torch.cuda.synchronize()
    p_ref = x.float() * ((chosen + 1).float() * weight).sum(dim=1, keepdim=True)
    p_err = float((p_out - p_ref).abs().max() / p_ref.abs().max())
    during.sort()
    dist.barrier(group=pg)
    p.close()
    d.close()
    return {"d_us_idle_p50": idle[len(idle) // 2], "d_us_p_pending_p50": during[len(during) // 2],
            "d_err_p_pending": d_err, "p_err": p_err, "d_rows": n_d, "p_rows": n_p,
            "buffers": [p.report().row(), d.report().row()]}
