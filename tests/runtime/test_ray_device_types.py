"""Device types as Ray custom resources: a mixed A100 + T4 plan runs each group on its type's node."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridflow.data import PromptLoader, char_tokenizer, task_examples
from hybridflow.graph import load_graph
from hybridflow.planner import GroupPlan, Plan, RoleLayout
from hybridflow.runtime import Controller, OptimSpec, RoleSpec

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

TOKENIZER = char_tokenizer()


@pytest.fixture(scope="module")
def a100_t4_cluster() -> Iterator[str]:
    """Node A (the head): 4 logical A100-80G; node B: 2 logical T4. Yields the head address."""
    from ray.cluster_utils import Cluster

    sim = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 4,
                                                        "resources": {"gpu_type:A100-80G": 4}})
    sim.add_node(num_cpus=2, num_gpus=2, resources={"gpu_type:T4": 2})
    sim.wait_for_nodes()
    yield sim.address
    ray.shutdown()
    sim.shutdown()


def _group(roles: tuple[str, ...], gpus: tuple[int, ...], host: int, device: str, dtype: str) -> GroupPlan:
    layouts = tuple(RoleLayout(role=role, dp=len(gpus), dtype=dtype, micro_batch_size=8) for role in roles)
    return GroupPlan(gpus=gpus, hosts=(host,) * len(gpus), device=device, roles=roles, layouts=layouts,
                     memory_per_gpu_bytes=0, capacity_bytes=0)


def _mixed_plan(reward_device: str = "T4", reward_host: int = 1) -> Plan:
    """Actor + reference on A100 GPUs 0-1 (host 0), the reward model on two T4s (host 1) in fp16."""
    return Plan(algorithm="grpo", groups=(_group(("actor", "reference"), (0, 1), 0, "A100-80G", "fp32"),
                                          _group(("reward",), (4, 5), reward_host, reward_device, "fp16")))


def test_each_group_runs_on_the_node_of_its_device_type(a100_t4_cluster: str, random_model_dir: Path) -> None:
    from hybridflow.runtime.ray_executor import RayExecutor, gpu_nodes

    graph = load_graph("grpo", n=2, max_new_tokens=4, reward_kind="reward_model")
    specs = {role.name: RoleSpec(name=role.name, kind=role.kind, model=str(random_model_dir),
                                 optim=OptimSpec(lr=1e-3) if role.kind.trainable else None)
             for role in graph.roles if role.kind.needs_gpu}
    loader = PromptLoader(records=task_examples("reverse", 8), tokenizer=TOKENIZER, batch_size=2)
    executor = RayExecutor(address=a100_t4_cluster)
    with Controller(graph, _mixed_plan(), specs=specs, executor=executor) as controller:
        result = controller.step(loader.batch(0), step=0)
        assert result.batch["scores"].shape == (4,) and "actor/loss" in result.metrics
        nodes = gpu_nodes()
        types = {n["NodeID"]: set(n["Resources"]) for n in ray.nodes() if n["Alive"]}
        assert "gpu_type:A100-80G" in types[nodes[0]] and "gpu_type:T4" in types[nodes[1]]
        for group, node in ((0, nodes[0]), (1, nodes[1])):
            infos = controller.groups[group].info()
            assert [info["node_id"] for info in infos] == [node, node], f"group {group} left its device's node"
            assert len({info["gpu_ids"][0] for info in infos}) == 2
        bundles = [executor.groups[g].placement_group.bundle_specs for g in (0, 1)]
        assert all(b["gpu_type:A100-80G"] == 1 for b in bundles[0])
        assert all(b["gpu_type:T4"] == 1 for b in bundles[1])


@pytest.mark.parametrize(("device", "host", "message"), [
    ("H100-80G", 1, r"plan group 1 \(reward, 2x H100-80G\) needs 2 gpu_type:H100-80G but the cluster declares "
                    r"\{'A100-80G': 4, 'T4': 2\}; start nodes with --resources"),
    ("T4", 0, r"plan group 1 \(reward, 2x T4\) needs 2 gpu_type:T4 on plan host 0 = Ray node \w+ .* which "
              r"declares \{'A100-80G': 4\}"),
])
def test_a_device_type_missing_from_the_planned_node_fails_fast_and_names_it(
        a100_t4_cluster: str, random_model_dir: Path, device: str, host: int, message: str) -> None:
    from hybridflow.runtime.ray_executor import RayExecutor

    graph = load_graph("grpo", n=2, max_new_tokens=4, reward_kind="reward_model")
    specs = {role.name: RoleSpec(name=role.name, kind=role.kind, model=str(random_model_dir))
             for role in graph.roles if role.kind.needs_gpu}
    executor = RayExecutor(address=a100_t4_cluster)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        Controller(graph, _mixed_plan(device, host), specs=specs, executor=executor)
    assert time.perf_counter() - start < 5, "the plan was checked only after groups started"
    assert executor.groups == []
    live = [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
    assert live == [], "a group placed before the failure still holds its GPUs"
