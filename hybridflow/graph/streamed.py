"""Which part of a graph a streamed step runs chunk by chunk (``runtime/streaming.py``; the planner costs the same).

A step streams from its *sampling* generate: the one generate node fed by the step's inputs, in a graph with no
filter (whose rounds regenerate). Every other generate node must be a row-wise follower of it: a generate on a
frozen role whose prompts a compute node renders from the sampled rows, answering each row once (``n`` = 1, which
validation requires of computed prompts): an LLM judge's. The followers, in order, are the nodes whose inputs come
from graph inputs, the sampling generate or other followers, and that work row by row:

- the row-wise ops (score, reference / actor log-probs, values);
- a follower generate;
- a compute node that writes a follower generate's prompts (an LLM judge's ``judge_prompts``), or that reads a
  follower generate's outputs (the judge's verdict parser).

Those compute nodes are taken to work row by row or prompt group by prompt group (a chunk holds a prompt's n
samples together): a judge's are. Other compute nodes (advantages) need the whole batch and run after the join.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.graph.node import Node
from hybridflow.graph.roles import Op, RoleKind

if TYPE_CHECKING:
    from hybridflow.graph.graph import Graph

# Ops that work row by row on generated rows, so a streamed step can run them on each finished chunk
ROW_WISE_OPS = (Op.SCORE, Op.REF_LOGPROB, Op.LOGPROB, Op.VALUES)


def computes_prompts(graph: Graph, node: Node) -> bool:
    """Whether generate ``node`` reads prompts a node of ``graph`` writes (an LLM judge's), not the step's."""
    return node.op is Op.GENERATE and node.port_inputs()["prompts"] in graph.producers


def follows_rows(graph: Graph, node: Node) -> bool:
    """Whether generate ``node`` answers each sampled row once on a frozen role (see the module)."""
    return (computes_prompts(graph, node) and node.samples_per_prompt == 1 and node.role is not None
            and graph.role(node.role).kind is RoleKind.FROZEN_POLICY)


def stream_generate(graph: Graph) -> Node | None:
    """The sampling generate a streamed step streams from, or None when the graph has none (see the module)."""
    if graph.filter_node is not None:
        return None
    generates = [node for node in graph.nodes if node.op is Op.GENERATE]
    sampling = [node for node in generates if not computes_prompts(graph, node)]
    if len(sampling) != 1 or graph.predecessors(sampling[0].name):
        return None
    others = {node.name for node in generates} - {sampling[0].name}
    if others - set(followers(graph, sampling[0])):
        return None  # a generate that needs more than its own rows (or is a policy's) would run after the join
    return sampling[0]


def followers(graph: Graph, generate: Node) -> tuple[str, ...]:
    """The nodes a streamed step runs chunk by chunk after ``generate``, in order (see the module)."""
    streamed = {generate.name}
    answering = {node.port_inputs()["prompts"]: node.name for node in graph.nodes
                 if node.name != generate.name and follows_rows(graph, node)}
    for name in graph.order:
        node = graph.node(name)
        if not set(graph.predecessors(name)) <= streamed:
            continue
        if node.op is Op.COMPUTE:
            follows = (any(field in answering for field in node.outputs)
                       or any(graph.producers.get(field) in answering.values() for field in node.inputs))
        else:
            follows = node.op in ROW_WISE_OPS or name in answering.values()
        if follows:
            streamed.add(name)
    return tuple(name for name in graph.order if name in streamed - {generate.name})
