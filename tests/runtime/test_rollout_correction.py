"""Off-policy corrections end to end on the local executor: the rollout's behaviour log-probs reach the update.

On-policy (the same weights generate and score, nothing updates in between) the behaviour log-probs equal the
trainer's ``old_logprobs``, so the correction weights are 1 and the loss is plain PPO's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import Graph, load_graph
from hybridflow.planner import ExecutionMode, GroupPlan, Plan, RoleLayout
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, StepResult, default_plan

TOKENIZER = char_tokenizer()
LOADER = PromptLoader(records=task_examples("reverse", 16), tokenizer=TOKENIZER, batch_size=4)


def _controller(graph: Graph, model: Path, plan: Plan, *, rollout: str = "native", lr: float = 1e-3,
                pipeline: str = "sync") -> Controller:
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model),
                              optim=OptimSpec(lr=lr) if r.kind.trainable else None,
                              rollout=rollout if r.kind.trainable else "native")
             for r in graph.roles if r.kind.needs_gpu}
    scorer = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)
    return Controller(graph, plan, specs=specs, driver_roles={"reward": scorer}, mode=ExecutionMode(pipeline=pipeline))


def _step(graph: Graph, model: Path, rollout: str = "native") -> StepResult:
    with _controller(graph, model, default_plan(graph), rollout=rollout) as controller:
        return controller.step(LOADER.batch(0), step=0)


def _split(graph: Graph) -> Plan:
    """The actor trains on one (logical) GPU and generates on another."""
    def group(gpu: int, role: str) -> GroupPlan:
        return GroupPlan(gpus=(gpu,), hosts=(0,), device="cpu", roles=(role,),
                         layouts=(RoleLayout(role=role, dp=1, dtype="fp32", micro_batch_size=16),),
                         memory_per_gpu_bytes=0, capacity_bytes=0)

    return Plan(algorithm=graph.name, groups=(group(0, "actor"), group(1, "actor:rollout")), driver_roles=("reward",))


@pytest.mark.parametrize(("mode", "rollout"), [("tis", "native"), ("tis", "hf_generate"), ("decoupled", "native")])
def test_a_grpo_step_with_a_correction_weights_every_token_by_one_on_policy(random_model_dir: Path, mode: str,
                                                                           rollout: str) -> None:
    graph = load_graph("grpo", rollout_correction=mode, reward_kind="reward_function", max_new_tokens=6,
                       temperature=0.7)
    result = _step(graph, random_model_dir, rollout)
    batch, metrics = result.batch, result.metrics
    mask = batch["response_mask"]
    assert batch["rollout_logprobs"].shape == batch["responses"].shape
    assert bool((batch["rollout_logprobs"][mask == 0] == 0).all())
    gap = (batch["rollout_logprobs"] - batch["old_logprobs"])[mask == 1].abs().max()
    assert float(gap) < 1e-5
    for name in ("rollout_is_mean", "rollout_is_min", "rollout_is_max", "rollout_is_kept_fraction"):
        assert metrics[f"actor/{name}"] == pytest.approx(1.0, abs=1e-4), name
    assert metrics["actor/rollout_logprob_gap_max"] < 1e-5
    assert torch.isfinite(torch.tensor(metrics["actor/loss"]))


def test_a_default_graph_returns_no_rollout_logprobs(random_model_dir: Path) -> None:
    result = _step(load_graph("grpo", reward_kind="reward_function", max_new_tokens=6), random_model_dir)
    assert "rollout_logprobs" not in result.batch
    assert not any(name.startswith("actor/rollout_") for name in result.metrics)


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
def test_one_step_off_samples_are_reweighted_by_the_stale_rollouts_logprobs(random_model_dir: Path,
                                                                             mode: str) -> None:
    # A cap just above 1 (float noise on-policy stays under it): the stale step's weights reach past it.
    graph = load_graph("grpo_no_ref", rollout_correction=mode, rollout_is_cap=1.001, reward_kind="reward_function",
                       max_new_tokens=6)
    with _controller(graph, random_model_dir, _split(graph), lr=3e-2, pipeline="one_step_off") as controller:
        results = [controller.step(LOADER.batch(s), step=s, upcoming=LOADER.batch(s + 1) if s < 1 else None)
                   for s in range(2)]
    fresh, stale = (result.metrics for result in results)
    assert [m["pipeline/staleness_max"] for m in (fresh, stale)] == [0.0, 1.0]
    assert fresh["actor/rollout_logprob_gap_max"] < 1e-5  # the rollout's copy starts from the trainer's weights
    assert fresh["actor/rollout_is_kept_fraction"] == pytest.approx(1.0, abs=1e-4)
    # Step 1 sampled with the weights before step 0's update: the trainer's old log-probs moved away from them.
    assert stale["actor/rollout_logprob_gap_max"] > 1e-3
    if mode == "tis":
        assert stale["actor/rollout_is_min"] < 0.999 and stale["actor/rollout_is_max"] <= 1.001 + 1e-6
    else:  # tokens the update made likelier (weight above the cap) leave the loss
        assert stale["actor/rollout_is_kept_fraction"] < 1.0
