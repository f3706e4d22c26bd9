"""The package order is a rule: a module imports only from packages below its own, and no two modules
import each other, directly or round a longer circle (type-only and lazy imports count too: they tie
the packages together for every reader and tool as much as a top-level import does).

The order, lowest first (docs/architecture.md describes each package):

    ground: errors, ids, layers, config, fsutil, httputil, cores, sampling, models (the families)
    < session, routes, artifacts
    < protocol, backends
    < security
    < node, tracker
    < gateway
    < cli
"""

from __future__ import annotations

from tests.unit.test_import_boundaries import PACKAGE, SRC, Import, _all_imports

LEVELS: tuple[tuple[str, ...], ...] = (
    ("errors", "ids", "layers", "config", "fsutil", "memory", "httputil", "cores", "sampling", "models"),
    ("session", "routes", "artifacts"),
    ("protocol", "backends"),
    ("security",),
    ("node", "tracker"),
    ("gateway",),
    ("cli",),
)
LEVEL = {name: i for i, names in enumerate(LEVELS) for name in names}


def _modules() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found.add(".".join(parts))
    return found


def _package(module: str) -> str:
    """The top-level part of ``meshnet.X...`` (``meshnet`` itself for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "meshnet"


def _edges() -> dict[str, set[str]]:
    """Module -> the meshnet modules it imports. ``from pkg import sub`` counts as importing ``pkg.sub``
    only; a module importing its own package's ``__init__`` (to reach a sibling) is not an edge."""
    modules = _modules()
    edges: dict[str, set[str]] = {}
    imports: list[Import] = _all_imports()
    for imp in imports:
        target = imp.target
        if not target.startswith("meshnet") or target == imp.module:
            continue
        if target not in modules:
            continue  # "from pkg import name": the name is no module; the edge to pkg was recorded too
        if imp.module.startswith(target + ".") and target != "meshnet":
            # a submodule reaching a sibling through its package (``from meshnet.gateway import dashboard``)
            continue
        edges.setdefault(imp.module, set()).add(target)
    return edges


def test_the_levels_name_every_package() -> None:
    packages = {_package(m) for m in _modules()} - {"meshnet"}
    assert packages == set(LEVEL), "add the new package to LEVELS (and the order in docs/architecture.md)"


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a package at its own level or above (ground modules may import
    each other: the circle check keeps them apart)."""

    def level(module: str) -> int:
        return LEVEL[_package(module)]

    return [
        f"{source} imports {target}"
        for source, targets in sorted(edges.items())
        for target in sorted(targets)
        if "meshnet" not in (_package(source), _package(target))
        and _package(source) != _package(target)
        and level(target) >= level(source)
        and not level(source) == level(target) == 0
    ]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_from_a_package_above_its_own() -> None:
    assert upward_imports(_edges()) == []


def test_no_circles_between_modules() -> None:
    assert circles(_edges()) == []


def test_the_checks_see_an_upward_import_and_a_circle() -> None:
    edges = {
        "meshnet.sampling": {"meshnet.backends.grammar"},  # ground importing a backend: upward
        "meshnet.backends.grammar": {"meshnet.sampling"},  # and back: a circle
        "meshnet.node.service": {"meshnet.protocol.messages", "meshnet.errors"},  # downward: fine
        "meshnet.cli.a": {"meshnet.cli.b"},
        "meshnet.cli.b": {"meshnet.cli.c"},
        "meshnet.cli.c": {"meshnet.cli.a"},  # a circle inside one package
        "meshnet.errors": {"meshnet.ids"},  # ground modules among themselves
    }
    assert upward_imports(edges) == ["meshnet.sampling imports meshnet.backends.grammar"]
    assert circles(edges) == [
        ["meshnet.backends.grammar", "meshnet.sampling"],
        ["meshnet.cli.a", "meshnet.cli.b", "meshnet.cli.c"],
    ]
