"""The immutable, validated dataflow graph of an RL algorithm."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cached_property

import networkx as nx

from hybridflow.graph.errors import (
    DeadNodeError,
    DuplicateFieldError,
    GraphCycleError,
    MissingFieldError,
    NodeSpecError,
    RoleOpError,
    UnknownRoleError,
)
from hybridflow.graph.node import DEFAULT_MAX_NEW_TOKENS, Node, freeze_options
from hybridflow.graph.roles import Op, Role, RoleKind
from hybridflow.graph.skipping import SkippedPass
from hybridflow.graph.streamed import followers, stream_generate

DEFAULT_INPUTS = ("prompts", "ground_truth", "uid")
"""What the dataset rows give every step: prompts, their ground truth and ``uid``, one id per prompt (unique
in the step) that its n samples share, so group statistics find a prompt's samples wherever they are."""
PAIR_INPUTS = ("prompts", "responses", "response_mask", "loss_mask", "pair", "chosen")
"""What a preference dataset gives every step of an offline graph (DPO): each pair as two rows, its chosen and its
rejected response, tied by ``pair`` (an id the two share) and told apart by ``chosen`` (1 / 0); no generate node."""


@dataclass(frozen=True, slots=True)
class Edge:
    """Data moving from ``src`` to ``dst``: the fields ``dst`` reads that ``src`` wrote."""

    src: str
    dst: str
    fields: tuple[str, ...]


@dataclass(frozen=True)
class Graph:
    """A validated algorithm graph. Build one with :class:`~hybridflow.graph.GraphBuilder`.

    Construction validates; an invalid graph cannot exist. Edges are derived from fields: a node
    depends on the producer of every field it reads. ``inputs`` are the fields the dataset provides.
    ``skipped``: the passes taken out because their results are known (:mod:`hybridflow.graph.skipping`).
    """

    name: str
    roles: tuple[Role, ...]
    nodes: tuple[Node, ...]
    inputs: tuple[str, ...] = DEFAULT_INPUTS
    skipped: tuple[SkippedPass, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", tuple(self.roles))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "skipped", tuple(self.skipped))
        _validate(self)

    def role(self, name: str) -> Role:
        for role in self.roles:
            if role.name == name:
                return role
        raise UnknownRoleError(f"graph {self.name!r} has no role {name!r}; roles: {self.role_names}")

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"graph {self.name!r} has no node {name!r}; nodes: {[n.name for n in self.nodes]}")

    @property
    def role_names(self) -> list[str]:
        return [role.name for role in self.roles]

    @cached_property
    def producers(self) -> dict[str, str]:
        """Field -> name of the node that writes it (graph inputs are absent)."""
        return {out: node.name for node in self.nodes for out in node.outputs}

    @cached_property
    def edges(self) -> tuple[Edge, ...]:
        """Data edges (the fields a node reads from another), plus a field-less edge from a filter to each node
        that runs on its kept rows and waits on nothing else after it."""
        grouped: dict[tuple[str, str], list[str]] = {}
        for node in self.nodes:
            for name in dict.fromkeys(node.inputs):  # a field read twice still moves once
                src = self.producers.get(name)
                if src is not None:
                    grouped.setdefault((src, node.name), []).append(name)
        data = tuple(Edge(src, dst, tuple(fields)) for (src, dst), fields in grouped.items())
        filters = [node.name for node in self.nodes if node.op is Op.FILTER]
        if len(filters) != 1:
            return data
        section = _section(self.nodes, data, filters[0])
        after = [node.name for node in self.nodes if node.name not in section and node.name != filters[0]]
        control = [Edge(filters[0], name, ()) for name in after
                   if all(edge.src in section for edge in data if edge.dst == name)]
        return data + tuple(control)

    @property
    def reads_pairs(self) -> bool:
        """Whether the graph trains on preference pairs from the dataset (its inputs are :data:`PAIR_INPUTS`)."""
        return set(PAIR_INPUTS) <= set(self.inputs)

    @cached_property
    def filter_node(self) -> Node | None:
        """The graph's filter node, if it has one (at most one)."""
        return next((node for node in self.nodes if node.op is Op.FILTER), None)

    @cached_property
    def lone_generate(self) -> Node | None:
        """The generate node when the graph has exactly one and no filter (whose rounds regenerate within a
        step): the node an overlapped rollout or a streamed step can take apart from the rest; else None."""
        generates = [node for node in self.nodes if node.op is Op.GENERATE]
        return generates[0] if len(generates) == 1 and self.filter_node is None else None

    @cached_property
    def stream_generate(self) -> Node | None:
        """The sampling generate a streamed step streams from: the one fed by the step's inputs, in a graph with
        no filter whose other generates (an LLM judge's) answer its rows one by one (:mod:`.streamed`); else None."""
        return stream_generate(self)

    @cached_property
    def streamed_followers(self) -> tuple[str, ...]:
        """The nodes a streamed step runs chunk by chunk after :attr:`stream_generate`, in order: row-wise ops
        (score, reference / actor log-probs, values) and an LLM judge's chain (:mod:`.streamed`). Empty when the
        graph has nothing to stream."""
        generate = self.stream_generate
        return () if generate is None else followers(self, generate)

    @cached_property
    def sampling_section(self) -> frozenset[str]:
        """The nodes a filter depends on: they rerun on fresh prompts until the batch is full (empty: no filter)."""
        if self.filter_node is None:
            return frozenset()
        return frozenset(_section(self.nodes, self.edges, self.filter_node.name))

    @cached_property
    def dag(self) -> nx.DiGraph:
        """A frozen networkx view: node attribute ``node`` holds the :class:`Node`."""
        return nx.freeze(_digraph(self.nodes, self.edges))

    @cached_property
    def order(self) -> tuple[str, ...]:
        """Node names in a deterministic topological order (ties broken by declaration order)."""
        position = {node.name: i for i, node in enumerate(self.nodes)}
        return tuple(nx.lexicographical_topological_sort(self.dag, key=position.__getitem__))

    def stages(self) -> tuple[tuple[str, ...], ...]:
        """Sets of nodes that may run concurrently: each stage depends only on earlier stages."""
        position = {node.name: i for i, node in enumerate(self.nodes)}
        return tuple(tuple(sorted(gen, key=position.__getitem__)) for gen in nx.topological_generations(self.dag))

    def predecessors(self, name: str) -> tuple[str, ...]:
        return tuple(self.dag.predecessors(name))

    def ops_by_role(self) -> dict[str, frozenset[Op]]:
        """Role -> the ops its nodes perform (empty for a declared role no node uses)."""
        ops: dict[str, set[Op]] = {role.name: set() for role in self.roles}
        for node in self.nodes:
            if node.role is not None:
                ops[node.role].add(node.op)
        return {name: frozenset(found) for name, found in ops.items()}

    def nodes_of(self, role: str) -> tuple[Node, ...]:
        return tuple(node for node in self.nodes if node.role == role)

    @property
    def max_new_tokens(self) -> int:
        """The longest response cap of the graph's generate nodes (the default cap when it has none)."""
        return max((node.max_new_tokens for node in self.nodes if node.op is Op.GENERATE),
                   default=DEFAULT_MAX_NEW_TOKENS)

    @property
    def samples_per_prompt(self) -> int:
        """``n`` of the graph's generate nodes (validation makes them agree)."""
        return max((node.samples_per_prompt for node in self.nodes), default=1)

    def with_role_kind(self, role: str, kind: RoleKind | str) -> Graph:
        """A copy where ``role`` has another kind (e.g. a reward model becomes a reward function)."""
        self.role(role)
        roles = tuple(Role(r.name, RoleKind(kind)) if r.name == role else r for r in self.roles)
        return replace(self, roles=roles)

    def with_node_options(self, node: str, **options: object) -> Graph:
        """A copy where ``node`` has these options changed (``n=8``, ``temperature=0.7``...)."""
        self.node(node)
        nodes = tuple(
            replace(n, options=freeze_options({**n.options_dict, **options}, node)) if n.name == node else n
            for n in self.nodes
        )
        return replace(self, nodes=nodes)


def _section(nodes: Iterable[Node], edges: Iterable[Edge], filter_name: str) -> set[str]:
    return set(nx.ancestors(_digraph(nodes, edges), filter_name))


def _digraph(nodes: Iterable[Node], edges: Iterable[Edge]) -> nx.DiGraph:
    dag = nx.DiGraph()
    for node in nodes:
        dag.add_node(node.name, node=node)
    for edge in edges:
        dag.add_edge(edge.src, edge.dst, fields=edge.fields)
    return dag


def _validate(graph: Graph) -> None:
    if not graph.nodes:
        raise NodeSpecError(f"graph {graph.name!r} has no nodes")
    _check_names(graph)
    _check_roles(graph)
    _check_fields(graph)
    _check_acyclic(graph)
    _check_filter(graph)
    _check_reaches_update(graph)
    _check_samples(graph)


def _check_names(graph: Graph) -> None:
    seen: set[str] = set()
    for node in graph.nodes:
        if node.name in seen:
            raise NodeSpecError(f"two nodes are named {node.name!r}; node names must be unique", node=node.name)
        seen.add(node.name)
    names = [role.name for role in graph.roles]
    if len(set(names)) != len(names):
        dup = next(name for name in names if names.count(name) > 1)
        raise NodeSpecError(f"role {dup!r} is declared twice", field=dup)


def _check_roles(graph: Graph) -> None:
    kinds = {role.name: role.kind for role in graph.roles}
    for node in graph.nodes:
        if node.role is None:
            continue
        if node.role not in kinds:
            raise UnknownRoleError(
                f"node {node.name!r} runs on role {node.role!r}, which the graph does not declare; "
                f"declared roles: {sorted(kinds)}",
                node=node.name,
                field=node.role,
            )
        kind = kinds[node.role]
        if node.op not in kind.allowed_ops:
            allowed = sorted(op.value for op in kind.allowed_ops)
            raise RoleOpError(
                f"node {node.name!r} asks role {node.role!r} ({kind}) to {node.op}, but a {kind} can only "
                f"do {allowed}",
                node=node.name,
                field=node.role,
            )


def _check_fields(graph: Graph) -> None:
    produced: dict[str, str] = {name: "<graph input>" for name in graph.inputs}
    if len(produced) != len(graph.inputs):
        twice = next(name for name in graph.inputs if graph.inputs.count(name) > 1)
        raise DuplicateFieldError(f"graph inputs {list(graph.inputs)} list field {twice!r} twice", field=twice)
    for node in graph.nodes:
        for name in node.outputs:
            if name in produced:
                raise DuplicateFieldError(
                    f"field {name!r} is produced by both {produced[name]!r} and node {node.name!r}; "
                    "rename one output",
                    node=node.name,
                    field=name,
                )
            produced[name] = node.name
    for node in graph.nodes:
        for name in node.inputs:
            if name not in produced:
                raise MissingFieldError(
                    f"node {node.name!r} reads field {name!r}, which no node and no graph input produces; "
                    f"available fields: {sorted(produced)}",
                    node=node.name,
                    field=name,
                )


def _check_acyclic(graph: Graph) -> None:
    dag = _digraph(graph.nodes, graph.edges)
    try:
        cycle = nx.find_cycle(dag)
    except nx.NetworkXNoCycle:
        return
    src, dst = cycle[0][0], cycle[0][1]
    fields = dag.edges[src, dst]["fields"]
    path = " -> ".join([edge[0] for edge in cycle] + [cycle[0][0]])
    raise GraphCycleError(
        f"nodes form a cycle {path}; node {dst!r} reads {list(fields)} from {src!r}",
        node=dst,
        field=fields[0],
    )


def _check_reaches_update(graph: Graph) -> None:
    dag = _digraph(graph.nodes, graph.edges)
    sinks = {node.name for node in graph.nodes if node.op is Op.UPDATE}
    if not sinks:
        first = graph.nodes[0]
        raise DeadNodeError(
            f"graph {graph.name!r} has no update node, so nothing trains: node {first.name!r} and its outputs "
            f"{list(first.outputs)} are dead, as is every other node; add an update",
            node=first.name,
            field=first.outputs[0] if first.outputs else None,
        )
    live: set[str] = set(sinks)
    for sink in sinks:
        live |= nx.ancestors(dag, sink)
    for node in graph.nodes:
        if node.name not in live:
            what = f"its outputs {list(node.outputs)} are" if node.outputs else "it is"
            raise DeadNodeError(
                f"node {node.name!r} has no path to an update node: {what} never used by training; "
                "remove it or feed it to an update",
                node=node.name,
                field=node.outputs[0] if node.outputs else None,
            )


def _check_samples(graph: Graph) -> None:
    """Every generate node of the dataset's prompts samples the same n; one whose prompts a node computes (an LLM
    judge's, from the sampled responses) answers each of those rows once, so rows line up."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if node.op is not Op.GENERATE:
            continue
        n = node.samples_per_prompt
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise NodeSpecError(f"node {node.name!r}: n={n!r} must be a positive integer", node=node.name, field="n")
        prompts = node.port_inputs()["prompts"]
        if prompts in graph.producers:
            if n != 1:
                raise NodeSpecError(f"node {node.name!r} generates from {prompts!r}, which node "
                                    f"{graph.producers[prompts]!r} computes from sampled rows: it answers each row "
                                    f"once, so n={n} must be 1", node=node.name, field="n")
            continue
        counts[node.name] = n
    if len(set(counts.values())) > 1:
        raise NodeSpecError(
            f"generate nodes disagree on samples per prompt {counts}; every rollout of one step must use "
            "the same n so rows line up",
            node=max(counts, key=counts.__getitem__),
            field="n",
        )


def _check_filter(graph: Graph) -> None:
    filters = [node.name for node in graph.nodes if node.op is Op.FILTER]
    if len(filters) > 1:
        raise NodeSpecError(f"graph {graph.name!r} has filters {filters}; one filter per graph", node=filters[1])
    if not filters:
        return
    # Updates write no fields, so a filter never depends on one: every update runs once, after it.
    if Op.GENERATE not in {graph.node(name).op for name in graph.sampling_section}:
        raise NodeSpecError(f"filter {filters[0]!r} depends on no generate node, so rerunning its inputs cannot "
                            "refill the batch; filter after a rollout", node=filters[0])
