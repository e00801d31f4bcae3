"""The package's own import graph: no cycles, no borrowed private names,
and the sides of the package importing downward only.

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


def imports_of(module: str, tree: Optional[ast.AST] = None) -> Iterator[tuple[str, ast.AST, Optional[str]]]:
    """Each package module that ``module`` imports, with the node, and
    the name imported from it (None for the module itself).  ``tree``
    stands for the module's own, in the checks' own tests.
    """
    for node in ast.walk(TREES[module] if tree is None else tree):
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
    assert "dramatiq_unique.backends.base" in edges["dramatiq_unique.middleware"]  # top level
    assert "dramatiq_unique.settings" in edges["dramatiq_unique.ops.cli"]  # inside a function
    assert "dramatiq_unique.middleware" in edges["dramatiq_unique"]  # under TYPE_CHECKING


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_no_module_uses_another_modules_private_name() -> None:
    assert borrowed_private_names() == []


#: The sides of the package, bottom first: a side imports only the sides
#: below it (and the shared base at the top of the package).
SIDES = ("model", "backends", "send", "worker", "ops")

#: Top-level packages that belong to a side but keep their public path.
_SIDE_OF = {"dashboard": "ops"}

#: The shared base at the top of the package: below every side, so it
#: imports none of them.
BASE = {"errors", "settings", "events", "compat", "background"}

#: The front: the hooks, the package's face and the test helpers, which
#: put the sides together (and ``ops`` front-ends use the middleware).
FRONT = {"", "__main__", "middleware", "testing"}


def _part(module: str) -> str:
    """The side, base module or front that ``module`` belongs to."""
    head = module[len(PACKAGE) + 1 :].split(".")[0] if module != PACKAGE else ""
    return _SIDE_OF.get(head, head)


def layering_violations(edges: dict[str, set[str]]) -> list[str]:
    """Each import that points up or sideways between the sides, or
    from the shared base into a side or the front.
    """
    found = []
    for module, targets in sorted(edges.items()):
        part = _part(module)
        for target in sorted(targets):
            there = _part(target)
            if part in BASE and there not in BASE:
                found.append(f"{module} (base) imports {target}")
            elif part in SIDES and there in SIDES and SIDES.index(there) > SIDES.index(part):
                found.append(f"{module} ({part}) imports {target} ({there})")
            elif part in SIDES and there in FRONT and part != "ops":
                found.append(f"{module} ({part}) imports the front's {target}")
    return found


def test_every_module_has_a_place() -> None:
    assert {_part(module) for module in MODULES} == {*SIDES, *BASE, *FRONT}


def test_the_top_of_the_package_holds_at_most_twelve_modules() -> None:
    top = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(top) <= 12, top


def test_dependencies_point_downward_between_the_sides() -> None:
    assert layering_violations(graph()) == []


def test_the_layering_check_finds_an_upward_import() -> None:
    edges = {
        f"{PACKAGE}.backends.stub": {f"{PACKAGE}.send.guard"},
        f"{PACKAGE}.model.spec": {f"{PACKAGE}.errors", f"{PACKAGE}.backends.base"},
        f"{PACKAGE}.errors": {f"{PACKAGE}.model.spec"},
        f"{PACKAGE}.send.guard": {f"{PACKAGE}.middleware"},
        f"{PACKAGE}.ops.admin": {f"{PACKAGE}.worker.delivery", f"{PACKAGE}.middleware"},
        f"{PACKAGE}.worker.take": {f"{PACKAGE}.send.context", f"{PACKAGE}.background"},
    }
    assert layering_violations(edges) == [
        f"{PACKAGE}.backends.stub (backends) imports {PACKAGE}.send.guard (send)",
        f"{PACKAGE}.errors (base) imports {PACKAGE}.model.spec",
        f"{PACKAGE}.model.spec (model) imports {PACKAGE}.backends.base (backends)",
        f"{PACKAGE}.send.guard (send) imports the front's {PACKAGE}.middleware",
    ]


#: Where the private names of Dramatiq and redis-py may be used.
_COMPAT = f"{PACKAGE}.compat"


def _own_attributes() -> set[str]:
    """Private attributes the package sets on its own objects (``self._x = ...``)."""
    own = set()
    for tree in TREES.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in _OWN:
                    own.add(node.attr)
    return own


def borrowed_library_names(skip: Optional[str] = _COMPAT) -> list[str]:
    """Each place outside ``compat.py`` that imports a private name or
    module of another library, or reads a private attribute that no
    code of the package defines or sets.  The package's own marks on
    other objects are spelt ``_unique_*``.
    """
    ours = set(private_definitions()) | _own_attributes() | _NAMEDTUPLE_API
    found = []
    for module, tree in TREES.items():
        if module == skip:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith(PACKAGE):
                path = (node.module or "").split(".")
                names = [alias.name for alias in node.names]
                if any(_private(part) for part in path) or any(_private(name) for name in names):
                    found.append(f"{module}:{node.lineno} imports {', '.join(names)} from {node.module}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append(f"{module}:{node.lineno} imports {alias.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in _OWN:
                    continue
                if node.attr not in ours and not node.attr.startswith("_unique_"):
                    found.append(f"{module}:{node.lineno} uses {node.attr}")
    return found


def test_no_private_name_of_dramatiq_or_redis_outside_compat() -> None:
    assert borrowed_library_names() == []
    # The check reads what compat.py borrows, when compat.py is not spared.
    assert any("_ConsumerThread" in line for line in borrowed_library_names(skip=None))


def test_every_import_of_the_package_names_one_of_its_modules() -> None:
    # An import of a module that moved away would otherwise be found by
    # whatever else is installed (an editable install of another tree).
    missing = []
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(PACKAGE)):
                if _base(module, node) not in MODULES:
                    missing.append(f"{module}:{node.lineno} imports {_base(module, node)}")
            elif isinstance(node, ast.Import):
                missing += [f"{module}:{node.lineno} imports {alias.name}" for alias in node.names
                            if alias.name.startswith(f"{PACKAGE}.") and alias.name not in MODULES]
    assert missing == []


# The backend seam -------------------------------------------------------

#: The package of the lock backends, and the modules of it that the
#: rest of the package may import besides the package itself: the
#: interface (the core, the capabilities and the records).  The package's ``__init__`` re-exports what is public
#: (``StubBackend``, ``from_url``, ``for_broker``).
_BACKENDS = f"{PACKAGE}.backends"
_INTERFACE = {f"{_BACKENDS}.{name}" for name in ("base", "capabilities", "records")}


def _outside_backends(module: str) -> bool:
    return module != _BACKENDS and not module.startswith(f"{_BACKENDS}.")


def _concrete(target: str) -> bool:
    """Whether ``target`` is a module of a concrete backend: anything in
    ``backends/`` but the package itself and the interface.
    """
    return target.startswith(f"{_BACKENDS}.") and target not in _INTERFACE


def concrete_backend_imports(trees: Optional[dict[str, ast.AST]] = None) -> list[str]:
    """Each place outside ``backends/`` that imports a concrete backend
    module (``backends.stub``, ``backends.redis*``, ``backends.postgres*``),
    at the top, under ``TYPE_CHECKING`` or in a function, or names one to
    ``importlib`` as a string.
    """
    trees = TREES if trees is None else trees
    found = []
    for module in sorted(trees):
        if not _outside_backends(module):
            continue
        for target, node, _ in imports_of(module, trees[module]):
            if _concrete(target):
                found.append(f"{module}:{node.lineno} imports {target}")
        for node in ast.walk(trees[module]):
            if isinstance(node, ast.Call):
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _concrete(arg.value):
                        found.append(f"{module}:{node.lineno} imports {arg.value} by name")
    return found


def _backend_class_names() -> set[str]:
    """The classes that ``backends/`` defines, and any name of a backend
    class yet to come (``...Backend``).
    """
    return {
        node.name
        for module, tree in TREES.items()
        if not _outside_backends(module)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }


def class_name_comparisons(trees: Optional[dict[str, ast.AST]] = None) -> list[str]:
    """Each comparison, anywhere in the package, with the name of a
    backend class: ``type(backend).__name__ == "RedisBackend"``, or ``in``
    a tuple of such names.  A backend is told by the capabilities it
    inherits (``isinstance``), never by its class's name.
    """
    names = _backend_class_names()
    found = []
    for module, tree in sorted((TREES if trees is None else trees).items()):
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            for part in ast.walk(node):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    if part.value in names or part.value.endswith("Backend"):
                        found.append(f"{module}:{node.lineno} compares with {part.value!r}")
    return found


def _capability_members() -> set[str]:
    """What the capabilities add to the core: the names a duck-typing
    probe would look for.
    """
    from dramatiq_unique.backends.base import LockBackend
    from dramatiq_unique.backends.capabilities import CAPABILITIES

    core = set(dir(LockBackend))
    return {name for kind in CAPABILITIES for name in vars(kind) if not name.startswith("_") and name not in core}


def capability_probes(trees: Optional[dict[str, ast.AST]] = None) -> list[str]:
    """Each ``hasattr``/``getattr`` that looks for a capability's member
    by its name, instead of ``isinstance`` against the capability.
    """
    members = _capability_members() - {"capability"}
    found = []
    for module, tree in sorted((TREES if trees is None else trees).items()):
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
                continue
            name = node.args[1]
            if node.func.id in ("hasattr", "getattr") and isinstance(name, ast.Constant):
                if name.value in members:
                    found.append(f"{module}:{node.lineno} probes {name.value!r} with {node.func.id}")
    return found


def test_no_module_outside_backends_imports_a_concrete_backend() -> None:
    assert concrete_backend_imports() == []


def test_no_code_tells_a_backend_by_its_class_name_or_probes_for_a_capability() -> None:
    assert class_name_comparisons() == []
    assert capability_probes() == []


def test_the_seam_checks_find_what_they_forbid() -> None:
    source = """
from .backends.redis.client import RedisBackend
from .backends import StubBackend, from_url
from .backends.base import LockBackend
import importlib
importlib.import_module("dramatiq_unique.backends.postgres")
if type(backend).__name__ == "RedisBackend" or type(b).__name__ in ("PostgresBackend",):
    pass
if getattr(backend, "batches_releases", False) and hasattr(backend, "native_extender"):
    pass
"""
    tree = ast.parse(source)
    trees = {f"{PACKAGE}.middleware": tree}
    assert concrete_backend_imports(trees) == [
        f"{PACKAGE}.middleware:2 imports {PACKAGE}.backends.redis.client",
        f"{PACKAGE}.middleware:6 imports {PACKAGE}.backends.postgres by name",
    ]
    assert class_name_comparisons(trees) == [
        f"{PACKAGE}.middleware:7 compares with 'RedisBackend'",
        f"{PACKAGE}.middleware:7 compares with 'PostgresBackend'",
    ]
    assert capability_probes(trees) == [
        f"{PACKAGE}.middleware:9 probes 'batches_releases' with getattr",
        f"{PACKAGE}.middleware:9 probes 'native_extender' with hasattr",
    ]


# The middleware keeps Dramatiq's hooks and its set-up ----------------------------

#: What UniqueMiddleware offers besides Dramatiq's hooks: its set-up and
#: the attributes the docs name (docs/api.md).
MIDDLEWARE_SET_UP = {
    "__init__", "actor_options", "attach", "backend", "enabled", "record_lock_args", "flush_confirmations", "key",
}


def test_the_middleware_keeps_only_dramatiqs_hooks_and_its_set_up() -> None:
    import dramatiq

    from dramatiq_unique import UniqueMiddleware

    hooks = {name for name in vars(dramatiq.Middleware) if not name.startswith("_")}
    own = {name for name in vars(UniqueMiddleware) if not name.startswith("_") or name == "__init__"}
    assert own - hooks - MIDDLEWARE_SET_UP == set(), "a method that belongs to the object that owns its work"
    assert not (set(vars(UniqueMiddleware)) & {"emit", "backend_error", "leases", "releaser", "release_retries"})
