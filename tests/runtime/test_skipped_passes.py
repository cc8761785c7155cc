"""Passes whose results are known are not run (issues 22 and 24): the old log-probs of a single on-policy update
come from its own forward, detached, and a reference nothing reads (``kl_coef: 0``) is never built. Same samples,
same seed: the metrics and weights equal those of the run that keeps the passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import Graph, load_graph, with_detached_logprobs
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, StepResult, default_plan

TOKENIZER = char_tokenizer()
LOADER = PromptLoader(records=task_examples("reverse", 32), tokenizer=TOKENIZER, batch_size=4)


def _run(graph: Graph, model: Path, steps: int = 2, optim: OptimSpec | None = None,
         ) -> tuple[list[StepResult], torch.Tensor, list[str], torch.Tensor]:
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model),
                              optim=(optim or OptimSpec(lr=1e-2)) if r.kind.trainable else None)
             for r in graph.roles if r.kind.needs_gpu}
    scorer = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)
    with Controller(graph, default_plan(graph), specs=specs, seed=3, driver_roles={"reward": scorer}) as controller:
        results = [controller.step(LOADER.batch(step), step=step) for step in range(steps)]
        built = sorted(role for group in controller.groups for info in group.info() for role in info["roles"])
        worker = controller.executor.groups[0].workers[0]  # type: ignore[attr-defined]
        weights = torch.cat([p.detach().flatten() for p in worker.engines["actor"].model.parameters()])
    return results, weights, built, results[-1].batch["responses"]


def _trained(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("actor/") and "time" not in k}


def test_a_single_on_policy_pass_skips_old_logprobs_with_the_same_metrics(random_model_dir: Path) -> None:
    graph = load_graph("grpo", reward_kind="reward_function", max_new_tokens=8, kl_coef=0.04)
    skipped = with_detached_logprobs(graph, {"actor"})
    assert "actor_logprob" not in skipped.order and "actor_logprob" in graph.order
    kept_metrics, kept_weights, _, kept_responses = _run(graph, random_model_dir)
    skip_metrics, skip_weights, _, skip_responses = _run(skipped, random_model_dir)
    assert torch.equal(kept_responses, skip_responses)  # the same samples at the last step
    for kept, skip in zip(kept_metrics, skip_metrics, strict=True):
        assert set(_trained(kept.metrics)) == set(_trained(skip.metrics)) and "actor/kl_loss" in skip.metrics
        for key, value in _trained(kept.metrics).items():
            assert skip.metrics[key] == pytest.approx(value, abs=1e-6), key
        assert "actor_logprob" in kept.node_seconds and "actor_logprob" not in skip.node_seconds
    assert skip_metrics[0].metrics["actor/approx_kl"] == 0.0  # the ratio is exactly 1
    assert torch.allclose(kept_weights, skip_weights, atol=1e-6)


def test_kl_coef_zero_never_builds_the_reference(random_model_dir: Path) -> None:
    graph = load_graph("grpo", reward_kind="reward_function", max_new_tokens=6, kl_coef=0.0)
    assert "reference" not in graph.role_names
    assert [s.node for s in graph.skipped] == ["reference_ref_logprob"]
    metrics, _, built, _ = _run(graph, random_model_dir, steps=1)
    assert built == ["actor"] and "actor/kl_loss" not in metrics[0].metrics


def test_a_detached_update_refuses_a_second_optimizer_step(random_model_dir: Path) -> None:
    graph = with_detached_logprobs(load_graph("grpo", reward_kind="reward_function", max_new_tokens=4), {"actor"})
    with pytest.raises(Exception, match=r"epochs=1, mini_batches=2.*keep the log-prob node"):
        _run(graph, random_model_dir, steps=1, optim=OptimSpec(lr=1e-3, mini_batches=2))
