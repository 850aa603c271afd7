"""What a CPU rank process imports before it is forked (``runtime/spawn.py``'s forkserver).

Owns the list of heavy imports every rank needs -- torch, megatron-core through the engine, the
reference and the trainer -- so that a spawned group of N ranks pays for them once (the
forkserver's import, ~6 s of CPU) instead of N times. Importing this module also installs the
known-warning filters (``quiet``), so their import-time notices stay quiet in every rank.

Invariant: nothing imported here initialises CUDA or starts threads (a forked process must not
inherit either); GPU groups use plain spawn and never load this module.
"""

from __future__ import annotations

import importlib

from colo_rollout.quiet import quiet_known_warnings

# what every CPU rank imports; the engine pulls in megatron-core, the model and the worker
MODULES = ("torch.distributed", "colo_rollout.engine.engine", "colo_rollout.model.megatron_gpt",
           "colo_rollout.rl.trainer")

quiet_known_warnings()
for _name in MODULES:
    importlib.import_module(_name)
