"""One PlanRequest feeds the search and a hand-written mapping; a role's fixed token budget is an input of the
plan (its layouts carry it and its cost is computed with it), never written into a finished plan (issue 38)."""

from __future__ import annotations

import pytest

from hybridflow.graph import Graph, Workload, load_graph
from hybridflow.planner import (
    Cluster,
    ModelSpec,
    Plan,
    PlannerOptions,
    PlanRequest,
    RunSettings,
    evaluate_mapping,
    plan_placement,
)
from hybridflow.planner.manual import parse_mapping

BUDGET = 96  # tokens per micro batch and GPU: a few rows of the workload below, so many micro batches


@pytest.fixture(scope="module")
def grpo() -> Graph:
    return load_graph("grpo", reward_kind="reward_function")


def request(graph: Graph, **fixed: object) -> PlanRequest:
    models = {role.name: ModelSpec.preset("qwen2.5-0.5b") for role in graph.roles if role.kind.needs_gpu}
    work = Workload(batch_size=16, prompt_len=32, response_len=32)
    return PlanRequest(graph, models, work, Cluster.parse("4xA100-80G"), **fixed)  # type: ignore[arg-type]


def node_seconds(plan: Plan, role: str) -> dict[str, float]:
    return {node.node: node.seconds for node in plan.nodes if node.role == role}


def test_a_mapping_is_costed_with_the_fixed_budget(grpo: Graph) -> None:
    mapping = parse_mapping("actor=0-3,reference=0-3")
    rows = evaluate_mapping(request(grpo), mapping, data_parallel_size=4)
    budgeted = evaluate_mapping(request(grpo, token_budgets={"actor": BUDGET}), mapping, data_parallel_size=4)
    layout = budgeted.layout("actor")
    assert (layout.max_tokens_per_micro_batch, layout.forward_max_tokens_per_micro_batch) == (BUDGET, BUDGET)
    assert budgeted.layout("reference").max_tokens_per_micro_batch == 0
    # The cost saw the budget: the actor's passes cost otherwise, the reference's (cut by rows) as before.
    assert node_seconds(budgeted, "actor") != node_seconds(rows, "actor")
    assert node_seconds(budgeted, "reference") == node_seconds(rows, "reference")
    # The same budget as the run's (every role's) costs the actor alike: one budget, one cost.
    run = RunSettings(train_tokens_per_gpu=BUDGET, forward_tokens_per_gpu=BUDGET)
    everyone = evaluate_mapping(request(grpo, settings=run), mapping, data_parallel_size=4)
    assert node_seconds(everyone, "actor") == pytest.approx(node_seconds(budgeted, "actor"))


def test_the_search_plans_with_the_fixed_budget(grpo: Graph) -> None:
    plan = plan_placement(request(grpo, token_budgets={"actor": BUDGET}), PlannerOptions(unit="gpu"))
    layout = plan.layout("actor")
    assert (layout.max_tokens_per_micro_batch, layout.forward_max_tokens_per_micro_batch) == (BUDGET, BUDGET)
    # Re-costing the chosen placement by hand with the same request gives the search's own step time.
    mapping = {role: group.gpus for group in plan.groups for role in group.roles}
    again = evaluate_mapping(request(grpo, token_budgets={"actor": BUDGET}), mapping,
                             data_parallel_size={lay.role: lay.dp for g in plan.groups for lay in g.layouts},
                             sharding={lay.role: lay.sharding for g in plan.groups for lay in g.layouts},
                             dtypes={lay.role: lay.dtype for g in plan.groups for lay in g.layouts})
    assert again.step_time_s == pytest.approx(plan.step_time_s, rel=1e-6)
    assert plan.step_time_s != plan_placement(request(grpo), PlannerOptions(unit="gpu")).step_time_s


def test_bad_request_fields_name_the_field(grpo: Graph) -> None:
    with pytest.raises(ValueError, match=r"PlanRequest.token_budgets\['actor'\]=0 must be a positive number"):
        request(grpo, token_budgets={"actor": 0})
    with pytest.raises(ValueError, match=r"token_budgets names \['critic'\]"):
        plan_placement(request(grpo, token_budgets={"critic": 64}))
    with pytest.raises(TypeError, match="plan_placement takes a PlanRequest"):
        plan_placement(grpo)  # type: ignore[arg-type]
