"""No import circles in any of the five packages: module A importing B (at module level or inside a
function, outside ``if TYPE_CHECKING:``) while B, directly or through others, imports A.

A package's ``__init__`` re-exporting its submodules is not counted as the submodules importing their
package (Python runs it first, but that is no dependency of theirs).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support import PACKAGES, REPO


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        source = REPO / "packages" / package / "src"
        for path in source.rglob("*.py"):
            parts = list(path.relative_to(source).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that ``import name`` loads (``name`` itself, or the package holding it)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(_owner(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                found.add(_owner(f"{node.module}.{alias.name}", modules))
    found.discard(None)
    return found


def _import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as a list of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_the_import_graph_has_no_circles():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    circles = _import_circles(graph)
    details = "; ".join(
        " <-> ".join(circle) + " (" + ", ".join(f"{a} imports {b}" for a in circle for b in sorted(graph[a] & set(circle)))
        + ")"
        for circle in circles
    )
    assert not circles, f"import circles: {details}"


@pytest.mark.parametrize(
    "graph",
    [{"a": {"b"}, "b": {"a"}}, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}],
)
def test_the_circle_finder_finds_circles(graph):
    assert _import_circles(graph) and all("d" not in circle for circle in _import_circles(graph))
