"""Property tests: random valid graphs validate and round-trip through JSON; breaking one invariant
of a valid graph raises the error type for that invariant, naming the node and field at fault.

The strategies live here for now; they may move to ``hybridflow.testing`` once other packages need them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridflow.graph import (
    DEFAULT_INPUTS,
    DeadNodeError,
    DuplicateFieldError,
    Graph,
    GraphCycleError,
    MissingFieldError,
    Node,
    Op,
    Role,
    RoleKind,
    RoleOpError,
    UnknownRoleError,
    from_json,
    to_json,
)

SEQ = ("prompts", "responses", "response_mask")
PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Spec:
    """The parts of a graph, kept apart so a test can break one and rebuild."""

    roles: tuple[Role, ...]
    nodes: tuple[Node, ...]
    inputs: tuple[str, ...] = DEFAULT_INPUTS

    def build(self) -> Graph:
        return Graph("random", self.roles, self.nodes, self.inputs)

    def without(self, name: str) -> Spec:
        return replace(self, nodes=tuple(n for n in self.nodes if n.name != name))

    def swapped(self, old: Node, new: Node) -> Spec:
        return replace(self, nodes=tuple(new if n.name == old.name else n for n in self.nodes))


option_values = st.one_of(
    st.integers(-5, 1000),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.text(max_size=6),
)
options = st.dictionaries(st.sampled_from(["temperature", "gamma", "group_size", "greedy", "label"]), option_values,
                          max_size=3)


@st.composite
def valid_specs(draw: st.DrawFn) -> Spec:
    """A random algorithm: a rollout, some role ops, a chain of compute nodes, and updates that read
    every field nobody else reads (so no node is dead), declared in a random order. Role-op ports are
    sometimes bound to renamed fields."""
    renamed = draw(st.booleans())
    seq = ("prompts", "rollout", "rollout_mask") if renamed else SEQ
    roles = [Role("actor", RoleKind.POLICY)]
    nodes = [Node("actor_generate", Op.GENERATE, "actor", ("prompts",), seq[1:],
                  options={**draw(options), "n": draw(st.integers(1, 4))})]
    available = ["ground_truth", *seq]
    role_ops = [("reference", RoleKind.FROZEN_POLICY, Op.REF_LOGPROB, "ref_logprobs"),
                ("reward", draw(st.sampled_from([RoleKind.REWARD_MODEL, RoleKind.REWARD_FUNCTION])), Op.SCORE,
                 "scores"),
                ("critic", RoleKind.VALUE, Op.VALUES, "values")]
    for role, kind, op, output in role_ops:
        if draw(st.booleans()):
            roles.append(Role(role, kind))
            inputs = (*seq, "ground_truth") if op is Op.SCORE else seq
            output = f"{role}_{output}" if renamed else output
            nodes.append(Node(f"{role}_{op.value}", op, role, inputs, (output,), options=draw(options)))
            available.append(output)
    if draw(st.booleans()):
        nodes.append(Node("actor_logprob", Op.LOGPROB, "actor", seq, ("old_logprobs",)))
        available.append("old_logprobs")
    for i in range(draw(st.integers(1, 5))):
        inputs = draw(st.lists(st.sampled_from(available), min_size=1, max_size=3, unique=True))
        outputs = [f"c{i}_out{j}" for j in range(draw(st.integers(1, 2)))]
        fn = draw(st.sampled_from(["gae", "grpo_advantages", "pkg.mod:fn", "my_file.py:fn"]))
        nodes.append(Node(f"c{i}", Op.COMPUTE, None, tuple(inputs), tuple(outputs), fn=fn, options=draw(options)))
        available.extend(outputs)
    read = {name for node in nodes for name in node.inputs}
    unread = [name for node in nodes for name in node.outputs if name not in read]
    has_critic = any(r.name == "critic" for r in roles)
    to_critic = [name for name in unread if has_critic and name not in seq and draw(st.booleans())]
    if to_critic:
        nodes.append(Node("critic_update", Op.UPDATE, "critic", (*seq, *to_critic), (), loss="value"))
    actor_reads = [name for name in unread if name not in to_critic and name not in seq]
    nodes.append(Node("actor_update", Op.UPDATE, "actor", (*seq, *actor_reads), (), loss="ppo_policy",
                      options=draw(options)))
    return Spec(tuple(draw(st.permutations(roles))), tuple(draw(st.permutations(nodes))))


def first_in_order(spec: Spec, names: set[str]) -> str:
    return next(node.name for node in spec.nodes if node.name in names)


@PROPERTY_SETTINGS
@given(valid_specs())
def test_random_valid_graphs_validate_and_round_trip_through_json(spec):
    graph = spec.build()
    text = to_json(graph)
    again = from_json(text)
    assert again == graph
    assert to_json(again) == text
    assert again.edges == graph.edges and again.stages() == graph.stages()


@PROPERTY_SETTINGS
@given(valid_specs(), st.randoms(use_true_random=False))
def test_edges_and_stages_do_not_depend_on_declaration_order(spec, rng):
    graph = spec.build()
    shuffled = list(spec.nodes)
    rng.shuffle(shuffled)
    other = replace(spec, nodes=tuple(shuffled)).build()
    assert set(other.edges) == set(graph.edges)
    assert [set(stage) for stage in other.stages()] == [set(stage) for stage in graph.stages()]


@PROPERTY_SETTINGS
@given(valid_specs())
def test_edges_carry_exactly_the_fields_each_node_reads_from_another(spec):
    graph = spec.build()
    carried = {(e.dst, f) for e in graph.edges for f in e.fields}
    for edge in graph.edges:
        assert set(edge.fields) <= set(graph.node(edge.src).outputs) & set(graph.node(edge.dst).inputs)
    for node in graph.nodes:
        from_nodes = {f for f in node.inputs if f not in graph.inputs}
        assert {f for dst, f in carried if dst == node.name} == from_nodes


@PROPERTY_SETTINGS
@given(valid_specs())
def test_stages_are_the_earliest_concurrent_layers(spec):
    graph = spec.build()
    stage_of = {name: i for i, stage in enumerate(graph.stages()) for name in stage}
    assert sorted(stage_of) == sorted(node.name for node in graph.nodes)
    for edge in graph.edges:
        assert stage_of[edge.src] < stage_of[edge.dst]
    for name, i in stage_of.items():
        # Nothing waits longer than it must: a node in stage i > 0 depends on something in stage i - 1.
        assert i == 0 or any(stage_of[p] == i - 1 for p in graph.predecessors(name))
    position = {name: i for i, name in enumerate(graph.order)}
    assert len(position) == len(graph.nodes)
    assert all(position[e.src] < position[e.dst] for e in graph.edges)


@PROPERTY_SETTINGS
@given(valid_specs(), st.data())
def test_dropping_a_producer_is_a_missing_field(spec, data):
    victim = data.draw(st.sampled_from([n for n in spec.nodes if n.op is not Op.UPDATE]))
    with pytest.raises(MissingFieldError) as info:
        spec.without(victim.name).build()
    err = info.value
    assert err.field in victim.outputs
    assert any(n.name == err.node and err.field in n.inputs for n in spec.nodes)
    assert repr(err.node) in str(err) and repr(err.field) in str(err)


@PROPERTY_SETTINGS
@given(valid_specs(), st.data())
def test_a_second_producer_of_a_field_is_a_duplicate(spec, data):
    producers = {f: n.name for n in spec.nodes for f in n.outputs}
    field = data.draw(st.sampled_from(sorted(producers)))
    at = data.draw(st.integers(0, len(spec.nodes)))
    dup = Node("dup", Op.COMPUTE, None, ("prompts",), (field,), fn="f")
    nodes = (*spec.nodes[:at], dup, *spec.nodes[at:])
    with pytest.raises(DuplicateFieldError) as info:
        replace(spec, nodes=nodes).build()
    later = [n.name for n in nodes if n.name in {"dup", producers[field]}][1]
    assert (info.value.node, info.value.field) == (later, field)
    assert repr(later) in str(info.value) and repr(field) in str(info.value)


@PROPERTY_SETTINGS
@given(valid_specs(), st.data())
def test_a_graph_input_that_a_node_also_writes_is_a_duplicate(spec, data):
    producers = {f: n.name for n in spec.nodes for f in n.outputs}
    field = data.draw(st.sampled_from(sorted(producers)))
    with pytest.raises(DuplicateFieldError) as info:
        replace(spec, inputs=(*spec.inputs, field)).build()
    assert (info.value.node, info.value.field) == (producers[field], field)


@PROPERTY_SETTINGS
@given(valid_specs(), st.data())
def test_a_back_edge_is_a_cycle(spec, data):
    graph = spec.build()
    producers = graph.producers
    candidates = []
    for node in graph.nodes:
        later = nx.descendants(graph.dag, node.name) | ({node.name} if node.op is Op.COMPUTE else set())
        fields = sorted(f for f, src in producers.items() if src in later)
        if node.op is not Op.UPDATE and fields:
            candidates.append((node, fields))
    node, fields = data.draw(st.sampled_from(candidates))
    field = data.draw(st.sampled_from(fields))
    if node.op is Op.COMPUTE:
        broken = replace(node, inputs=(*node.inputs, field))
    else:  # a role op has fixed ports: rebind one of them to the later field
        broken = replace(node, inputs=(field, *node.inputs[1:]))
    with pytest.raises(GraphCycleError) as info:
        spec.swapped(node, broken).build()
    err = info.value
    in_cycle = {node.name} | (nx.descendants(graph.dag, node.name) & nx.ancestors(graph.dag, producers[field]))
    assert err.node in in_cycle | {producers[field]}
    assert err.field is not None and repr(err.node) in str(err) and repr(err.field) in str(err)


@PROPERTY_SETTINGS
@given(valid_specs(), st.data())
def test_a_node_on_an_undeclared_role_is_rejected(spec, data):
    victim = data.draw(st.sampled_from([n for n in spec.nodes if n.role is not None]))
    with pytest.raises(UnknownRoleError) as info:
        spec.swapped(victim, replace(victim, role="ghost")).build()
    assert (info.value.node, info.value.field) == (victim.name, "ghost")
    assert "'ghost'" in str(info.value)


@PROPERTY_SETTINGS
@given(valid_specs(), st.data())
def test_dropping_a_role_declaration_is_rejected_at_its_first_node(spec, data):
    role = data.draw(st.sampled_from([r for r in spec.roles if any(n.role == r.name for n in spec.nodes)]))
    with pytest.raises(UnknownRoleError) as info:
        replace(spec, roles=tuple(r for r in spec.roles if r != role)).build()
    users = {n.name for n in spec.nodes if n.role == role.name}
    assert (info.value.node, info.value.field) == (first_in_order(spec, users), role.name)


@PROPERTY_SETTINGS
@given(valid_specs(), st.data())
def test_asking_a_role_for_a_forbidden_op_is_rejected(spec, data):
    victim = data.draw(st.sampled_from([n for n in spec.nodes if n.role is not None]))
    kind = data.draw(st.sampled_from([k for k in RoleKind if victim.op not in k.allowed_ops]))
    broken = replace(spec, roles=(*spec.roles, Role("other", kind))).swapped(victim, replace(victim, role="other"))
    with pytest.raises(RoleOpError) as info:
        broken.build()
    assert (info.value.node, info.value.field) == (victim.name, "other")
    assert f"({kind.value})" in str(info.value) and victim.op.value in str(info.value)


@PROPERTY_SETTINGS
@given(valid_specs(), st.data())
def test_changing_a_role_kind_under_its_nodes_is_rejected(spec, data):
    role = data.draw(st.sampled_from([r for r in spec.roles if any(n.role == r.name for n in spec.nodes)]))
    used = {n.op for n in spec.nodes if n.role == role.name}
    kind = data.draw(st.sampled_from([k for k in RoleKind if not used <= k.allowed_ops]))
    with pytest.raises(RoleOpError) as info:
        spec.build().with_role_kind(role.name, kind)
    offenders = {n.name for n in spec.nodes if n.role == role.name and n.op not in kind.allowed_ops}
    assert (info.value.node, info.value.field) == (first_in_order(spec, offenders), role.name)


@PROPERTY_SETTINGS
@given(valid_specs(), st.data())
def test_a_node_that_reaches_no_update_is_dead(spec, data):
    readable = sorted({*spec.inputs, *(f for n in spec.nodes for f in n.outputs)})
    inputs = data.draw(st.lists(st.sampled_from(readable), min_size=1, max_size=3, unique=True))
    chain = data.draw(st.integers(1, 3))
    dead = [Node(f"dead{i}", Op.COMPUTE, None, tuple(inputs) if i == 0 else (f"unused{i - 1}",), (f"unused{i}",),
                 fn="f") for i in range(chain)]
    at = data.draw(st.integers(0, len(spec.nodes)))
    with pytest.raises(DeadNodeError) as info:
        replace(spec, nodes=(*spec.nodes[:at], *dead, *spec.nodes[at:])).build()
    assert (info.value.node, info.value.field) == ("dead0", "unused0")
    assert "'dead0'" in str(info.value) and "'unused0'" in str(info.value)
