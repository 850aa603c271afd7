"""Colocated GRPO: rollout -> train -> reshard, on the same ranks, from a YAML config.

    torchrun --nproc-per-node N -m colo_rollout.rl.train configs/grpo_cpu.yaml
    colo-rollout train configs/grpo_cpu.yaml          (spawns CPU ranks)

Each step: ``rollout()`` samples ``samples_per_prompt`` completions for ``prompts_per_step``
prompts on the inference engine (its own layout), the verifiable task scores them, the trainer
(megatron GPTModel, its own TP x DP layout) takes one clipped-ratio step with group-relative
advantages, and ``WeightSync`` reshards the new weights into the engine. Per-step metrics (reward,
response length, rollout/train/sync time, bytes synced, trainer-vs-rollout logprob gap) go to
``metrics.jsonl`` and TensorBoard; the reward curve to ``reward.png``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from colo_rollout.quiet import quiet_known_warnings

# run as a program (torchrun's entry; "__mp_main__": the same module re-run by the CPU ranks it
# spawns): filter before megatron's import-time notices
if __name__ in ("__main__", "__mp_main__"):
    quiet_known_warnings()

import torch  # noqa: E402

from colo_rollout.config import Config, load_config  # noqa: E402
from colo_rollout.engine.engine import Engine, check_same_config  # noqa: E402
from colo_rollout.worker.memory import MemoryReport  # noqa: E402
from colo_rollout.model.weights import random_state_dict  # noqa: E402
from colo_rollout.runtime.parallel import init_parallel  # noqa: E402
from colo_rollout.sched.request import SamplingParams  # noqa: E402
from colo_rollout.rl.grpo import flat_group_share  # noqa: E402
from colo_rollout.rl.rollout import Carry, rollout  # noqa: E402
from colo_rollout.rl.tasks import task_for  # noqa: E402
from colo_rollout.rl.trainer import Trainer  # noqa: E402
from colo_rollout.rl.weight_sync import WeightSync  # noqa: E402
from colo_rollout.config.files import output_errors, strict_json


def run_train(rank: int, world: int, config_path: str, overrides: dict | None = None,
              quiet: bool = False) -> dict:
    quiet_known_warnings()
    cfg = load_config(config_path, overrides)
    groups = init_parallel(cfg.parallel)
    # the command's own section (Engine() checks the model, engine and parallel ones)
    check_same_config(cfg, groups, ("rl",), "train")
    # model.checkpoint: the engine and the trainer each read their own slices of it;
    # otherwise both start from the same random full state dict
    sd = None if cfg.model.checkpoint is not None else random_state_dict(cfg.model)
    engine = Engine(cfg, groups, sd)
    trainer = Trainer(cfg, sd, groups.device)
    sync = WeightSync(timeout_s=cfg.parallel.timeout_s)
    sync(trainer.module, engine.model)  # start from identical weights (checks the plan too)
    rng = random.Random(cfg.rl.seed)
    task = task_for(cfg.rl, cfg.model.vocab_size)
    # the rollout's logprobs are of the tempered distribution it draws from, as the trainer's
    # (Trainer.token_logprobs divides by rl.temperature): the policy trained is pi_T
    params = SamplingParams(temperature=cfg.rl.temperature, max_tokens=cfg.rl.max_new_tokens,
                            ignore_eos=True, tempered_logprobs=True)
    metrics = os.path.join(cfg.rl.out_dir, "metrics.jsonl")
    with output_errors(metrics, "the metrics"):
        os.makedirs(cfg.rl.out_dir, exist_ok=True)
        log = open(metrics, "w") if rank == 0 else None
    tb = _tensorboard(cfg.rl.out_dir) if rank == 0 else None
    bar = None
    if rank == 0 and not quiet:
        from tqdm import tqdm

        bar = tqdm(total=cfg.rl.steps, unit="step", desc="grpo", dynamic_ncols=True)
    history = []
    # partial rollout: the groups a step leaves unfinished, resumed by the next
    carry = Carry() if cfg.rl.finish_groups else None
    for step in range(cfg.rl.steps):
        # with a carry, its groups count against the step's prompts: the groups in flight stay
        # rl.prompts_per_step, and the backlog cannot grow
        backlog = len({t.group for t in carry.trajectories}) if carry is not None else 0
        prompts = [task.prompt(rng) for _ in range(cfg.rl.prompts_per_step - backlog)]
        t0 = time.perf_counter()
        drafted = (engine.scheduler.drafts_verified, engine.scheduler.drafts_accepted)
        trajs = rollout(engine, prompts, n=cfg.rl.samples_per_prompt, params=params,
                        reward_fn=task.reward, weight_version=sync.version, tag=f"s{step}",
                        finish_groups=cfg.rl.finish_groups or None, carry=carry)
        t1 = time.perf_counter()
        ok = [t for t in trajs if t.status in ("completed", "truncated")]
        mem = {}
        if cfg.rl.release_memory != "off":  # the trainer gets the rollout's device memory
            mem["mem_engine_before"] = MemoryReport.now(groups.device).allocated
            mem["mem_engine_released"] = engine.release_memory(cfg.rl.release_memory).allocated
        # (every rank holds the same trajectories: all skip an empty step together)
        stats = trainer.step(ok) if ok else {"loss": 0.0, "logprob_gap_max": 0.0,
                                             "logprob_gap_mean": 0.0}
        if cfg.rl.release_memory != "off":
            if groups.device.type == "cuda":
                mem["mem_train_peak"] = torch.cuda.max_memory_allocated(groups.device)
                torch.cuda.reset_peak_memory_stats(groups.device)
            mem["mem_engine_resumed"] = engine.resume_memory().allocated
        t2 = time.perf_counter()
        s = sync(trainer.module, engine.model)
        if cfg.rl.release_memory == "discard":
            engine.weights_loaded()  # the sync wrote every inference parameter
        if cfg.engine.mtp:  # this step's MTP drafts: verified, share accepted
            verified = engine.scheduler.drafts_verified - drafted[0]
            stats["mtp_drafts"] = verified
            stats["mtp_acceptance"] = ((engine.scheduler.drafts_accepted - drafted[1])
                                       / max(verified, 1))
        if carry is not None:
            stats["carried"] = len(carry.trajectories)
            stats["resumed_segments"] = sum(len(t.segments) > 1 for t in ok)
        row = {"step": step, "reward": sum(t.reward for t in ok) / max(len(ok), 1),
               "flat_groups": flat_group_share([t.reward for t in ok], [t.group for t in ok]),
               "response_len": sum(sum(t.loss_mask) for t in ok) / max(len(ok), 1),
               "failed": len(trajs) - len(ok), "rollout_s": t1 - t0, "train_s": t2 - t1,
               "sync_s": s.seconds, "sync_bytes": s.bytes_remote + s.bytes_local, **stats, **mem}
        history.append(row)
        if log is not None:
            with output_errors(metrics, "the metrics"):
                log.write(strict_json(row) + "\n")
                log.flush()
        if tb is not None:
            for k, v in row.items():
                if k != "step":
                    tb.add_scalar(k, v, step)
        if bar is not None:
            bar.set_postfix_str(f"reward {row['reward']:.3f} gap {row['logprob_gap_max']:.1e}")
            bar.update(1)
    if bar is not None:
        bar.close()
    if cfg.rl.export_dir is not None:
        trainer.export(cfg.rl.export_dir)
    sync.close()  # its process group
    engine.close()  # D graphs hold NCCL collectives: drop them before the groups go away
    if rank == 0:
        log.close()
        if tb is not None:
            tb.close()
        with output_errors(cfg.rl.out_dir, "the reward plot"):
            _plot(history, os.path.join(cfg.rl.out_dir, "reward.png"))
    return {"history": history}


def _tensorboard(out_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is a dependency; a broken install only loses the events
        return None
    return SummaryWriter(os.path.join(out_dir, "tb"))


def _plot(history: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["reward"] for h in history], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("colocated GRPO")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """torchrun entry point: ``python -m colo_rollout.rl.train CONFIG [--set k=v ...]``."""
    from colo_rollout.cli import main as cli_main

    return cli_main(["train", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
