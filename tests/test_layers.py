"""The layers hold (docs/architecture.md): each folder imports only the folders below it, pure
scheduling imports no torch, the runner never reads the scheduler. Checked on the import
statements of each module (lazy imports included), transitively within the package for torch,
so a new import that breaks a layer fails here."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "colo_rollout"
# plain Python: typed values in and out, unit-tested without processes or devices
PURE = sorted(str(p.relative_to(PKG)) for p in (PKG / "sched").glob("*.py")) + [
    "multiplex/turnstile.py", "multiplex/segment_policy.py", "engine/strategy.py"]

# what each layer (a folder, or a top-level module) may import from the package, itself apart;
# the order is the drawing in docs/architecture.md, bottom up
_BELOW: dict[str, set[str]] = {
    "config": set(), "text": set(), "testing": set(), "quiet": set(),
    "runtime": {"config"},
    "sched": {"config"},
    "multiplex": {"config", "runtime", "sched"},
    "model": {"config", "runtime"},
    "checkpoint": {"config", "runtime", "model"},
    "worker": {"config", "runtime", "sched", "multiplex", "model", "checkpoint"},
    "engine": {"config", "runtime", "sched", "multiplex", "model", "checkpoint", "worker"},
    "workloads": {"config", "sched", "engine"},
    "door": {"config", "checkpoint", "sched", "workloads"},
    "launch": {"config", "runtime", "door"},
    "rl": {"config", "runtime", "sched", "model", "checkpoint", "worker", "engine", "quiet",
           "cli"},  # cli: rl.train's torchrun entry point hands its argv to the one CLI
}
_TOP = {"tools", "cli", "preload"}  # the commands: may import every layer


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
    assert "colo_rollout.sched.scheduler" not in _imports(PKG / "worker/runner.py")


def _layer(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*.py") if p.name != "__init__.py"
                                        or p.parent != PKG), ids=lambda p: str(p.relative_to(PKG)))
def test_each_layer_imports_only_the_layers_below_it(path):
    layer = _layer(path)
    if layer in _TOP:
        return
    assert layer in _BELOW, f"{layer}: a new layer; place it in _BELOW and docs/architecture.md"
    used = {m.split(".")[1] for m in _imports(path) if m.startswith("colo_rollout.")}
    bad = sorted(used - _BELOW[layer] - {layer})
    assert bad == [], f"{path.relative_to(PKG)} ({layer}) imports {bad}"


def test_every_module_states_what_it_owns():
    """A module's docstring is its contract: present, and more than a title."""
    short = [str(p.relative_to(PKG)) for p in sorted(PKG.rglob("*.py"))
             if len((ast.get_docstring(ast.parse(p.read_text())) or "").split()) < 8]
    assert short == [], f"modules without a docstring that says what they own: {short}"
