"""The names of the tensors a checkpoint directory stores, read without torch or safetensors.

Config loading runs without them, and one architecture field depends on what is stored, not only
on config.json: whether the MTP layer config.json declares is there (config/hf_config.py
``stored_architecture``). The names come from where ``checkpoint/store.py``'s CheckpointStore
takes them, with its precedence: ``model.safetensors``' header (8 bytes little-endian header
length, then a JSON object of tensor name -> dtype / shape / offsets, and ``__metadata__``), else
``model.safetensors.index.json``'s ``weight_map``.

Must not go in here: validating the files (the store does that, and reports what is wrong naming
the file), reading tensors.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header


def stored_tensor_names(directory: str | os.PathLike) -> frozenset[str] | None:
    """Every tensor name ``directory``'s weights hold, or None when they cannot be listed here
    (no weight file, a header or index that does not parse): the store then refuses the
    checkpoint, naming the file, when it is opened."""
    directory = pathlib.Path(directory)
    single, index = directory / SINGLE_NAME, directory / INDEX_NAME
    try:
        if single.is_file():  # a single weight file wins over an index, as in the store
            with open(single, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    return None
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER:
                    return None
                body = f.read(n)
            if len(body) != n:
                return None
            header = json.loads(body)
            if not isinstance(header, dict):
                return None
            return frozenset(k for k in header if k != "__metadata__")
        if index.is_file():
            weight_map = json.loads(index.read_bytes()).get("weight_map")
            return frozenset(weight_map) if isinstance(weight_map, dict) else None
    except (OSError, ValueError, AttributeError, RecursionError):  # JSON / UTF-8 decoding
        return None
    return None
