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
import sys
import traceback

from colo_rollout.quiet import quiet_known_warnings

# what every CPU rank imports; the engine pulls in megatron-core, the model and the worker
MODULES = ("torch.distributed", "colo_rollout.engine.engine", "colo_rollout.model.megatron_gpt",
           "colo_rollout.rl.trainer")

quiet_known_warnings()
for _name in MODULES:
    importlib.import_module(_name)


def _quiet_orphan_start(exc_type, exc, tb, _default=sys.excepthook):
    """The forkserver's children report a failed start through ``sys.excepthook``. A start
    that fails inside multiprocessing's own bootstrap, on the launcher's resources (a
    semaphore or pipe the launcher removed as it exited: an interrupt while the ranks were
    starting), is the launcher's exit, which reports itself: no traceback here (found by
    probing: Ctrl-C 1-2 s into a run printed `error: interrupted` and then a child's
    FileNotFoundError from SemLock._rebuild). Anything else: the default hook."""
    frames = traceback.extract_tb(tb)
    if (issubclass(exc_type, (OSError, EOFError)) and frames
            and all("multiprocessing" in f.filename for f in frames)):
        return
    _default(exc_type, exc, tb)


sys.excepthook = _quiet_orphan_start
