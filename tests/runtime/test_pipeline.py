"""``one_step_off``: the rollout group generates step t+1 while the trainer works on step t (staleness 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from plans import split_plan

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import RoleKind, load_graph
from hybridflow.planner import ExecutionMode, Plan
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, default_plan

BACKEND = f"{Path(__file__).with_name('minimal_backend.py')}:BACKEND"
TOKENIZER = char_tokenizer()
GRAPH = load_graph("grpo_no_ref", n=4, max_new_tokens=5, reward_kind="reward_function")
LOADER = PromptLoader(records=task_examples("reverse", 64), tokenizer=TOKENIZER, batch_size=4)
SCORER = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)



SPLIT = split_plan()


def _controller(plan: Plan, pipeline: str) -> Controller:
    # A large learning rate, so one update visibly changes what the bigram policy samples.
    specs = {"actor": RoleSpec(name="actor", kind=RoleKind.POLICY, model="unused", backend=BACKEND,
                               optim=OptimSpec(lr=100.0), options={"vocab_size": len(TOKENIZER)})}
    return Controller(GRAPH, plan, specs=specs, driver_roles={"reward": SCORER}, mode=ExecutionMode(pipeline=pipeline))


def _run(pipeline: str, steps: int) -> list[Any]:
    with _controller(SPLIT, pipeline) as controller:
        return [controller.step(LOADER.batch(s), step=s, upcoming=LOADER.batch(s + 1) if s + 1 < steps else None)
                for s in range(steps)]


def test_each_step_trains_on_samples_one_update_old() -> None:
    results = _run("one_step_off", 4)
    assert all(r.metrics["pipeline/partial_fraction"] == 0.0 for r in results)  # whole batches, one version
    assert [r.metrics["pipeline/staleness_max"] for r in results] == [0.0, 1.0, 1.0, 1.0]
    assert [int(r.batch["policy_version"][0]) for r in results] == [0, 0, 1, 2]  # updates behind each batch
    assert all("actor/loss" in r.metrics for r in results)


def test_the_prefetched_samples_come_from_the_weights_before_the_update() -> None:
    overlapped = _run("one_step_off", 2)[1].batch
    synced = _run("sync", 2)[1].batch
    with _controller(SPLIT, "sync") as fresh:  # the initial weights: what step 1 sampled with, one step off
        again = fresh.generate("actor_generate", overlapped.select(["prompts", "prompt_mask", "uid"]), seed=1)
    assert torch.equal(overlapped["responses"], again["responses"])
    assert not torch.equal(overlapped["responses"], synced["responses"])  # on-policy step 1 samples differ


def test_one_step_off_needs_a_rollout_on_gpus_of_its_own() -> None:
    with pytest.raises(ValueError, match="on GPUs of its own"):
        _controller(default_plan(GRAPH), "one_step_off")
    with pytest.raises(ValueError, match=r"pipeline='fully_async' must be one of \['sync', 'one_step_off', 'async'\]"):
        _controller(SPLIT, "fully_async")
    with pytest.raises(ValueError, match="pipeline=async needs the rollout of 'actor' on GPUs of its own"):
        _controller(default_plan(GRAPH), "async")


@pytest.mark.slow
def test_hybridflow_train_runs_and_resumes_one_step_off_on_a_detached_rollout(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run's last checkpoint holds the batch of the step after it (generated with the weights before the
    last update), so a resumed run with more steps trains on samples one update old, as an uninterrupted run."""
    from hybridflow.train.config import load_config
    from hybridflow.train.loop import train

    def config(steps: int) -> Any:
        return load_config(None, ["algorithm=grpo_no_ref", "algorithm.options={n: 2, max_new_tokens: 4}",
                                  f"steps={steps}", "checkpoint.every=2", "model.sft_steps=5", "data.batch_size=4",
                                  "data.num_examples=32", "placement.mode=manual", "placement.cluster=2xCPU",
                                  "placement.meshes={actor: [0], 'actor:rollout': [1]}", "pipeline.mode=one_step_off",
                                  f"output_dir={tmp_path}", "logging.progress=false", "logging.plot=false"])

    assert [row["pipeline/staleness_max"] for row in train(config(2)).history] == [0.0, 1.0]
    assert (tmp_path / "checkpoints" / "step_000002" / "roles" / "rollout_state.bin").is_file()
    capsys.readouterr()
    resumed = train(config(3), resume=True).history
    assert [row["pipeline/staleness_max"] for row in resumed] == [1.0]
    assert "warning" not in capsys.readouterr().err
