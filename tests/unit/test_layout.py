"""The rooms' rules, checked on the source: imports flow one way, env reads live in one module.

cluster -> router -> workers, and inside `workers` from the roles down to the kernels
(`WORKER_ROOMS`, top first; docs/architecture.md draws the same picture). Every import counts,
lazy and type-only ones included: an arrow back up is a circle waiting to happen.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "router", "workers")  # top first
# Inside workers, top first: a module may import from its own room and the rooms after it.
WORKER_ROOMS = (
    "__init__", "api", "serve", "disagg", "llm", "engine", "spec", "scheduler", "transfer", "lora",
    "model",
    "attention", "kvcache", "sequence", "detokenizer", "sampling", "parallel", "kernels",
    "config", "protocol", "engine_stats", "ray_kv", "env",
)  # fmt: skip
ROUTER_DOOR = "workers.api"
ENV_MODULE = "workers.env"
MAX_LINES = 350
MAX_TOP_LEVEL_WORKER_MODULES = 8


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The project modules `path` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` imports pkg.mod where that is a module, else pkg itself
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                for a in node.names
            ]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in PACKAGES)
    return out


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _room(module: str) -> int:
    """Index of a workers module's room in WORKER_ROOMS."""
    parts = module.split(".")
    return WORKER_ROOMS.index(parts[1] if len(parts) > 1 else "__init__")


def test_every_workers_module_is_in_a_room() -> None:
    rooms = {m.split(".")[1] for m in MODULES if m.startswith("workers.")}
    unknown = sorted(rooms - set(WORKER_ROOMS))
    assert not unknown, f"add these to WORKER_ROOMS at their place in the order: {unknown}"


def test_imports_flow_down_from_cluster_to_router_to_workers() -> None:
    upward = [
        f"{m} -> {dep}"
        for m, deps in GRAPH.items()
        for dep in deps
        if PACKAGES.index(dep.split(".")[0]) < PACKAGES.index(m.split(".")[0])
    ]
    assert not upward, "imports against the flow:\n" + "\n".join(upward)


def test_router_uses_only_the_workers_door() -> None:
    past_door = [
        f"{m} -> {dep}"
        for m, deps in GRAPH.items()
        if m.startswith("router")
        for dep in deps
        if dep.startswith("workers") and dep != ROUTER_DOOR
    ]
    assert not past_door, f"the router imports workers only through {ROUTER_DOOR}:\n" + "\n".join(
        past_door
    )


def test_workers_rooms_import_only_downward() -> None:
    upward = [
        f"{m} -> {dep}"
        for m, deps in GRAPH.items()
        if m.startswith("workers")
        for dep in deps
        if dep.startswith("workers") and _room(dep) < _room(m)
    ]
    assert not upward, "imports up the rooms' order:\n" + "\n".join(upward)


def test_no_import_circles() -> None:
    # Tarjan's strongly connected components over the module graph: any of 2+ is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for dep in GRAPH.get(m, ()):
            if dep not in MODULES:
                continue
            if dep not in index:
                visit(dep)
                low[m] = min(low[m], low[dep])
            elif dep in stack:
                low[m] = min(low[m], index[dep])
        if low[m] == index[m]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == m:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in MODULES:
        if m not in index:
            visit(m)
    assert not circles, f"import circles: {circles}"


ENV_READ = re.compile(r"\b(os\.environ|os\.getenv|getenv\(|environ\[|environ\.get)")


def test_environment_is_read_in_one_module() -> None:
    readers = [
        str(path.relative_to(ROOT))
        for name, path in MODULES.items()
        if name != ENV_MODULE and ENV_READ.search(path.read_text())
    ]
    assert not readers, f"read environment variables through {ENV_MODULE}: {readers}"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_modules_stay_small(pkg: str) -> None:
    big = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / pkg).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not big, f"over {MAX_LINES} lines: {big}"


def test_workers_top_level_holds_few_modules() -> None:
    top = [p.name for p in (ROOT / "workers").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= MAX_TOP_LEVEL_WORKER_MODULES, sorted(top)


def test_a_router_replica_never_imports_torch() -> None:
    """A router replica imports `cluster/ingress.py`: with it no torch, no engine (a fresh
    interpreter, as a replica's)."""
    code = ("import sys, cluster.ingress; "
            "print(sorted({'torch', 'workers.engine'} & set(sys.modules)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout
