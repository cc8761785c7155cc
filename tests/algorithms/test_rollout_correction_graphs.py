"""Off-policy corrections wired into the graphs: the generate option, the factories' options, the errors."""

from __future__ import annotations

import pytest
import torch
from hybridflow.algorithms.graphs import check_rollout_correction
from test_builtin_graphs_run import role_op_outputs, run_computes

from hybridflow.graph import Graph, GraphBuilder, NodeSpecError, Op, RoleKind, from_json, load_graph, to_json
from hybridflow.registry import LOSSES

CORRECTED = ["ppo", "grpo", "grpo_no_ref", "dr_grpo", "dapo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline"]


def _sampling_node(graph: Graph) -> str:
    return next(name for name in graph.order if graph.node(name).op is Op.GENERATE)


def _uses(graph: Graph, field: str) -> bool:
    return any(field in node.inputs or field in node.outputs for node in graph.nodes)


def test_a_generate_node_writes_rollout_logprobs_only_when_asked() -> None:
    g = GraphBuilder("g")
    actor, reward = g.role("actor", RoleKind.POLICY), g.role("reward", RoleKind.REWARD_FUNCTION)
    g.generate(actor, n=2, logprobs=True)
    g.score(reward)
    g.update(actor, loss="ppo_policy", inputs=("prompts", "responses", "response_mask", "rollout_logprobs", "scores"))
    graph = g.build()
    node = graph.node("actor_generate")
    assert node.outputs == ("responses", "response_mask", "rollout_logprobs")
    assert node.port_outputs()["rollout_logprobs"] == "rollout_logprobs"
    assert from_json(to_json(graph)) == graph
    plain = GraphBuilder("p")
    plain.generate(plain.role("actor", RoleKind.POLICY), logprobs=False)
    assert plain._nodes[0].outputs == ("responses", "response_mask")


def test_a_bad_logprobs_option_or_binding_names_the_field() -> None:
    g = GraphBuilder("g")
    with pytest.raises(NodeSpecError, match="logprobs='yes' must be True or False") as err:
        g.generate(g.role("actor", RoleKind.POLICY), logprobs="yes")
    assert err.value.field == "logprobs"
    with pytest.raises(NodeSpecError, match="rollout_logprobs") as err:
        g.generate("actor", outputs=("r", "m"), logprobs=True)
    assert err.value.field == "outputs"


@pytest.mark.parametrize("algorithm", CORRECTED)
def test_default_graphs_ask_for_no_logprobs(algorithm: str) -> None:
    graph = load_graph(algorithm)
    assert not _uses(graph, "rollout_logprobs")
    assert all("logprobs" not in node.options_dict and "rollout_correction" not in node.options_dict
               for node in graph.nodes)


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
@pytest.mark.parametrize("algorithm", CORRECTED)
def test_a_correction_asks_the_rollout_for_logprobs_and_feeds_the_update(algorithm: str, mode: str) -> None:
    graph = load_graph(algorithm, rollout_correction=mode, rollout_is_cap=3.0)
    sampler = graph.node(_sampling_node(graph))
    assert sampler.option("logprobs") is True and "rollout_logprobs" in sampler.outputs
    update = graph.node("actor_update")
    assert "rollout_logprobs" in update.inputs
    assert update.option("rollout_correction") == mode and update.option("rollout_is_cap") == 3.0
    generates = [node for node in graph.nodes if node.op is Op.GENERATE]
    assert [node.option("logprobs") for node in generates[1:]] == [None] * (len(generates) - 1)  # ReMax's greedy
    check_rollout_correction(graph)


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
@pytest.mark.parametrize("algorithm", CORRECTED)
def test_on_policy_the_correction_weights_are_one(algorithm: str, mode: str) -> None:
    graph = load_graph(algorithm, rollout_correction=mode)
    gen = torch.Generator().manual_seed(1)
    rows = 3 * graph.samples_per_prompt
    fields = role_op_outputs(graph, rows, gen)
    fields["rollout_logprobs"] = fields["old_logprobs"].clone()  # the rollout and the trainer agree
    run_computes(graph, fields)
    update = graph.node("actor_update")
    batch = {name: fields[name] for name in update.inputs}
    logprobs = (batch["old_logprobs"] + 0.05).requires_grad_()
    loss, metrics = LOSSES.get("ppo_policy")(outputs={"logprobs": logprobs}, batch=batch, **update.options_dict)
    plain_options = {k: v for k, v in update.options_dict.items() if not k.startswith("rollout_")}
    plain, _ = LOSSES.get("ppo_policy")(outputs={"logprobs": logprobs}, batch=batch, **plain_options)
    assert loss.item() == pytest.approx(plain.item(), abs=1e-7)
    for name in ("rollout_is_mean", "rollout_is_min", "rollout_is_max", "rollout_is_kept_fraction"):
        assert metrics[name].item() == pytest.approx(1.0, abs=1e-7), name
    assert metrics["rollout_logprob_gap_max"].item() == 0.0


def test_bad_correction_options_name_the_option() -> None:
    with pytest.raises(ValueError, match="rollout_correction 'is'; use one of tis, decoupled"):
        load_graph("grpo", rollout_correction="is")
    with pytest.raises(ValueError, match=r"rollout_is_cap=3\.0 applies only with rollout_correction"):
        load_graph("grpo", rollout_is_cap=3.0)
    with pytest.raises(ValueError, match=r"rollout_is_cap=0\.0 must be > 0"):
        load_graph("grpo", rollout_correction="tis", rollout_is_cap=0.0)
    with pytest.raises(TypeError, match="rollout_correction"):
        load_graph("gspo", rollout_correction="tis")  # gspo_policy has no correction


def test_a_correction_without_the_field_names_node_and_option() -> None:
    g = GraphBuilder("mine")
    actor, reward = g.role("actor", RoleKind.POLICY), g.role("reward", RoleKind.REWARD_FUNCTION)
    g.generate(actor)
    g.score(reward)
    g.logprob(actor)
    g.update(actor, loss="ppo_policy", inputs=("prompts", "responses", "response_mask", "old_logprobs", "scores"),
             rollout_correction="tis")
    with pytest.raises(ValueError, match=r"node 'actor_update': rollout_correction='tis' needs .*logprobs=True"):
        check_rollout_correction(g.build())
