"""Running a test file's Triton cases under Triton's CPU interpreter, in a subprocess.

TRITON_INTERPRET is read when kernels are decorated, so it must be set before the kernel
module is imported: the test file re-runs itself (its ``__main__`` block calls
``interpreted_main`` with its cases, which prints "all cases pass") in a fresh interpreter with
the flag set.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None


def run_interpreted(test_file: str, timeout: float = 300) -> None:
    """Run ``test_file`` as a script with TRITON_INTERPRET=1; assert it passed every case."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, test_file], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all cases pass" in proc.stdout, proc.stdout + proc.stderr


def interpreted_main(cases) -> None:
    """A test file's ``__main__`` under the interpreter: run ``cases()`` (it returns the
    failures as lines), print them or "all cases pass", exit non-zero on any failure."""
    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    failures = cases()
    print("\n".join(failures) if failures else "all cases pass")
    sys.exit(1 if failures else 0)
