"""Quiet output: the third-party notices known to be harmless, filtered once at the entry points.

Owns ``quiet_known_warnings()`` (idempotent) and ``run_quietly`` (the per-rank trampoline the
CLI launches its targets through, so the filters are in place before a target's module imports
megatron, whose import-time notices would otherwise print on every rank). Called by
``cli.main``, ``rl.train`` run as ``__main__`` (torchrun) and the ``run_*`` rank functions.

Each filter names one notice by its message (a regex matched at the start of the message), never
a category or a module as a whole: anything not listed here still shows. What is filtered, and
why it is harmless here:

  * megatron: "Apex is not installed" / "Transformer Engine and Apex are not installed" -- it
    falls back to torch's norms, optimizers and multi-tensor helpers, which is what this project
    runs on CPU and without TE (the TE modules are used when TE is importable);
  * megatron: "full scope is deprecated" -- TransformerConfig's default CUDA-graph scope; this
    project captures its own graphs and never uses megatron's;
  * megatron: "When using expert parallelism and tensor parallelism for training, sequence
    parallelism must be used" and "When using async grad allreduce it is recommended to set
    ... CUDA_DEVICE_MAX_CONNECTIONS" -- training advice printed for the inference model's
    EP + ATP layouts (it is never trained; the trainer runs TP 1, rl.trainer_tp);
  * megatron: "GPTModel IS DEPRECATED" (a log record of ``megatron.core.models.gpt.gpt_model``)
    -- the trainer and the reference are megatron GPTModels on purpose (the oracle);
  * torch: "`torch.distributed.all_gather_into_tensor` is deprecated" -- the D gather's call,
    which torch still supports;
  * torch: "No CUDA runtime is found, using CUDA_HOME=..." (a log record of
    ``torch.utils.cpp_extension``, printed when megatron imports it) -- on a CPU-only host that
    is the expected state.

No transformers progress bar comes from this package: it never calls transformers (only the
tests do, to build reference checkpoints).
"""

from __future__ import annotations

import importlib
import logging
import re
import warnings

# (category, message regex) of every warnings.warn notice filtered
KNOWN_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (UserWarning, r"Apex is not installed\."),
    (UserWarning, r"Transformer Engine and Apex are not installed\."),
    (UserWarning, r"full scope is deprecated\."),
    (UserWarning, r"When using expert parallelism and tensor parallelism for training, "
                  r"sequence parallelism must be used"),
    (UserWarning, r"When using async grad allreduce it is recommended to set the environment "
                  r"variable CUDA_DEVICE_MAX_CONNECTIONS"),
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated\."),
    # FlashAttention-4's first call of a kernel variant (cutlass-dsl's JIT): an argument it
    # passes as a Python object, one notice per compile (engine.prefill_attention: flash)
    (UserWarning, r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument"),
)

# logger name -> message regex of the log records filtered (only that logger's own records)
KNOWN_LOG_RECORDS: dict[str, str] = {
    "megatron.core.models.gpt.gpt_model": r"GPTModel IS DEPRECATED\.",
    "torch.utils.cpp_extension": r"No CUDA runtime is found, using CUDA_HOME=",
}


class _DropMessage(logging.Filter):
    """Drops the records of one logger whose message matches ``pattern`` (at its start)."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # a malformed record is not ours to hide
            return True
        return self.pattern.match(msg) is None


def quiet_known_warnings() -> None:
    """Install the filters (idempotent: a second call adds nothing). Only the listed notices
    are hidden; every other warning and log record still shows."""
    for category, message in KNOWN_WARNINGS:
        # filterwarnings removes an equal entry before inserting it: calling twice adds nothing
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, pattern in KNOWN_LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.pattern.pattern == pattern
                   for f in logger.filters):
            logger.addFilter(_DropMessage(pattern))


def run_quietly(rank: int, world: int, fn: str, **kwargs):
    """Rank function the CLI launches: install the filters, then import and run ``fn``
    ("package.module:function") with the rest of the arguments."""
    quiet_known_warnings()
    mod, name = fn.split(":")
    return getattr(importlib.import_module(mod), name)(rank=rank, world=world, **kwargs)
