"""The shape of pipeline/: its layers (import-linter, configured in pyproject.toml), no import
cycle among its modules, and no import of its own modules hidden inside a function (where it would
hide a cycle or a layer violation until the function runs)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipeline"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module under pipeline/ (a package is its __init__.py)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imported(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """The modules an import statement in ``module`` names (absolute; ``from x import y`` names
    ``x.y`` when that is a module, else ``x``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: ruff bans them (TID252), but resolve them anyway
        package = module.split(".")
        if MODULES.get(module, Path()).name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _own(name: str) -> bool:
    return name == "pipeline" or name.startswith("pipeline.")


# --- no in-function imports of the project's own modules ------------------------------------------


def _imports_in_functions(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    def visit(node: ast.AST, in_function: bool) -> Iterator[ast.Import | ast.ImportFrom]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                yield child
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from visit(child, inner)

    yield from visit(tree, False)


def test_no_function_imports_the_projects_own_modules():
    """Third-party imports inside functions are fine (heavy or optional SDKs load when used); the
    project's own modules are imported at the top, where import-linter and the cycle check see them."""
    found = []
    for module, path in MODULES.items():
        for node in _imports_in_functions(_parse(path)):
            names = [n for n in _imported(node, module) if _own(n)]
            if names or (isinstance(node, ast.ImportFrom) and node.level):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "import the project's modules at module level, not inside a function:\n" + "\n".join(found)


def test_the_in_function_check_sees_methods_nested_functions_and_relative_imports():
    tree = ast.parse(
        "import os\n"
        "def f():\n    import numpy\n    from pipeline.core import io\n"
        "class C:\n    def m(self):\n        def inner():\n            import pipeline.host.probe\n"
        "    async def a(self):\n        from . import env\n"
    )
    names = [ast.unparse(node) for node in _imports_in_functions(tree)]
    assert names == ["import numpy", "from pipeline.core import io", "import pipeline.host.probe", "from . import env"]


# --- the layers ----------------------------------------------------------------------------------


def _lint_imports() -> str | None:
    beside = Path(sys.executable).with_name("lint-imports")
    return str(beside) if beside.exists() else shutil.which("lint-imports")


def test_import_linter_contracts_are_kept():
    command = _lint_imports()
    if command is None:
        pytest.skip("lint-imports is not installed: pip install -e '.[test]' (import-linter)")
    done = subprocess.run([command, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"lint-imports exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


# --- no import cycle ------------------------------------------------------------------------------


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: at module level, in its ``if``/``try``/``with``
    blocks and class bodies; not in functions, and not under ``if TYPE_CHECKING:`` (annotations)."""

    def visit(statements: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    yield from visit(node.body)
                yield from visit(node.orelse)
            elif isinstance(node, ast.Try) or (sys.version_info >= (3, 11) and isinstance(node, ast.TryStar)):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    yield from visit(block)
            elif isinstance(node, (ast.With, ast.ClassDef, ast.For, ast.While)):
                yield from visit(node.body)

    yield from visit(tree.body)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports when it is imported."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        edges = set()
        for node in _top_level_imports(_parse(path)):
            for name in _imported(node, module):
                while name and name not in MODULES and "." in name:  # `import pipeline.x.attr`: the module
                    name = name.rsplit(".", 1)[0]
                if name in MODULES and name != module:
                    edges.add(name)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path: list[str] = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_import_cycle_among_the_projects_modules():
    graph = import_graph()
    assert sum(len(e) for e in graph.values()) > len(graph) / 2, "the import graph is nearly empty: the scan is broken"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_reports_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_type_checking_imports_are_not_dependencies():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nimport typing\n"
        "if TYPE_CHECKING:\n    import pipeline.a\nelse:\n    import pipeline.b\n"
        "if typing.TYPE_CHECKING:\n    import pipeline.c\n"
        "try:\n    import pipeline.d\nexcept ImportError:\n    import pipeline.e\n"
        "def f():\n    import pipeline.f\n"
    )
    names = [alias.name for node in _top_level_imports(tree) for alias in node.names]
    assert names == ["TYPE_CHECKING", "typing", "pipeline.b", "pipeline.d", "pipeline.e"]
