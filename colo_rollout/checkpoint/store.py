"""Checkpoint storage: a Hugging Face checkpoint directory as files on disk.

Owns the on-disk format and nothing more: finding and validating ``config.json`` and the
safetensors weights (one ``model.safetensors``, or shards listed by
``model.safetensors.index.json``), reading tensors -- or row/column slices of them -- without
materialising what was not asked for, and writing a checkpoint in the layout transformers'
``save_pretrained`` produces. Every problem with what is on disk is a :class:`CheckpointError`
whose message names the file and, when there is one, the tensor or key.

What must not go here: knowledge of any model (which tensors exist, what their shapes mean),
mapping between Hugging Face and megatron names, and ``torch.distributed``. The layers above
decide *what* to read or write; this module only moves bytes between disk and tensors.
"""

from __future__ import annotations

import difflib
import json
import os
import pathlib
import re
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from colo_rollout.config.checkpoint_errors import (
    CONFIG_NAME,
    CheckpointError,
    read_checkpoint_file,
)

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Weight files this module writes (and so may replace): model.safetensors, model-0000i-of-0000N.
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")

# safetensors header dtype codes -> torch dtypes.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}


class _Repeated(dict):
    """A JSON object as ``json.loads`` builds it (the last of a repeated key wins), which also
    keeps each repeated key with its values in order (``repeated``)."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.repeated: dict[str, list[Any]] = {}
        if len(self) != len(pairs):
            for key, value in pairs:
                self.repeated.setdefault(key, []).append(value)
            self.repeated = {k: v for k, v in self.repeated.items() if len(v) > 1}


def _read_json_object(path: pathlib.Path) -> dict[str, Any]:
    """The JSON object in ``path``, or a CheckpointError saying why not. Every object in it
    is a ``_Repeated`` (a dict that also lists its repeated keys)."""
    try:
        text = read_checkpoint_file(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"not UTF-8 ({e.reason} at byte {e.start})", path=path) from None
    try:
        obj = json.loads(text, object_pairs_hook=_Repeated)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"not JSON: {e.msg} at line {e.lineno} column {e.colno}",
                              path=path) from None
    except RecursionError:
        raise CheckpointError("not JSON: nested too deeply", path=path) from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise CheckpointError(f"not JSON: {e}", path=path) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"expected a JSON object, got {type(obj).__name__}", path=path)
    return obj


class CheckpointStore:
    """Read-only view of a Hugging Face checkpoint directory: config.json + safetensors, either one
    file (model.safetensors) or sharded (model.safetensors.index.json with its weight_map). Reads
    are slices: only the requested rows/columns are read from disk (safetensors get_slice); a
    whole tensor is never materialised unless asked for. File handles are opened lazily and cached
    (a single-file checkpoint is opened at construction, since its header is the list of names);
    ``close`` drops them and a later read reopens."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = pathlib.Path(directory)
        self.bytes_read = 0  # bytes of the stored tensors returned by read(), before any cast
        self._handles: dict[pathlib.Path, Any] = {}  # safe_open handles, opened on first use
        if not self.directory.is_dir():
            problem = "not a directory" if self.directory.exists() else "no such directory"
            raise CheckpointError(problem, path=self.directory)
        self.config: dict[str, Any] = _read_json_object(self.directory / CONFIG_NAME)
        single, index = self.directory / SINGLE_NAME, self.directory / INDEX_NAME
        # Same precedence as transformers: a single weight file wins over an index.
        if single.is_file():
            self._source = single  # the file that lists the names, for "no such tensor" errors
            self._files = {n: single for n in self._handle(single).keys()}
        elif index.is_file():
            self._source = index
            self._files = self._read_index(index)
        else:
            # a weight file's name on something that is no regular file (a folder, a FIFO, a
            # link to nowhere): named as such, not as absent (found by probing)
            odd = next((p for p in (single, index) if os.path.lexists(p)), None)
            if odd is not None:
                raise CheckpointError("not a regular file (a directory, FIFO, device or a link "
                                      "to nowhere), so the checkpoint has no weights", path=odd)
            pickled = sorted(p.name for p in self.directory.glob("*.bin"))[:1]
            why = (f"; {pickled[0]} is a pickle, which is never loaded (convert it with "
                   "transformers' save_pretrained(..., safe_serialization=True))"
                   if pickled else " (shards without an index are not accepted)")
            raise CheckpointError(f"no weights: expected {SINGLE_NAME} or {INDEX_NAME}{why}",
                                  path=self.directory)

    def _read_index(self, index: pathlib.Path) -> dict[str, pathlib.Path]:
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError("missing or not an object", path=index, name="weight_map")
        # a tensor listed twice with different shards: JSON keeps the last entry, which may
        # name a shard that does not hold it -- named as what it is (found by probing: "not in
        # this file"); the same shard twice is harmless
        name, shards = next(((n, v) for n, v in weight_map.repeated.items()
                             if len(set(map(repr, v))) > 1), (None, None))
        if name is not None:
            raise CheckpointError(f"listed {len(shards)} times ({', '.join(map(repr, shards))}): "
                                  "a tensor has one entry", path=index,
                                  name=f"weight_map.{name}")
        files: dict[str, pathlib.Path] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise CheckpointError(f"expected a file name, got {file!r}", path=index,
                                      name=f"weight_map.{name}")
            rel = pathlib.PurePosixPath(file)
            if rel.is_absolute() or ".." in rel.parts or "\\" in file or not file:
                # the shards live in the checkpoint's directory (the file names themselves may
                # be links, as in the hub's cache: the name is checked, not its target)
                raise CheckpointError(f"{file!r}: expected a file in the checkpoint's directory",
                                      path=index, name=f"weight_map.{name}")
            files[name] = self.directory / file
        # Check each shard once, naming one tensor the index maps to it.
        for path, name in {p: n for n, p in reversed(files.items())}.items():
            if not path.is_file():
                what = ("not a regular file (a directory, FIFO or device)" if path.exists()
                        else "shard file missing")
                raise CheckpointError(f"{what} (listed in {INDEX_NAME})", path=path, name=name)
        return files

    def _handle(self, path: pathlib.Path) -> Any:
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = self._handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot open as safetensors: {e}", path=path) from None
        return handle

    def _slice(self, name: str) -> tuple[pathlib.Path, Any]:
        path = self.file_of(name)
        try:
            return path, self._handle(path).get_slice(name)
        except SafetensorError:
            raise CheckpointError(f"not in this file, though {INDEX_NAME} maps it here",
                                  path=path, name=name) from None

    def names(self) -> list[str]:
        return sorted(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def file_of(self, name: str) -> pathlib.Path:
        try:
            return self._files[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._files, n=3)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            raise CheckpointError(f"no such tensor in {self.directory}{hint}",
                                  path=self._source, name=name) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name)[1].get_shape())

    def dtype(self, name: str) -> torch.dtype:
        path, sl = self._slice(name)
        code = sl.get_dtype()
        if code not in _DTYPES:
            raise CheckpointError(f"unsupported dtype {code}", path=path, name=name)
        return _DTYPES[code]

    def read(self, name: str, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None, dtype: torch.dtype | None = None,
             at: int | None = None) -> torch.Tensor:
        """Tensor ``name``, restricted to ``rows`` [start, stop) of dim 0 and ``cols`` of dim 1,
        cast to ``dtype`` if given; with ``at``, its entry ``at`` of dim 0 first (one expert of
        a fused [experts, rows, cols] tensor), ``rows`` and ``cols`` then of that entry. Always
        contiguous; without a cast, whole and row-only reads share memory with the file's
        copy-on-write mapping (writing to them never reaches disk)."""
        path, sl = self._slice(name)
        full_shape = tuple(sl.get_shape())
        if at is not None:
            if (len(full_shape) < 1 or not isinstance(at, int) or isinstance(at, bool)
                    or not 0 <= at < full_shape[0]):
                raise CheckpointError(f"entry {at!r} asked of shape {list(full_shape)}",
                                      path=path, name=name)
        shape = full_shape[1:] if at is not None else full_shape

        def bound(span: tuple[int, int], dim: int, what: str) -> slice:
            if len(shape) <= dim:
                raise CheckpointError(f"{what} given for a {len(shape)}-D tensor", path=path,
                                      name=name)
            ok = (isinstance(span, tuple) and len(span) == 2
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in span))
            if not ok or not 0 <= span[0] <= span[1] <= shape[dim]:
                raise CheckpointError(f"{what} must be (start, stop) with 0 <= start <= stop <= "
                                      f"{shape[dim]} (dim {dim} of shape {list(shape)}), got "
                                      f"{span!r}", path=path, name=name)
            return slice(*span)

        index = [slice(None)] if rows is None else [bound(rows, 0, "rows")]
        if cols is not None:
            index.append(bound(cols, 1, "cols"))
        if at is not None:
            index.insert(0, at)
        try:
            # Only a request without any slice reads the whole tensor (also the only way for 0-D).
            if rows is None and cols is None and at is None:
                tensor = self._handle(path).get_tensor(name)
            else:
                tensor = sl[tuple(index)]
        except SafetensorError as e:
            raise CheckpointError(f"cannot read: {e}", path=path, name=name) from None
        # safetensors returns views of the file's private (copy-on-write) memory map, so pages are
        # read from disk only when touched. A column slice is a strided view: copy just those
        # elements, so that every result is contiguous (as collectives and .view() require).
        tensor = tensor.contiguous()
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor if dtype is None or dtype == tensor.dtype else tensor.to(dtype)

    def close(self) -> None:
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.__exit__(None, None, None)

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def write_checkpoint(directory: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]],
                     config: dict, max_shard_bytes: int = 5 * 2**30,
                     extra_files: dict[str, str | bytes] | None = None
                     ) -> list[pathlib.Path]:
    """Stream (name, tensor) pairs into safetensors laid out as transformers' save_pretrained does:
    one 'model.safetensors' when everything fits in one shard, else shards
    'model-0000i-of-0000N.safetensors' plus 'model.safetensors.index.json'
    ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}).

    Holds at most one shard's tensors in memory: a shard is written (under a temporary name,
    renamed once N is known) when the next tensor would take it past max_shard_bytes; a larger
    tensor gets a shard of its own. Tensors go to CPU, contiguous; CPU tensors are held by
    reference until written, so the caller must not modify one after yielding it. Safetensors
    metadata is {"format": "pt"}. Also writes each extra_files entry (file name -> text or
    bytes) and config.json (indent=2, key order kept); weight files of an earlier checkpoint
    here that this one does not use are removed. A file here that is a symbolic link is
    replaced, never written through (a folder of links into a hub cache or another checkpoint:
    found by probing, the export rewrote the source's config.json). Duplicate names ->
    ValueError. Returns the weight files."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    directory = pathlib.Path(directory)
    extra_files = dict(extra_files or {})
    for file in extra_files:
        if (pathlib.PurePath(file).name != file or file in (CONFIG_NAME, INDEX_NAME)
                or _WEIGHT_FILE.fullmatch(file)):
            raise ValueError(f"extra_files: {file!r} is not a plain file name of its own")
    config_text = json.dumps(config, indent=2, sort_keys=False) + "\n"  # fail before writing
    directory.mkdir(parents=True, exist_ok=True)

    temps: list[pathlib.Path] = []
    shard_names: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_storages: set[int] = set()
    pending_bytes = total_bytes = 0
    seen: set[str] = set()

    def flush() -> None:
        nonlocal pending, pending_bytes
        temp = directory / f".model-{len(temps) + 1:05d}.safetensors.tmp"
        temps.append(temp)
        save_file(pending, str(temp), metadata={"format": "pt"})
        shard_names.append(list(pending))
        pending, pending_bytes = {}, 0
        pending_storages.clear()

    try:
        for name, tensor in tensors:
            if name in seen:
                raise ValueError(f"duplicate tensor name {name!r}")
            seen.add(name)
            t = tensor.detach().to("cpu").contiguous()
            nbytes = t.numel() * t.element_size()
            if pending and pending_bytes + nbytes > max_shard_bytes:
                flush()
            # save_file refuses tensors sharing memory within one file (tied weights): copy.
            if t.untyped_storage().data_ptr() in pending_storages:
                t = t.clone()
            pending_storages.add(t.untyped_storage().data_ptr())
            pending[name] = t
            pending_bytes += nbytes
            total_bytes += nbytes
        flush()  # the last (or only) shard; an empty stream gives one empty file
        n = len(temps)
        finals = ([directory / SINGLE_NAME] if n == 1 else
                  [directory / f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)])
        for temp, final in zip(temps, finals):
            os.replace(temp, final)
    except BaseException:
        for temp in temps:
            temp.unlink(missing_ok=True)
        raise

    index = directory / INDEX_NAME
    if n > 1:
        weight_map = {name: final.name for names, final in zip(shard_names, finals)
                      for name in names}
        index_obj = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        _write_own(index, json.dumps(index_obj, indent=2, sort_keys=True) + "\n")
    else:
        index.unlink(missing_ok=True)
    for old in directory.iterdir():
        if _WEIGHT_FILE.fullmatch(old.name) and old not in finals:
            old.unlink()
    for file, data in extra_files.items():
        _write_own(directory / file, data)
    # config.json last: a new directory only becomes a loadable checkpoint once all is written.
    _write_own(directory / CONFIG_NAME, config_text)
    return finals


def _write_own(path: pathlib.Path, data: str | bytes) -> None:
    """``data`` as the file ``path`` itself: a symbolic link there is removed first, so what
    it pointed to is left alone."""
    if path.is_symlink():
        path.unlink()
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")
