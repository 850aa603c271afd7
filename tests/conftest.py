"""Shared fixtures: one spawned gloo process group per (test module, world size)."""

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
