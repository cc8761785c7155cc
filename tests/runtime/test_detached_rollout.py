"""A policy whose rollout runs on a group of its own: generate there, weights shipped after every update."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import Graph, load_graph
from hybridflow.planner import GroupPlan, Plan, RoleLayout
from hybridflow.runtime import Batch, Controller, OptimSpec, RoleSpec

TOKENIZER = char_tokenizer()
LOADER = PromptLoader(records=task_examples("reverse", 64), tokenizer=TOKENIZER, batch_size=4)


def _group(gpus: Sequence[int], roles: Sequence[str]) -> GroupPlan:
    layouts = tuple(RoleLayout(role=role, dp=len(gpus), dtype="fp32", micro_batch_size=8) for role in roles)
    return GroupPlan(gpus=tuple(gpus), hosts=(0,) * len(gpus), device="cpu", roles=tuple(roles), layouts=layouts,
                     memory_per_gpu_bytes=0, capacity_bytes=0)


def _plan(trainer: Sequence[int] = (0,), rollout: Sequence[int] = (1,)) -> Plan:
    """GRPO with the actor training on ``trainer`` and generating on ``rollout`` (beside the reference)."""
    return Plan(algorithm="grpo", groups=(_group(trainer, ["actor"]), _group(rollout, ["actor:rollout", "reference"])),
                driver_roles=("reward",), weight_sync_bytes=1, weight_sync_seconds=0.5)


def _graph() -> Graph:
    return load_graph("grpo", reward_kind="reward_function", max_new_tokens=6)


def _controller(model: Path, plan: Plan, graph: Graph | None = None) -> Controller:
    graph = graph or _graph()
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model),
                              optim=OptimSpec(lr=1e-2) if r.kind.trainable else None)
             for r in graph.roles if r.kind.needs_gpu}
    return Controller(graph, plan, specs=specs,
                      driver_roles={"reward": RuleScorer(TASKS.get("reverse").reward, TOKENIZER)})


def _weights(controller: Controller, group: int, role: str, rank: int = 0) -> dict[str, torch.Tensor]:
    worker = controller.executor.groups[group].workers[rank]  # type: ignore[attr-defined]
    return {name: tensor.clone() for name, tensor in worker.engines[role].model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_generate_runs_on_the_rollout_group_and_sees_every_update(random_model_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = (("fleet/actor:rollout/replicas", 1), ("fleet/actor:rollout/sync_bytes", 7),
             ("fleet/actor:rollout/sync_s", 0.25))
    with _controller(random_model_dir, dataclasses.replace(_plan(), extra=fleet)) as controller:
        rollout = controller.executor.groups[1].workers[0].engines["actor:rollout"]  # type: ignore[attr-defined]
        trainer = controller.executor.groups[0].workers[0].engines["actor"]  # type: ignore[attr-defined]
        seen: list[dict[str, torch.Tensor]] = []
        generate = rollout.generate

        def spy(batch: Batch, sampling: Any) -> Batch:
            seen.append({name: t.clone() for name, t in rollout.model.state_dict().items()})
            return generate(batch, sampling)

        def refuse(batch: Batch, sampling: Any) -> Batch:
            raise AssertionError("the trainer group generated although the plan detached its rollout")

        monkeypatch.setattr(rollout, "generate", spy)
        monkeypatch.setattr(trainer, "generate", refuse)
        trained = []
        for step in range(3):
            result = controller.step(LOADER.batch(step), step=step)
            trained.append(_weights(controller, 0, "actor"))
        assert len(seen) == 3
        assert not _same(trained[0], trained[1]), "the updates did not move the actor"
        for step in (1, 2):  # each rollout sampled from the policy the previous update left
            assert _same(seen[step], trained[step - 1]), f"step {step} generated with stale weights"
        assert _same(_weights(controller, 1, "actor:rollout"), trained[-1])
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())  # tied weights once
    assert result.metrics["actor/weight_sync/bytes"] == params  # fp32, one full copy
    assert result.metrics["actor/weight_sync/receivers"] == 1
    assert result.metrics["actor/weight_sync/seconds"] > 0
    assert result.metrics["weight_sync/planned_bytes"] == 1 and result.metrics["weight_sync/planned_seconds"] == 0.5
    # a planned server fleet's sync estimate sits beside the server rollout's measured rollout/sync_* metrics
    assert result.metrics["actor/rollout/sync_bytes_planned"] == 7
    assert result.metrics["actor/rollout/sync_s_planned"] == 0.25
    assert result.metrics["transfer/to_group1_bytes"] > 0  # the prompts went to the rollout group


def test_two_rank_trainer_ships_to_every_rank_of_a_two_rank_rollout(random_model_dir: Path) -> None:
    with _controller(random_model_dir, _plan(trainer=(0, 1), rollout=(2, 3))) as controller:
        result = controller.step(LOADER.batch(0), step=0)
        trained = _weights(controller, 0, "actor")
        assert _same(trained, _weights(controller, 0, "actor", rank=1)), "data-parallel trainer ranks diverged"
        for rank in (0, 1):
            assert _same(_weights(controller, 1, "actor:rollout", rank=rank), trained)
    assert result.metrics["actor/weight_sync/receivers"] == 2
    assert len(result.batch) == 4 * _graph().samples_per_prompt


def test_a_checkpoint_load_refreshes_the_rollout(random_model_dir: Path, tmp_path: Path) -> None:
    with _controller(random_model_dir, _plan()) as controller:
        controller.step(LOADER.batch(0), step=0)
        controller.save_checkpoint(str(tmp_path))
        saved = _weights(controller, 0, "actor")
        controller.step(LOADER.batch(1), step=1)
        assert not _same(_weights(controller, 1, "actor:rollout"), saved)
        controller.load_checkpoint(str(tmp_path))
        assert _same(_weights(controller, 1, "actor:rollout"), saved)


def test_rollout_of_a_policy_without_a_spec_is_refused(random_model_dir: Path) -> None:
    graph = _graph()
    specs = {"reference": RoleSpec(name="reference", kind="frozen_policy", model=str(random_model_dir))}
    with pytest.raises(KeyError, match=r"separate rollout .*'actor'"):
        Controller(graph, _plan(), specs=specs, driver_roles={"reward": RuleScorer(TASKS.get("reverse").reward,
                                                                                   TOKENIZER)})


def test_a_rollout_for_a_role_that_does_not_generate_is_refused(random_model_dir: Path) -> None:
    plan = Plan(algorithm="grpo", groups=(_group((0,), ["actor", "reference:rollout"]), _group((1,), ["reference"])),
                driver_roles=("reward",))
    with pytest.raises(ValueError, match=r"'reference:rollout'.*trainable policy"):
        _controller(random_model_dir, plan)
    same = Plan(algorithm="grpo", groups=(_group((0,), ["actor", "actor:rollout"]), _group((1,), ["reference"])),
                driver_roles=("reward",))
    with pytest.raises(ValueError, match=r"'actor:rollout' shares 'actor'.*drop 'actor:rollout'"):
        _controller(random_model_dir, same)


@pytest.mark.gpu
def test_weights_shipped_between_cuda_groups(random_model_dir: Path) -> None:
    """Both groups on CUDA (one device is enough: plan GPU ids wrap onto the visible devices)."""
    def cuda(group: GroupPlan) -> GroupPlan:
        return GroupPlan(gpus=group.gpus, hosts=group.hosts, device="A100-80G", roles=group.roles,
                         layouts=group.layouts, memory_per_gpu_bytes=0, capacity_bytes=0)

    plan = _plan()
    with _controller(random_model_dir, Plan(algorithm="grpo", groups=tuple(cuda(g) for g in plan.groups),
                                            driver_roles=("reward",))) as controller:
        result = controller.step(LOADER.batch(0), step=0)
        trained = _weights(controller, 0, "actor")
        assert next(iter(trained.values())).is_cuda
        assert _same(_weights(controller, 1, "actor:rollout"), trained)
    assert result.metrics["actor/weight_sync/bytes"] > 0
