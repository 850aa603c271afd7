"""Quiet output: exactly the known-harmless third-party notices are filtered (by message), once,
at the entry points; anything else still shows."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest

from colo_rollout.quiet import KNOWN_LOG_RECORDS, KNOWN_WARNINGS, quiet_known_warnings

# a notice of each known kind, as the library prints it
KNOWN = [
    (UserWarning, "Apex is not installed. Falling back to Torch Norm"),
    (UserWarning, "Transformer Engine and Apex are not installed. Falling back to Torch "
                  "optimizers."),
    (UserWarning, "full scope is deprecated. Use empty cuda_graph_modules to capture the whole "
                  "layer."),
    (UserWarning, "When using expert parallelism and tensor parallelism for training, sequence "
                  "parallelism must be used"),
    (UserWarning, "When using async grad allreduce it is recommended to set the environment "
                  "variable CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                    "`torch.distributed.all_gather_single` instead."),
]
# near misses: other messages, or the same message under another category
OTHERS = [
    (UserWarning, "Something else is not installed."),
    (UserWarning, "An Apex is not installed."),  # the regex is anchored at the start
    (FutureWarning, "`torch.distributed.all_gather` is deprecated."),
    (DeprecationWarning, "Apex is not installed. Falling back to Torch Norm"),
    (RuntimeWarning, "full scope is deprecated."),
]


def _shown(category, message) -> bool:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_known_warnings()  # after "always": ours come first, as at an entry point
        warnings.warn(message, category)
    return bool(seen)


@pytest.mark.parametrize("category, message", KNOWN)
def test_known_notices_are_filtered(category, message):
    assert not _shown(category, message)


@pytest.mark.parametrize("category, message", OTHERS)
def test_everything_else_still_shows(category, message):
    assert _shown(category, message)


def test_filters_are_by_message_and_installed_once():
    assert all(msg for _, msg in KNOWN_WARNINGS)  # never a blanket (empty) message
    with warnings.catch_warnings():
        quiet_known_warnings()
        n = len(warnings.filters)
        quiet_known_warnings()
        assert len(warnings.filters) == n
    for name in KNOWN_LOG_RECORDS:
        before = len(logging.getLogger(name).filters)
        quiet_known_warnings()
        assert len(logging.getLogger(name).filters) == before


@pytest.mark.parametrize("name, message", [
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED. GPTModel is only accepting "
                                           "critical bug fixes"),
    ("torch.utils.cpp_extension", "No CUDA runtime is found, using CUDA_HOME='/usr/local'"),
])
def test_known_log_records_are_dropped_and_others_kept(caplog, name, message):
    quiet_known_warnings()
    logger = logging.getLogger(name)
    with caplog.at_level(logging.WARNING, logger=name):
        logger.warning(message)
        logger.warning("another warning of this logger")
    assert [r.getMessage() for r in caplog.records if r.name == name] == [
        "another warning of this logger"]


_SCRIPT = """
import sys
if sys.argv[1] == "quiet":
    from colo_rollout.quiet import quiet_known_warnings
    quiet_known_warnings()
from colo_rollout.config import ModelConfig
from colo_rollout.model.model import megatron_config
megatron_config(ModelConfig(), tp=1, init=False)  # imports megatron, builds its config
import warnings
warnings.warn("a warning of our own", UserWarning)
"""


def test_a_fresh_rank_process_prints_only_what_is_not_known():
    """What a launched rank sees: megatron's import-time notices (Apex, TE, torch's CUDA_HOME
    line) and TransformerConfig's appear without the filters and not with them; an unknown
    warning appears in both."""
    pytest.importorskip("megatron.core")
    procs = {mode: subprocess.Popen([sys.executable, "-c", _SCRIPT, mode], text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for mode in ("loud", "quiet")}  # side by side
    err = {}
    for mode, proc in procs.items():
        _, err[mode] = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[mode]
        assert "a warning of our own" in err[mode]
    loud, quiet = err["loud"], err["quiet"]
    assert "Apex is not installed" in loud and "full scope is deprecated" in loud
    for needle in ("Apex is not installed", "Transformer Engine and Apex", "full scope",
                   "No CUDA runtime is found"):
        assert needle not in quiet, quiet
