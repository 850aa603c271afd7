"""`colo-rollout bench-sync`: the weight sync against the copy bandwidth, end to end through the
command line on CPU ranks (one rank, and two with an expert-parallel trainer): the table, the
JSON, every inference tensor equal to the trainer's after the sync; bad arguments refused."""

from __future__ import annotations

import json
from pathlib import Path

from colo_rollout.cli import main
from tests.test_door import door_error

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_one_rank_sync_is_timed_and_exact(tmp_path, capsys):
    assert main(["bench-sync", str(CONFIGS / "bench_speed_cpu.yaml"), "--iters", "2",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bench-sync on CPU: 1 rank(s)" in out and "GB/s" in out
    res = json.loads((tmp_path / "bench_sync.json").read_text())
    assert res["checked"] > 10 and res["equal"] == res["checked"]
    assert res["bytes_per_rank"] > 0 and len(res["all_s"]) == 2
    assert res["gb_per_s"] > 0 and res["copy_gb_per_s"] > 0


def test_two_ranks_from_an_expert_parallel_trainer(tmp_path, capsys):
    assert main(["bench-sync", str(CONFIGS / "grpo_cpu.yaml"), "--set", "rl.trainer_ep=2",
                 "--iters", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_sync.json").read_text())
    assert res["world"] == 2 and res["trainer"] == "TP1 x EP2" and res["layout"] == "EP2/ADP2"
    assert res["bytes_total"] == 2 * res["bytes_per_rank"]


def test_bad_iters_and_keys_are_refused(tmp_path, capsys):
    cfg = str(CONFIGS / "bench_speed_cpu.yaml")
    assert main(["bench-sync", cfg, "--iters", "0", "--out", str(tmp_path)]) == 2
    assert "error: --iters" in capsys.readouterr().err
    line = door_error(capsys, "bench-sync", cfg, "--set", "rl.trainer_ep=3", "--out",
                      str(tmp_path))
    assert "rl.trainer_ep" in line
