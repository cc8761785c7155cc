"""The import map is clean: no import circle between modules, and the layers of docs/architecture.md hold.

Every module of ``hybridflow/``, ``backends/`` (``hybridflow.backends``) and ``algorithms/``
(``hybridflow.algorithms``) is parsed, never imported. Module-level and function-level imports both count
(a lazy import only hides a circle until the function runs); imports under ``if TYPE_CHECKING:`` do not
(they never run). Importing ``pkg.mod`` from outside ``pkg`` runs ``pkg/__init__.py`` first, so it is an
edge to ``pkg`` as well as to ``pkg.mod``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"hybridflow": ROOT / "hybridflow", "hybridflow.backends": ROOT / "backends",
           "hybridflow.algorithms": ROOT / "algorithms"}


@cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, a package named by its ``__init__.py``."""
    found = {}
    for prefix, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((prefix, *parts))] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _run_time_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level or in a function, not under TYPE_CHECKING."""
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.orelse:
            yield from _run_time_imports(child)
        return
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    for child in ast.iter_child_nodes(node):
        yield from _run_time_imports(child)


def _owner(name: str) -> str:
    """The longest prefix of ``name`` that is one of our modules, else ``name``'s top-level package."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules():
            return ".".join(parts[:end])
    return parts[0]


def _targets(module: str, statement: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(statement, ast.Import):
        return {_owner(alias.name) for alias in statement.names}
    base = statement.module or ""
    if statement.level:
        package = module if modules()[module].name == "__init__.py" else module.rpartition(".")[0]
        anchor = package.rsplit(".", statement.level - 1)[0] if statement.level > 1 else package
        base = f"{anchor}.{base}" if base else anchor
    # ``from pkg import mod`` imports the submodule; ``from pkg import name`` only runs pkg.
    return {_owner(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules() else _owner(base)
            for alias in statement.names}


def _entered_packages(importer: str, target: str) -> set[str]:
    """The packages whose ``__init__`` runs on the way to ``target`` and do not contain the importer."""
    parts = target.split(".")
    ancestors = {".".join(parts[:end]) for end in range(1, len(parts))}
    return {a for a in ancestors if a in modules() and not (importer == a or importer.startswith(a + "."))}


@cache
def imports_of(module: str) -> frozenset[str]:
    """What ``module`` imports when it runs: our modules by dotted name, others by top-level package."""
    tree = ast.parse(modules()[module].read_text(), filename=str(modules()[module]))
    found: set[str] = set()
    for statement in _run_time_imports(tree):
        for target in _targets(module, statement):
            found |= {target, *_entered_packages(module, target)}
    found.discard(module)
    return frozenset(found)


@cache
def import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(modules())
    graph.add_edges_from((module, target) for module in modules() for target in imports_of(module)
                         if target in modules())
    return graph


def test_the_scan_sees_every_kind_of_import() -> None:
    """The scan is not vacuous: it finds lazy imports and the package ``__init__`` an import passes through."""
    assert len(modules()) > 150 and import_graph().number_of_edges() > 300
    assert "torch" in imports_of("hybridflow.algorithms.functions")
    assert "ray" in imports_of("hybridflow.runtime.worker")  # only inside a function
    # ``from hybridflow.planner.metrics_file import ...`` runs hybridflow/planner/__init__.py first.
    assert {"hybridflow.planner.metrics_file", "hybridflow.planner"} <= imports_of("hybridflow.monitor.report")


def test_relative_imports_resolve_against_the_importing_package() -> None:
    def targets(module: str, source: str) -> set[str]:
        statement = ast.parse(source).body[0]
        assert isinstance(statement, ast.ImportFrom)
        return _targets(module, statement)

    assert targets("hybridflow.planner.search", "from .models import ModelSpec") == {"hybridflow.planner.models"}
    assert targets("hybridflow.planner.search", "from . import models") == {"hybridflow.planner.models"}
    assert targets("hybridflow.planner", "from .plan import Plan") == {"hybridflow.planner.plan"}
    assert targets("hybridflow.planner.search", "from .. import registry") == {"hybridflow.registry"}
    assert targets("hybridflow.planner.search", "from ..graph import Graph") == {"hybridflow.graph"}


def test_type_checking_imports_are_left_out_and_the_rest_kept() -> None:
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
              "def f():\n    import c\n")
    names = {alias.name for statement in _run_time_imports(ast.parse(source)) for alias in statement.names}
    assert names == {"TYPE_CHECKING", "b", "c"}




def import_circles() -> dict[frozenset[str], str]:
    """Each set of modules that import one another in a circle, with one such circle spelled out."""
    graph = import_graph()
    circles = {}
    for component in map(frozenset, nx.strongly_connected_components(graph)):
        if len(component) > 1:
            cycle = [edge[0] for edge in nx.find_cycle(graph.subgraph(component))]
            circles[component] = " -> ".join([*cycle, cycle[0]]) + f"  (all of: {', '.join(sorted(component))})"
    return circles


def test_no_import_circle() -> None:
    circles = import_circles()
    assert not circles, "import circles:\n" + "\n".join(sorted(circles.values()))


def _layer(module: str) -> str:
    """``hybridflow.planner.models`` -> ``planner``; ``hybridflow.registry`` -> ``registry``; the package itself
    -> ``hybridflow``."""
    return module.split(".")[1] if module.count(".") else module


# The leaf modules beside the layers: anyone may import them, they import no other part of hybridflow.
LEAVES = {"registry", "files", "fields", "logits", "loss_norm", "models", "_version", "_source_tree"}
# What each layer may import of hybridflow besides itself and the leaves, as docs/architecture.md states it.
MAY_IMPORT: dict[str, set[str]] = {
    **{leaf: set() for leaf in LEAVES},
    "graph": set(),
    "planner": {"graph"},
    "agents": {"graph", "planner"},
    "runtime": {"graph", "planner", "agents"},
    "backends": {"graph", "planner", "agents", "runtime"},
    "algorithms": {"graph"},
    "data": {"runtime"},
    "monitor": {"planner"},
    "testing": {"graph", "planner"},
    "train": {"graph", "planner", "agents", "runtime", "data", "monitor"},
    "classic": {"graph", "planner", "train"},
    "cli": {"hybridflow", "graph", "planner", "agents", "runtime", "data", "monitor", "train", "classic"},
    "hybridflow": {"classic", "train"},  # the package's lazy ``__getattr__``
}
# The layers that never import torch or ray, even lazily: a planner dry run starts in well under a second,
# and environments and tools run alike on workers and on the driver.
LIGHT = {"graph", "planner", "agents", "registry", "files"}


def test_every_layer_is_on_the_map() -> None:
    layers = {_layer(module) for module in modules()}
    assert layers == set(MAY_IMPORT), f"place these in MAY_IMPORT and docs/architecture.md: {layers ^ set(MAY_IMPORT)}"


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_a_layer_imports_only_what_the_architecture_allows(layer: str) -> None:
    allowed = {layer} | MAY_IMPORT[layer] | (set() if layer in LEAVES else LEAVES)
    wrong = sorted(f"{module} imports {target}" for module in modules() if _layer(module) == layer
                   for target in imports_of(module)
                   if target.startswith("hybridflow") and _layer(target) not in allowed)
    assert not wrong, f"{layer} may import {sorted(allowed - {layer})} of hybridflow:\n" + "\n".join(wrong)


@pytest.mark.parametrize("layer", sorted(LIGHT))
def test_light_layers_never_import_torch_or_ray(layer: str) -> None:
    """Not even through a module they import, lazily or not."""
    graph = import_graph()
    heavy = set()
    for module in (m for m in modules() if _layer(m) == layer):
        for reached in {module} | nx.descendants(graph, module):
            for target in imports_of(reached) & {"torch", "ray"}:
                path = nx.shortest_path(graph, module, reached)
                heavy.add(" -> ".join([*path, target]))
    assert not heavy, "\n".join(sorted(heavy))


def test_the_core_never_imports_backends_or_algorithms() -> None:
    """Built-ins are found through entry points, like a third party's plugins."""
    plugins = {"backends", "algorithms"}
    assert not plugins & set().union(*(MAY_IMPORT[layer] for layer in MAY_IMPORT if layer not in plugins))
    wrong = sorted(f"{module} imports {target}" for module in modules() if _layer(module) not in plugins
                   for target in imports_of(module) if target.startswith("hybridflow.") and _layer(target) in plugins)
    assert not wrong, "\n".join(wrong)
