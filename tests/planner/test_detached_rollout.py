"""Detached rollouts: a trainable policy's generate nodes on GPUs of their own (``actor:rollout``)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridflow.graph import Graph, Workload, load_graph
from hybridflow.planner import (
    Cluster,
    GroupPlan,
    InfeasibleError,
    ModelSpec,
    Plan,
    PlannerOptions,
    plan_placement,
    rollout_role,
)
from hybridflow.planner.costs import COLLECTIVE_LATENCY_S, USABLE_MEMORY
from hybridflow.planner.manual import evaluate_mapping, parse_mapping
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.weight_moves import WEIGHT_TENSOR_S
from hybridflow.testing import check_plan
from hybridflow.testing.strategies import clusters, graphs, role_models, workloads

from .conftest import SEED_MAPPING

ROLLOUT = rollout_role("actor")
Instance = tuple[Graph, dict[str, ModelSpec], Workload, Cluster]


@pytest.fixture(scope="module")
def seed(ppo: Graph, llama_models: dict[str, ModelSpec], seed_workload: Workload) -> Instance:
    return ppo, llama_models, seed_workload, Cluster.parse("8xA100-80G")


def pinned(instance: Instance, mapping: str) -> Plan:
    """``mapping`` with training layouts fixed, so plans with and without a detached rollout train the
    actor alike, and the colocated engine reuses the training shards (no resharding on actor_update)."""
    graph = instance[0]
    every = dict.fromkeys([role.name for role in graph.roles if role.kind.needs_gpu] + [ROLLOUT], 8)
    return evaluate_mapping(PlanRequest(*instance, micro_batch_sizes=every), parse_mapping(mapping),
                            sharding="NO_SHARD",
                            data_parallel_size={"actor": 1, "critic": 1}, rollout_tp={"actor": 4, ROLLOUT: 1})


def group_of(plan: Plan, role: str) -> GroupPlan:
    index = plan.group_index(role)
    assert index is not None, f"{role} runs on the driver"
    return plan.groups[index]


def node(plan: Plan, name: str) -> float:
    return next(n.seconds for n in plan.nodes if n.node == name)


def without_timing(plan: Plan) -> Plan:
    return dataclasses.replace(plan, search=None)


def test_rollout_on_its_own_gpus_is_costed_and_valid(seed: Instance) -> None:
    graph, models, _, cluster = seed
    detached = pinned(seed, SEED_MAPPING + f",{ROLLOUT}=6-7")
    assert detached.detached_rollouts == {"actor": ROLLOUT} and detached.feasible
    assert detached.runs_on("actor", generates=True) == ROLLOUT and detached.runs_on("actor") == "actor"
    assert (group_of(detached, ROLLOUT).gpus, group_of(detached, ROLLOUT).roles) == ((6, 7), (ROLLOUT,))
    generate = next(n for n in detached.nodes if n.node == "actor_generate")
    assert (generate.group, generate.role) == (detached.group_index(ROLLOUT), ROLLOUT)
    rollout = detached.layout(ROLLOUT)
    assert (rollout.tp, rollout.dp, rollout.dtype) == (1, 2, "bf16")
    assert detached.weight_sync_bytes == models["actor"].params * 2
    # NO_SHARD trainer: no gather first, one full bf16 copy at the inter-node bandwidth, sent tensor by tensor.
    shipment = (detached.weight_sync_bytes / cluster.inter_node_bandwidth + COLLECTIVE_LATENCY_S
                + models["actor"].weight_tensors * WEIGHT_TENSOR_S)
    assert detached.weight_sync_seconds == pytest.approx(shipment, rel=1e-9)
    check_plan(detached, graph=graph, cluster=cluster)
    assert Plan.from_json(detached.to_json()) == detached
    assert Plan.from_json(detached.to_json()).detached_rollouts == {"actor": ROLLOUT}


def test_shipping_weights_slows_the_actor_update_by_exactly_the_shipment(seed: Instance) -> None:
    detached = pinned(seed, SEED_MAPPING + f",{ROLLOUT}=6-7")
    colocated = pinned(seed, SEED_MAPPING)
    fields = ("dp", "tp", "sharding", "micro_batch_size", "gradient_checkpointing", "dtype")
    trains = [tuple(getattr(plan.layout("actor"), f) for f in fields) for plan in (detached, colocated)]
    assert trains[0] == trains[1]
    assert colocated.weight_sync_seconds == 0 and colocated.weight_sync_bytes == 0
    assert detached.weight_sync_seconds > 0
    assert node(detached, "actor_update") == pytest.approx(node(colocated, "actor_update")
                                                            + detached.weight_sync_seconds, rel=1e-9)
    assert node(detached, "critic_update") == pytest.approx(node(colocated, "critic_update"), rel=1e-9)


@pytest.mark.parametrize("gpus", [(0, 1, 2, 3), (3, 1, 0, 2)])
def test_rollout_on_the_actors_gpus_is_the_colocated_plan(seed: Instance, gpus: tuple[int, ...]) -> None:
    mapping = parse_mapping(SEED_MAPPING)
    same = evaluate_mapping(PlanRequest(*seed), {**mapping, ROLLOUT: gpus})
    assert same.detached_rollouts == {} and ROLLOUT not in same.roles
    assert without_timing(same) == without_timing(evaluate_mapping(PlanRequest(*seed), mapping))


@pytest.mark.parametrize("role", ["reference", "critic", "reward"])
def test_rollout_for_a_role_that_does_not_generate_and_train_is_an_error(seed: Instance, role: str) -> None:
    mapping = {**parse_mapping(SEED_MAPPING), rollout_role(role): (6, 7)}
    with pytest.raises(ValueError, match=re.escape(f"role {role!r}")):
        evaluate_mapping(PlanRequest(*seed), mapping)


def test_rollout_of_a_reward_function_is_an_error(llama_models: dict[str, ModelSpec], seed_workload: Workload) -> None:
    graph = load_graph("grpo", reward_kind="reward_function")
    models = {"actor": llama_models["actor"], "reference": llama_models["reference"]}
    mapping = {**parse_mapping("actor=0-3,reference=4-5"), rollout_role("reward"): (6, 7)}
    with pytest.raises(ValueError, match=r"role 'reward'.*only a trainable policy"):
        evaluate_mapping(PlanRequest(graph, models, seed_workload, Cluster.parse("8xA100-80G")), mapping)


@st.composite
def instances(draw: st.DrawFn) -> Instance:
    graph = draw(graphs())
    return graph, draw(role_models(graph)), draw(workloads(max_batch=256)), draw(clusters(max_gpus=8))


def _plan(instance: Instance, options: PlannerOptions | None = None) -> Plan | None:
    try:
        return plan_placement(PlanRequest(*instance), options=options)
    except InfeasibleError:
        return None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(instances())
def test_separate_rollout_is_never_worse_and_its_plans_are_valid(instance: Instance) -> None:
    graph, _, _, cluster = instance
    default = _plan(instance)
    separate = _plan(instance, PlannerOptions(separate_rollout=True))
    if default is not None:
        assert separate is not None
        assert separate.step_time_s <= default.step_time_s * (1 + 1e-9)
        if separate.detached_rollouts:
            assert separate.step_time_s < default.step_time_s
    if separate is not None:
        check_plan(separate, graph=graph, cluster=cluster)


def test_small_policy_trains_on_a100s_while_its_rollout_decodes_on_the_h20s() -> None:
    """The H20's HBM (4 TB/s, twice the A100's) decodes faster; the A100's FLOPs train faster. (An L40S, once
    chosen here for its peak FLOPs, trains slower than an A100 once its memory-bound ops are priced at its
    864 GB/s.)"""
    graph = load_graph("grpo")
    models = dict.fromkeys(("actor", "reference", "reward"), ModelSpec.preset("llama3.2-3b"))
    workload = Workload(batch_size=512, prompt_len=512, response_len=2048)
    cluster = Cluster.parse("4xA100-80G+4xH20")
    default = plan_placement(PlanRequest(graph, models, workload, cluster))
    separate = plan_placement(PlanRequest(graph, models, workload, cluster),
                              options=PlannerOptions(separate_rollout=True))
    check_plan(separate, graph=graph, cluster=cluster)
    assert default.detached_rollouts == {} and separate.detached_rollouts == {"actor": ROLLOUT}
    assert separate.step_time_s < default.step_time_s * 0.97  # ~7% by the cost model
    devices = {role: group_of(separate, role).device for role in ("actor", ROLLOUT)}
    assert devices == {"actor": "A100-80G", ROLLOUT: "H20"}
    assert separate.weight_sync_bytes == models["actor"].params * 2


def test_rollout_engine_memory_is_reported_as_the_search_counted_it(seed: Instance) -> None:
    plan = evaluate_mapping(PlanRequest(*seed), parse_mapping(SEED_MAPPING + f",{ROLLOUT}=6-7"),
                            rollout_tp={ROLLOUT: 2})
    group = group_of(plan, ROLLOUT)
    assert plan.feasible
    assert group.memory_per_gpu_bytes <= group.capacity_bytes * USABLE_MEMORY
