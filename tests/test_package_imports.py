"""DESIGN.md's package table, enforced: which package may import which (as the policy purity test does for
``policy/``). Arrows point one way; a new edge is a design change — make it here and in docs/architecture.md
together, with the reason."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dilu_invoker

ROOT = Path(dilu_invoker.__file__).parent
#: what every package may use: the shared model, wire formats, configuration, logging, small helpers
FOUNDATION = {"dilu_invoker", "model", "wire", "config", "logs", "aiotasks", "jsonutil"}
#: the invoker's two jobs: the data plane and the cluster agent (which may use the data plane, never the
#: other way round)
AGENT = {"agent", "routing", "forwarding", "instances", "reports", "registry", "streams", "cluster"}

MAY_IMPORT: dict[str, set[str]] = {
    "policy": set(),
    "gpu": {"policy"},
    "loadbalancer": {"policy", "redis_embedded"},
    "invoker": {"gpu"},
    "invoker.agent": {"invoker", "gpu"},
    "openwhisk": {"invoker", "invoker.agent", "store", "redis_embedded", "health"},
    "sim": {"policy"},
    "store": set(),
    "redis_embedded": set(),
    "health": {"redis_embedded"},
}
#: edges the table does not show, each with its reason (module → modules it may import beyond its package's)
EXCEPTIONS: dict[str, set[str]] = {
    # the balancer reserves a GPU's budget atomically when it places an instance (the budgets' Lua scripts
    # live with the GPU package that owns the keyspace)
    "loadbalancer.service": {"dilu_invoker.gpu.budgets"},
    # the profiler measures an action through the live shim and its control block
    "sim.profiler": {"dilu_invoker.gpu.abi", "dilu_invoker.gpu.shim"},
    # the configuration validates the vertical policy's knobs at start-up by building the policy's own
    # frozen config (one parser for flags, env and Ansible), imported lazily inside GpuConfig.vertical()
    "config": {"dilu_invoker.policy.vertical_slo"},
    # pre-loading learns only modules of installed packages, by the same site-packages roots the worker
    # reports its imports against (stdlib-only framing module shared with the runtime)
    "invoker.dataplane.preload": {"dilu_invoker.actions._ipc"},
    # the direct lane speaks the worker's own frames (kinds, header, the run answer and its error shape), so
    # the invoker and the runtime cannot drift apart on the wire
    "invoker.dataplane.runtime_client": {"dilu_invoker.actions._ipc"},
}
#: composition roots: they put everything together
ROOTS = {"standalone", "cli", "__main__", "doctor", "banner"}


def _layer(module: str) -> str:
    """``dilu_invoker.invoker.cluster.routing`` → ``invoker.agent``; ``dilu_invoker.gpu.node`` → ``gpu``."""
    parts = module.split(".")[1:]
    if not parts:
        return "dilu_invoker"
    if parts[0] == "invoker" and len(parts) > 1 and parts[1] in AGENT:
        return "invoker.agent"
    return parts[0]


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        out.append((name, path))
    return out


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from pkg import submodule`` imports the submodule; ``from module import name`` the module
            for a in node.names:
                full = f"{node.module}.{a.name}"
                names.add(full if full.startswith("dilu_invoker.") and _is_module(full) else node.module)
    return {n for n in names if n == "dilu_invoker" or n.startswith("dilu_invoker.")}


@pytest.mark.parametrize(("module", "path"), _modules(), ids=[m for m, _ in _modules()])
def test_imports_follow_the_package_table(module: str, path: Path) -> None:
    own = _layer(module)
    if own in ROOTS:
        return
    short = module.removeprefix("dilu_invoker.")
    bad = []
    for name in _imports(path):
        target = _layer(name)
        if target == own or name in EXCEPTIONS.get(short, set()):
            continue
        if own == "actions":
            bad.append(name)  # it ships into images: stdlib + aiohttp only
        elif target not in FOUNDATION and target not in MAY_IMPORT.get(own, set()):
            bad.append(name)
    assert not bad, f"{module} ({own}) may not import {sorted(bad)}"


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def test_the_data_plane_knows_nothing_of_the_agent() -> None:
    plane = [(m, p) for m, p in _modules() if _layer(m) == "invoker"]
    assert plane, "no data-plane modules found"
    for module, path in plane:
        agent = sorted(n for n in _imports(path) if _layer(n) == "invoker.agent")
        assert not agent, f"{module} imports the cluster agent: {agent}"


def test_every_package_is_in_the_table() -> None:
    packages = {_layer(m) for m, _ in _modules()} - ROOTS - FOUNDATION - {"actions"}
    assert packages <= set(MAY_IMPORT), packages - set(MAY_IMPORT)
