"""The policy package stays pure: stdlib and its own modules only, nothing that does I/O or reads time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dilu_invoker.policy

PACKAGE = Path(dilu_invoker.policy.__file__).parent
ALLOWED = {
    "__future__",
    "bisect",
    "collections",
    "dataclasses",
    "enum",
    "heapq",
    "itertools",
    "operator",
    # Persistent maps (values, no I/O, no clock): snapshots derive in O(log n) instead of copying.
    "immutables",
    "math",
    # Optional (the `[sim]` extra): split placement's bounds at C speed; without it the walk
    # decides alike. Arrays, no I/O, no clock.
    "numpy",
    "types",
    "typing",
}
FORBIDDEN_CALLS = {"open", "print", "input"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.glob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_imports_only_stdlib_and_policy(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            assert top in ALLOWED or name.startswith("dilu_invoker.policy"), (
                f"{path.name} imports {name}"
            )


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_no_io_calls(path: Path) -> None:
    tree = ast.parse(path.read_text())
    called = {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    assert not called & FORBIDDEN_CALLS, f"{path.name} calls {called & FORBIDDEN_CALLS}"


def test_every_module_is_checked() -> None:
    assert {p.name for p in _modules()} >= {
        "types.py",
        "cluster.py",
        "placement.py",
        "vertical.py",
        "horizontal.py",
        "fragmentation.py",
        "compaction.py",
        "fill.py",
    }
