"""Running the test files' Triton cases under Triton's CPU interpreter, in worker processes.

TRITON_INTERPRET is read when kernels are decorated, so it must be set before the kernel
modules are imported: the cases run in fresh interpreters with the flag set. A session's
files are shared out over one worker per core (``InterpretedRuns``, the ``interpreted``
fixture), all started on first use: each worker imports torch, triton and megatron once
(~3.5 s per process; one process per file paid it eleven times), runs its files' ``_interpreted()``
cases in the order the session checks them and writes each file's result as it finishes.
A file's own ``__main__`` block (``interpreted_main``) runs its cases alone, by hand.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
PASS = "all cases pass"


# the kernel test files with interpreted cases: the first one a session asks for starts them
# all, so the single-threaded interpreters run side by side on the host's cores
KERNEL_TESTS = ("test_fused_moe.py", "test_moe_align.py", "test_paged_attention.py",
                "test_paged_prefill.py", "test_residual.py", "test_rope_kv.py",
                "test_fused_layer_kernels.py", "test_norm_add.py", "test_fp8.py",
                "test_multi_copy.py", "test_router_topk.py", "test_greedy_pick.py",
                "test_batch_invariant.py", "test_fp8_te_scaling.py", "test_mla_decode.py")


def shared_dir(uid: str | None = None) -> pathlib.Path | None:
    """Under pytest-xdist, the one results folder of this test run that every xdist worker
    shares (named by the run's uid: ``uid``, else the worker's environment); None in a plain
    pytest session."""
    uid = uid or os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return pathlib.Path(tempfile.gettempdir()) / f"colo-interpreted-{uid}" if uid else None


class InterpretedRuns:
    """The interpreted runs of one test session (the ``interpreted`` fixture, conftest.py):
    the files dealt in name order (pytest's) over ``workers`` processes (default: one per
    core), all started on the first ``check``. Under pytest-xdist the xdist workers share
    them: the first to ask (an atomic mkdir in ``shared_dir``) starts them, the others read
    the same result files -- each xdist session used to run every interpreted file itself,
    twice the interpreters' CPU on two cores (the controller removes the folder at the end:
    ``remove_shared``)."""

    def __init__(self, files=KERNEL_TESTS, workers: int | None = None) -> None:
        self.files = sorted(pathlib.Path(f).name for f in files)
        self.workers = max(1, min(len(self.files), workers or os.cpu_count() or 1))
        shared = shared_dir()
        self._tmp = None if shared else tempfile.TemporaryDirectory(prefix="interpreted-")
        self._path = shared or pathlib.Path(self._tmp.name)
        self._path.mkdir(exist_ok=True)
        self._started = False  # this session asked (and either started them or found them)
        self._procs: list[subprocess.Popen] = []
        self._owner: dict[str, subprocess.Popen | None] = {}

    def _start(self, names: list[str]) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        # stderr to a file: a pipe nobody reads until the end would fill and stall the worker
        err = self._path / f"worker{len(self._procs)}-{os.getpid()}.err"
        with open(err, "w") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "tests.interpreted",
                                     str(self._path), *names], env=env, cwd=str(REPO),
                                    stdout=subprocess.DEVNULL, stderr=fh)
        proc.err_path = err
        self._procs.append(proc)
        self._owner.update((n, proc) for n in names)

    def check(self, test_file: str, timeout: float = 300) -> None:
        """Assert ``test_file``'s interpreted cases all passed (waiting up to ``timeout``)."""
        name = pathlib.Path(test_file).name
        if not self._started:
            self._started = True
            try:  # the first session of the run to ask starts them
                (self._path / "started").mkdir()
                mine = True
            except FileExistsError:
                mine = False
            for w in range(self.workers):
                names = self.files[w :: self.workers]
                if mine:
                    self._start(names)
                else:  # another xdist worker's processes write these results
                    self._owner.update((n, None) for n in names)
        if name not in self._owner:  # a file not listed: a worker of its own
            self._start([name])
        proc, result = self._owner[name], self._path / f"{name}.out"
        deadline = time.monotonic() + timeout
        while not result.exists():
            if proc is not None and proc.poll() is not None and not result.exists():
                raise AssertionError(f"{test_file}: the interpreted worker exited "
                                     f"({proc.returncode}) before its cases ran:\n"
                                     f"{proc.err_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{test_file}: interpreted cases ran past {timeout} s")
            time.sleep(0.1)
        out = result.read_text()
        assert out == PASS, out

    def close(self) -> None:
        """Stop this session's processes: at once in a plain session; under xdist after up to
        300 s (another worker may still be waiting on their results)."""
        for proc in self._procs:
            if self._tmp is None:
                try:
                    proc.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        if self._tmp is not None:
            self._tmp.cleanup()


def remove_shared(uid: str) -> None:
    """The xdist controller's end of the run ``uid``: the shared results folder removed."""
    import shutil

    shutil.rmtree(shared_dir(uid), ignore_errors=True)


def interpreted_main(cases) -> None:
    """A test file's ``__main__`` under the interpreter: run ``cases()`` (it returns the
    failures as lines), print them or "all cases pass", exit non-zero on any failure."""
    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    failures = cases()
    print("\n".join(failures) if failures else PASS)
    sys.exit(1 if failures else 0)


def _worker(out_dir: str, names: list[str]) -> None:
    """One worker: each file's ``_interpreted()`` in turn, its result written to
    ``out_dir/<file>.out`` when it finishes (renamed into place: never read half-written)."""
    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    for name in names:
        try:
            module = importlib.import_module(f"tests.{pathlib.Path(name).stem}")
            failures = module._interpreted()
            text = "\n".join(failures) if failures else PASS
        except Exception:  # noqa: BLE001 -- the file's check reports it; the next file runs
            text = traceback.format_exc()
        tmp = pathlib.Path(out_dir) / f".{name}.tmp"
        tmp.write_text(text)
        tmp.rename(pathlib.Path(out_dir) / f"{name}.out")


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
