"""The package map holds: kernels never import layers or models, and no two packages of kvflow
import each other (directly or around a longer circle), counting every import at any depth of a
module (lazy imports inside functions included) except those under `if TYPE_CHECKING:`.

The graph is read from the source with `ast`, independently of what Python happens to import."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "kvflow"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> set[str]:
    """Every kvflow module name `path` imports (a `from a import b` counts as a.b and a)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m == "kvflow" or m.startswith("kvflow.")}


def _graph() -> dict[str, set[str]]:
    """module -> the kvflow modules it imports (names resolved to modules that exist)."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for name in _imports(path):
            while name not in files and "." in name:  # `from pkg.mod import func` -> pkg.mod
                name = name.rpartition(".")[0]
            if name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _package(module: str) -> str:
    """kvflow.kernels.cpu.native -> kvflow.kernels; kvflow.config -> kvflow.config; kvflow -> kvflow."""
    return ".".join(module.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _edges_within(graph: dict[str, set[str]], members: list[str], key=lambda m: m) -> list[str]:
    return sorted(
        f"{a} -> {b}" for a in graph for b in graph[a] if key(a) in members and key(b) in members and key(a) != key(b)
    )


def test_the_cycle_finder_finds_a_cycle():
    """The checker itself: a planted circle is found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_kernels_import_neither_layers_nor_models():
    graph = _graph()
    bad = sorted(
        f"{m} imports {t}"
        for m, targets in graph.items()
        if m.startswith("kvflow.kernels")
        for t in targets
        if t.startswith(("kvflow.layers", "kvflow.models"))
    )
    assert not bad, "kernels hold bindings and native sources only:\n" + "\n".join(bad)


def test_no_package_cycle():
    graph = _graph()
    packages: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        for target in targets:
            # `kvflow/__init__.py` is the public facade (it imports LLM, SamplingParams...): importing the
            # bare package from inside is not a dependency on those.
            if _package(target) != _package(module) and target != "kvflow":
                packages[_package(module)].add(_package(target))
    cycles = _cycles(packages)
    assert not cycles, "\n".join(
        f"packages import each other: {c}\n  " + "\n  ".join(_edges_within(graph, c, _package)) for c in cycles
    )


def test_no_module_cycle():
    """Finer than packages: no two modules import each other, inside a package either."""
    cycles = _cycles(_graph())
    assert not cycles, "\n".join(f"modules import each other: {c}" for c in cycles)
