"""The project's files in and out: ``read_regular_file`` and ``strict_json``.

Owns the rule every reader of a named file follows (config YAML, trace JSONL): the path names
a regular file of at most a given size, opened without blocking -- a FIFO would wait for a
writer for ever, a device such as /dev/zero would never end, a directory is not a file. The
callers turn ``FileProblem`` into their own one-line errors (file, key). And the rule every
JSON the project writes follows (reports, metrics): strict JSON, a value that is not a finite
number written as null -- Python's bare NaN / Infinity tokens are refused by strict readers
(jq, JSON.parse, Go, serde).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
from typing import Any


class FileProblem(ValueError):
    """Why a named file cannot be read (one line, without the path)."""


class OutputError(RuntimeError):
    """A run's output could not be written (the disk full, the folder gone or read-only):
    the command's one error line, exit code 1 -- the door checked the path could be written,
    the run found it could not (found by probing: on a full disk every report was a
    traceback, and each JSON was left truncated or empty)."""

    user_facing = True  # raised on a rank: the command's one error line (runtime/spawn.py)


@contextlib.contextmanager
def output_errors(path: str | os.PathLike[str], what: str):
    """An OSError inside the block (writing ``path``, ``what`` it is) as OutputError."""
    try:
        yield
    except OSError as e:
        raise OutputError(f"{os.fspath(path)}: cannot write {what}: {e.strerror or e}") \
            from None


def write_output(path: str | os.PathLike[str], text: str, what: str) -> None:
    """``text`` into the file ``path`` whole or not at all, its folder made if missing:
    written beside it and renamed over it (a reader never sees half a report, and a failed
    write leaves the previous one); an OSError is OutputError naming ``what``."""
    name = os.fspath(path)
    tmp = None
    with output_errors(name, what):
        try:
            os.makedirs(os.path.dirname(os.path.abspath(name)), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(name)}.",
                                       dir=os.path.dirname(name) or ".")
            with open(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, name)
            tmp = None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


def read_regular_file(path: str | os.PathLike[str], max_bytes: int, kind: str,
                      what: str) -> bytes:
    """The bytes of the regular file ``path``, or FileProblem: an empty path, a path that is
    not a regular file, one larger than ``max_bytes``, or the OS's reason it cannot be read (a
    relative path that does not exist names the working directory). ``kind`` names the file
    in the messages ("trace file"), ``what`` says what it should be ("a trace is a JSONL
    file")."""
    name = os.fspath(path)
    if not name:
        raise FileProblem(f"no {kind} named (the path is empty)")
    try:
        # non-blocking: opening a FIFO for reading would wait for a writer
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise FileProblem(f"not a regular file (a directory, FIFO or device): {what}")
            if st.st_size > max_bytes:
                raise FileProblem(f"{st.st_size} bytes, more than the {max_bytes} a {kind} may "
                                  "have")
            data = f.read(max_bytes + 1)
            if len(data) > max_bytes:  # grew while read
                raise FileProblem(f"more than the {max_bytes} bytes a {kind} may have")
            return data
    except OSError as e:
        where = ("" if os.path.isabs(name) or not isinstance(e, FileNotFoundError)
                 else f" (relative to the working directory {os.getcwd()})")
        raise FileProblem(f"cannot read {kind}: {e.strerror or e}{where}") from None


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def strict_json(obj: Any, indent: int | None = None) -> str:
    """``obj`` as strict JSON: NaN and infinities as null."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False)
