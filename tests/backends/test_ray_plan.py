"""A PPO step following a two-node plan on Ray: actor (FSDP) + critic (DeepSpeed) on one node's group,
reference (FSDP) + reward model (torch) on the other's; every rank is its own process on gloo."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("deepspeed", reason="needs DeepSpeed (the `deepspeed` extra)")

from hybridflow.data import PromptLoader, char_tokenizer, task_examples  # noqa: E402
from hybridflow.graph import RoleKind, load_graph  # noqa: E402
from hybridflow.planner import GroupPlan, Plan, RoleLayout, Sharding  # noqa: E402
from hybridflow.runtime import Controller, OptimSpec, RoleSpec  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# What each backend reports running for the plan's sharding (DeepSpeed names its ZeRO stage).
EXECUTED = {Sharding.FULL_SHARD: "FULL_SHARD", Sharding.NO_SHARD: "NO_SHARD", Sharding.ZERO2: "ZERO2"}
LAYOUTS = {"actor": ("fsdp", Sharding.FULL_SHARD), "critic": ("deepspeed", Sharding.ZERO2),
           "reference": ("fsdp", Sharding.NO_SHARD), "reward": ("torch", Sharding.NO_SHARD)}


def two_node_plan() -> Plan:
    def group(roles: tuple[str, str], gpus: tuple[int, int], host: int) -> GroupPlan:
        layouts = tuple(RoleLayout(role=role, dp=2, dtype="fp32", micro_batch_size=4, sharding=LAYOUTS[role][1])
                        for role in roles)
        return GroupPlan(gpus=gpus, hosts=(host, host), device="cpu", roles=roles, layouts=layouts,
                         memory_per_gpu_bytes=0, capacity_bytes=0)

    return Plan(algorithm="ppo", groups=(group(("actor", "critic"), (0, 1), 0),
                                         group(("reference", "reward"), (2, 3), 1)))


def test_ppo_follows_the_plan_with_fsdp_and_deepspeed_roles(ray_two_nodes: str) -> None:
    from hybridflow.runtime.ray_executor import RayExecutor, gpu_nodes

    graph = load_graph("ppo", max_new_tokens=6)
    specs = {role.name: RoleSpec(name=role.name, kind=role.kind, model="tiny-qwen2", backend=LAYOUTS[role.name][0],
                                 optim=OptimSpec(lr=1e-3) if role.kind.trainable else None)
             for role in graph.roles}
    assert specs["reward"].kind is RoleKind.REWARD_MODEL
    loader = PromptLoader(records=task_examples("reverse", 16), tokenizer=char_tokenizer(), batch_size=4)
    with Controller(graph, two_node_plan(), specs=specs, executor=RayExecutor(address=ray_two_nodes)) as controller:
        result = controller.step(loader.batch(0), step=0)
        assert {"actor/loss", "critic/vf_loss", "critic/grad_norm"} <= set(result.metrics)
        nodes = gpu_nodes()
        for group, host in ((0, 0), (1, 1)):
            infos = controller.groups[group].info()
            assert [info["node_id"] for info in infos] == [nodes[host]] * 2, f"group {group} is not on host {host}"
            assert len({info["gpu_ids"][0] for info in infos}) == 2, "two ranks share one GPU bundle"
            assert len({info["placement_group"] for info in infos}) == 1
            # Each engine runs the layout the plan recorded (the plan is the contract).
            for info in infos:
                for role, ran in info["layouts"].items():
                    planned = controller.plan.layout(role)
                    assert ran["micro_batch_size"] == planned.micro_batch_size, role
                    assert ran["forward_micro_batch_size"] == (planned.forward_micro_batch_size
                                                               or planned.micro_batch_size), role
                    assert ran["sharding"] == EXECUTED[planned.sharding], role


def test_placement_auto_runs_the_planned_layouts_on_fsdp_and_deepspeed(tmp_path, random_model_dir) -> None:
    from hybridflow.runtime.ray_executor import RayExecutor
    from hybridflow.train.config import load_config
    from hybridflow.train.prepare import prepare_run

    config = load_config(None, ["algorithm=grpo", "placement.mode=auto", "placement.cluster=2xCPU", "data.batch_size=4",
                                "algorithm.options={max_new_tokens: 4, n: 2}", "executor.name=ray",
                                "roles={actor: {backend: fsdp}, reference: {backend: deepspeed}}",
                                f"output_dir={tmp_path}", "logging.progress=false"])
    prepared = prepare_run(config)
    specs = prepared.role_specs(str(random_model_dir))
    assert {specs["actor"].backend, specs["reference"].backend} == {"fsdp", "deepspeed"}
    loader = PromptLoader(records=task_examples("reverse", 16), tokenizer=char_tokenizer(), batch_size=4)
    with Controller(prepared.graph, prepared.plan, specs=specs, executor=RayExecutor(),
                    driver_roles={"reward": prepared.scorer}) as controller:
        controller.step(loader.batch(0), step=0)
        ran = {(info["rank"], role): layout for group in controller.groups for info in group.info()
               for role, layout in info["layouts"].items()}
    for (_, role), layout in ran.items():
        planned = prepared.plan.layout(role)
        assert layout["micro_batch_size"] == planned.micro_batch_size, role
        assert layout["forward_micro_batch_size"] == (planned.forward_micro_batch_size or planned.micro_batch_size)
        assert layout["rollout_batch_size"] == planned.rollout_batch_size, role
        stage = {"NO_SHARD": "NO_SHARD", "SHARD_GRAD_OP": "ZERO2", "FULL_SHARD": "ZERO3", "ZERO1": "ZERO1",
                 "ZERO2": "ZERO2", "ZERO3": "ZERO3"}
        expected = planned.sharding.value if specs[role].backend == "fsdp" else stage[planned.sharding.value]
        assert layout["sharding"] == expected, role
    assert {role for _, role in ran} == {"actor", "reference"}
