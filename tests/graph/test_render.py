"""Text, mermaid, DOT and JSON views show every node and edge of the graph they render."""

from __future__ import annotations

import json
import re

import pytest

from hybridflow.graph import FORMATS, Graph, from_dict, load_graph, render, to_dict
from hybridflow.registry import ALGORITHMS

BUILTINS = ["ppo", "grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline"]


@pytest.fixture(params=BUILTINS)
def graph(request: pytest.FixtureRequest) -> Graph:
    return load_graph(request.param)


def test_every_builtin_is_registered():
    assert set(BUILTINS) <= set(ALGORITHMS.names())


def test_json_lists_nodes_with_ports_and_edges_with_fields(graph):
    data = json.loads(render(graph, "json"))
    assert [n["name"] for n in data["nodes"]] == [n.name for n in graph.nodes]
    for entry, node in zip(data["nodes"], graph.nodes, strict=True):
        assert (entry["op"], entry["role"]) == (node.op.value, node.role)
        assert (entry["inputs"], entry["outputs"]) == (list(node.inputs), list(node.outputs))
        assert entry.get("fn") == node.fn and entry.get("loss") == node.loss
    assert {(e["src"], e["dst"], tuple(e["fields"])) for e in data["edges"]} == {
        (e.src, e.dst, e.fields) for e in graph.edges
    }
    assert data["stages"] == [list(s) for s in graph.stages()]
    assert data["roles"] == [{"name": r.name, "kind": r.kind.value} for r in graph.roles]


def test_json_round_trips(graph):
    assert from_dict(json.loads(render(graph, "json"))) == graph
    assert from_dict(to_dict(graph)) == graph


def test_text_lists_each_node_under_its_stage(graph):
    text = render(graph, "text")
    lines = text.splitlines()
    assert lines[0].startswith(f"graph {graph.name}: roles ")
    for role in graph.roles:
        assert f"{role.name} ({role.kind.value})" in lines[0]
    stage, seen = -1, {}
    for line in lines[1:]:
        if match := re.fullmatch(r"stage (\d+):", line):
            stage = int(match.group(1))
        elif match := re.fullmatch(r"  (\S+) \[(\w+) @ (\w+)(?:: (\S+))?\]", line):
            seen[match.group(1)] = stage
            node = graph.node(match.group(1))
            assert match.group(2) == node.op.value and match.group(3) == (node.role or "driver")
        elif line.startswith("      in:  "):
            assert line.removeprefix("      in:  ").split(", ") == list(node.inputs)
    assert seen == {name: i for i, s in enumerate(graph.stages()) for name in s}


def test_mermaid_declares_every_node_and_labels_every_edge(graph):
    lines = render(graph, "mermaid").splitlines()
    assert lines[0] == "flowchart TD"
    declared = {m.group(1) for line in lines if (m := re.match(r"    (\w+)[\[{]", line))}
    assert declared == {n.name for n in graph.nodes}
    edges = {(m.group(1), tuple(m.group(2).split(", ")), m.group(3))
             for line in lines if (m := re.fullmatch(r"    (\w+) -->\|([^|]+)\| (\w+)", line))}
    assert edges == {(e.src, e.fields, e.dst) for e in graph.edges}
    compute = next(n for n in graph.nodes if n.fn)
    assert any(line.startswith(f"    {compute.name}{{{{") for line in lines)  # compute nodes are hexagons


def test_dot_is_a_digraph_with_every_node_and_edge(graph):
    dot = render(graph, "dot")
    assert dot.startswith(f'digraph "{graph.name}" {{') and dot.endswith("}")
    assert dot.count("{") == dot.count("}")
    nodes = set(re.findall(r'^  "(\w+)" \[label=', dot, flags=re.M))
    edges = {(s, d, tuple(f.split(", "))) for s, d, f in re.findall(r'^  "(\w+)" -> "(\w+)" \[label="([^"]*)"\];',
                                                                    dot, flags=re.M)}
    assert nodes == {n.name for n in graph.nodes}
    assert edges == {(e.src, e.dst, e.fields) for e in graph.edges}


def test_unknown_format_lists_the_valid_ones(graph):
    with pytest.raises(ValueError, match=r"unknown graph format 'svg'.*'text', 'mermaid', 'dot', 'json'"):
        render(graph, "svg")
    assert set(FORMATS) == {"text", "mermaid", "dot", "json"}


def test_ppo_json_shows_every_op_with_its_fields():
    data = json.loads(render(load_graph("ppo"), "json"))
    by_op: dict[str, list[dict]] = {}
    for node in data["nodes"]:
        by_op.setdefault(node["op"], []).append(node)
    assert set(by_op) == {"generate", "score", "ref_logprob", "values", "logprob", "compute", "update"}
    assert by_op["generate"][0]["outputs"] == ["responses", "response_mask", "loss_mask"]
    assert by_op["score"][0]["outputs"] == ["scores"] and "ground_truth" in by_op["score"][0]["inputs"]
    assert by_op["ref_logprob"][0]["outputs"] == ["ref_logprobs"]
    assert by_op["values"][0]["role"] == "critic" and by_op["values"][0]["outputs"] == ["values"]
    assert by_op["logprob"][0]["outputs"] == ["old_logprobs"]
    produced = {f for n in by_op["compute"] for f in n["outputs"]}
    assert {"token_rewards", "advantages", "returns"} <= produced
    updates = {n["role"]: n for n in by_op["update"]}
    assert {"advantages", "old_logprobs"} <= set(updates["actor"]["inputs"])
    assert {"returns", "values"} <= set(updates["critic"]["inputs"])
