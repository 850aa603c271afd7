"""Checkpoint storage (colo_rollout.checkpoint.store): write_checkpoint and CheckpointStore
round trips, sliced reads, error messages, and interchange with transformers' own checkpoints."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from colo_rollout.checkpoint.store import CheckpointError, CheckpointStore, write_checkpoint

CONFIG = {"model_type": "toy", "hidden_size": 8, "nested": {"a": [1, 2]}}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),
        "layers.0.attn.qkv.weight": torch.randn(24, 8, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(8, generator=g).to(torch.float16),
        "layers.0.experts.weight": torch.randn(4, 6, 8, generator=g),
        "layers.0.ids": torch.arange(10, dtype=torch.int64),
        "layers.0.mask": torch.rand(5, 3, generator=g) > 0.5,
        "layers.0.fp8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        "scale": torch.tensor(0.5),
    }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch.equal is not implemented for float8; compare the bits.
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _check_roundtrip(store: CheckpointStore, tensors: dict[str, torch.Tensor]) -> None:
    assert store.names() == sorted(tensors)
    for name, t in tensors.items():
        assert name in store
        assert store.shape(name) == tuple(t.shape)
        assert store.dtype(name) == t.dtype
        assert _same(store.read(name), t), name


def test_write_single_file(tmp_path):
    tensors = _tensors()
    files = write_checkpoint(tmp_path, tensors.items(), CONFIG, extra_files={"README.md": "hi\n"})
    assert files == [tmp_path / "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json",
                                                          "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text()) == CONFIG
    assert (tmp_path / "config.json").read_text().startswith('{\n  "model_type": "toy"')
    assert (tmp_path / "README.md").read_text() == "hi\n"
    with safe_open(str(files[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    with CheckpointStore(tmp_path) as store:
        assert store.config == CONFIG
        assert store.directory == tmp_path
        _check_roundtrip(store, tensors)
        assert store.file_of("scale") == files[0]


def test_write_sharded(tmp_path):
    tensors = _tensors()
    limit = 700  # the 768-byte tensor gets a shard of its own; the rest pack into several
    files = write_checkpoint(tmp_path, tensors.items(), CONFIG, max_shard_bytes=limit)
    n = len(files)
    assert n >= 3
    assert [p.name for p in files] == [f"model-{i:05d}-of-{n:05d}.safetensors"
                                       for i in range(1, n + 1)]
    assert not list(tmp_path.glob(".*tmp")) and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": sum(_nbytes(t) for t in tensors.values())}
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == {p.name for p in files}
    # Each shard holds whole tensors, in stream order, and stays under the limit unless it is
    # one oversized tensor.
    order = [index["weight_map"][name] for name in tensors]
    assert order == sorted(order)
    for p in files:
        with safe_open(str(p), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            size = sum(_nbytes(f.get_tensor(k)) for k in f.keys())
            assert size <= limit or len(f.keys()) == 1
    with CheckpointStore(tmp_path) as store:
        _check_roundtrip(store, tensors)
        assert store.file_of("scale") == tmp_path / index["weight_map"]["scale"]


def test_sliced_reads_and_bytes_read(tmp_path):
    tensors = _tensors()
    write_checkpoint(tmp_path, tensors.items(), CONFIG, max_shard_bytes=700)
    store = CheckpointStore(tmp_path)
    emb, qkv, exp = (tensors[k] for k in ("embed.weight", "layers.0.attn.qkv.weight",
                                          "layers.0.experts.weight"))
    expected = 0
    cases = [
        ("embed.weight", dict(rows=(4, 12)), emb[4:12]),
        ("embed.weight", dict(cols=(2, 5)), emb[:, 2:5]),
        ("embed.weight", dict(rows=(0, 16), cols=(7, 8)), emb[:, 7:8]),
        ("layers.0.attn.qkv.weight", dict(rows=(8, 16), cols=(0, 4)), qkv[8:16, 0:4]),
        ("layers.0.experts.weight", dict(rows=(1, 3)), exp[1:3]),
        ("layers.0.experts.weight", dict(cols=(2, 4)), exp[:, 2:4]),
        ("layers.0.ids", dict(rows=(3, 7)), tensors["layers.0.ids"][3:7]),
        ("layers.0.fp8", dict(rows=(1, 2), cols=(3, 8)), tensors["layers.0.fp8"][1:2, 3:8]),
        ("embed.weight", dict(rows=(5, 5)), emb[5:5]),
        ("scale", {}, tensors["scale"]),
    ]
    for name, kw, want in cases:
        got = store.read(name, **kw)
        assert _same(got, want), (name, kw)
        assert got.is_contiguous()
        expected += _nbytes(want)
        assert store.bytes_read == expected
    # A cast counts the bytes read from disk (stored dtype), not the bytes after the cast.
    got = store.read("layers.0.attn.qkv.weight", rows=(0, 2), dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, qkv[0:2].float())
    assert store.bytes_read == expected + _nbytes(qkv[0:2])
    store.close()
    assert torch.equal(store.read("embed.weight", rows=(0, 1)), emb[0:1])  # reopens lazily


@pytest.mark.parametrize("kw, problem", [
    (dict(name="embed.weight", rows=(0, 17)),
     r"rows must be \(start, stop\) with 0 <= start <= stop <= 16 \(dim 0 of shape \[16, 8\]\), "
     r"got \(0, 17\)"),
    (dict(name="embed.weight", rows=(-1, 3)), r"rows must be .*, got \(-1, 3\)"),
    (dict(name="embed.weight", rows=(5, 4)), r"rows must be .*, got \(5, 4\)"),
    (dict(name="embed.weight", rows=(0.0, 3)), r"rows must be .*, got \(0.0, 3\)"),
    (dict(name="embed.weight", rows=[0, 3]), r"rows must be .*, got \[0, 3\]"),
    (dict(name="embed.weight", cols=(0, 9)), r"cols must be .* <= 8 \(dim 1 of shape"),
    (dict(name="layers.0.ids", cols=(0, 1)), r"cols given for a 1-D tensor"),
    (dict(name="scale", rows=(0, 1)), r"rows given for a 0-D tensor"),
])
def test_slice_errors(tmp_path, kw, problem):
    write_checkpoint(tmp_path, _tensors().items(), CONFIG)
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match=problem) as info:
        store.read(**kw)
    err = info.value
    assert str(err).startswith(f"{tmp_path / 'model.safetensors'}: {kw['name']}: ")
    assert err.path == tmp_path / "model.safetensors" and err.name == kw["name"]
    assert store.bytes_read == 0


def test_unknown_tensor_names_index_and_suggests(tmp_path):
    write_checkpoint(tmp_path, _tensors().items(), CONFIG, max_shard_bytes=700)
    store = CheckpointStore(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    for call in (lambda: store.read("embed.weigth"), lambda: store.shape("embed.weigth"),
                 lambda: store.file_of("embed.weigth")):
        with pytest.raises(CheckpointError) as info:
            call()
        assert str(info.value).startswith(f"{index}: embed.weigth: no such tensor in {tmp_path}")
        assert "did you mean 'embed.weight'" in str(info.value)
    with pytest.raises(CheckpointError) as info:
        store.read("zzz")
    assert "did you mean" not in str(info.value)
    assert "zzz" not in store


def test_writer_edge_cases(tmp_path):
    t = torch.arange(6.0).reshape(2, 3)
    with pytest.raises(ValueError, match="duplicate tensor name 'a'"):
        write_checkpoint(tmp_path, [("a", t), ("b", t), ("a", t)], CONFIG, max_shard_bytes=24)
    assert list(tmp_path.iterdir()) == []  # temporary shards removed on failure
    with pytest.raises(ValueError, match="extra_files"):
        write_checkpoint(tmp_path, [("a", t)], CONFIG, extra_files={"config.json": "{}"})
    with pytest.raises(TypeError):
        write_checkpoint(tmp_path, [("a", t)], {"bad": object()})
    assert list(tmp_path.iterdir()) == []  # config is checked before anything is written
    # Tied / shared-memory tensors, views (offset or non-contiguous) and parameters are writable.
    p = torch.nn.Parameter(torch.randn(3, 2))
    base = torch.arange(10.0)
    pairs = [("tied.a", t), ("tied.b", t), ("view", t.t()), ("param", p), ("part", base[3:7]),
             ("empty", torch.zeros(0, 4))]
    write_checkpoint(tmp_path, pairs, CONFIG)
    with CheckpointStore(tmp_path) as store:
        for name, want in pairs:
            assert torch.equal(store.read(name), want.detach())


def test_rewrite_removes_stale_weight_files(tmp_path):
    tensors = _tensors()
    (tmp_path / "tokenizer.json").write_text("{}")
    write_checkpoint(tmp_path, tensors.items(), CONFIG, max_shard_bytes=700)
    write_checkpoint(tmp_path, tensors.items(), CONFIG)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors",
                                                          "tokenizer.json"]
    files = write_checkpoint(tmp_path, tensors.items(), CONFIG, max_shard_bytes=700)
    assert sorted(p.name for p in tmp_path.glob("model*")) == sorted(
        [p.name for p in files] + ["model.safetensors.index.json"])
    _check_roundtrip(CheckpointStore(tmp_path), tensors)


# ---- construction errors: each names the file and, where there is one, the key or tensor ----

def _error(directory) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        CheckpointStore(directory)
    return info.value


def test_directory_errors(tmp_path):
    assert str(_error(tmp_path / "nope")) == f"{tmp_path / 'nope'}: no such directory"
    (tmp_path / "file").write_text("x")
    assert str(_error(tmp_path / "file")) == f"{tmp_path / 'file'}: not a directory"


@pytest.mark.parametrize("content, problem", [
    (None, "missing"),
    (b'{"a": "\xff"}', r"not UTF-8"),
    (b'{"a": 1,', r"not JSON: .* at line 1 column 9"),
    (b"[1, 2]", r"expected a JSON object, got list"),
])
def test_config_errors(tmp_path, content, problem):
    write_checkpoint(tmp_path, [("a", torch.zeros(2))], CONFIG)
    cfg = tmp_path / "config.json"
    cfg.unlink() if content is None else cfg.write_bytes(content)
    err = _error(tmp_path)
    assert re.fullmatch(f"{re.escape(str(cfg))}: {problem}.*", str(err)) and err.path == cfg


def test_no_weights(tmp_path):
    write_checkpoint(tmp_path, [("a", torch.zeros(2))], CONFIG)
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00001.safetensors")
    msg = str(_error(tmp_path))
    assert msg.startswith(f"{tmp_path}: no weights: expected model.safetensors or "
                          "model.safetensors.index.json")
    # a pickled checkpoint is named, and never opened (its bytes are not even a pickle here)
    (tmp_path / "model-00001-of-00001.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    assert str(_error(tmp_path)).endswith("; pytorch_model.bin is a pickle, which is never "
                                          "loaded (convert it with transformers' "
                                          "save_pretrained(..., safe_serialization=True))")


def _sharded(tmp_path):
    write_checkpoint(tmp_path, _tensors().items(), CONFIG, max_shard_bytes=700)
    index = tmp_path / "model.safetensors.index.json"
    return index, json.loads(index.read_text())


@pytest.mark.parametrize("content, prefix", [
    ("{not json", "not JSON"),
    ('{"metadata": {}}', "weight_map: missing or not an object"),
    ('{"weight_map": ["a"]}', "weight_map: missing or not an object"),
    ('{"weight_map": {"a": 3}}', "weight_map.a: expected a file name, got 3"),
    # shards outside the checkpoint's directory (found by probing: read without a word)
    ('{"weight_map": {"a": "/etc/passwd"}}',
     "weight_map.a: '/etc/passwd': expected a file in the checkpoint's directory"),
    ('{"weight_map": {"a": "../other/model.safetensors"}}',
     "weight_map.a: '../other/model.safetensors': expected a file in the checkpoint's"),
    ('{"weight_map": {"a": ""}}', "weight_map.a: '': expected a file in the checkpoint's"),
])
def test_index_errors(tmp_path, content, prefix):
    index, _ = _sharded(tmp_path)
    index.write_text(content)
    err = _error(tmp_path)
    assert str(err).startswith(f"{index}: {prefix}") and err.path == index


def test_missing_shard_names_shard_and_tensor(tmp_path):
    index, obj = _sharded(tmp_path)
    shard = obj["weight_map"]["scale"]
    (tmp_path / shard).unlink()
    err = _error(tmp_path)
    assert err.path == tmp_path / shard and obj["weight_map"][err.name] == shard
    assert str(err) == (f"{tmp_path / shard}: {err.name}: shard file missing "
                        "(listed in model.safetensors.index.json)")


def test_index_points_at_wrong_shard(tmp_path):
    index, obj = _sharded(tmp_path)
    wrong = next(f for f in obj["weight_map"].values() if f != obj["weight_map"]["scale"])
    obj["weight_map"]["scale"] = wrong
    index.write_text(json.dumps(obj))
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="not in this file, though") as info:
        store.read("scale")
    assert str(info.value).startswith(f"{tmp_path / wrong}: scale: ")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_shard_files(tmp_path, damage):
    def spoil(path):
        data = path.read_bytes()
        path.write_bytes(data[:-7] if damage == "truncate" else b"garbage!" + data[8:])

    # Single file: its header is read at construction.
    single = tmp_path / "single"
    write_checkpoint(single, _tensors().items(), CONFIG)
    spoil(single / "model.safetensors")
    assert str(_error(single)).startswith(f"{single / 'model.safetensors'}: cannot open as "
                                          "safetensors: ")
    # Sharded: shards are opened lazily, so the first read from the bad shard fails.
    sharded = tmp_path / "sharded"
    index, obj = _sharded(sharded)
    spoil(sharded / obj["weight_map"]["scale"])
    store = CheckpointStore(sharded)
    with pytest.raises(CheckpointError, match="cannot open as safetensors") as info:
        store.read("scale")
    assert info.value.path == sharded / obj["weight_map"]["scale"]
    assert torch.equal(store.read("embed.weight"), _tensors()["embed.weight"])


# ---- interchange with transformers ----

@pytest.fixture(scope="module")
def tiny_moe():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, intermediate_size=48,
        num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers, transformers.Qwen3MoeForCausalLM(config).eval()


def test_transformers_loads_written_checkpoint(tmp_path, tiny_moe):
    transformers, model = tiny_moe
    state = model.state_dict()
    config = json.loads(model.config.to_json_string())
    files = write_checkpoint(tmp_path, state.items(), config, max_shard_bytes=8000)
    assert len(files) >= 3
    loaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path).state_dict()
    assert loaded.keys() == state.keys()
    for name, want in state.items():
        assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want), name


@pytest.mark.parametrize("shard_size", [None, "20KB"])
def test_store_reads_save_pretrained(tmp_path, tiny_moe, shard_size):
    _, model = tiny_moe
    kw = {} if shard_size is None else {"max_shard_size": shard_size}
    model.save_pretrained(tmp_path, **kw)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_size is not None)
    state = model.state_dict()
    with CheckpointStore(tmp_path) as store:
        assert store.config["num_local_experts"] == 4
        # transformers keeps experts fused in memory but saves them per expert (gate, up, down);
        # test-only reassembly, so the comparison covers every tensor of the model.
        experts = "model.layers.0.mlp.experts."
        fused = {k for k in state if k.startswith(experts)}
        for name in set(state) - fused:
            assert torch.equal(store.read(name), state[name]), name
        gate_up = torch.stack([torch.cat([store.read(f"{experts}{e}.gate_proj.weight"),
                                          store.read(f"{experts}{e}.up_proj.weight")])
                               for e in range(4)])
        down = torch.stack([store.read(f"{experts}{e}.down_proj.weight") for e in range(4)])
        assert torch.equal(gate_up, state[experts + "gate_up_proj"])
        assert torch.equal(down, state[experts + "down_proj"])
        assert len(store.names()) == len(state) - len(fused) + 4 * 3
        # A sliced read of a saved tensor matches the same slice in memory.
        lm = state["lm_head.weight"]
        assert torch.equal(store.read("lm_head.weight", rows=(10, 20), cols=(4, 8)), lm[10:20, 4:8])
