"""The layers hold: pure scheduling imports no torch, the runner never reads the scheduler
(docs/architecture.md). Checked on the import statements of each module, transitively within
the package, so a new import that breaks a layer fails here."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "colo_rollout"
# plain Python: typed values in and out, unit-tested without processes or devices
PURE = ["inference/plan.py", "inference/planner.py", "inference/kv_cache.py",
        "inference/turnstile.py", "inference/request.py", "inference/scheduler.py",
        "inference/segment_policy.py", "inference/strategy.py"]


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def _closure(rel: str) -> set[str]:
    """Every module imported by ``rel``, following the package's own modules."""
    seen, todo, mods = set(), [PKG / rel], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for mod in _imports(path):
            mods.add(mod)
            if mod.startswith("colo_rollout."):
                sub = PKG.joinpath(*mod.split(".")[1:])
                for cand in (sub.with_suffix(".py"), sub / "__init__.py"):
                    if cand.exists():
                        todo.append(cand)
    return mods


@pytest.mark.parametrize("rel", PURE)
def test_pure_scheduling_imports_no_torch(rel):
    bad = sorted(m for m in _closure(rel) if m == "torch" or m.startswith(("torch.", "megatron")))
    assert bad == [], f"{rel} reaches {bad}"


def test_the_runner_never_reads_the_scheduler():
    assert "colo_rollout.inference.scheduler" not in _imports(PKG / "inference/runner.py")
