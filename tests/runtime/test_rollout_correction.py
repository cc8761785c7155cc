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
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, StepResult, default_plan

TOKENIZER = char_tokenizer()
LOADER = PromptLoader(records=task_examples("reverse", 16), tokenizer=TOKENIZER, batch_size=4)


def _step(graph: Graph, model: Path, rollout: str = "native") -> StepResult:
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model), micro_batch_size=4,
                              optim=OptimSpec(lr=1e-3) if r.kind.trainable else None,
                              rollout=rollout if r.kind.trainable else "native")
             for r in graph.roles if r.kind.needs_gpu}
    scorer = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)
    with Controller(graph, default_plan(graph), specs=specs, driver_roles={"reward": scorer}) as controller:
        return controller.step(LOADER.batch(0), step=0)


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
