"""Checkpoint errors, apart from the file code: config loading raises them without torch.

Owns ``CheckpointError`` (message ``PATH: WHAT: problem``) and the name of a checkpoint's
config file.
"""

from __future__ import annotations

import os
import pathlib

CONFIG_NAME = "config.json"


class CheckpointError(ValueError):
    """A problem with a checkpoint on disk. Message: 'PATH: WHAT: problem' where PATH is the file
    (config.json, a shard file, the index) and WHAT the tensor name or key when there is one.

    ``message`` is the problem alone; the prefix is built from ``path`` and ``name``, which are
    kept as attributes (``path`` as a :class:`pathlib.Path` or None). ``user_facing``: raised
    on a rank, the command prints the message as its one ``error:`` line
    (runtime/spawn.py)."""

    user_facing = True

    def __init__(self, message: str, *, path: str | os.PathLike | None = None,
                 name: str | None = None) -> None:
        self.path = pathlib.Path(path) if path is not None else None
        self.name = name
        self.problem = message
        super().__init__("".join(f"{p}: " for p in (path, name) if p is not None) + message)
