"""The simulator's modules import each other without a cycle, lazy imports inside functions
included: a cycle hides which module is the lower one, and breaks as soon as an import in it
moves to the top of a file."""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve

ROOT = Path(pdserve.__file__).parent.parent  # the folder that holds the pdserve package


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The modules in `known` that `path` imports anywhere in it. `from pkg import name` is
    an import of `pkg.name` when that is a module, else of `pkg` itself."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found & known


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (itself left out)."""
    files = {module_name(p): p for p in (ROOT / package.replace(".", "/")).rglob("*.py")}
    return {name: imports_of(path, set(files)) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None when the graph is acyclic."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        path.append(name)
        for dep in sorted(graph[name]):
            if cycle := visit(dep):
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        if cycle := visit(name):
            return cycle
    return None


def test_find_cycle_reports_the_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_sim_imports_form_no_cycle():
    graph = import_graph("pdserve.sim")
    assert "pdserve.sim.calibration" in graph["pdserve.sim.commands"]  # lazy imports count
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
