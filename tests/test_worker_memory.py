"""worker/memory.py without processes: a release that fails part-way leaves a state resume
undoes (probing found an engine whose release raised after freeing the KV cache: resume said
"not released" and every later generate failed)."""

from __future__ import annotations

import pytest
import torch

from colo_rollout.worker.memory import WorkerMemory


class _Runner:
    def __init__(self) -> None:
        self.kv = "storage"

    def release_kv(self) -> None:
        self.kv = None

    def resume_kv(self) -> None:
        self.kv = "storage"


class _Model(torch.nn.Module):
    def __init__(self, fail_fp8: bool = False, fail_after: int | None = None) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.arange(4.0))
        self.b = torch.nn.Parameter(torch.arange(6.0).view(2, 3))
        self.fail_fp8 = fail_fp8
        self.fail_after = fail_after  # the weights pass raises after this many parameters

    def named_parameters(self, *args, **kwargs):
        for i, item in enumerate(super().named_parameters(*args, **kwargs)):
            if self.fail_after is not None and i == self.fail_after:
                raise MemoryError("host memory exhausted")
            yield item

    def moe_layers(self):
        return []

    def drop_fp8(self) -> None:
        if self.fail_fp8:
            raise AttributeError("a module without the FP8 sites")

    def weights_updated(self) -> None:
        pass


@pytest.mark.parametrize("weights", ["offload", "discard"])
def test_a_release_whose_weights_pass_raises_halfway_is_undone_by_resume(weights):
    """The first parameter moved (offloaded or dropped), the second not: resume brings back
    the first and keeps the second."""
    model, runner = _Model(), _Runner()
    mem = WorkerMemory(model, runner, torch.device("cpu"))
    model.fail_after = 1
    with pytest.raises(MemoryError):
        mem.release(weights, drain=lambda: None)
    assert model.a.numel() == 0 and model.b.numel() == 6 and mem.released == weights
    model.fail_after = None
    mem.resume(drain=lambda: None)
    assert runner.kv == "storage"
    if weights == "offload":
        mem.check_ready()
        assert torch.equal(model.a, torch.arange(4.0))
        assert torch.equal(model.b, torch.arange(6.0).view(2, 3))
    else:
        assert torch.isnan(model.a).all() and torch.isnan(model.b).all()


@pytest.mark.parametrize("weights", ["offload", "discard"])
def test_a_release_that_raises_part_way_is_undone_by_resume(weights):
    model, runner = _Model(fail_fp8=True), _Runner()
    mem = WorkerMemory(model, runner, torch.device("cpu"))
    with pytest.raises(AttributeError):
        mem.release(weights, drain=lambda: None)
    assert runner.kv is None and mem.released == weights
    with pytest.raises(RuntimeError, match="released: call resume_memory"):
        mem.check_ready()
    mem.resume(drain=lambda: None)
    assert runner.kv == "storage" and mem.released is None
    if weights == "offload":  # nothing had moved: the weights are as they were
        mem.check_ready()
        assert torch.equal(model.a, torch.arange(4.0))
    else:  # a discard's weights are NaN until written, whatever the release got to
        with pytest.raises(RuntimeError, match="weights were discarded"):
            mem.check_ready()
        assert torch.isnan(model.a).all() and model.b.shape == (2, 3)


@pytest.mark.parametrize("weights", ["keep", "offload"])
def test_release_and_resume_keep_the_weights(weights):
    model = _Model()
    mem = WorkerMemory(model, _Runner(), torch.device("cpu"))
    mem.release(weights, drain=lambda: None)
    if weights == "offload":
        assert model.a.numel() == 0
    mem.resume(drain=lambda: None)
    mem.check_ready()
    assert torch.equal(model.b, torch.arange(6.0).view(2, 3))
