"""No import circles among rollingkv_cli's modules.

A circle works only by the accident of which import runs first (a function-level import defers it, and the
next refactor moves it), so every import counts here: module level, inside functions, and under `if TYPE_CHECKING:`
(a type checker follows those, and they are a circle in the design all the same). A module importing its own
packages' __init__ is not an edge: Python runs a package before its modules, whoever asks.

Seen failing at 2b4e950 (main): gguf_header -> lib.builder -> lib.patchset -> models -> gguf_header and
hw.pcie -> hw.profile -> hw.pcie, before this branch broke them.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "rollingkv_cli"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in its body (functions included)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def resolve(module: str | None, level: int) -> str:
        if not level:
            return module or ""
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}

    def add(target: str) -> None:
        # Importing a.b.c runs a and a.b first: their __init__ modules are edges too (except our own packages).
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            candidate = ".".join(parts[:i])
            if candidate in known and candidate != name and candidate not in own_packages:
                found.add(candidate)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name)
            elif isinstance(child, ast.ImportFrom):
                base = resolve(child.module, child.level)
                add(base)
                for alias in child.names:
                    add(f"{base}.{alias.name}")
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def import_graph() -> dict[str, set[str]]:
    names = module_names()
    known = set(names)
    return {name: imported_modules(name, path, known) for name, path in names.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a path through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return [_one_circle(graph, set(c)) for c in components]


def _one_circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    # Breadth-first from start back to start inside the component: the shortest circle through it.
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_no_import_circles():
    circles = find_cycles(import_graph())
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_detector_finds_imports_and_circles():
    """The checker itself finds imports at module level, inside functions and under TYPE_CHECKING, and a circle in a
    graph (so that a broken parser cannot pass the test above by finding no imports at all)."""
    graph = import_graph()
    assert "rollingkv_cli.lib.paths" in graph["rollingkv_cli.lib.builder"]  # module level
    assert "rollingkv_cli.lib.procs" in graph["rollingkv_cli.lib.builder"]  # inside a function
    assert "rollingkv_cli.hw.hostinfo" in graph["rollingkv_cli.hw.profile"]  # inside a function
    fake = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(fake) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_type_checking_and_function_imports_count(tmp_path):
    """A TYPE_CHECKING import and one inside a function are edges (hw.profile's import of hw.pcie was the former)."""
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rollingkv_cli.hw.pcie import GpuInfo\n"
                      "def f():\n    from rollingkv_cli.lib import paths\n")
    known = {"rollingkv_cli.hw.pcie", "rollingkv_cli.lib", "rollingkv_cli.lib.paths", "rollingkv_cli.hw"}
    assert imported_modules("rollingkv_cli.x", module, known) == known
