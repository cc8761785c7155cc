"""Registries fail loudly, and ``file.py:function`` / ``module:function`` names load user code."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from hybridflow.graph import Graph, load_graph
from hybridflow.registry import ALGORITHMS, Registry, RegistryError, load_object

USER_GRAPH = """
from hybridflow.graph import GraphBuilder

def tiny(*, n=1):
    g = GraphBuilder("tiny")
    actor, reward = g.role("actor", "policy"), g.role("reward", "reward_function")
    g.generate(actor, n=n)
    g.score(reward)
    g.update(actor, loss="ppo_policy", inputs=("responses", "scores"))
    return g.build()

BUILT = tiny(n=2)
NOT_A_GRAPH = 42
"""


def test_a_duplicate_name_raises_and_keeps_the_first():
    widgets: Registry[int] = Registry("widget")
    widgets.add("a", 1)
    with pytest.raises(RegistryError, match="widget 'a' is already registered"):
        widgets.add("a", 2)
    with pytest.raises(RegistryError):
        widgets.register("a")(3)
    assert widgets.get("a") == 1


def test_an_unknown_name_lists_the_valid_ones():
    widgets: Registry[int] = Registry("widget")
    for name, value in (("zeta", 1), ("alpha", 2)):
        assert widgets.register(name)(value) == value
    with pytest.raises(RegistryError) as info:
        widgets.get("beta")
    assert str(info.value) == "unknown widget 'beta'; valid names: ['alpha', 'zeta']"
    assert isinstance(info.value, KeyError)
    assert list(widgets) == ["alpha", "zeta"] and "alpha" in widgets and "beta" not in widgets


def test_builtin_algorithms_come_from_entry_points():
    assert {"ppo", "grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline"} <= set(ALGORITHMS.names())
    with pytest.raises(RegistryError, match=r"unknown algorithm 'nope'; valid names: \[.*'grpo'.*'ppo'"):
        load_graph("nope")


def test_module_path_names_load_objects():
    assert load_object("json:dumps") is json.dumps
    widgets: Registry[object] = Registry("widget")
    assert widgets.get("json:loads") is json.loads


def test_user_file_functions_and_graph_objects_load(tmp_path: Path):
    path = tmp_path / "algo.py"
    path.write_text(USER_GRAPH)
    graph = load_graph(f"{path}:tiny", n=3)
    assert isinstance(graph, Graph) and graph.samples_per_prompt == 3
    assert load_graph(f"{path}:BUILT").samples_per_prompt == 2
    with pytest.raises(TypeError, match="gave a int, not a Graph"):
        load_graph(f"{path}:NOT_A_GRAPH")


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("{dir}/missing.py:f", FileNotFoundError, "no file"),
        ("{dir}/algo.py:nope", AttributeError, r"has no attribute 'nope'; it defines \[.*'BUILT', .*'tiny'\]"),
        ("no_such_module_xyz:f", ModuleNotFoundError, "no_such_module_xyz"),
        ("{dir}/algo.py:", ValueError, "is not of the form"),
        (":f", ValueError, "is not of the form"),
    ],
)
def test_bad_import_paths_say_which_part_is_wrong(tmp_path: Path, spec, error, message):
    (tmp_path / "algo.py").write_text(USER_GRAPH)
    with pytest.raises(error, match=message):
        load_object(spec.format(dir=tmp_path))


def test_a_user_file_runs_once_however_many_names_it_serves(tmp_path: Path):
    runs = tmp_path / "runs.txt"
    path = tmp_path / "counted.py"
    path.write_text(f"open({str(runs)!r}, 'a').write('x')\nA = 1\nB = 2\n")
    assert (load_object(f"{path}:A"), load_object(f"{path}:B"), load_object(f"{path}:A")) == (1, 2, 1)
    assert runs.read_text() == "x"


def test_a_user_file_that_fails_is_not_cached_half_run(tmp_path: Path):
    path = tmp_path / "flaky.py"
    path.write_text("raise RuntimeError('not yet')\n")
    with pytest.raises(RuntimeError, match="not yet"):
        load_object(f"{path}:VALUE")
    path.write_text("VALUE = 7\n")
    assert load_object(f"{path}:VALUE") == 7


def test_a_plugin_that_fails_to_import_says_so_on_every_lookup(monkeypatch):
    def entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        return [importlib.metadata.EntryPoint("fine", "json", group),
                importlib.metadata.EntryPoint("broken", "no_such_plugin_xyz", group)]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    widgets: Registry[int] = Registry("widget", entry_point_group="test.widgets")
    for _ in range(2):  # not "unknown widget" the second time
        with pytest.raises(ImportError, match=r"widget plugin 'broken' \(no_such_plugin_xyz.*no_such_plugin_xyz"):
            widgets.get("anything")
