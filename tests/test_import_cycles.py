"""No two modules of the project import each other, directly or around a longer loop
(STYLE.md rule 14): a type both need lives in a leaf module both import.

Imports are read from the source with `ast`, so every one counts: those under
`if TYPE_CHECKING:`, inside functions, and `from package import name` where `name` is a
submodule (an import of that submodule). Importing a package's submodule is an edge to the
submodule only, not to the packages above it. The module graph's strongly connected components
of more than one module are the cycles; the test names each with the imports that close it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("worker_service", "router_service", "gateway_service", "radixserve", "radixserve_client")

# module -> {imported module: first line importing it}
Graph = dict[str, dict[str, int]]


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of `packages` under `root`, by dotted name (a package is its __init__)."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """`name` or its longest prefix that is one of `modules` (None: not the project's)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(root: Path, packages: Iterable[str]) -> Graph:
    modules = module_files(root, packages)
    graph: Graph = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve_from(module, is_package, node)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if submodule in modules else base)
            for target in targets:
                known = _known(target, modules)
                if known is not None and known != module:
                    edges.setdefault(known, node.lineno)
        graph[module] = edges
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        # Iterative depth-first search: (module, iterator over its successors).
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            module, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, {})))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[module] = min(low[module], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def describe(graph: Graph, component: list[str]) -> str:
    members = set(component)
    edges = [
        f"    {module} -> {target} (line {line})"
        for module in component
        for target, line in sorted(graph[module].items())
        if target in members
    ]
    return f"  {len(component)} modules: {', '.join(component)}\n" + "\n".join(edges)


def test_no_module_imports_another_that_imports_it_back() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert len(graph) > 100, "the walk found too few modules: wrong root?"
    found = cycles(graph)
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(describe(graph, c) for c in found)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_walk_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checker itself: each hidden way of importing closes a cycle it must report."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        # a <-> b only under TYPE_CHECKING
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "pkg/b.py": "import pkg.a\n",
        # c -> d -> e -> c, e's import inside a function, d's a relative submodule import
        "pkg/c.py": "from pkg import d\n",
        "pkg/d.py": "from . import e\n",
        "pkg/e.py": "def f():\n    from pkg.c import thing\n",
        # a leaf everyone imports and a module importing a name (not a submodule) of the package
        "pkg/leaf.py": "import os\n",
        "pkg/user.py": "from pkg import leaf\nfrom pkg.leaf import os\nfrom pkg import __name__\n",
        "other/__init__.py": "from pkg.user import x\n",
    })
    graph = import_graph(tmp_path, ["pkg", "other"])
    assert graph["pkg.user"] == {"pkg.leaf": 1, "pkg": 3}
    assert graph["other"] == {"pkg.user": 1}
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d", "pkg.e"]]
    assert "pkg.e -> pkg.c (line 2)" in describe(graph, ["pkg.c", "pkg.d", "pkg.e"])
