"""Shared fixtures: one spawned gloo process group per (test module, world size); the test
tiers (markers unit / dist / gpu, declared in pyproject.toml) set from what each test uses."""

from __future__ import annotations

import pytest

from colo_rollout.runtime.spawn import WorkerGroup


@pytest.fixture(scope="module")
def worker_groups():
    """Lazily spawned WorkerGroups keyed by world size; reused by every test of the module."""
    groups: dict[int, WorkerGroup] = {}

    def get(world: int) -> WorkerGroup:
        g = groups.get(world)
        if g is None or not g.alive:
            g = groups[world] = WorkerGroup(world)
        return g

    yield get
    for g in groups.values():
        g.close()


@pytest.fixture(scope="session")
def interpreted(request):
    """The kernel tests' interpreted runs (tests/interpreted.py), started together: those of
    the session's collected test files that have them."""
    from tests.interpreted import KERNEL_TESTS, InterpretedRuns

    collected = {item.path.name for item in request.session.items
                 if "interpreted" in item.fixturenames}
    runs = InterpretedRuns([f for f in KERNEL_TESTS if f in collected])
    yield runs
    runs.close()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller, per worker: the run's uid, which names the interpreted runs'
    shared results folder (tests/interpreted.py: shared_dir)."""
    node.config.stash[_RUN_UID] = node.workerinput["testrunuid"]


def pytest_sessionfinish(session):
    """The xdist controller removes the interpreted runs' shared results folder once every
    worker has finished."""
    uid = session.config.stash.get(_RUN_UID, None)
    if uid is not None:
        from tests.interpreted import remove_shared

        remove_shared(uid)


_RUN_UID = pytest.StashKey[str]()


# modules whose tests start processes without the worker_groups fixture (a private
# WorkerGroup, a subprocess, or a command that launches ranks)
_DIST_MODULES = {"test_crossed_path", "test_eight_ranks", "test_generate_cli", "test_modes",
                 "test_quiet", "test_rendezvous", "test_wedged_exit", "test_replay",
                 "test_checkpoint_door", "test_door", "test_bench_speed", "test_bench_sync"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.module.__name__.rsplit(".", 1)[-1]
        if item.get_closest_marker("gpu") is not None:  # a kernel file's GPU test
            continue
        if name == "test_gpu":
            item.add_marker(pytest.mark.gpu)
        elif "worker_groups" in item.fixturenames or name in _DIST_MODULES:
            item.add_marker(pytest.mark.dist)
        else:
            item.add_marker(pytest.mark.unit)
