"""colo_rollout: a training-coupled colocated rollout engine for RL on MoE LLMs."""

__version__ = "0.1.0"
