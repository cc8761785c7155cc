"""Exact resume in every mode: 4 uninterrupted steps equal 2 steps, a checkpoint, and 2 resumed steps.

The checkpoint of an overlapped mode holds the rollout's work for later steps (batches generated with
weights older than the checkpoint's, sequences half generated): without it the first resumed batch would be
sampled with the checkpoint's weights (staleness 0 instead of 1) and every later step would differ.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from plans import split_plan

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import RoleKind, load_graph
from hybridflow.planner import ExecutionMode
from hybridflow.runtime import Controller, OptimSpec, RoleSpec
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.rollout_state import ROLLOUT_STATE, ResumeWarning, decode, encode

BACKEND = f"{Path(__file__).with_name('minimal_backend.py')}:BACKEND"
TOKENIZER = char_tokenizer()
GRAPH = load_graph("grpo_no_ref", n=4, max_new_tokens=5, reward_kind="reward_function")
LOADER = PromptLoader(records=task_examples("reverse", 64), tokenizer=TOKENIZER, batch_size=4)
SCORER = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)
STEPS, CUT = 4, 2
# Wall-clock metrics (and those derived from them) are not part of what a step computes.
TIMED = ("pipeline/rollout_idle_fraction", "pipeline/trainer_idle_fraction", "pipeline/rollout_tokens_per_s",
         "pipeline/trainer_tokens_per_s", "actor/weight_sync/seconds")
FIELDS = ("prompts", "responses", "response_mask", "advantages", "old_logprobs", "policy_version",
          "token_policy_version")
MODES: dict[str, dict[str, Any]] = {
    "sync": {"pipeline": "sync"},
    "one_step_off": {"pipeline": "one_step_off"},
    "async k=2, whole batches": {"pipeline": "async", "max_staleness": 2},
}


def _controller(mode: dict[str, Any], *, delay: float = 0.0, train_delay: float = 0.02) -> Controller:
    # A large learning rate, so one update visibly changes what the bigram policy samples; a trainer slower
    # than the rollout, so the rollout always runs its k steps ahead (the schedule does not hang on timing).
    specs = {"actor": RoleSpec(name="actor", kind=RoleKind.POLICY, model="unused", backend=BACKEND,
                               optim=OptimSpec(lr=100.0),
                               options={"vocab_size": len(TOKENIZER), "generate_delay_s": delay,
                                        "train_delay_s": train_delay})}
    return Controller(GRAPH, split_plan(), specs=specs, driver_roles={"reward": SCORER},
                      mode=ExecutionMode(**mode), eos_token_id=-1)


def _upcoming(step: int) -> Batch | None:
    return LOADER.batch(step) if step < STEPS else None


def _steps(controller: Controller, steps: range) -> list[Any]:
    return [controller.step(LOADER.batch(s), step=s, upcoming=_upcoming) for s in steps]


def _computed(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k not in TIMED and not k.startswith(("time/", "timeline/", "memory/"))}


def _interrupted(mode: dict[str, Any], checkpoint: Path, **options: float) -> tuple[list[Any], list[Any]]:
    """Run steps 0..CUT-1 and checkpoint; then, in a fresh controller, load it and run the rest."""
    with _controller(mode, **options) as controller:
        first = _steps(controller, range(CUT))
        controller.save_checkpoint(str(checkpoint))
    with _controller(mode, **options) as resumed, warnings.catch_warnings():
        warnings.simplefilter("error", ResumeWarning)  # this checkpoint resumes exactly: no warning
        resumed.load_checkpoint(str(checkpoint))
        return first, _steps(resumed, range(CUT, STEPS))


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_a_resumed_run_equals_the_uninterrupted_one(mode: str, tmp_path: Path) -> None:
    with _controller(MODES[mode]) as controller:
        full = _steps(controller, range(STEPS))
    first, rest = _interrupted(MODES[mode], tmp_path / "checkpoint")
    for step, (a, b) in enumerate(zip(full, first + rest, strict=True)):
        assert _computed(a.metrics) == pytest.approx(_computed(b.metrics), abs=1e-6, rel=1e-6), step
        for name in FIELDS if mode != "sync" else FIELDS[:5]:
            assert torch.equal(a.batch[name], b.batch[name]), (step, name)
    if mode != "sync":  # what the checkpoint saved: samples k updates older than the resumed trainer
        k = MODES[mode].get("max_staleness", 1)
        assert (tmp_path / "checkpoint" / ROLLOUT_STATE).is_file()
        assert rest[0].metrics["pipeline/staleness_max"] == k
        assert int(rest[0].batch["policy_version"].max()) == CUT - k


def test_partial_rollouts_resume_with_the_tokens_in_flight(tmp_path: Path) -> None:
    """Sequences half generated at the checkpoint keep their tokens and versions. The rollout's capacity is one
    step's rows, so the rows in flight share every segment until they finish, whatever the timing: the first
    resumed step is the uninterrupted run's, token for token (later steps depend on when weights land)."""
    mode = {"pipeline": "async", "max_staleness": 1, "segment_tokens": 2}
    options = {"delay": 0.05, "train_delay": 0.08}  # the trainer's update lands while step CUT generates
    with _controller(mode, **options) as controller:
        _steps(controller, range(CUT))
        controller.save_checkpoint(str(tmp_path / "checkpoint"))
        saved = decode((tmp_path / "checkpoint" / ROLLOUT_STATE).read_bytes())
        uninterrupted = _steps(controller, range(CUT, CUT + 1))[0]
    with _controller(mode, **options) as resumed:
        resumed.load_checkpoint(str(tmp_path / "checkpoint"))
        again = _steps(resumed, range(CUT, CUT + 1))[0]
    assert CUT in saved.steps and saved.segments > 0
    for name in FIELDS:
        assert torch.equal(uninterrupted.batch[name], again.batch[name]), name
    versions = again.batch["token_policy_version"]
    assert int(versions.min()) >= CUT - 1 and int(versions.max()) <= CUT
    assert again.metrics["pipeline/staleness_max"] <= 1


def test_the_rollout_state_round_trips_and_refuses_another_mode(tmp_path: Path) -> None:
    mode = {"pipeline": "async", "max_staleness": 1, "segment_tokens": 2}
    with _controller(mode, delay=0.02) as controller:
        _steps(controller, range(2))
        state = controller._overlap.rollouter.snapshot()  # type: ignore[union-attr]
    assert encode(decode(encode(state))) == encode(state)
    with _controller(mode) as same:  # restored, not started: a checkpoint written now holds the same bytes
        rollouter = same._overlap.rollouter  # type: ignore[union-attr]
        assert rollouter.restore(decode(encode(state))) is None
        assert encode(rollouter.snapshot()) == encode(state)
    with _controller(MODES["async k=2, whole batches"]) as other:
        why = other._overlap.rollouter.restore(state)  # type: ignore[union-attr]
    assert why is not None and "max_staleness=1, segment_tokens=2" in why and "uses max_staleness=2" in why


def _warned(action: Callable[[], object]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught if issubclass(w.category, ResumeWarning)]


def test_a_checkpoint_without_rollout_state_resumes_with_a_warning(tmp_path: Path) -> None:
    with _controller(MODES["sync"]) as controller:
        _steps(controller, range(CUT))
        controller.save_checkpoint(str(tmp_path))
    with _controller(MODES["one_step_off"]) as resumed:
        messages = _warned(lambda: resumed.load_checkpoint(str(tmp_path)))
        result = _steps(resumed, range(CUT, CUT + 1))[0]
    assert len(messages) == 1 and "holds no rollout state" in messages[0], messages
    assert "this one_step_off run resumes inexactly" in messages[0]
    assert result.metrics["pipeline/staleness_max"] == 0.0  # what the warning announced


def test_a_checkpoint_without_the_next_steps_batch_warns(tmp_path: Path) -> None:
    """A run that offered no prompts past its end (as the loop did before its prompt horizon) checkpointed no
    batch of the step after it: the resumed step samples with the checkpoint's weights, and says so."""
    with _controller(MODES["one_step_off"]) as controller:
        for step in range(CUT):
            controller.step(LOADER.batch(step), step=step, upcoming=lambda s: LOADER.batch(s) if s < CUT else None)
        controller.save_checkpoint(str(tmp_path))
    with _controller(MODES["one_step_off"]) as resumed:
        resumed.load_checkpoint(str(tmp_path))
        messages = _warned(lambda: _steps(resumed, range(CUT, CUT + 1)))
    assert len(messages) == 1 and f"holds no samples of step(s) [{CUT}]" in messages[0], messages


def test_sync_mode_warns_that_an_overlapped_checkpoints_samples_go_unused(tmp_path: Path) -> None:
    with _controller(MODES["one_step_off"]) as controller:
        _steps(controller, range(CUT))
        controller.save_checkpoint(str(tmp_path))
    with _controller(MODES["sync"]) as resumed:
        messages = _warned(lambda: resumed.load_checkpoint(str(tmp_path)))
    assert len(messages) == 1 and "a sync run does not use it" in messages[0], messages


def test_the_loop_offers_prompts_past_its_end_only_for_its_last_checkpoint() -> None:
    from hybridflow.train.loop import prompt_horizon

    one_off, k2 = ExecutionMode(pipeline="one_step_off"), ExecutionMode(pipeline="async", max_staleness=2)
    assert prompt_horizon(4, 2, one_off) == 5  # the checkpoint at step 4 holds step 4's batch
    assert prompt_horizon(5, 2, k2) == 7  # the last checkpoint is at step 5 (the run's end): it holds steps 5 and 6
    assert prompt_horizon(5, 0, k2) == 5 and prompt_horizon(4, 2, ExecutionMode(pipeline="sync")) == 4
