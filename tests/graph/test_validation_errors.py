"""Each way a graph can be wrong raises its own error type, naming the node and the field."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hybridflow.graph import (
    DeadNodeError,
    DuplicateFieldError,
    Graph,
    GraphBuilder,
    GraphCycleError,
    GraphValidationError,
    MissingFieldError,
    Node,
    NodeSpecError,
    Op,
    Role,
    RoleKind,
    RoleOpError,
    UnknownRoleError,
)

SEQ = ("prompts", "responses", "response_mask")


def reinforce(extra: Callable[[GraphBuilder], None] | None = None, *, n: int = 1) -> Graph:
    """A minimal valid algorithm (sample, score, advantage, update); ``extra`` adds nodes before build."""
    g = GraphBuilder("tiny")
    actor, reward = g.role("actor", RoleKind.POLICY), g.role("reward", RoleKind.REWARD_FUNCTION)
    g.generate(actor, n=n)
    g.score(reward)
    g.compute("adv", fn="grpo_advantages", inputs=("scores", "response_mask"), outputs=("advantages",))
    if extra is not None:
        extra(g)
    g.update(actor, loss="ppo_policy", inputs=(*SEQ, "advantages"))
    return g.build()


def assert_names(err: GraphValidationError, *, node: str | None, field: str | None) -> None:
    assert err.node == node
    assert err.field == field
    for name in (node, field):
        if name is not None:
            assert repr(name) in str(err) or name in str(err), f"{name!r} missing from: {err}"


def test_the_minimal_algorithm_is_valid():
    graph = reinforce()
    assert [node.name for node in graph.nodes] == ["actor_generate", "reward_score", "adv", "actor_update"]


def test_every_error_is_a_value_error_subclass_of_the_base():
    for cls in (GraphCycleError, MissingFieldError, DuplicateFieldError, UnknownRoleError, RoleOpError,
                DeadNodeError, NodeSpecError):
        assert issubclass(cls, GraphValidationError) and issubclass(cls, ValueError)


class TestMissingField:
    def test_a_field_nobody_produces(self):
        with pytest.raises(MissingFieldError) as info:
            reinforce(lambda g: g.compute("norm", fn="f", inputs=("advantages", "baseline"), outputs=("x",)))
        assert_names(info.value, node="norm", field="baseline")
        assert "available fields" in str(info.value) and "'scores'" in str(info.value)

    def test_a_renamed_port_reads_the_renamed_field(self):
        def greedy_score(g: GraphBuilder) -> None:
            g.score("reward", name="greedy_score", inputs=("prompts", "greedy", "response_mask", "ground_truth"),
                    outputs=("greedy_scores",))

        with pytest.raises(MissingFieldError) as info:
            reinforce(greedy_score)
        assert_names(info.value, node="greedy_score", field="greedy")

    def test_a_graph_input_the_dataset_does_not_provide(self):
        g = GraphBuilder("no_truth", inputs=("prompts",))
        actor, reward = g.role("actor", "policy"), g.role("reward", "reward_model")
        g.generate(actor)
        g.score(reward)
        g.update(actor, loss="l", inputs=("scores",))
        with pytest.raises(MissingFieldError) as info:
            g.build()
        assert_names(info.value, node="reward_score", field="ground_truth")


class TestDuplicateField:
    def test_two_nodes_write_one_field(self):
        with pytest.raises(DuplicateFieldError) as info:
            reinforce(lambda g: g.compute("again", fn="f", inputs=("scores",), outputs=("advantages",)))
        assert_names(info.value, node="again", field="advantages")
        assert "'adv'" in str(info.value)

    def test_a_node_overwrites_a_graph_input(self):
        with pytest.raises(DuplicateFieldError) as info:
            reinforce(lambda g: g.compute("clean", fn="f", inputs=("prompts",), outputs=("prompts",)))
        assert_names(info.value, node="clean", field="prompts")
        assert "<graph input>" in str(info.value)

    def test_graph_inputs_list_a_field_twice(self):
        g = GraphBuilder("twice", inputs=("prompts", "ground_truth", "prompts"))
        with pytest.raises(DuplicateFieldError) as info:
            Graph("twice", reinforce().roles, reinforce().nodes, g.inputs)
        assert_names(info.value, node=None, field="prompts")


class TestUnknownRole:
    def test_a_node_on_an_undeclared_role(self):
        with pytest.raises(UnknownRoleError) as info:
            reinforce(lambda g: g.values("critic"))
        assert_names(info.value, node="critic_values", field="critic")
        assert "declared roles: ['actor', 'reward']" in str(info.value)

    def test_graph_role_lookup_lists_the_roles(self):
        with pytest.raises(UnknownRoleError, match=r"no role 'critic'.*\['actor', 'reward'\]"):
            reinforce().role("critic")


class TestRoleOp:
    @pytest.mark.parametrize(
        ("kind", "op", "add"),
        [
            (RoleKind.FROZEN_POLICY, Op.UPDATE, lambda g: g.update("other", loss="l", inputs=("advantages",))),
            (RoleKind.VALUE, Op.GENERATE, lambda g: g.generate("other", name="other_generate", outputs=("r2", "m2"))),
            (RoleKind.VALUE, Op.LOGPROB, lambda g: g.logprob("other")),
            (RoleKind.POLICY, Op.VALUES, lambda g: g.values("other")),
            (RoleKind.REWARD_MODEL, Op.LOGPROB, lambda g: g.logprob("other")),
            (RoleKind.REWARD_FUNCTION, Op.UPDATE, lambda g: g.update("other", loss="l", inputs=("scores",))),
            (RoleKind.POLICY, Op.REF_LOGPROB, lambda g: g.ref_logprob("other")),
        ],
    )
    def test_a_role_asked_for_an_op_its_kind_cannot_do(self, kind, op, add):
        assert op not in kind.allowed_ops

        def extra(g: GraphBuilder) -> None:
            g.role("other", kind)
            add(g)

        with pytest.raises(RoleOpError) as info:
            reinforce(extra)
        node = f"other_{op.value}"
        assert_names(info.value, node=node, field="other")
        assert f"{kind.value} can only do {sorted(o.value for o in kind.allowed_ops)}" in str(info.value)

    def test_changing_a_role_kind_revalidates(self):
        with pytest.raises(RoleOpError) as info:
            reinforce().with_role_kind("actor", RoleKind.FROZEN_POLICY)
        assert_names(info.value, node="actor_update", field="actor")


class TestCycle:
    def test_two_nodes_read_each_other(self):
        def loop(g: GraphBuilder) -> None:
            g.compute("a", fn="f", inputs=("scores", "b_out"), outputs=("a_out",))
            g.compute("b", fn="f", inputs=("a_out",), outputs=("b_out",))
            g.compute("use", fn="f", inputs=("b_out",), outputs=("baseline",))

        with pytest.raises(GraphCycleError) as info:
            reinforce(loop)
        err = info.value
        assert (err.node, err.field) in {("a", "b_out"), ("b", "a_out")}
        assert_names(err, node=err.node, field=err.field)
        assert "a -> b -> a" in str(err) or "b -> a -> b" in str(err)

    def test_a_compute_node_reading_its_own_output(self):
        with pytest.raises(GraphCycleError) as info:
            reinforce(lambda g: g.compute("self_loop", fn="f", inputs=("scores", "x"), outputs=("x",)))
        assert_names(info.value, node="self_loop", field="x")

    def test_a_back_edge_into_a_role_op(self):
        # The rollout would need the advantages it helps to compute.
        g = GraphBuilder("back")
        actor, reward = g.role("actor", "policy"), g.role("reward", "reward_function")
        g.generate(actor, inputs=("advantages",))
        g.score(reward)
        g.compute("adv", fn="f", inputs=("scores",), outputs=("advantages",))
        g.update(actor, loss="l", inputs=("advantages",))
        with pytest.raises(GraphCycleError) as info:
            g.build()
        assert info.value.node in {"actor_generate", "reward_score", "adv"}
        assert info.value.field in {"advantages", "responses", "response_mask", "scores"}


class TestDeadNode:
    def test_a_node_whose_outputs_nobody_reads(self):
        with pytest.raises(DeadNodeError) as info:
            reinforce(lambda g: g.compute("metrics", fn="f", inputs=("scores",), outputs=("score_mean",)))
        assert_names(info.value, node="metrics", field="score_mean")
        assert "no path to an update" in str(info.value)

    def test_a_dead_chain_is_reported_at_its_first_node(self):
        def chain(g: GraphBuilder) -> None:
            g.compute("first", fn="f", inputs=("scores",), outputs=("x",))
            g.compute("second", fn="f", inputs=("x",), outputs=("y",))

        with pytest.raises(DeadNodeError) as info:
            reinforce(chain)
        assert_names(info.value, node="first", field="x")

    def test_a_role_op_feeding_nothing(self):
        def critic(g: GraphBuilder) -> None:
            g.values(g.role("critic", RoleKind.VALUE))

        with pytest.raises(DeadNodeError) as info:
            reinforce(critic)
        assert_names(info.value, node="critic_values", field="values")

    def test_a_graph_without_update(self):
        g = GraphBuilder("no_update")
        g.generate(g.role("actor", "policy"))
        with pytest.raises(DeadNodeError, match="no update node") as info:
            g.build()
        assert_names(info.value, node="actor_generate", field="responses")


class TestNodeSpec:
    def test_duplicate_node_names(self):
        with pytest.raises(NodeSpecError) as info:
            reinforce(lambda g: g.compute("adv", fn="f", inputs=("scores",), outputs=("other",)))
        assert_names(info.value, node="adv", field=None)
        assert "unique" in str(info.value)

    def test_a_role_declared_twice(self):
        g = reinforce()
        with pytest.raises(NodeSpecError) as info:
            Graph("twice", (*g.roles, Role("actor", RoleKind.VALUE)), g.nodes)
        assert_names(info.value, node=None, field="actor")

    def test_an_empty_graph(self):
        with pytest.raises(NodeSpecError, match="no nodes"):
            Graph("empty", (Role("actor", RoleKind.POLICY),), ())

    @pytest.mark.parametrize("name", ["", "1st", "has space", "dot.ted"])
    def test_a_bad_node_name(self, name):
        with pytest.raises(NodeSpecError) as info:
            Node(name, Op.COMPUTE, None, ("scores",), ("x",), fn="f")
        assert_names(info.value, node=name, field="name")

    @pytest.mark.parametrize("value", [[1, 2], {"a": 1}, (0.1,), object()])
    def test_an_option_that_is_not_a_json_scalar(self, value):
        with pytest.raises(NodeSpecError) as info:
            reinforce(lambda g: g.compute("bad", fn="f", inputs=("scores",), outputs=("x",), weights=value))
        assert_names(info.value, node="bad", field="weights")

    @pytest.mark.parametrize("n", [0, -2, 2.0, "4", True, None])
    def test_n_must_be_a_positive_integer(self, n):
        with pytest.raises(NodeSpecError) as info:
            reinforce(n=n)
        assert_names(info.value, node="actor_generate", field="n")

    def test_generate_nodes_must_agree_on_n(self):
        g = GraphBuilder("remax_with_groups")
        actor = g.role("actor", "policy")
        g.generate(actor, n=4)
        g.generate(actor, name="greedy_generate", outputs=("greedy_responses", "greedy_response_mask"), greedy=True)
        g.compute("adv", fn="f", inputs=("responses", "greedy_responses"), outputs=("advantages",))
        g.update(actor, loss="l", inputs=("advantages",))
        with pytest.raises(NodeSpecError) as info:
            g.build()
        assert_names(info.value, node="actor_generate", field="n")
        assert "'greedy_generate': 1" in str(info.value)

    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [
            ({"op": Op.COMPUTE, "role": "actor", "fn": "f", "outputs": ("x",)}, "role"),
            ({"op": Op.COMPUTE, "role": None, "outputs": ("x",)}, "fn"),
            ({"op": Op.COMPUTE, "role": None, "fn": "f", "outputs": ()}, "outputs"),
            ({"op": Op.UPDATE, "role": "actor", "outputs": ()}, "loss"),
            ({"op": Op.UPDATE, "role": "actor", "loss": "l", "outputs": ("x",)}, "outputs"),
            ({"op": Op.UPDATE, "role": None, "loss": "l", "outputs": ()}, "role"),
            ({"op": Op.LOGPROB, "role": "actor", "fn": "f", "outputs": ("old_logprobs",)}, "fn"),
            ({"op": Op.COMPUTE, "role": None, "fn": "f", "loss": "l", "outputs": ("x",)}, "loss"),
        ],
    )
    def test_op_specific_arguments(self, kwargs, field):
        inputs = SEQ if kwargs["op"] is Op.LOGPROB else ("scores",)
        with pytest.raises(NodeSpecError) as info:
            Node("n1", kwargs.pop("op"), kwargs.pop("role"), inputs, kwargs.pop("outputs"), **kwargs)
        assert_names(info.value, node="n1", field=field)

    def test_a_port_count_mismatch(self):
        with pytest.raises(NodeSpecError) as info:
            reinforce(lambda g: g.logprob("actor", inputs=("prompts", "responses")))
        assert_names(info.value, node="actor_logprob", field="inputs")
        assert "['prompts', 'responses', 'response_mask']" in str(info.value)

    def test_one_field_bound_to_two_ports(self):
        with pytest.raises(NodeSpecError) as info:
            reinforce(lambda g: g.logprob("actor", inputs=("prompts", "responses", "responses")))
        assert_names(info.value, node="actor_logprob", field="responses")

    def test_a_bare_string_is_not_split_into_letters(self):
        with pytest.raises(NodeSpecError) as info:
            reinforce(lambda g: g.compute("oops", fn="f", inputs="scores", outputs=("x",)))
        assert_names(info.value, node="oops", field="inputs")
        assert "('scores',)" in str(info.value)

    def test_unknown_op_and_role_kind_strings(self):
        with pytest.raises(ValueError, match="'train'"):
            Node("n1", "train", "actor", (), ())  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="'critic'"):
            Role("c", "critic")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="identifier"):
            Role("has space", RoleKind.POLICY)


def test_with_node_options_revalidates_and_keeps_the_original():
    graph = reinforce()
    with pytest.raises(NodeSpecError) as info:
        graph.with_node_options("actor_generate", n=0)
    assert_names(info.value, node="actor_generate", field="n")
    changed = graph.with_node_options("actor_generate", n=8, temperature=0.7)
    assert changed.samples_per_prompt == 8 and graph.samples_per_prompt == 1
    assert changed.node("actor_generate").option("temperature") == 0.7
    with pytest.raises(KeyError, match="no node 'nope'"):
        graph.with_node_options("nope", n=2)
