"""The training loop: one controller step per iteration; the graph, not a trainer class, is the algorithm."""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from hybridflow.graph import Graph
from hybridflow.graph.node import MAX_FILTER_ROUNDS
from hybridflow.planner import Plan
from hybridflow.planner.execution import ExecutionMode
from hybridflow.runtime import Controller, RoleSpec
from hybridflow.runtime.errors import StepTracker
from hybridflow.runtime.rollout_state import ResumeWarning
from hybridflow.train import setup
from hybridflow.train.checkpoint import save_checkpoint
from hybridflow.train.config import TrainConfig
from hybridflow.train.export import export_policy
from hybridflow.train.metrics import MetricsWriter, console_line, step_metrics
from hybridflow.train.preemption import Preemption
from hybridflow.train.prepare import PreparedRun, prepare_run
from hybridflow.train.retention import prune_checkpoints
from hybridflow.train.rundir import begin_run
from hybridflow.train.signals import GracefulStop, Terminated, stop_on_sigterm
from hybridflow.train.validation import JUDGE_TABLE, TABLE, judged_samples, validate


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """Where a run wrote its outputs, and the metrics of each step it ran."""

    run_dir: Path
    metrics_path: Path
    curve_path: Path | None  # the reward plot (plots/reward.png) of report.html
    history: list[dict[str, float]]
    start_step: int
    report_path: Path | None = None  # report.html: every plot and the summary table
    export_path: Path | None = None  # the final policy as an HF directory (RUN_DIR/final)


def train(config: TrainConfig, *, resume: bool = False, graph: Graph | None = None, plan: Plan | None = None,
          specs: Mapping[str, RoleSpec] | None = None, overwrite: bool = False, resume_from: str | None = None,
          allow_config_change: bool = False, rewards: Sequence[Any] | None = None) -> TrainResult:
    """Run ``config.steps`` steps (from the latest checkpoint when ``resume``); write metrics and a curve.

    The run's values are composed once (:func:`~hybridflow.train.prepare.prepare_run`: graph, plan, data,
    reward), before anything is written or loaded. ``graph``, ``plan`` and ``specs`` are built from ``config``
    unless given: a caller that made them (the classic API, a notebook) passes the values themselves, and the
    run executes exactly those.
    ``overwrite``, ``resume_from`` and ``allow_config_change``: see :mod:`hybridflow.train.rundir`. ``rewards``:
    reward functions as objects (callables or ``data.reward`` specs), in place of ``data.reward``
    (:class:`~hybridflow.train.trainer.GRPOTrainer`).
    """
    with stop_on_sigterm(config.checkpoint.sigterm_grace_s) as stop:  # hybridflow/train/signals.py
        prepared = prepare_run(config, graph=graph, plan=plan, specs=specs, note=partial(_note, config),
                               rewards=rewards)
        try:
            return _train(prepared, stop, resume=resume, overwrite=overwrite, resume_from=resume_from,
                          allow_config_change=allow_config_change)
        finally:
            prepared.scorer.close()  # its worker processes


def _train(prepared: PreparedRun, stop: GracefulStop, *, resume: bool, overwrite: bool, resume_from: str | None,
           allow_config_change: bool) -> TrainResult:
    config, graph, plan = prepared.config, prepared.graph, prepared.plan
    run_dir = Path(config.output_dir).resolve()  # Ray workers run elsewhere: every path they see is absolute
    begin = begin_run(run_dir, config, graph, resume=resume, overwrite=overwrite, resume_from=resume_from,
                      allow_config_change=allow_config_change)
    _note(config, f"preparing the policy ({config.model.path or config.model.name})")
    train_data, val_data = prepared.train_data, prepared.validation_data
    model_dir, tokenizer = setup.prepare_model(config, run_dir, train_data.records, prepared.tokenizer)
    data = train_data.records
    specs = prepared.role_specs(model_dir)
    (run_dir / "plan.json").write_text(plan.to_json())  # what ran, for `hybridflow report` and reruns
    (run_dir / "config.json").write_text(json.dumps(asdict(config), indent=2))  # only once the run validated
    checkpoint, start = begin.checkpoint, begin.step
    adapter_policy = any(spec.lora is not None for spec in specs.values())
    loader = setup.prompt_loader(config, data, tokenizer, graph)
    writer = MetricsWriter(run_dir, resume_step=start if resume else None,
                           trackers=config.logging.trackers, name=run_dir.name, config=asdict(config))
    history: list[dict[str, float]] = []
    scorer = prepared.scorer
    data_metrics = {"data/train_prompts": float(train_data.kept), "data/filtered_prompts": float(train_data.filtered)}
    _note(config, f"starting the workers ({config.executor.name} executor)")
    with _resume_warnings(), StepTracker() as running, Controller(graph, plan, specs=specs,
                    executor=setup.make_executor(config), seed=config.seed, services=setup.services(config, plan),
                    driver_roles={r.name: scorer for r in graph.roles if not r.kind.needs_gpu},
                    mode=config.execution_mode(plan), eos_token_id=tokenizer.eos_token_id) as controller:
        if checkpoint is not None:
            controller.load_checkpoint(str(checkpoint / "roles"))
        horizon = prompt_horizon(config.steps, config.checkpoint.every, controller.mode)
        progress = _Progress(range(start, config.steps), enabled=config.logging.progress,
                             label=f"{config.algorithm.name} from step {start}")
        validation = partial(validate, controller, graph, tokenizer=tokenizer, scorer=scorer, seed=config.seed,
                             batch_size=config.data.batch_size, table_rows=config.validation.samples)
        before = None
        if config.validation.before_train and val_data is not None and start == 0:
            _note(config, f"validating before training ({len(val_data.records)} prompts)")
            before = validation(val_data.records)
            writer.write_table(-1, TABLE, before.samples)  # step -1: the weights before any update
        scorer.drain_means()  # the probe's and validation's scores are not the first step's

        def write_roles(directory: str) -> None:  # role states plus the hf/ view beside them
            controller.save_checkpoint(directory)
            if not adapter_policy:  # a LoRA checkpoint stays adapter-sized: its base is model_dir
                export_policy(controller, graph, model_dir, tokenizer, Path(directory).parent / "hf")

        def write_checkpoint(done: int) -> Path:
            written = save_checkpoint(run_dir, done, write_roles, {"seed": config.seed,
                                                                   "fingerprint": begin.fingerprint})
            prune_checkpoints(run_dir, config.checkpoint.keep)
            return written

        preemption = Preemption(stop=stop, steps=config.steps, write=write_checkpoint)
        if checkpoint is not None and run_dir in checkpoint.resolve().parents:  # --resume-from another run's: not
            preemption.saved(start, checkpoint)  # where --resume looks, so a SIGTERM before a step writes one here
        with stop.deferred():  # a SIGTERM from here on checkpoints the last finished step (preemption.py)
            for step in progress:
                preemption.check(done=step)
                began = time.perf_counter()
                running.step = step
                # A filter's extra rounds draw prompts from beyond the run's own steps, so reruns see the same ones.
                more = partial(_extra_prompts, loader, config.steps, step)
                upcoming = partial(_upcoming, loader, horizon)
                try:
                    with stop.abandonable():
                        result = controller.step(loader.batch(step), step=step, more=more, upcoming=upcoming)
                except Terminated:
                    if not stop.abandoned:
                        raise
                    raise preemption.abandoned(step, intact=controller.abandon_step()) from None
                metrics = step_metrics(result, time.perf_counter() - began, graph)
                judged = judged_samples(result.batch, tokenizer, config.validation.samples)
                if judged:  # an LLM judge's verdicts, beside the samples they scored
                    writer.write_table(step, JUDGE_TABLE, judged)
                metrics.update(scorer.drain_means())
                if step == 0:  # once per run (a resumed run keeps step 0's line)
                    metrics.update(data_metrics)
                if before is not None and step == start:
                    metrics.update(before.metrics)
                if val_data is not None and config.validation.every and (
                        (step + 1) % config.validation.every == 0 or step + 1 == config.steps):
                    checked = _validated(stop, validation, val_data.records)
                    if checked is not None:
                        metrics.update(checked.metrics)
                        writer.write_table(step, TABLE, checked.samples)
                writer.write(step, metrics)
                history.append({"step": step, **metrics})
                progress.show(metrics)
                if config.logging.console_every and (step + 1) % config.logging.console_every == 0:
                    print(console_line(step, config.steps, metrics), file=sys.stderr, flush=True)
                if checkpoint_due(step, config):
                    preemption.saved(step + 1, write_checkpoint(step + 1))
            # A SIGTERM during the last step ends no run early: it has finished, and exports final/ as usual.
        _note(config, f"exporting the final policy to {run_dir / 'final'}")
        exported = export_policy(controller, graph, model_dir, tokenizer, run_dir / "final")
    writer.close()
    curve = report = None
    if config.logging.plot and writer.path.stat().st_size:
        from hybridflow.monitor import write_report

        report = write_report(run_dir).html
        curve = run_dir / "plots" / "reward.png" if (run_dir / "plots" / "reward.png").is_file() else None
    return TrainResult(run_dir=run_dir, metrics_path=writer.path, curve_path=curve, history=history,
                       start_step=start, report_path=report, export_path=exported)


def _validated(stop: GracefulStop, validation: Callable[[Any], Any], records: Any) -> Any:
    """A validation pass, or None when a SIGTERM asked to stop before it (none is started) or during it past
    the grace (it is abandoned: the step it follows is finished and gets checkpointed)."""
    if stop.requested:
        return None
    try:
        with stop.abandonable():
            return validation(records)
    except Terminated:
        if not stop.abandoned:
            raise
        return None


def checkpoint_due(step: int, config: TrainConfig) -> bool:
    """Whether ``step`` ends with a checkpoint: every ``checkpoint_every`` steps and at the run's last step, so
    that ``--resume`` of a finished run finds it finished instead of training its last steps again."""
    return bool(config.checkpoint.every) and ((step + 1) % config.checkpoint.every == 0 or step + 1 == config.steps)


def _upcoming(loader: Any, horizon: int, step: int) -> Any:
    """The prompt rows of a later ``step`` for a pipelined run (None from ``horizon`` on)."""
    return loader.batch(step) if step < horizon else None


def prompt_horizon(steps: int, checkpoint_every: int, mode: ExecutionMode) -> int:
    """The first step whose prompts an overlapped run never offers: ``steps``, or ``steps + k`` when the run
    checkpoints (its last checkpoint is at ``steps``, see :func:`checkpoint_due`), which would otherwise lack the
    batches of the next k steps that the uninterrupted longer run had generated by then; a later ``--resume``
    with more steps then continues exactly. The rollout generates those k batches overlapped with the last
    steps; only the checkpoint uses them."""
    if not mode.overlapped or not checkpoint_every:
        return steps
    return steps + mode.k  # a run with checkpoints writes one at its last step (checkpoint_due)


@contextmanager
def _resume_warnings() -> Iterator[None]:
    """Show each :class:`ResumeWarning` (what a resume cannot reproduce) as one ``hybridflow: warning:`` line."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", ResumeWarning)
        shown = warnings.showwarning

        def show(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            if issubclass(category, ResumeWarning):
                print(f"hybridflow: warning: {message}", file=sys.stderr, flush=True)
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        yield


def _note(config: TrainConfig, message: str) -> None:
    """A progress line for the slow parts before the step bar exists (model load, SFT warm-up, workers)."""
    if config.logging.progress:
        print(f"hybridflow: {message}", file=sys.stderr, flush=True)


def _extra_prompts(loader: Any, steps: int, step: int, round_index: int) -> Any:
    """Prompt rows of a filter's extra round ``round_index`` (0-based) of ``step``: batches after the run's own."""
    return loader.batch(steps + step * EXTRA_ROUNDS_PER_STEP + round_index)


EXTRA_ROUNDS_PER_STEP = MAX_FILTER_ROUNDS  # room per step in the prompt stream for a filter's extra rounds


class _Progress:
    """A tqdm bar over the steps showing the latest reward, or a plain range when disabled."""

    def __init__(self, steps: range, *, enabled: bool, label: str) -> None:
        self.steps = steps
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=len(steps), desc=label, unit="step")

    def __iter__(self) -> Iterator[int]:
        yield from self.steps
        if self.bar is not None:
            self.bar.close()

    def show(self, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                                 step_s=f"{metrics['time/step']:.2f}")
            self.bar.update(1)
