"""Colocated GRPO that learns to emit token 7 on 2 CPU ranks (about 10 s).

    python examples/grpo_target_token.py
Same as `colo-rollout train configs/grpo_cpu.yaml`; metrics in runs/grpo_cpu/.
"""

from colo_rollout.runtime.spawn import WorkerGroup

if __name__ == "__main__":
    with WorkerGroup(2) as group:
        history = group.run("colo_rollout.rl.train:run_train", timeout=600,
                            config_path="configs/grpo_cpu.yaml")[0]["history"]
    for row in history:
        print(f"step {row['step']:2d}  reward {row['reward']:.3f}  "
              f"logprob gap {row['logprob_gap_max']:.1e}  sync {row['sync_s'] * 1e3:.1f} ms")
