"""The planner's step time equals exhaustive enumeration's on every instance we can afford to enumerate."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hybridflow.graph import Workload, load_graph
from hybridflow.planner import Cluster, InfeasibleError, ModelSpec, plan_placement
from hybridflow.planner.layouts import best_combination, role_candidates
from hybridflow.planner.problem import build_problem
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.search import set_partitions
from hybridflow.testing import brute_force_step_time
from hybridflow.testing.strategies import clusters, graphs, role_models, workloads


def enumeration_size(roles: int, cluster: Cluster) -> int:
    """Upper bound on the brute force's (partition, allocation) combinations."""
    allocations = sum(math.prod(m.gpus + 1 for m in cluster.machines if m.device.name == d) - 1
                      for d in cluster.device_names)
    bell = [1, 1, 2, 5, 15, 52][roles]
    return bell * allocations**roles


def assert_matches_brute_force(graph, models, workload, cluster) -> None:
    problem = build_problem(graph, models, workload, cluster)
    expected = brute_force_step_time(problem)
    if expected is None:
        with pytest.raises(InfeasibleError):
            plan_placement(PlanRequest(graph, models, workload, cluster))
        return
    plan = plan_placement(PlanRequest(graph, models, workload, cluster))
    assert plan.step_time_s == pytest.approx(expected, rel=1e-9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
          derandomize=True)
@given(graphs(), workloads(max_batch=256), clusters(max_gpus=16), st.data())
def test_planner_matches_brute_force_on_random_instances(graph, workload, cluster, data):
    models = data.draw(role_models(graph))
    roles = sum(role.kind.needs_gpu for role in graph.roles)
    assume(enumeration_size(roles, cluster) <= 150_000)
    assert_matches_brute_force(graph, models, workload, cluster)


@pytest.mark.parametrize(("spec", "algorithm", "reward", "models"), [
    ("4xA100-80G+2xT4", "ppo", "reward_model", ("qwen2.5-7b", "qwen2.5-7b", "qwen2.5-7b", "qwen2.5-1.5b")),
    ("8xA100-80G", "ppo", "reward_model", ("llama3-8b",) * 4),
    ("2x8xA100-80G", "grpo", "reward_function", ("llama3-8b", "llama3-8b")),
    ("8xA100-80G+8xL40S", "grpo", "reward_function", ("qwen2.5-7b", "qwen2.5-7b")),
    ("8xH100+8xA100-80G", "ppo", "reward_model", ("llama3-8b",) * 4),
    ("2xT4+2xA10G+4xL40S", "rloo", "reward_model", ("qwen2.5-1.5b", "qwen2.5-1.5b", "qwen2.5-0.5b")),
])
def test_planner_matches_brute_force_on_fixed_instances(spec, algorithm, reward, models):
    graph = load_graph(algorithm, reward_kind=reward)
    roles = [role.name for role in graph.roles if role.kind.needs_gpu]
    specs = {role: ModelSpec.preset(name) for role, name in zip(roles, models, strict=True)}
    assert_matches_brute_force(graph, specs, Workload(batch_size=256, prompt_len=512, response_len=512),
                               Cluster.parse(spec))


def test_partitions_are_the_bell_numbers():
    for n, bell in enumerate([1, 1, 2, 5, 15, 52]):
        found = [tuple(sorted(block) for block in p) for p in set_partitions([f"r{i}" for i in range(n)])]
        assert len(found) == bell and len({tuple(sorted(map(tuple, p))) for p in found}) == bell


def test_group_layout_search_equals_the_full_product_of_candidates():
    """Branch and bound over colocated roles' layouts finds the product's true minimum."""
    import itertools

    graph = load_graph("ppo")
    spec = ModelSpec.preset("qwen2.5-1.5b")
    cluster = Cluster.parse("4xA100-40G")
    problem = build_problem(graph, dict.fromkeys(("actor", "critic", "reward", "reference"), spec),
                            Workload(batch_size=128, prompt_len=512, response_len=512), cluster)
    from hybridflow.planner.groups import GroupEvaluator
    from hybridflow.planner.layouts import usable_bytes

    shape = GroupEvaluator(problem).shape("A100-40G", [4])
    fronts = [role_candidates(problem.role(r), shape, "bf16", 512) for r in ("actor", "critic", "reference")]
    capacity = usable_bytes(shape)
    feasible = [sum(c.seconds for c in combo) for combo in itertools.product(*fronts)
                if sum(c.static for c in combo) + max(c.transient for c in combo) <= capacity]
    chosen = best_combination(fronts, capacity)
    assert feasible and chosen is not None
    assert sum(c.seconds for c in chosen) == pytest.approx(min(feasible), rel=1e-12)
