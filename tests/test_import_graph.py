"""The package's own import graph: no cycles, no borrowed private names.

Every import counts: at the top of a module, under ``TYPE_CHECKING``, and
inside a function.  A cycle that only a deferred import keeps from
failing at import time is still two modules that each need the other,
which is what this test is about.  Importing ``a.b.c`` is counted as an
edge to ``a.b.c`` alone, not to the packages above it (which Python also
runs, but which are lazy importers here).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

import dramatiq_unique

PACKAGE = "dramatiq_unique"
ROOT = Path(dramatiq_unique.__file__).parent

#: Receivers whose private attributes are a module's own.
_OWN = {"self", "cls"}

#: The public API of a named tuple, spelt with an underscore.
_NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


def _base(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` reads from."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    anchor = package[: len(package) - node.level + 1]
    return ".".join(anchor + ([node.module] if node.module else []))


def imports_of(module: str) -> Iterator[tuple[str, ast.AST, Optional[str]]]:
    """Each package module that ``module`` imports, with the node, and
    the name imported from it (None for the module itself).
    """
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name, node, None
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in MODULES:
                    yield submodule, node, None
                elif base in MODULES:
                    yield base, node, alias.name


def graph() -> dict[str, set[str]]:
    """module -> the package modules it imports."""
    return {module: {target for target, _, _ in imports_of(module) if target != module} for module in MODULES}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module
    (Tarjan), each sorted: every import cycle lies inside one.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges[node]:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_definitions() -> dict[str, set[str]]:
    """private name -> the modules that define a function, method or
    class of that name.  Private attributes (``self._sock``) are left
    out: the same name on another library's object (redis-py's
    connection) is no name of ours.
    """
    defined: dict[str, set[str]] = {}
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                if node.name not in _NAMEDTUPLE_API:
                    defined.setdefault(node.name, set()).add(module)
    return defined


def borrowed_private_names() -> list[str]:
    """Each place where a module imports, or reads off another object,
    a private name that only other modules of the package define.
    """
    defined = private_definitions()
    found = []
    for module, tree in TREES.items():
        for target, node, name in imports_of(module):
            if name is not None and _private(name) and target != module:
                found.append(f"{module}:{node.lineno} imports {name} from {target}")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            if node.attr in _NAMEDTUPLE_API or (isinstance(node.value, ast.Name) and node.value.id in _OWN):
                continue
            owners = defined.get(node.attr, set())
            if owners and module not in owners:
                found.append(f"{module}:{node.lineno} uses {node.attr} of {', '.join(sorted(owners))}")
    return found


def test_the_graph_sees_every_kind_of_import() -> None:
    # A check that finds nothing because it reads nothing would pass.
    edges = graph()
    assert len(MODULES) > 30
    assert "dramatiq_unique.backend" in edges["dramatiq_unique.middleware"]  # top level
    assert "dramatiq_unique.backends.redis" in edges["dramatiq_unique.middleware"]  # inside a function
    assert "dramatiq_unique.middleware" in edges["dramatiq_unique"]  # under TYPE_CHECKING


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_no_module_uses_another_modules_private_name() -> None:
    assert borrowed_private_names() == []
