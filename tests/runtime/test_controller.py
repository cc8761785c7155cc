"""The controller on the local executor: every built-in algorithm runs, learns nothing silly, fails loudly."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import Graph, GraphBuilder, RoleKind, load_graph
from hybridflow.planner import GroupPlan, Plan, RoleLayout
from hybridflow.runtime import (
    Batch,
    Controller,
    NonFiniteLossError,
    OptimSpec,
    RewardFunctionError,
    RoleSpec,
    default_plan,
)

TOKENIZER = char_tokenizer()
LOADER = PromptLoader(records=task_examples("reverse", 64), tokenizer=TOKENIZER, batch_size=4)


def _specs(graph: Graph, model: Path, lr: float = 1e-3) -> dict[str, RoleSpec]:
    return {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model),
                             optim=OptimSpec(lr=lr) if r.kind.trainable else None)
            for r in graph.roles if r.kind.needs_gpu}


def _scorer() -> RuleScorer:
    return RuleScorer(TASKS.get("reverse").reward, TOKENIZER)


def _actor_weights(controller: Controller) -> torch.Tensor:
    worker = controller.executor.groups[0].workers[0]  # type: ignore[attr-defined]
    return torch.cat([p.detach().flatten().clone() for p in worker.engines["actor"].model.parameters()])


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline"])
def test_each_algorithm_runs_steps_and_moves_the_actor(algorithm: str, random_model_dir: Path) -> None:
    graph = load_graph(algorithm, reward_kind="reward_function", max_new_tokens=6)
    with Controller(graph, default_plan(graph), specs=_specs(graph, random_model_dir),
                    driver_roles={"reward": _scorer()}) as controller:
        before = _actor_weights(controller)
        for step in range(2):
            result = controller.step(LOADER.batch(step), step=step)
        after = _actor_weights(controller)
    n = graph.samples_per_prompt
    assert len(result.batch) == 4 * n
    assert not torch.equal(before, after), "the update node did not change the actor"
    assert math.isfinite(result.metrics["actor/loss"]) and set(result.node_seconds) == set(graph.order)
    mask = result.batch["response_mask"]
    assert mask.shape == result.batch["responses"].shape and bool((mask.sum(dim=1) >= 1).all())


def test_data_parallel_ranks_stay_identical_and_reward_model_scores(random_model_dir: Path) -> None:
    graph = load_graph("ppo", max_new_tokens=5)  # reward model on the GPU group, critic too
    with Controller(graph, default_plan(graph, num_gpus=2), specs=_specs(graph, random_model_dir)) as controller:
        result = controller.step(LOADER.batch(0), step=0)
        ranks = controller.executor.groups[0].workers  # type: ignore[attr-defined]
        weights = [torch.cat([p.flatten() for p in w.engines["critic"].model.parameters()]) for w in ranks]
    assert result.batch["scores"].shape == (4,)
    assert torch.equal(weights[0], weights[1]), "gradient averaging left the replicas different"


def test_generation_is_reproducible_for_a_seed_and_step(random_model_dir: Path) -> None:
    graph = load_graph("grpo", reward_kind="reward_function", max_new_tokens=6)
    runs = []
    for _ in range(2):
        with Controller(graph, default_plan(graph), specs=_specs(graph, random_model_dir), seed=7,
                        driver_roles={"reward": _scorer()}) as controller:
            runs.append(controller.step(LOADER.batch(0), step=0))
    assert torch.equal(runs[0].batch["responses"], runs[1].batch["responses"])
    assert runs[0].metrics["actor/loss"] == runs[1].metrics["actor/loss"]


def test_disjoint_groups_and_the_driver_run_concurrently(random_model_dir: Path) -> None:
    graph = load_graph("grpo", reward_kind="reward_function", max_new_tokens=6)
    layout = {role: RoleLayout(role=role, dp=1, dtype="fp32", micro_batch_size=8) for role in ("actor", "reference")}
    plan = Plan(algorithm="grpo", driver_roles=("reward",), groups=(
        GroupPlan(gpus=(0,), hosts=(0,), device="cpu", roles=("actor",), layouts=(layout["actor"],),
                  memory_per_gpu_bytes=0, capacity_bytes=0),
        GroupPlan(gpus=(1,), hosts=(0,), device="cpu", roles=("reference",), layouts=(layout["reference"],),
                  memory_per_gpu_bytes=0, capacity_bytes=0)))
    active, overlap = set[str](), []

    def slow_scorer(batch: Batch) -> Batch:
        active.add("reward")
        time.sleep(0.3)
        overlap.append(set(active))
        active.discard("reward")
        return _scorer()(batch)

    with Controller(graph, plan, specs=_specs(graph, random_model_dir), driver_roles={"reward": slow_scorer}) as c:
        engine = c.executor.groups[1].workers[0].engines["reference"]  # type: ignore[attr-defined]
        original = engine.log_probs

        def slow_log_probs(batch: Batch, *, with_entropy: bool = False) -> Batch:
            active.add(threading.current_thread().name)
            time.sleep(0.3)
            overlap.append(set(active))
            return original(batch, with_entropy=with_entropy)

        engine.log_probs = slow_log_probs
        start = time.perf_counter()
        c.step(LOADER.batch(0), step=0)
        elapsed = time.perf_counter() - start
    assert any(len(seen) > 1 for seen in overlap), f"reward scoring never overlapped ref log-probs: {overlap}"
    assert elapsed < 0.6 + 1.0


def test_a_failing_reward_function_names_the_sample(random_model_dir: Path) -> None:
    def picky(response: str, truth: str) -> float:
        raise ValueError("cannot parse")

    graph = load_graph("grpo", reward_kind="reward_function", max_new_tokens=4)
    with (Controller(graph, default_plan(graph), specs=_specs(graph, random_model_dir),
                     driver_roles={"reward": RuleScorer(picky, TOKENIZER)}) as controller,
          pytest.raises(RewardFunctionError, match=r"sample 0.*prompt 'rev") as info):
        controller.step(LOADER.batch(0), step=0)
    assert info.value.sample == 0


def nan_loss(*, outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    return outputs["logprobs"].sum() * float("nan"), {}


def test_a_nan_loss_aborts_the_step_before_the_optimizer_moves(random_model_dir: Path) -> None:
    g = GraphBuilder("nan")
    actor, reward = g.role("actor", RoleKind.POLICY), g.role("reward", RoleKind.REWARD_FUNCTION)
    g.generate(actor, max_new_tokens=4)
    g.score(reward)
    g.update(actor, loss=f"{__file__}:nan_loss", inputs=("prompts", "responses", "response_mask", "scores"))
    graph = g.build()
    with Controller(graph, default_plan(graph), specs=_specs(graph, random_model_dir),
                    driver_roles={"reward": _scorer()}) as controller:
        before = _actor_weights(controller)
        with pytest.raises(NonFiniteLossError, match="actor"):
            controller.step(LOADER.batch(0), step=0)
        assert torch.equal(before, _actor_weights(controller))


def test_a_role_missing_from_the_plan_or_scorers_is_named(random_model_dir: Path) -> None:
    graph = load_graph("grpo", reward_kind="reward_function")
    with pytest.raises(KeyError, match="'reward' runs on the driver"):
        Controller(graph, default_plan(graph), specs=_specs(graph, random_model_dir))


def test_a_layout_that_does_not_fill_its_group_is_refused(random_model_dir: Path) -> None:
    graph = load_graph("grpo", reward_kind="reward_function")
    layouts = tuple(RoleLayout(role=r, dp=1, dtype="fp32") for r in ("actor", "reference"))
    plan = Plan(algorithm="grpo", driver_roles=("reward",), groups=(
        GroupPlan(gpus=(0, 1), hosts=(0, 0), device="cpu", roles=("actor", "reference"), layouts=layouts,
                  memory_per_gpu_bytes=0, capacity_bytes=0),))
    with pytest.raises(ValueError, match=r"'actor' has dp=1 x tp=1 but its group has 2 GPUs"):
        Controller(graph, plan, specs=_specs(graph, random_model_dir), driver_roles={"reward": _scorer()})
