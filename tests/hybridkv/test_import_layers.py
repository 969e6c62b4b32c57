# SPDX-License-Identifier: Apache-2.0
"""No import cycles among the series' own modules (the overlay under vllm/).

The graph has one node per overlay module (each .py file under this
repository's vllm/) and an edge for every import of another overlay module
that can run: at module level and deferred ones inside functions alike (a
deferred import still makes the two modules depend on each other), but not
those under ``if TYPE_CHECKING:``. Imports of vLLM's own modules are not
edges: only the files in this repository are. Run as a script, it prints the
cycles it finds.
"""

import ast
from pathlib import Path

from hybridkv.base import REPO

OVERLAY = REPO / "vllm"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def overlay_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(OVERLAY.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST):
    """Every import node in ``node`` that can run (not under
    ``if TYPE_CHECKING:``)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
        return
    children = ast.iter_child_nodes(node)
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children = iter(node.orelse)
    for child in children:
        yield from _imports(child)


def _targets(module: str, is_package: bool, node: ast.stmt) -> list[str]:
    """Modules an import node names (a ``from P import N`` names ``P.N`` too,
    which is a module where N is a submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        package = module.split(".")
        package = package[: len(package) - node.level + (1 if is_package else 0)]
        base = ".".join([*package, base] if base else package)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph() -> dict[str, set[str]]:
    """Overlay module -> the overlay modules it imports."""
    modules = overlay_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in _imports(tree):
            for target in _targets(name, path.name == "__init__.py", node):
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _describe(cycle: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in sorted(cycle) for b in sorted(graph[a] & cycle)]
    return "; ".join(edges)


def test_the_graph_sees_the_overlay_and_its_imports():
    graph = import_graph()
    assert "vllm.v1.core.kv_cache_capacity" in graph
    # A deferred import (inside a function) is an edge.
    cli = graph["vllm.entrypoints.cli.kv_capacity"]
    assert "vllm.v1.core.kv_cache_capacity" in cli
    # A relative import and an ``if TYPE_CHECKING:`` one, on a made-up module.
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from vllm.v1.core import kv_cache_page_unify\n"
        "else:\n"
        "    from . import kv_cache_page_planner\n"
        "def f():\n"
        "    from .kv_cache_planning_errors import describe_layers\n"
    )
    named = [
        t
        for node in _imports(tree)
        for t in _targets("vllm.v1.core.x", False, node)
        if t in graph
    ]
    assert named == [
        "vllm.v1.core.kv_cache_page_planner",
        "vllm.v1.core.kv_cache_planning_errors",
    ]


def test_no_import_cycles_among_overlay_modules():
    graph = import_graph()
    found = [_describe(c, graph) for c in cycles(graph)]
    assert not found, "import cycles among the overlay modules: " + " | ".join(found)


def test_cycles_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]


if __name__ == "__main__":
    graph = import_graph()
    for cycle in cycles(graph):
        print(f"cycle: {_describe(cycle, graph)}")
