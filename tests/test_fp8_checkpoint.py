"""Block-scaled FP8 checkpoints (DeepSeek-V3's format; Qwen3-*-FP8 releases)
load dequantized (checkpoint/fp8_blocks.py): every span a rank reads equals the same span of
the whole dequantised weight, the format is checked from the headers, config.json's
quantization_config is parsed or refused naming its key, and an engine served from such a
checkpoint on EP2/ATP2 (row and column slices across the blocks) matches transformers on the
dequantised weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from colo_rollout.checkpoint.fp8_blocks import BlockFp8Store, float_view, quantize_blocks
from colo_rollout.checkpoint.store import CheckpointError, CheckpointStore
from colo_rollout.config.hf_config import hf_architecture
from tests.cases_hf import save_tiny_checkpoint, to_fp8_block_checkpoint
from tests.test_hf_import import CASES, check_equivalent, edit_config

BLOCK = (16, 32)


def _write(directory, tensors: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3MoeForCausalLM"]}, f)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return str(directory)


def _dequantised(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    n, k = q.shape
    return q.float() * s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def test_every_span_reads_as_the_dequantised_weight(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 70, generator=g)  # ragged: 50 = 3 x 16 + 2, 70 = 2 x 32 + 6
    q, s = quantize_blocks(w, BLOCK)
    bias = torch.randn(50, generator=g).bfloat16()
    d = _write(tmp_path / "c", {"a.weight": q, "a.weight_scale_inv": s, "a.bias": bias,
                                "b.weight": w.bfloat16()})
    full = _dequantised(q, s, BLOCK)
    assert (full - w).abs().max() <= w.abs().max() / 8  # e4m3: 3 mantissa bits
    with BlockFp8Store(CheckpointStore(d), BLOCK) as st:
        assert sorted(st.names()) == ["a.bias", "a.weight", "b.weight"]
        assert "a.weight_scale_inv" not in st and "a.weight" in st
        assert st.scaled("a.weight") and not st.scaled("b.weight")
        assert st.dtype("a.weight") == torch.float32 and st.dtype("b.weight") == torch.bfloat16
        assert st.shape("a.weight") == (50, 70)
        assert torch.equal(st.read("a.weight"), full)
        for rows in (None, (0, 16), (5, 37), (16, 32), (49, 50), (7, 7)):
            for cols in (None, (0, 32), (3, 66), (64, 70), (31, 33)):
                got = st.read("a.weight", rows=rows, cols=cols)
                want = full[slice(*(rows or (0, 50))), slice(*(cols or (0, 70)))]
                assert torch.equal(got, want), (rows, cols)
        assert st.read("a.weight", rows=(5, 37), dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.equal(st.read("b.weight"), w.bfloat16())  # float tensors pass through
        assert torch.equal(st.read("a.bias"), bias)
        with pytest.raises(CheckpointError, match="rows must be"):
            st.read("a.weight", rows=(0, 51))
    assert float_view(CheckpointStore(d), None).__class__ is CheckpointStore
    view = float_view(CheckpointStore(d), BLOCK, "meta")  # dequantised where the params live
    assert view.read("a.weight", rows=(5, 37)).device.type == "meta"
    assert view.read("b.weight").device.type == "cpu"  # float tensors: as stored
    assert float_view(view, BLOCK).device is None  # re-viewed: the new device


def test_a_sharded_release_reads_each_tensor_from_its_shard(tmp_path):
    """Releases are sharded (model.safetensors.index.json), a weight and its scales possibly in
    different shards."""
    q, s = quantize_blocks(torch.randn(50, 70, generator=torch.Generator().manual_seed(1)),
                           BLOCK)
    d = tmp_path / "sharded"
    d.mkdir()
    with open(d / "config.json", "w") as f:
        json.dump({"architectures": ["Qwen3MoeForCausalLM"]}, f)
    save_file({"a.weight": q}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"a.weight_scale_inv": s}, str(d / "model-00002-of-00002.safetensors"))
    with open(d / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                  "a.weight_scale_inv": "model-00002-of-00002.safetensors"}}, f)
    with BlockFp8Store(CheckpointStore(d), BLOCK) as st:
        assert st.names() == ["a.weight"]
        assert torch.equal(st.read("a.weight", cols=(3, 66)), _dequantised(q, s, BLOCK)[:, 3:66])


def test_the_format_is_checked_from_the_headers(tmp_path):
    q, s = quantize_blocks(torch.randn(50, 70), BLOCK)

    def error(tensors) -> str:
        d = _write(tmp_path / f"c{len(os.listdir(tmp_path))}", tensors)
        with pytest.raises(CheckpointError) as info:
            BlockFp8Store(CheckpointStore(d), BLOCK)
        return str(info.value)

    got = error({"a.weight": q})
    assert "an e4m3 weight without its block scales 'a.weight_scale_inv'" in got, got
    got = error({"a.weight": q, "a.weight_scale_inv": s[:3]})
    assert "a.weight_scale_inv" in got and "shape [3, 3], expected [4, 3]" in got
    got = error({"b.weight_scale_inv": s})
    assert "a block scale without its weight 'b.weight'" in got
    got = error({"a.weight": q.view(10, 5, 70), "a.weight_scale_inv": s})
    assert "2-D weights only" in got
    # scales that are not 16- or 32-bit floats would scale the codes by their truncations
    # (found by probing: int32 scales served zero weights)
    for bad in (torch.int32, torch.float8_e4m3fn):
        got = error({"a.weight": q, "a.weight_scale_inv": s.to(bad)})
        assert "a.weight_scale_inv" in got and "block scales load from float32" in got, got
    # another 8-bit weight beside its scales is named (it was "an unexpected scale tensor")
    got = error({"a.weight": q.float().to(torch.float8_e5m2), "a.weight_scale_inv": s})
    assert got.endswith("a.weight: stored as float8_e5m2 beside its block scales: "
                        "block-scaled weights load from e4m3 (quantization_config.fmt)"), got


@pytest.mark.parametrize("qc, key, problem", [
    ({"quant_method": "awq", "bits": 4}, "quantization_config.quant_method", "'awq' is not"),
    ({"quant_method": "fp8"}, "quantization_config.weight_block_size", "per-tensor FP8"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]},
     "quantization_config.weight_block_size", "positive ints"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
     "quantization_config.fmt", "'e5m2'"),
    ("fp8", "quantization_config", "expected an object or null"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "quantization_config.activation_scheme", "'static': block-scaled FP8 checkpoints load "
                                              "with dynamic activations only"),
])
def test_quantization_config_is_parsed_or_refused_naming_the_key(tmp_path, qc, key, problem):
    d = tmp_path / "q"
    save_tiny_checkpoint(d, "qwen3")
    assert hf_architecture(d).weight_block is None
    edit_config(str(d), quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                             "weight_block_size": [128, 64]})
    assert hf_architecture(d).weight_block == (128, 64)
    edit_config(str(d), quantization_config=qc)
    with pytest.raises(CheckpointError) as info:
        hf_architecture(d)
    assert key in str(info.value) and problem in str(info.value), str(info.value)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint as a block-scaled FP8 release (ragged [48, 40] blocks: the
    q rows of one attention-TP rank end inside a block), and its dequantised float twin."""
    root = tmp_path_factory.mktemp("fp8ckpt")
    save_tiny_checkpoint(root / "float", "qwen3")
    to_fp8_block_checkpoint(str(root / "float"), str(root / "fp8"), str(root / "ref"), (48, 40))
    return str(root / "fp8"), str(root / "ref")


def test_checkpoint_check_sees_the_float_release(fp8_ckpt):
    from colo_rollout.checkpoint.loader import check_checkpoint
    from colo_rollout.config import config_from_dict

    fp8, _ = fp8_ckpt
    cfg = config_from_dict({"model": {"checkpoint": fp8}, "engine": {"max_seq_len": 128}}).model
    arch = check_checkpoint(cfg)  # no "unexpected tensor" for the scales
    assert arch.weight_block == (48, 40)
    with CheckpointStore(fp8) as st:
        assert st.dtype("model.layers.0.self_attn.q_proj.weight") == torch.float8_e4m3fn
        assert st.dtype("model.layers.0.mlp.gate.weight") == torch.float32  # the router: kept


def test_the_export_of_an_fp8_release_declares_float_weights(fp8_ckpt):
    """The export writes float tensors (no scales): its config.json drops the source's
    quantization_config, else transformers would read the export as an FP8 release."""
    from colo_rollout.checkpoint.export import export_problem, _export_config
    from colo_rollout.config import config_from_dict

    fp8, _ = fp8_ckpt
    cfg = config_from_dict({"model": {"checkpoint": fp8}, "engine": {"max_seq_len": 128}}).model
    assert export_problem(cfg) is None
    got = _export_config(cfg, "Qwen3MoeForCausalLM", "bfloat16")
    assert "quantization_config" not in got and got["dtype"] == "bfloat16"
    with open(os.path.join(fp8, "config.json")) as f:
        assert "quantization_config" in json.load(f)  # (the source's, left as it is)


def test_an_fp8_release_without_its_quantization_config_is_refused(fp8_ckpt, tmp_path):
    """Malformed releases, checked at the door: scales beside weights, or e4m3 weights alone,
    with no quantization_config to say how to read them (the codes unscaled would load)."""
    import shutil

    from safetensors.torch import load_file

    from colo_rollout.checkpoint.loader import check_checkpoint
    from colo_rollout.config import config_from_dict

    fp8, _ = fp8_ckpt
    d = str(tmp_path / "noqc")
    shutil.copytree(fp8, d)
    edit_config(d, quantization_config=None)

    def error() -> str:
        cfg = config_from_dict({"model": {"checkpoint": d}, "engine": {"max_seq_len": 128}})
        with pytest.raises(CheckpointError) as info:
            check_checkpoint(cfg.model)
        return str(info.value)

    got = error()
    assert "unexpected tensors" in got and "weight_scale_inv" in got, got
    assert got.endswith("block-scaled FP8 weights load when config.json's quantization_config "
                        "says so (quant_method 'fp8', weight_block_size)"), got
    path = os.path.join(d, "model.safetensors")  # the scales gone too: e4m3 codes alone
    save_file({k: v for k, v in load_file(path).items() if not k.endswith("_scale_inv")}, path)
    got = error()
    assert "stored in e4m3 but config.json has no quantization_config" in got, got


def test_ep2_atp2_engine_from_an_fp8_release_matches_transformers(worker_groups, fp8_ckpt):
    fp8, ref = fp8_ckpt
    res = worker_groups(2).run(f"{CASES}:serve_checkpoint", directory=fp8, adp=1, ep=2,
                               reference=ref)
    assert res[0]["layout"] == "EP2/ATP2"
    check_equivalent(res)
