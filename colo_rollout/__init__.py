"""colo_rollout: a training-coupled colocated rollout engine for RL on MoE LLMs."""

from colo_rollout.runtime.cudnn_env import load_torch_cudnn_first

__version__ = "0.1.0"

# before anything imports Transformer Engine (megatron-core's utils do): torch's cuDNN is the
# process's, not an older toolkit's that TE's loader would find first (runtime/cudnn_env.py)
load_torch_cudnn_first()
