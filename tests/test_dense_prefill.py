"""Long fresh sequences through a dense attention call (model/dense_prefill.py,
``engine.prefill_attention: cudnn``): which sequences go dense, the padded call against the
per-sequence oracle (CPU: torch's default SDPA runs the same code; cuDNN itself only on a
GPU), the plan that leaves them out of the Triton kernel's tiles, ``_prefill``'s dispatch, and
the key's refusals where it cannot run."""

from __future__ import annotations

import random
import types

import pytest
import torch

from colo_rollout.model import dense_prefill as dp
from colo_rollout.model import paged_prefill as pp
from colo_rollout.testing.attention_oracle import kv_from_cache, prefill_per_sequence
from tests.test_paged_prefill import _case, _oracle

F32 = torch.float32


def test_only_long_fresh_sequences_go_dense():
    new, ctx = [4096, 4096, 100, 1024, 1023, 1], [4096, 8192, 100, 1024, 1023, 1]
    assert dp.dense_sequences(new, ctx) == (0, 3)  # 1 has a cached prefix; 2, 4, 5 short
    assert dp.dense_sequences(new, ctx, min_tokens=100) == (0, 2, 3, 4)
    assert [dp.padded_len(n) for n in (1, 256, 257, 4096, 4097)] == [256, 256, 512, 4096, 4352]


def test_dense_calls_group_by_padded_length_in_batch_sizes():
    # (sequence, first row, new tokens): eleven of 512 back to back, one of 300 between them,
    # two of 1024 apart
    held = [(s, 512 * s, 512) for s in range(5)] + [(5, 2560, 300)]
    held += [(6 + s, 2860 + 512 * s, 512) for s in range(6)]
    held += [(12, 6000, 1024), (14, 8000, 1024)]
    calls = dp.dense_calls(tuple(held), "cpu")
    assert [(c.length, [s for s, _, _ in c.seqs]) for c in calls] == [
        (512, [0, 1, 2, 3, 4, 5, 6, 7]), (512, [8, 9, 10, 11]), (1024, [12, 14])]
    assert calls[1].rows is None  # four back to back, unpadded: views
    rows = calls[0].rows.tolist()  # 300 padded to 512: the last row repeated
    assert len(rows) == 8 * 512
    assert rows[5 * 512 : 5 * 512 + 300] == list(range(2560, 2860))
    assert rows[5 * 512 + 300 : 6 * 512] == [2859] * 212
    assert rows[6 * 512 : 7 * 512] == list(range(2860, 3372))
    assert calls[2].rows.tolist() == list(range(6000, 7024)) + list(range(8000, 9024))
    assert dp.dense_calls((), "cpu") == []


def _slots(tables, s, n, bs):
    return torch.tensor([int(tables[s, p // bs]) * bs + p % bs for p in range(n)])


@pytest.mark.parametrize("g, n_q, lens, multiple",
                         [(2, 4, [37], 16), (1, 1, [64], 64), (4, 2, [5], 256),
                          (2, 2, [32, 32, 32], 16), (2, 4, [20, 9, 32], 16)])
def test_the_dense_calls_are_the_oracle(g, n_q, lens, multiple):
    """Every sequence fresh: its calls (batched, padded or views) give the oracle's rows,
    written into ``out`` or, for one unpadded call over all rows, returned as the result."""
    dim, bs = 32, 8
    q, k_all, v_all, tables = _case(g, n_q, dim, bs, lens, lens, F32, torch.int64,
                                    seed=sum(lens))
    starts = [sum(lens[:i]) for i in range(len(lens))]
    slots = torch.cat([_slots(tables, s, n, bs) for s, n in enumerate(lens)])
    calls = dp.dense_calls(tuple((s, starts[s], n) for s, n in enumerate(lens)), "cpu",
                           multiple)
    ref = _oracle(q, k_all, v_all, tables, lens, lens, g, n_q, dim)
    # the step's rotated K and V rows: the calls' only source of keys and values
    k, v = kv_from_cache(k_all[1], v_all[1], slots)
    out = torch.full_like(q, float("nan"))
    for call in calls:
        got = dp.dense_prefill_attention(q, k, v, call, dim ** -0.5, out)
        assert got is out
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if len(calls) == 1 and calls[0].rows is None:
        whole = dp.dense_prefill_attention(q, k, v, calls[0], dim ** -0.5, None)
        assert whole.shape == q.shape and whole.dtype == q.dtype
        torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-5)
    elif calls[0].rows is not None:
        with pytest.raises(ValueError, match="needs out"):
            dp.dense_prefill_attention(q, k, v, calls[0], 0.3, None)


def test_the_dense_call_refuses_q_k_and_v_that_do_not_match():
    call = dp.DenseCall(4, ((0, 0, 4),), None)
    kv = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="do not match"):  # 3 heads over 2 groups
        dp.dense_prefill_attention(torch.zeros(4, 3, 8), kv, kv, call, 0.3, None)
    with pytest.raises(ValueError, match="do not match"):  # another row count
        dp.dense_prefill_attention(torch.zeros(4, 4, 8), torch.zeros(5, 2, 8), kv, call, 0.3,
                                   None)
    with pytest.raises(ValueError, match="do not match"):  # another value width
        dp.dense_prefill_attention(torch.zeros(4, 4, 8), kv, torch.zeros(4, 2, 6), call, 0.3,
                                   None)


def test_the_plan_leaves_dense_sequences_out_of_its_tiles():
    new, ctx = [40, 9, 17, 3], [40, 30, 17, 3]
    cfg = pp.TileConfig(16, 16, 4, 2, False)
    plan = pp.plan_prefill(new, ctx, 2, 64, F32, "cpu", cfg, dense=(0, 2))
    assert plan.dense == ((0, 0, 40), (2, 49, 17))
    assert {s for s, _ in plan.tiles.tolist()} == {1, 3}
    assert plan.tokens == sum(new) and plan.q_starts.tolist() == [0, 40, 49, 66]
    assert pp.plan_prefill(new, ctx, 2, 64, F32, "cpu", cfg).dense == ()
    with pytest.raises(ValueError, match="not among"):
        pp.plan_prefill(new, ctx, 2, 64, F32, "cpu", cfg, dense=(4,))


@pytest.mark.parametrize("backend", dp.DENSE_BACKENDS)
def test_prefill_on_cudnn_fills_the_rows_the_kernel_leaves(monkeypatch, backend):
    """``_prefill`` with a dense backend (cudnn, flash): the plan leaves the long fresh
    sequences out, the kernel's stand-in writes only its tiles' sequences (NaN elsewhere), and
    the dense call fills the rest: the oracle's output for every row."""
    from colo_rollout.model import attention as at

    heads, groups, dim, bs = 8, 2, 16, 4
    new, ctx = [12, 1, 20, 9], [12, 9, 20, 30]
    kv = at.KVStorage(2, 60, bs, groups, dim, F32, torch.device("cpu"))
    kv.k.normal_()
    kv.v.normal_()
    free = list(range(60))
    random.Random(1).shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctx]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [kv.sink_block] * (width - len(t)) for t in tables])
    slots = torch.cat([_slots(bt, s, c, bs)[c - n:] for s, (n, c) in enumerate(zip(new, ctx))])
    meta = at.AttnMetadata(is_prefill=True, positions=torch.zeros(0), slot_mapping=slots,
                           block_tables=bt, context_lens=torch.tensor(ctx), seq_lens_new=new,
                           context_lens_host=ctx)
    fake = types.SimpleNamespace(heads=heads, groups=groups, head_dim=dim,
                                 q_per_group=heads // groups, scale=dim ** -0.5,
                                 prefill_backend=backend)
    fake._gather_kv = lambda kv, layer, tab: at.PagedSelfAttention._gather_kv(fake, kv, layer,
                                                                              tab)
    q = torch.randn(sum(new), heads, dim)

    def kernel(q, k, v, tables, plan, scale):
        out = pp.torch_prefill_attention(q, k, v, tables, plan, scale)
        for _, q0, n in plan.dense:
            out[q0 : q0 + n] = float("nan")  # this kernel never writes them
        return out

    monkeypatch.setattr(at, "triton_prefill_attention", kernel)
    monkeypatch.setattr(at, "dense_sequences",
                        lambda n, c: dp.dense_sequences(n, c, min_tokens=10))
    got = at.PagedSelfAttention._prefill(fake, q, kv_from_cache(kv.k[1], kv.v[1], slots), kv,
                                         1, meta)
    assert [s for s, _, _ in meta.prefill_plan.dense] == [0, 2]
    torch.testing.assert_close(got, prefill_per_sequence(fake, q, kv, 1, meta),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", dp.DENSE_BACKENDS)
def test_cudnn_is_refused_where_it_cannot_run(tmp_path, backend):
    cpu = torch.device("cpu")
    assert "the device is cpu" in dp.cudnn_usable(cpu)
    assert "the device is cpu" in dp.flash_usable(cpu)
    with pytest.raises(RuntimeError, match=f"engine.prefill_attention: {backend} was requested"):
        pp.resolve_backend(backend, cpu)

    from colo_rollout.config import ConfigError
    from colo_rollout.config.schema import EngineConfig

    assert EngineConfig(prefill_attention=backend).prefill_attention == backend
    with pytest.raises(ConfigError, match="engine.prefill_attention"):
        EngineConfig(prefill_attention="cudnn9")


def test_the_cudnn_backend_keeps_the_rope_kernel():
    """cudnn's P is the Triton kernel's plus dense calls: the rope and KV write stay the
    Triton kernel's (with the q/k norms fused), as for the triton backend."""
    from colo_rollout.model import attention as at

    for backend, want in (("cudnn", "triton"), ("flash", "triton"), ("triton", "triton"),
                          ("torch", "torch")):
        fake = types.SimpleNamespace(prefill_backend=backend)
        meta = types.SimpleNamespace(is_prefill=True)
        assert at.PagedSelfAttention._rope_backend(fake, torch.zeros(1), meta) == want


def test_warm_plans_runs_every_shape_the_calls_can_take():
    """One call per (batch size, padded length) a P step of up to ``max_tokens`` rows with
    sequences up to ``max_len`` can make (CPU: torch's SDPA runs them)."""
    assert dp.warm_plans(2, 1, 8, F32, torch.device("cpu"), max_tokens=2048, max_len=1536,
                         multiple=512) == 3  # (2, 1024), (1, 1024), (1, 1536)
    assert dp.warm_plans(2, 1, 8, F32, torch.device("cpu"), max_tokens=512, max_len=4096,
                         multiple=512) == 0  # no fresh sequence of MIN_TOKENS fits


def test_auto_takes_cudnn_only_where_it_runs():
    assert pp.resolve_backend("auto", torch.device("cpu")) == "torch"


def test_flash_fits_16_bit_models_with_head_dims_it_takes():
    assert dp.flash_fits(torch.bfloat16, 128) is None and dp.flash_fits(torch.float16, 256) is None
    assert "16-bit" in dp.flash_fits(torch.float32, 128)
    assert "head_dim 100" in dp.flash_fits(torch.bfloat16, 100)
    assert "head_dim 264" in dp.flash_fits(torch.bfloat16, 264)


def test_flash_names_a_missing_install(monkeypatch):
    """Without flash_attn.cute the kernel's import error is one line naming the package."""
    import builtins

    real = builtins.__import__

    def no_flash(name, *args, **kwargs):
        if name.startswith("flash_attn"):
            raise ModuleNotFoundError(f"No module named '{name}'")
        return real(name, *args, **kwargs)

    from colo_rollout.config import attention_support

    monkeypatch.setattr(attention_support, "_FLASH", [])
    monkeypatch.setattr(builtins, "__import__", no_flash)
    with pytest.raises(ImportError, match=r"flash_attn.cute \(FlashAttention-4\) does not "
                                          r"import: ModuleNotFoundError") as got:
        dp.flash_attention()
    assert "\n" not in str(got.value)


def test_cudnn_fits_16_bit_models_with_head_dims_it_takes():
    assert dp.cudnn_fits(torch.bfloat16, 128) is None and dp.cudnn_fits(torch.float16, 64) is None
    assert dp.cudnn_fits(None, None) is None
    assert "16-bit" in dp.cudnn_fits(torch.float32, 128)
    assert "head_dim 192" in dp.cudnn_fits(torch.bfloat16, 192)
    assert "head_dim 100" in dp.cudnn_fits(torch.bfloat16, 100)


@pytest.mark.parametrize("new, ctx, dense", [([40, 9, 17, 3], [40, 30, 17, 3], (0, 2)),
                                             ([5], [12], ()), ([16, 16], [16, 16], (0, 1))])
def test_the_plan_rides_the_steps_packed_copy(new, ctx, dense):
    """The runner's plan: the host half packed as int64 words into the step's one copy
    (runtime/device.h2d_packed, beside other arrays), read back as the int32 tables --
    the same plan ``plan_prefill`` copies on its own, odd and even table lengths alike."""
    import numpy as np

    from colo_rollout.runtime.device import h2d_packed

    cfg = pp.TileConfig(16, 16, 4, 2, False)
    want = pp.plan_prefill(new, ctx, 2, 64, F32, "cpu", cfg, dense=dense)
    host = pp.plan_prefill_host(new, ctx, 2, 64, F32, "cpu", cfg, dense=dense)
    before = np.arange(7, dtype=np.int64)  # another array of the same copy, first
    got_before, dev = h2d_packed([before, host.packed()], torch.device("cpu"))
    got = host.on_device(dev)
    assert got_before.tolist() == list(range(7))
    for name in ("q_starts", "new_lens", "ctx_lens", "tiles"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == torch.int32 and torch.equal(a, b), name
    assert (got.n_tiles, got.tokens, got.pack, got.dense) == (want.n_tiles, want.tokens,
                                                              want.pack, want.dense)
