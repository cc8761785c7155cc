"""Imports flow one way: the graph DSL, the registry, the planner and the built-in graphs load neither
torch nor ray, so listing, rendering and planning algorithms starts fast (checked in a fresh interpreter);
and the core reaches algorithms and backends only through entry points."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HEAVY = ("torch", "ray")
CORE = Path(__file__).resolve().parents[2] / "hybridflow"


def heavy_modules_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    # Run outside the checkout: from its root, ``-c`` would put the source folder ``hybridflow/`` (which
    # lacks the ``algorithms`` and ``backends`` subpackages that the install maps in) ahead of the install.
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_graph_registry_and_builtin_graphs_import_without_torch_or_ray():
    assert heavy_modules_after("import hybridflow.graph, hybridflow.registry, hybridflow.algorithms.graphs") == []


def test_loading_and_rendering_every_builtin_stays_light():
    code = (
        "from hybridflow.graph import load_graph, render, FORMATS, Workload, edge_bytes\n"
        "from hybridflow.registry import ALGORITHMS\n"
        "for name in ALGORITHMS.names():\n"
        "    graph = load_graph(name)\n"
        "    edge_bytes(graph, Workload(batch_size=2, prompt_len=4, response_len=4))\n"
        "    for fmt in FORMATS: render(graph, fmt)\n"
    )
    assert heavy_modules_after(code) == []


def test_the_graph_command_stays_light():
    code = "import contextlib, io\nfrom hybridflow.cli import main\n" \
           "with contextlib.redirect_stdout(io.StringIO()): assert main(['graph', 'ppo', '--format', 'json']) == 0"
    assert heavy_modules_after(code) == []


def test_the_probe_does_see_torch_when_it_is_imported():
    assert heavy_modules_after("import hybridflow.algorithms.functions") == ["torch"]


def test_the_planner_imports_without_torch_or_ray():
    assert heavy_modules_after("import hybridflow.planner") == []


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


def test_the_core_never_imports_algorithms_or_backends_by_name():
    """The core reaches built-ins only through entry points, so third-party plugins are peers of them."""
    for path in sorted(CORE.rglob("*.py")):
        plugins = {m for m in imported_modules(path) if m.startswith(("hybridflow.algorithms", "hybridflow.backends"))}
        assert not plugins, f"{path.relative_to(CORE.parent)} imports {sorted(plugins)}"


def test_graph_and_planner_never_import_torch_or_ray_even_lazily():
    for package in ("graph", "planner"):
        for path in sorted((CORE / package).rglob("*.py")):
            heavy = {m for m in imported_modules(path) if m.split(".")[0] in HEAVY}
            assert not heavy, f"{path.relative_to(CORE.parent)} imports {sorted(heavy)}"


def test_agents_import_without_torch_or_ray_and_use_only_the_registry_graph_and_planner():
    """Environments and tools are plain Python: they run on workers and on the driver (prompt tool schemas)."""
    code = ("import hybridflow.agents.builtins, hybridflow.agents.loop, hybridflow.agents.server, "
            "hybridflow.agents.metrics\nfrom hybridflow.registry import ENVIRONMENTS\nENVIRONMENTS.get('calculator')()")
    assert heavy_modules_after(code) == []
    for path in sorted((CORE / "agents").rglob("*.py")):
        core = {m.split(".")[1] for m in imported_modules(path) if m.startswith("hybridflow.") and m.count(".")}
        where = path.relative_to(CORE.parent)
        assert core <= {"agents", "registry", "graph", "planner"}, f"{where} imports hybridflow.{sorted(core)}"
