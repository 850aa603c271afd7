"""The grouped MoE path's expert GEMMs (model/fused_moe.py): the Triton fused-MoE kernel against
the torch path (torch._grouped_mm) and an fp32 reference, run by Triton's CPU interpreter in a
subprocess (TRITON_INTERPRET is read when the kernels are decorated, so it must be set before
the module is first imported; skipped when triton does not import); the tile regimes, the
grid bound and the backend's resolution at model build."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from colo_rollout.config import ConfigError
from colo_rollout.config.schema import EngineConfig
from colo_rollout.model import fused_moe as fm
from tests.interpreted import HAS_TRITON, interpreted_main


T = fm.Tile
# (N tokens, E_local, E_global, top-k, H, F, dtype, activation, gated, padding rows, tiles)
# E_global > E_local: pairs routed to other ranks' experts (key == E, sorted last); padding
# rows (n_valid < N) go to no expert. tiles None: the engine's own choice (tile_config's
# regimes); small tiles elsewhere, so K loops, column tiles and row blocks run several times
CASES = [
    (1, 4, 4, 2, 32, 32, torch.float32, F.silu, True, 0, None),
    (7, 4, 8, 2, 32, 48, torch.float32, F.silu, True, 0,
     (T(16, 16, 16, 4, 2), T(16, 32, 16, 4, 2))),
    (40, 8, 8, 4, 64, 32, torch.float32, F.silu, True, 0,
     (T(16, 32, 32, 4, 2), T(16, 32, 16, 4, 2))),
    (23, 8, 16, 4, 48, 40, torch.float32, F.silu, True, 3,  # ragged F
     (T(16, 16, 32, 4, 2), T(16, 16, 32, 4, 2))),
    (33, 4, 8, 4, 32, 64, torch.float32, F.gelu, False, 0,  # grouped program order
     (T(32, 32, 16, 4, 2, 4), T(16, 16, 32, 4, 2))),
    (12, 8, 8, 2, 64, 48, torch.bfloat16, F.silu, True, 0,
     (T(16, 16, 32, 4, 2), T(16, 32, 32, 4, 2))),
    (29, 4, 16, 4, 32, 40, torch.bfloat16, F.silu, True, 2,
     (T(16, 16, 16, 4, 2, 2), T(16, 16, 16, 4, 2))),
    (18, 4, 4, 2, 32, 32, torch.bfloat16, F.relu, False, 0, None),
    (5, 8, 32, 2, 32, 32, torch.bfloat16, F.silu, True, 0,
     (T(16, 16, 16, 4, 2), T(16, 16, 16, 4, 2))),
    (40, 4, 32, 4, 32, 32, torch.bfloat16, F.silu, True, 5,  # mostly other ranks' pairs
     (T(16, 32, 32, 4, 2), T(16, 32, 32, 4, 2))),
    # TMA descriptors for the weights (and fc2's A): ragged F (gate tiles reading into the
    # up rows, fc2's K tail past the descriptor's end), other ranks' pairs, padding rows
    (29, 4, 16, 4, 32, 40, torch.bfloat16, F.silu, True, 2,
     (T(16, 16, 16, 4, 2, 2, True), T(16, 16, 16, 4, 2, 1, True))),
    (33, 8, 8, 2, 48, 32, torch.bfloat16, F.gelu, False, 0,
     (T(32, 32, 16, 4, 2, 4, True), T(16, 16, 32, 4, 2, 1, True))),
    # the persistent fc2 (4 programs under the interpreter walking more tiles than that):
    # K tail past the descriptor's end, other ranks' pairs and padding rows zeroed by the
    # spare row blocks' loop, grouped order; and every pair local, one column tile
    (29, 4, 16, 4, 48, 40, torch.bfloat16, F.silu, True, 2,
     (T(16, 16, 16, 4, 2, 2, True), T(16, 16, 16, 4, 2, 2, True, True))),
    (37, 4, 4, 2, 16, 32, torch.bfloat16, F.silu, True, 0,
     (T(16, 16, 16, 4, 2, 1, True), T(16, 16, 16, 4, 2, 1, True, True))),
    # an expert's last row block of <= tail_m rows as a tail_m-row tile (fc1's gathered A;
    # pointer-fed and TMA-fed weights, fp32 and bf16, ragged F, other ranks' pairs, padding
    # rows): every case has experts with such a tail and experts with a longer one
    (40, 4, 8, 4, 32, 40, torch.float32, F.silu, True, 3,
     (T(32, 16, 16, 4, 2, tail_m=16), T(16, 32, 16, 4, 2))),
    (60, 4, 12, 4, 48, 40, torch.bfloat16, F.silu, True, 2,
     (T(32, 16, 16, 4, 2, 2, True, tail_m=16), T(16, 16, 16, 4, 2, 2, True, True))),
    # fc1's gate and up tiles in one [2, n, k] TMA box and one MMA (``paired``): ragged F (the
    # box's columns past n_out zero-filled), other ranks' pairs, padding rows; with tails
    (29, 4, 16, 4, 32, 40, torch.bfloat16, F.silu, True, 2,
     (T(16, 16, 16, 4, 2, 2, True, paired=True), T(16, 16, 16, 4, 2, 1, True))),
    (60, 4, 12, 4, 48, 40, torch.bfloat16, F.gelu, True, 2,
     (T(32, 16, 16, 4, 2, 2, True, tail_m=16, paired=True), T(16, 16, 16, 4, 2, 2, True, True))),
]


def _pairs(N, E, E_global, k, pad, gen, first=None):
    """The grouped path's routing, as GatherMoE._grouped computes it: top-k of random router
    scores, this rank's experts [first, first + E), padding rows to no expert -> (token,
    sorted_key, offs, prob sorted)."""
    logits = torch.randn(N, E_global, generator=gen)
    probs = torch.softmax(logits, dim=-1)
    chosen = logits.topk(k, dim=1).indices
    weight = probs.gather(1, chosen)
    if first is None:
        first = int(torch.randint(0, E_global - E + 1, (1,), generator=gen))
    local = chosen - first
    mine = (local >= 0) & (local < E)
    mine &= (torch.arange(N) < N - pad).unsqueeze(1)
    key = torch.where(mine, local, E).flatten()
    sorted_key, order = torch.sort(key, stable=True)
    offs = torch.searchsorted(sorted_key, torch.arange(E), right=True, out_int32=True)
    return order // k, sorted_key, offs, weight.flatten()[order], order


def _case(i):
    N, E, Eg, k, H, Fd, dtype, act, gated, pad, tiles = CASES[i]
    gen = torch.Generator().manual_seed(i)
    token, sorted_key, offs, prob, order = _pairs(N, E, Eg, k, pad, gen)
    x = torch.randn(N, H, generator=gen).to(dtype)
    fc1 = (torch.randn(E, 2 * Fd if gated else Fd, H, generator=gen) / H ** 0.5).to(dtype)
    fc2 = (torch.randn(E, H, Fd, generator=gen) / Fd ** 0.5).to(dtype)
    return x, token, sorted_key, offs, prob, fc1, fc2, act, gated, tiles, order


def _interpreted() -> list[str]:
    """Run every case through the interpreted kernels; returns the failures."""
    fails = []
    for i in range(len(CASES)):
        x, token, sorted_key, offs, prob, fc1, fc2, act, gated, tiles, order = _case(i)
        dtype, E = x.dtype, fc1.shape[0]
        R = int(offs[-1])
        rows = len(token)
        if tiles and tiles[0].tma and not fm.tma_usable(x, fc1):
            fails.append(f"case {i}: the TMA case would run on pointer loads")
        if tiles and tiles[0].tail_m:
            counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
            last = counts - (counts - 1).clamp(min=0) // tiles[0].block_m * tiles[0].block_m
            if not ((counts > 0) & (last <= tiles[0].tail_m)).any() or not (
                    last > tiles[0].tail_m).any():
                fails.append(f"case {i}: the case does not run both tile sizes: {counts}")
        if tiles and tiles[1].persistent and not fm.runs_persistent(
                torch.empty(1, fc2.shape[2], dtype=dtype), fc2, tiles[1]):
            fails.append(f"case {i}: the persistent case would run the other kernel")
        # the two launches by hand, fc2's output poisoned (NaN): every row must be written
        t1, t2 = tiles or (fm.TILES[(fm.regime(rows, E), "fc1")],
                           fm.TILES[(fm.regime(rows, E), "fc2")])
        h = fm.moe_gemm(x, fc1, offs, rows, token=token, prob=prob, gated=gated,
                        act=fm.ACTIVATIONS[act], tile=t1)
        poison = torch.full((rows, fc2.shape[1]), float("nan"), dtype=dtype)
        got = fm.moe_gemm(h, fc2, offs, rows, zero_tail=True, out=poison, tile=t2)
        ref = fm.torch_experts(x, token, offs, prob, fc1, fc2, act, gated)
        ref32 = fm.torch_experts(x.float(), token, offs, prob, fc1.float(), fc2.float(), act,
                                 gated)
        if got.shape != ref.shape or got.dtype != dtype:
            fails.append(f"case {i}: {tuple(got.shape)} {got.dtype}, want {tuple(ref.shape)}")
            continue
        if not torch.isfinite(got).all():
            fails.append(f"case {i}: rows left unwritten (NaN)")
        scale = ref32[:R].abs().max().item() if R else 1.0
        err32 = (got[:R].float() - ref32[:R]).abs().max().item() / scale if R else 0.0
        err = (got[:R].float() - ref[:R].float()).abs().max().item() / scale if R else 0.0
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        if err32 > tol or err > 2 * tol:
            fails.append(f"case {i}: rel err vs fp32 {err32:.2e}, vs torch {err:.2e} > {tol}")
        if dtype != torch.float32:  # one rounding: no worse than the torch path's two
            err_ref = (ref[:R].float() - ref32[:R]).abs().max().item() / scale if R else 0.0
            if err32 > 1.5 * err_ref + 1e-3:
                fails.append(f"case {i}: err {err32:.2e} vs the torch path's {err_ref:.2e}")
        if (got[R:] != 0).any():  # other ranks' experts and padding rows: zeros
            fails.append(f"case {i}: rows past offs[-1] = {R} are not zero")
        if R < rows and not (sorted_key[R:] == E).all():
            fails.append(f"case {i}: the case's tail is not other ranks' pairs")
        if tiles is None:  # the entry point's triton backend: the same launches
            via = fm.moe_experts(x, token, offs, prob, fc1, fc2, act, gated, backend="triton")
            if not torch.equal(via, got):
                fails.append(f"case {i}: moe_experts(backend='triton') differs")
        # fc2 storing each sorted row at its pair's place (order): the same rows, permuted
        # (triton_experts(order=) is fc1, then this launch)
        sc = fm.moe_gemm(h, fc2, offs, rows, zero_tail=True, scatter=order, tile=t2)
        if not torch.equal(sc[order], got):
            fails.append(f"case {i}: the scattered fc2 is not the sorted one permuted")
    # no local pair at all (every pair another rank's): zeros; offs int64 reads the same
    gen = torch.Generator().manual_seed(99)
    x = torch.randn(6, 32, generator=gen)
    token, sorted_key, offs, prob, _ = _pairs(6, 4, 16, 2, 6, gen, first=0)  # all padding
    fc1, fc2 = torch.randn(4, 64, 32, generator=gen), torch.randn(4, 32, 32, generator=gen)
    got = fm.triton_experts(x, token, offs.long(), prob, fc1, fc2, F.silu, True)
    if got.shape != (12, 32) or (got != 0).any():
        fails.append(f"no local pairs: {tuple(got.shape)}, max {got.abs().max()}")
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_matches_torch_path_interpreted(interpreted):
    interpreted.check(__file__)


def test_resolve_backend():
    cpu = torch.device("cpu")
    assert fm.resolve_backend("torch", cpu) == "torch"
    assert fm.resolve_backend("auto", cpu, torch.bfloat16) == "torch"
    with pytest.raises(RuntimeError, match="triton was requested"):
        fm.resolve_backend("triton", cpu)
    with pytest.raises(ValueError, match="must be one of"):
        fm.resolve_backend("cutlass", cpu)
    if fm.triton_available():
        assert fm.resolve_backend("auto", "cuda:0", torch.bfloat16) == "triton"
        assert fm.resolve_backend("auto", "cuda:0", torch.float32) == "torch"
        assert fm.resolve_backend("triton", "cuda:0", torch.float32) == "triton"


def test_auto_on_cpu_tensors_is_the_torch_path():
    x, token, _, offs, prob, fc1, fc2, act, gated, _, order = _case(1)
    R = int(offs[-1])  # the torch path leaves the rows past offs[-1] unwritten
    got = fm.moe_experts(x, token, offs, prob, fc1, fc2, act, gated)
    ref = fm.torch_experts(x, token, offs, prob, fc1, fc2, act, gated)
    assert torch.equal(got[:R], ref[:R])
    # in the pairs' own order: sorted row r at order[r], other ranks' rows zero
    placed = fm.moe_experts(x, token, offs, prob, fc1, fc2, act, gated, order=order)
    assert torch.equal(placed[order][:R], ref[:R]) and (placed[order][R:] == 0).all()
    with pytest.raises(ValueError):
        fm.moe_experts(x, token, offs, prob, fc1, fc2, act, gated, backend="cutlass")
    assert fm.triton_supports(F.silu) and not fm.triton_supports(torch.tanh)


def test_grid_bound_covers_every_padded_layout():
    """row_blocks: every expert's count padded up to BLOCK_M fits, and the spare blocks
    cover the rows past the local pairs (one block each zeroes them), for splits of the rows
    up to the worst, every non-empty expert one row past a block multiple."""
    for rows in (1, 7, 8, 64, 1024, 32768):
        for E in (4, 64, 128):
            for bm in (16, 32, 64):
                bound = fm.row_blocks(rows, E, bm)
                per = [rows // E + (e < rows % E) for e in range(E)]
                worst = [max(0, rows - (E - 1))] + [1] * (E - 1) if rows >= E else [1] * rows
                for counts in (per, worst, [rows], [rows // 3] + [1] * (E - 1), [1]):
                    local = sum(counts)
                    if local > rows:
                        continue
                    used = sum(-(-c // bm) for c in counts)
                    assert used < bound, (rows, E, bm, counts[:4])
                    assert (bound - used) * bm >= rows - local, (rows, E, bm, counts[:4])


def test_regimes_and_tiles():
    assert fm.regime(8, 64) == "small" and fm.regime(64, 64) == "small"
    assert fm.regime(256, 128) == "decode"
    assert fm.regime(1024, 64) == "decode" and fm.regime(8192, 64) == "prefill"
    for (reg, which), t in fm.TILES.items():
        assert reg in ("small", "decode", "prefill") and which in ("fc1", "fc2")
        assert t.block_m >= 16 and t.block_n >= 16 and t.block_k >= 16
    for bad in (8, 24, 128):  # tail_m: a power of two in [16, block_m)
        with pytest.raises(ValueError, match="tail_m"):
            T(128, 128, 64, 8, 4, tail_m=bad)
    cpu = torch.device("cpu")
    assert fm.fit_tile(fm.TILES[("prefill", "fc1")], cpu, 2, True) == fm.TILES[("prefill", "fc1")]
    # fitting keeps the launch's kind (the persistent fc2 of prefill)
    small = fm.fit_tile(fm.TILES[("prefill", "fc2")], cpu, 2, False)
    assert small.persistent and small.tma
    w = torch.empty(4, 64, 32, dtype=torch.bfloat16)
    a = torch.empty(8, 32, dtype=torch.bfloat16)
    assert fm.runs_persistent(a, w, small)
    assert not fm.runs_persistent(a, w, small, token=torch.zeros(8, dtype=torch.long))
    assert not fm.runs_persistent(a, w, small, fp8=True)
    assert not fm.runs_persistent(a.float(), w.float(), small)  # no TMA for fp32
    # a short prefill's fc2 (<= PREFILL_FC2_DEEP_PAIRS pairs) pipelines deeper; nothing else
    deep, n = fm.PREFILL_FC2_DEEP, fm.PREFILL_FC2_DEEP_PAIRS
    assert deep.num_stages > fm.TILES[("prefill", "fc2")].num_stages and deep.persistent
    assert fm.tile_for("prefill", "fc2", pairs=n) == deep
    assert fm.tile_for("prefill", "fc2", pairs=n + 1) == fm.TILES[("prefill", "fc2")]
    assert fm.tile_for("prefill", "fc2") == fm.TILES[("prefill", "fc2")]
    assert fm.tile_for("prefill", "fc1", pairs=n) == fm.TILES[("prefill", "fc1")]
    assert fm.tile_for("decode", "fc2", pairs=64) == fm.TILES[("decode", "fc2")]
    assert fm.tile_for("prefill", "fc2", True, n) == fm.BLOCKWISE_TILES[("prefill", "fc2")]
    # fc2 leaves its rows sorted for the slot sums in the prefill regime on the kernel only
    assert fm.stores_sorted(8 * 4096, 128, "triton")
    assert not fm.stores_sorted(8 * 4096, 128, "torch")
    assert not fm.stores_sorted(8 * 64, 64, "triton")  # decode: the scatter


def test_engine_config_key():
    assert EngineConfig().moe_kernel == "auto"
    assert EngineConfig(moe_kernel="torch").moe_kernel == "torch"
    with pytest.raises(ConfigError, match="engine.moe_kernel"):
        EngineConfig(moe_kernel="cutlass")


if __name__ == "__main__":  # the interpreted run (the test above starts it)
    interpreted_main(_interpreted)
