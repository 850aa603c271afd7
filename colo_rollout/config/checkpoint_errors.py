"""Checkpoint errors, apart from the file code: config loading raises them without torch.

Owns ``CheckpointError`` (message ``PATH: WHAT: problem``), the name of a checkpoint's
config file, and ``read_checkpoint_file``: how its JSON files (config.json, the shard index)
are read -- as every named file of the project is (config/files.py): a regular file of bounded
size, opened without blocking.
"""

from __future__ import annotations

import os
import pathlib

from colo_rollout.config.files import FileProblem, read_regular_file

CONFIG_NAME = "config.json"
# the largest JSON file of a checkpoint read (config.json is a few kB; the shard index of a
# DeepSeek-V3 release, 90k tensors, is ~9 MB): a link to /dev/zero must not be read for ever
MAX_JSON_BYTES = 256 * 2**20


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


def read_checkpoint_file(path: pathlib.Path, missing: str = "missing") -> bytes:
    """The bytes of the checkpoint file ``path``, or a CheckpointError naming it: ``missing``
    where nothing is there (a link to nowhere included), else why it cannot be read -- a
    FIFO, device or directory is refused without being opened for a blocking read (found by
    probing: a FIFO named config.json hung the door for ever)."""
    try:
        return read_regular_file(path, MAX_JSON_BYTES, path.name,
                                 "a checkpoint's config.json and index are JSON files")
    except FileProblem as e:
        problem = missing if not path.exists() else str(e)
        raise CheckpointError(problem, path=path) from None
