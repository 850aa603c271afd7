"""``load_sharded`` (model/weights.py): a full state dict into a model's shards, all or nothing
-- a bad entry anywhere (a non-float tensor, a name the model lacks, an expert past its count, a
wrong shape, a missing parameter) is refused before the first parameter is written, so the
model serves what it held before (a bad last entry used to leave a half-loaded model)."""

from __future__ import annotations

import pytest
import torch

from colo_rollout.model.weights import load_sharded
from colo_rollout.runtime.parallel import Layout

E = 2


class Tiny(torch.nn.Module):
    """Megatron-named parameters: a router, two local experts (one rank holds both)."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = torch.nn.Module()
        layer = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([layer])
        layer.router = torch.nn.Linear(4, E, bias=False)
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = torch.nn.Module()
        layer.mlp.experts.local_experts = torch.nn.ModuleList()
        for _ in range(E):
            ex = torch.nn.Module()
            ex.linear_fc1 = torch.nn.Linear(4, 6, bias=False)
            ex.linear_fc2 = torch.nn.Linear(3, 4, bias=False)
            layer.mlp.experts.local_experts.append(ex)


def _full(value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in Tiny().state_dict().items()}


def _load(model, full):
    load_sharded(model, full, Layout(1, 1, 1), 0, num_experts=E)


def test_a_good_state_dict_loads_every_parameter():
    model = Tiny()
    _load(model, _full(0.5))
    assert all(bool((p == 0.5).all()) for p in model.parameters())


@pytest.mark.parametrize("change, error, fragment", [
    (lambda f: f.__setitem__(sorted(f)[-1], torch.zeros(7, 7)), ValueError, "shard shape"),
    (lambda f: f.__setitem__(sorted(f)[-1], torch.ones(6, 4, dtype=torch.int64)), ValueError,
     "expected a floating-point tensor, got torch.int64"),
    (lambda f: f.__setitem__(sorted(f)[-1], [[1.0]]), ValueError,
     "expected a floating-point tensor, got list"),
    (lambda f: f.__setitem__("decoder.layers.0.mlp.experts.local_experts.9.linear_fc1.weight",
                             torch.zeros(6, 4)), KeyError, "expert 9 of a model with 2"),
    (lambda f: f.__setitem__("decoder.layers.0.mlp.experts.local_experts.1.gate.weight",
                             torch.zeros(6, 4)), KeyError, "an expert's tensors are linear_fc1"),
    (lambda f: f.pop(sorted(f)[-1]), KeyError, "state dict is missing"),
    (lambda f: f.__setitem__("decoder.layers.0.extra.weight", torch.zeros(2)), KeyError,
     "the inference model has no"),
    (lambda f: f.__setitem__("mtp.layers.0.enorm.weight", torch.zeros(4)), KeyError,
     "an MTP layer's weight, and the model has no MTP layer: model.mtp_num_layers 1 serves"),
])
def test_a_bad_entry_leaves_the_model_as_it_was(change, error, fragment):
    model = Tiny()
    _load(model, _full(0.5))
    bad = _full(2.0)
    change(bad)
    with pytest.raises(error, match=fragment):
        _load(model, bad)
    assert all(bool((p == 0.5).all()) for p in model.parameters())  # nothing written
