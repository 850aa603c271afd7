"""GPU tier: the engine on 1 and 2 GPUs (NCCL, bf16) against the megatron reference.

Skipped without CUDA (CI). scripts/gpu_check.sh runs this file on the GPU host; each test
appends its measurements to $COLO_GPU_REPORT (JSON lines) for the summary table.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from colo_rollout.testing import WorkerGroup

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(NGPU == 0, reason="needs CUDA GPUs")


def _record(name: str, row: dict) -> None:
    path = os.environ.get("COLO_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **row}) + "\n")


@pytest.fixture(scope="module")
def gpu_groups():
    groups: dict[int, WorkerGroup] = {}

    def get(world: int) -> WorkerGroup:
        if world > NGPU:
            pytest.skip(f"needs {world} GPUs, have {NGPU}")
        if world not in groups or not groups[world].alive:
            groups[world] = WorkerGroup(world, backend="nccl")
        return groups[world]

    yield get
    for g in groups.values():
        g.close()


@pytest.mark.parametrize("world,adp,ep", [(1, 1, 1), (2, 2, 2), (2, 1, 2), (2, 1, 1)])
def test_gpu_bf16_engine_matches_reference(gpu_groups, world, adp, ep):
    from tests.cases_gpu import BF16_LOGPROB_TOL

    res = gpu_groups(world).run("tests.cases_gpu:gpu_engine_matches_reference", timeout=600,
                                adp=adp, ep=ep)
    r0 = res[0]
    _record("engine_vs_reference_bf16", {
        "layout": r0["layout"], "gpus": world, "checked": r0["checked"],
        "max_logprob_diff": r0["max_logprob_diff"], "mean_logprob_diff": r0["mean_logprob_diff"],
        "mismatches": len(r0["mismatches"]), "wall_s": r0["wall_s"],
        "tok_per_s": r0["generated"] / r0["wall_s"], "device": r0["device"],
        "passed": not r0["mismatches"] and r0["max_logprob_diff"] < BF16_LOGPROB_TOL})
    assert r0["checked"] > 40
    assert r0["mismatches"] == [], r0["mismatches"][:5]
    assert r0["max_logprob_diff"] < BF16_LOGPROB_TOL
    for r in res[1:]:
        assert r["tokens"] == r0["tokens"]
