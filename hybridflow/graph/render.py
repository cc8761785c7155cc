"""Text, mermaid, DOT and JSON views of a graph, and JSON back to a graph."""

from __future__ import annotations

import json
from typing import Any

from hybridflow.graph.graph import Graph
from hybridflow.graph.node import Node, freeze_options
from hybridflow.graph.roles import Op, Role
from hybridflow.graph.skipping import SkippedPass

FORMATS = ("text", "mermaid", "dot", "json")


def to_dict(graph: Graph) -> dict[str, Any]:
    """A JSON-ready dict: ``nodes`` (name, op, role, inputs, outputs...) and ``edges`` (src, dst, fields)."""
    nodes = []
    for node in graph.nodes:
        entry: dict[str, Any] = {
            "name": node.name,
            "op": node.op.value,
            "role": node.role,
            "inputs": list(node.inputs),
            "outputs": list(node.outputs),
        }
        if node.fn:
            entry["fn"] = node.fn
        if node.loss:
            entry["loss"] = node.loss
        if node.options:
            entry["options"] = node.options_dict
        nodes.append(entry)
    out = {
        "name": graph.name,
        "inputs": list(graph.inputs),
        "roles": [{"name": role.name, "kind": role.kind.value} for role in graph.roles],
        "nodes": nodes,
        "edges": [{"src": e.src, "dst": e.dst, "fields": list(e.fields)} for e in graph.edges],
        "stages": [list(stage) for stage in graph.stages()],
    }
    if graph.skipped:  # absent when nothing was skipped, so such a graph's JSON is as it was
        out["skipped"] = [{"node": s.node, "reason": s.reason, "role": s.role} for s in graph.skipped]
    return out


def from_dict(data: dict[str, Any]) -> Graph:
    """Rebuild (and so re-validate) a graph from :func:`to_dict` output; edges are re-derived."""
    roles = tuple(Role(r["name"], r["kind"]) for r in data["roles"])
    nodes = tuple(
        Node(n["name"], Op(n["op"]), n["role"], tuple(n["inputs"]), tuple(n["outputs"]),
             fn=n.get("fn"), loss=n.get("loss"), options=freeze_options(n.get("options", {}), n["name"]))
        for n in data["nodes"]
    )
    skipped = tuple(SkippedPass(s["node"], s["reason"], s.get("role")) for s in data.get("skipped", ()))
    return Graph(data["name"], roles, nodes, tuple(data["inputs"]), skipped)


def to_json(graph: Graph) -> str:
    return json.dumps(to_dict(graph), indent=2)


def from_json(text: str) -> Graph:
    return from_dict(json.loads(text))


def _label(node: Node) -> str:
    where = node.role or "driver"
    what = node.fn or node.loss
    return f"{node.name} [{node.op.value} @ {where}{': ' + what if what else ''}]"


def to_text(graph: Graph) -> str:
    kinds = ", ".join(f"{r.name} ({r.kind.value})" for r in graph.roles)
    lines = [f"graph {graph.name}: roles {kinds}; inputs {', '.join(graph.inputs)}"]
    for i, stage in enumerate(graph.stages()):
        lines.append(f"stage {i}:")
        for name in stage:
            node = graph.node(name)
            lines.append(f"  {_label(node)}")
            lines.append(f"      in:  {', '.join(node.inputs) or '-'}")
            if node.outputs:
                lines.append(f"      out: {', '.join(node.outputs)}")
    if graph.skipped:
        lines.append("skipped (results known in advance):")
        lines.extend(f"  {skipped.describe()}" for skipped in graph.skipped)
    return "\n".join(lines)


def to_mermaid(graph: Graph) -> str:
    lines = ["flowchart TD"]
    shape = {Op.COMPUTE: ('{{"', '"}}'), Op.FILTER: ('>"', '"]'), Op.UPDATE: ('[/"', '"/]')}
    for node in graph.nodes:
        left, right = shape.get(node.op, ('["', '"]'))
        lines.append(f"    {node.name}{left}{_label(node)}{right}")
    for edge in graph.edges:
        lines.append(f"    {edge.src} -->|{', '.join(edge.fields)}| {edge.dst}")
    return "\n".join(lines)


def to_dot(graph: Graph) -> str:
    shape = {Op.COMPUTE: "hexagon", Op.FILTER: "invtriangle", Op.UPDATE: "parallelogram"}
    lines = [f'digraph "{graph.name}" {{', "  rankdir=TB;"]
    for node in graph.nodes:
        lines.append(f'  "{node.name}" [label="{_label(node)}", shape={shape.get(node.op, "box")}];')
    for edge in graph.edges:
        lines.append(f'  "{edge.src}" -> "{edge.dst}" [label="{", ".join(edge.fields)}"];')
    lines.append("}")
    return "\n".join(lines)


def render(graph: Graph, fmt: str = "text") -> str:
    """Render ``graph`` as one of :data:`FORMATS`."""
    renderers = {"text": to_text, "mermaid": to_mermaid, "dot": to_dot, "json": to_json}
    if fmt not in renderers:
        raise ValueError(f"unknown graph format {fmt!r}; choose one of {list(FORMATS)}")
    return renderers[fmt](graph)
