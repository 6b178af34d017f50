"""pdserve's modules import each other without a cycle, lazy imports inside functions included
(a cycle hides which module is the lower one, and breaks as soon as an import in it moves to the
top of a file), and the layers hold: the router and the workers share only the protocol."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pdserve

ROOT = Path(pdserve.__file__).parent.parent  # the folder that holds the pdserve package


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str], annotations: bool = False) -> set[str]:
    """The modules in `known` that `path` imports anywhere in it (with `annotations`, in its
    `if TYPE_CHECKING:` blocks too). `from pkg import name` is an import of `pkg.name` when
    that is a module, else of `pkg` itself."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if annotations else _walk_runtime(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found & known


def _walk_runtime(tree: ast.AST):
    """ast.walk, leaving out `if TYPE_CHECKING:` blocks (annotations only, never imported)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def import_graph(package: str, annotations: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (itself left out)."""
    files = {module_name(p): p for p in (ROOT / package.replace(".", "/")).rglob("*.py")}
    return {
        name: imports_of(path, set(files), annotations) - {name} for name, path in files.items()
    }


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


def test_pdserve_imports_form_no_cycle():
    graph = import_graph("pdserve")
    assert "pdserve.sim.calibration" in graph["pdserve.sim.commands"]  # lazy imports count
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_annotations_form_no_cycle_either():
    """A circle through `if TYPE_CHECKING:` imports is a circle of concepts (each module needs
    the other to be read): e.g. the block manager and the KV connector, or the load reporter
    and the worker it took whole."""
    graph = import_graph("pdserve", annotations=True)
    assert "pdserve.engine.block" in graph["pdserve.engine.kv_connector"]  # annotations count
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def _reaches(graph: dict[str, set[str]], start: str, prefixes: tuple[str, ...]) -> list[str]:
    """Modules under `prefixes` that `start` imports, directly or not."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return sorted(d for d in seen if d.startswith(prefixes))


def test_router_and_workers_share_only_the_protocol():
    graph = import_graph("pdserve")
    layers = {
        "pdserve.router": ("pdserve.serving", "pdserve.launch"),
        "pdserve.serving": ("pdserve.router", "pdserve.launch"),
        "pdserve.protocol": ("pdserve.router", "pdserve.serving", "pdserve.launch"),
    }
    for package, forbidden in layers.items():
        for name in [n for n in graph if n.startswith(package)]:
            assert not _reaches(graph, name, forbidden), (name, _reaches(graph, name, forbidden))


def test_a_router_reads_its_model_without_importing_torch():
    """`pdserve serve` and `pdserve router` read the model's config and tokenizer (to validate
    flags, count tokens, render chat templates) but never run it: torch stays out of the router
    process (it cost ~1 s of every start and ~185 MB of its RSS), and a bad flag is refused in
    half a second."""
    code = (
        "import sys\n"
        "import pdserve.launch.commands, pdserve.launch.local, pdserve.launch.procs\n"
        "import pdserve.router.app, pdserve.router.frontend\n"
        "from pdserve.model.loader import load_model_config, load_tokenizer\n"
        "config = load_model_config(None)[1]\n"
        "tokens = load_tokenizer(None).encode('What is the capital of France?')\n"
        "print(config.num_layers, len(tokens) > 0, sorted(m for m in sys.modules if m == 'torch'"
        " or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["30", "True", "[]"], out.stdout
