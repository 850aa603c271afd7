"""`colo-rollout bench-mtp`: MTP drafting's decode throughput against none, through the command
line on a CPU rank: the table and JSON, the same greedy tokens with and without MTP, the
oracle weights' drafts (nearly) all accepted and the random weights' (nearly) none, fewer D
iterations with the oracle, a head distilled from the model's own outputs learning (its loss
falls, its drafts accepted on prompts it was not fit to); bad arguments refused at the
door."""

from __future__ import annotations

import json
from pathlib import Path

from colo_rollout.cli import main
from tests.test_door import door_error

CFG = str(Path(__file__).resolve().parents[1] / "configs" / "bench_speed_cpu.yaml")


def test_bench_mtp_runs_and_reports(tmp_path, capsys):
    assert main(["bench-mtp", CFG, "--batches", "1", "4", "--prompt-len", "8",
                 "--new-tokens", "24", "--reps", "1", "--distill-steps", "80",
                 "--distill-seqs", "16", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bench-mtp on CPU" in out and "speedup" in out and "distilled:" in out
    res = json.loads((tmp_path / "bench_mtp.json").read_text())
    assert res["same_tokens"] and len(res["rows"]) == 6
    acc = {}
    for r in res["rows"]:
        assert r["same_tokens"] and r["base_tok_s"] > 0 and r["mtp_tok_s"] > 0
        # D iterations only (P steps are not counted; found by probing: 0.96 tokens per D
        # iteration, impossible): the plain run makes one token a D iteration, 23 of 24 here
        assert r["base_d_iterations"] == 23
        assert 1.0 <= r["tokens_per_d_iteration"] <= 2.0
        acc.setdefault(r["weights"], []).append(r["acceptance"])
        if r["weights"] == "oracle":
            assert r["acceptance"] > 0.9 and r["mtp_d_iterations"] < r["base_d_iterations"]
            assert r["tokens_per_d_iteration"] > 1.5
        elif r["weights"] == "random":
            assert r["acceptance"] < 0.2 and r["tokens_per_d_iteration"] < 1.2
    d = res["distill"]
    assert d["steps"] == 80 and len(d["losses"]) == 80
    assert d["loss_last"] < d["loss_first"] - 0.5 and d["accuracy_last"] > 0.5
    # two of the 16 continuations held out of the fit: the head's accuracy on them, measured
    assert 0.0 <= d["held_out_accuracy"] <= 1.0
    # held-out prompts: the learnt drafts are accepted well above the random head's
    assert min(acc["distilled"]) > max(acc["random"]) + 0.15


def test_bench_mtp_bad_arguments(capsys, tmp_path):
    assert main(["bench-mtp", CFG, "--new-tokens", "1", "--out", str(tmp_path)]) == 2
    assert "error: --new-tokens" in capsys.readouterr().err
    line = door_error(capsys, "bench-mtp", CFG, "--batches", "64", "--out", str(tmp_path))
    assert "engine.max_batch_size" in line
    # requests the engine would refuse (the table came out all NaN with exit 0), the oracle's
    # layer kinds, and an MTP layer count the command would have replaced silently
    line = door_error(capsys, "bench-mtp", CFG, "--batches", "4", "--prompt-len", "100",
                      "--new-tokens", "100", "--set", "engine.num_kv_blocks=8",
                      "--out", str(tmp_path))
    assert line.startswith(f"error: {CFG}: engine: bench-mtp's requests (4 at once, "
                           "--prompt-len 100 + --new-tokens 100) would not all be served"), line
    line = door_error(capsys, "bench-mtp", CFG, "--prompt-len", "64", "--set",
                      "engine.max_prefill_tokens=16", "--out", str(tmp_path))
    assert "engine.max_prefill_tokens 16" in line, line
    line = door_error(capsys, "bench-mtp", CFG, "--set", "model.num_layers=2", "--set",
                      "model.first_k_dense=1", "--out", str(tmp_path))
    assert "model.first_k_dense: 1: bench-mtp's oracle copies layer 0" in line, line
    assert main(["bench-mtp", CFG, "--set", "model.mtp_num_layers=0", "--out",
                 str(tmp_path)]) == 2
    assert "error: --set model.mtp_num_layers=0" in capsys.readouterr().err
    assert main(["bench-mtp", CFG, "--set", "model.mtp_num_layers=true", "--out",
                 str(tmp_path)]) == 2  # a bool is no count (found by probing: True == 1)
    assert "error: --set model.mtp_num_layers=True" in capsys.readouterr().err
    assert main(["bench-mtp", CFG, "--distill-steps", "-1", "--out", str(tmp_path)]) == 2
    assert "error: --distill-steps" in capsys.readouterr().err
    assert main(["bench-mtp", CFG, "--distill-batch", "0", "--out", str(tmp_path)]) == 2
    assert "error: --distill-batch" in capsys.readouterr().err
    line = door_error(capsys, "bench-mtp", CFG, "--set", "engine.mtp=maybe")
    assert "engine.mtp" in line
    # bench-speed's D rows are one per sequence: MTP is bench-mtp's
    line = door_error(capsys, "bench-speed", CFG, "--set", "model.mtp_num_layers=1", "--set",
                      "engine.mtp=true")
    assert "engine.mtp" in line and "bench-mtp" in line


def test_demo_reports_mtp_drafts(tmp_path):
    """The demo with MTP drafting (2 CPU ranks): every output as without, and the drafts and
    their acceptance in the report."""
    demo = str(Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml")
    rep = tmp_path / "rep.json"
    assert main(["demo", demo, "--set", "model.mtp_num_layers=1", "--set", "engine.mtp=true",
                 "--report", str(rep)]) == 0
    got = json.loads(rep.read_text())
    assert got["mtp"]["drafts"] > 100 and 0.0 <= got["mtp"]["acceptance"] <= 1.0


def test_distill_mtp_refuses_what_it_cannot_fit():
    import pytest
    import torch

    from colo_rollout.config import config_from_dict
    from colo_rollout.rl.mtp_distill import distill_mtp

    model = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_attention_heads": 4,
             "num_query_groups": 2, "moe_ffn_hidden_size": 16, "num_experts": 4,
             "moe_router_topk": 2}
    plain = config_from_dict({"model": model}).model
    with_mtp = config_from_dict({"model": {**model, "mtp_num_layers": 1}}).model
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="mtp_num_layers"):
        distill_mtp(plain, {}, [[1, 2, 3]], cpu)
    with pytest.raises(ValueError, match="no MTP layer"):
        distill_mtp(with_mtp, {"embedding.word_embeddings.weight": torch.zeros(1)}, [[1, 2, 3]],
                    cpu)
    sd = {"mtp.layers.0.eh_proj.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="at least 3 tokens"):
        distill_mtp(with_mtp, sd, [[1, 2]], cpu)
    with pytest.raises(ValueError, match="must be >= 1"):
        distill_mtp(with_mtp, sd, [[1, 2, 3]], cpu, steps=0)
