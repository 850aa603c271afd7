"""NCCL's launch ordering across communicators, set for every NCCL rank before its first one.

Owns ``nccl_env`` (what to set, a pure function of the NCCL version and the environment) and
``apply_nccl_env`` (sets it in this process; ``runtime/parallel.py`` calls it before
``init_process_group``, ``runtime/spawn.py`` passes it to spawned NCCL ranks).

Why: P and D own their communicators (phase-owned state), and on one device NCCL does not
order operations of different communicators -- two ranks may run them in different orders and
each wait in a kernel for the other: on 2x H200, Fine with P's MoE graphs stalled in 6 of 7
cells, P's eager AllReduce hung on both ranks beside D's graph-captured collectives
(docs/benchmarks.md, session 7). From NCCL 2.26 ``NCCL_LAUNCH_ORDER_IMPLICIT=1`` orders them
by host launch order, which the turnstile already makes identical on every rank; it must be
set before any communicator exists and before graphs are captured, and launches must come
from one host thread -- ``NCCL_LAUNCH_RACE_FATAL=1`` turns two threads' racing launches into
an error instead of an unordered pair. (Overlap of the two phases' kernels is kept with CUDA
>= 12.3, a >= 12.9 driver during graph capture.) A value the user set is kept. Older NCCL: no
variable is set, and the stall's remedies stay what they were (``engine.stream_route``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

LAUNCH_ORDER_SINCE = (2, 26, 0)
LAUNCH_ORDER = {"NCCL_LAUNCH_ORDER_IMPLICIT": "1", "NCCL_LAUNCH_RACE_FATAL": "1"}


def nccl_env(version: tuple[int, ...] | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set for an NCCL of ``version`` (None: no NCCL) that ``environ`` does not
    already set."""
    if version is None or tuple(version[:3]) < LAUNCH_ORDER_SINCE:
        return {}
    return {k: v for k, v in LAUNCH_ORDER.items() if k not in environ}


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL torch links, or None (a build without NCCL, or no CUDA)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        v = torch.cuda.nccl.version()
        return tuple(v) if isinstance(v, tuple) else None
    except Exception:  # noqa: BLE001 - no NCCL in this build: nothing to order
        return None


def apply_nccl_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set ``nccl_env`` in ``environ`` (default this process's); returns what was set."""
    environ = os.environ if environ is None else environ
    got = nccl_env(nccl_version(), environ)
    environ.update(got)
    return got
