"""Invariants of the auto planner under hypothesis, on clusters of up to 16 GPUs (the exact regime)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hybridflow.graph import Graph, Workload
from hybridflow.planner import Cluster, InfeasibleError, ModelSpec, Plan, plan_placement
from hybridflow.planner.manual import colocate_all_mapping, evaluate_mapping, even_split_mapping
from hybridflow.planner.problem import build_problem
from hybridflow.planner.request import PlanRequest
from hybridflow.testing import check_plan
from hybridflow.testing.strategies import clusters, graphs, role_models, workloads

FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
SLACK = 1 + 1e-9


@st.composite
def instances(draw: st.DrawFn, max_gpus: int = 16) -> tuple[Graph, dict[str, ModelSpec], Workload, Cluster]:
    graph = draw(graphs())
    return graph, draw(role_models(graph)), draw(workloads()), draw(clusters(max_gpus=max_gpus))


def auto_plan(graph: Graph, models: dict[str, ModelSpec], workload: Workload, cluster: Cluster) -> Plan:
    try:
        return plan_placement(PlanRequest(graph, models, workload, cluster))
    except InfeasibleError:
        assume(False)
        raise


def without_timing(plan: Plan) -> Plan:
    return dataclasses.replace(plan, search=None)


@FAST
@given(instances())
def test_plan_invariants_hold_and_plans_are_deterministic(instance):
    graph, models, workload, cluster = instance
    plan = auto_plan(graph, models, workload, cluster)
    check_plan(plan, graph=graph, cluster=cluster)
    assert plan.feasible
    assert all(g.memory_per_gpu_bytes <= g.capacity_bytes for g in plan.groups)
    assert without_timing(plan) == without_timing(plan_placement(PlanRequest(graph, models, workload, cluster)))


@FAST
@given(instances())
def test_auto_beats_colocate_all_and_even_split(instance):
    graph, models, workload, cluster = instance
    plan = auto_plan(graph, models, workload, cluster)
    problem = build_problem(graph, models, workload, cluster)
    colocated = evaluate_mapping(PlanRequest(graph, models, workload, cluster), colocate_all_mapping(problem),
                                 sharding=None)
    assert colocated.cross_group_bytes == 0
    check_plan(colocated, graph=graph, cluster=cluster)
    if colocated.feasible:
        assert plan.step_time_s <= colocated.step_time_s * SLACK
    split = even_split_mapping(problem)
    if split is not None:
        even = evaluate_mapping(PlanRequest(graph, models, workload, cluster), split, sharding=None)
        if even.feasible:
            assert plan.step_time_s <= even.step_time_s * SLACK


@st.composite
def manual_mappings(draw: st.DrawFn, roles: tuple[str, ...], cluster: Cluster) -> dict[str, tuple[int, ...]]:
    """A random valid mapping: roles split into groups, each on free GPUs of one device type."""
    labels = [draw(st.integers(0, i)) for i in range(len(roles))]
    free = {name: [g for m in cluster.machines if m.device.name == name for g in m.gpu_ids]
            for name in cluster.device_names}
    mapping: dict[str, tuple[int, ...]] = {}
    for label in sorted(set(labels)):
        usable = [name for name, gpus in free.items() if gpus]
        assume(usable)
        device = draw(st.sampled_from(usable))
        gpus = draw(st.lists(st.sampled_from(free[device]), min_size=1, unique=True))
        free[device] = [g for g in free[device] if g not in gpus]
        for role, mine in zip(roles, labels, strict=True):
            if mine == label:
                mapping[role] = tuple(sorted(gpus))
    return mapping


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(instances(max_gpus=12), st.data())
def test_auto_beats_any_valid_manual_mapping(instance, data):
    graph, models, workload, cluster = instance
    plan = auto_plan(graph, models, workload, cluster)
    problem = build_problem(graph, models, workload, cluster)
    mapping = data.draw(manual_mappings(problem.role_names, cluster))
    manual = evaluate_mapping(PlanRequest(graph, models, workload, cluster), mapping, sharding=None)
    check_plan(manual, graph=graph, cluster=cluster)
    if manual.feasible:
        assert plan.step_time_s <= manual.step_time_s * SLACK


@FAST
@given(instances(max_gpus=12), st.sampled_from(["A100-80G", "T4", "H100-80G", "L40S"]), st.sampled_from([1, 2, 4]))
def test_adding_gpus_never_makes_the_optimum_worse(instance, device, extra):
    graph, models, workload, cluster = instance
    plan = auto_plan(graph, models, workload, cluster)
    parts = [(m.host, m.device, m.gpus) for m in cluster.machines]
    bigger = Cluster.of([*parts, (len(parts), device, extra)])
    assert bigger.num_gpus <= 16
    assert plan_placement(PlanRequest(graph, models, workload, bigger)).step_time_s <= plan.step_time_s * SLACK


@pytest.mark.parametrize("spec", ["8xA100-80G", "2x4xH100", "4xA100-80G+2xT4"])
def test_colocated_plans_move_no_bytes_between_groups(spec, ppo, llama_models, seed_workload):
    cluster = Cluster.parse(spec)
    problem = build_problem(ppo, llama_models, seed_workload, cluster)
    plan = evaluate_mapping(PlanRequest(ppo, llama_models, seed_workload, cluster), colocate_all_mapping(problem),
                            sharding=None)
    assert len(plan.groups) == 1 and plan.cross_group_bytes == 0
