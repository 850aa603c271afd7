"""RL side of colo_rollout: rollout(), weight sync after each step, the colocated GRPO loop.

rollout.py (token-in/token-out batch API), weight_sync.py (megatron.core.resharding hook),
grpo.py (objective), trainer.py (megatron GPTModel trainer), train.py (the loop and launch).
"""
