"""Which cuDNN the process runs: torch's own, for torch and for Transformer Engine alike.

Owns ``load_torch_cudnn_first`` (``colo_rollout/__init__.py`` calls it, so it precedes every
import of megatron-core, whose ``utils`` import TE) and ``te_cudnn_env`` (what it sets: a pure
function).

Why: TE's loader (``transformer_engine/common/__init__.py``) dlopens cuDNN globally from
CUDNN_HOME, CUDNN_PATH, CUDA_HOME, /usr/local/cuda, then the system's library path -- before
torch has loaded its own. Where the system has an older cuDNN (the H200 host, session 25:
9.14 in /lib/x86_64-linux-gnu beside torch's bundled 9.19), either torch's lazy load then gets
that library and refuses it ("cuDNN version incompatibility: PyTorch was compiled against
(9, 19, 0) but found runtime version (9, 14, 0)"), or -- torch's loaded first -- the two
versions' sub-libraries mix and TE's core library fails to load (undefined symbol in
libcudnn_heuristic.so.9: its dependencies are found by name in the system's path). So: load
torch's cuDNN first, point TE's loader at the directory it came from (CUDNN_PATH) so TE opens
the very same file, and load that directory's sub-libraries (libcudnn_*.so.9) globally so TE's
core library's dependencies resolve to them by name. A CUDNN_HOME / CUDNN_PATH the user set
elsewhere is kept (and nothing is loaded from it). Only where TE is installed (the check
imports nothing); elsewhere torch is not even imported here.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
from collections.abc import Mapping, MutableMapping


def te_installed() -> bool:
    """Whether Transformer Engine is importable (found, not imported)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def loaded_cudnn_dir(maps: str) -> str | None:
    """The directory of the libcudnn.so this process mapped (``maps``: /proc/self/maps's
    text), or None."""
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if os.path.basename(path).startswith("libcudnn.so"):
            return os.path.dirname(path)
    return None


def te_cudnn_env(cudnn_dir: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """What to set for TE's loader: CUDNN_PATH at torch's cuDNN directory, unless the user
    chose one (CUDNN_HOME or CUDNN_PATH) or it is unknown."""
    if cudnn_dir is None or environ.get("CUDNN_HOME") or environ.get("CUDNN_PATH"):
        return {}
    return {"CUDNN_PATH": cudnn_dir}


def load_torch_cudnn_first(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """With TE installed and a torch built with cuDNN: load torch's cuDNN now and set
    ``te_cudnn_env`` in ``environ``; returns what it set ({}: nothing)."""
    if not te_installed():
        return {}
    import torch

    try:
        if not torch.backends.cudnn.is_available() or torch.backends.cudnn.version() is None:
            return {}
    except RuntimeError:  # TE was imported first and its cuDNN is the process's already:
        return {}  # torch says so at its first cuDNN use, not at this package's import
    try:
        with open("/proc/self/maps") as f:
            where = loaded_cudnn_dir(f.read())
    except OSError:  # not Linux
        where = None
    got = te_cudnn_env(where, environ)
    environ.update(got)
    # TE's loader opens torch's directory (set now, or inherited from the parent that set it
    # -- spawned ranks): its sub-libraries first, the base one before those that need it
    if where is not None and (environ.get("CUDNN_HOME") or environ.get("CUDNN_PATH")) == where:
        for lib in sorted(glob.glob(os.path.join(where, "libcudnn_*.so*")), key=_load_order):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            except OSError:  # one this build cannot load: TE then reports its own error
                pass
    return got


# cuDNN 9's sub-libraries in dependency order (each needs only those before it)
_SUBLIBS = ("graph", "engines_runtime_compiled", "engines_precompiled", "heuristic", "ops",
            "cnn", "adv")


def _load_order(path: str) -> int:
    name = os.path.basename(path)[len("libcudnn_"):].split(".so")[0]
    return _SUBLIBS.index(name) if name in _SUBLIBS else len(_SUBLIBS)
