"""Running a test file's Triton cases under Triton's CPU interpreter, in a subprocess.

TRITON_INTERPRET is read when kernels are decorated, so it must be set before the kernel
module is imported: the test file re-runs itself (its ``__main__`` block calls
``interpreted_main`` with its cases, which prints "all cases pass") in a fresh interpreter with
the flag set. The session's runs start together (``InterpretedRuns``, the ``interpreted``
fixture): each interpreter is single-threaded, so side by side they use every core.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None


# the kernel test files with interpreted cases: the first one a session asks for starts them
# all, so the single-threaded interpreters run side by side on the host's cores
KERNEL_TESTS = ("test_fused_moe.py", "test_moe_align.py", "test_paged_attention.py",
                "test_paged_prefill.py", "test_residual.py", "test_rope_kv.py",
                "test_fused_layer_kernels.py", "test_norm_add.py", "test_fp8.py",
                "test_multi_copy.py", "test_router_topk.py")


class InterpretedRuns:
    """The interpreted runs of one test session (the ``interpreted`` fixture, conftest.py):
    each file's script in its own subprocess, all started together on first use."""

    def __init__(self, files=KERNEL_TESTS) -> None:
        self.files = [str(REPO / "tests" / f) for f in files]
        self._procs: dict[str, subprocess.Popen] = {}

    def _start(self, path: str) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        self._procs[path] = subprocess.Popen([sys.executable, path], env=env, text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def check(self, test_file: str, timeout: float = 300) -> None:
        """Assert ``test_file``'s interpreted cases all passed (waiting up to ``timeout``)."""
        path = str(pathlib.Path(test_file).resolve())
        if not self._procs:
            for f in self.files:
                self._start(f)
        if path not in self._procs:  # a file not listed: run on its own
            self._start(path)
        proc = self._procs[path]
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"{test_file}: interpreted cases ran past {timeout} s")
        assert proc.returncode == 0, out + err
        assert "all cases pass" in out, out + err

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def interpreted_main(cases) -> None:
    """A test file's ``__main__`` under the interpreter: run ``cases()`` (it returns the
    failures as lines), print them or "all cases pass", exit non-zero on any failure."""
    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    failures = cases()
    print("\n".join(failures) if failures else "all cases pass")
    sys.exit(1 if failures else 0)
