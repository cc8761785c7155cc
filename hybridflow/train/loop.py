"""The training loop: one controller step per iteration; the graph, not a trainer class, is the algorithm."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridflow.graph import Graph
from hybridflow.planner import Plan
from hybridflow.runtime import Controller, RoleSpec
from hybridflow.train import setup
from hybridflow.train.checkpoint import checkpoint_step, latest_checkpoint, save_checkpoint
from hybridflow.train.config import TrainConfig
from hybridflow.train.metrics import MetricsWriter, plot_rewards, step_metrics


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """Where a run wrote its outputs, and the metrics of each step it ran."""

    run_dir: Path
    metrics_path: Path
    curve_path: Path | None
    history: list[dict[str, float]]
    start_step: int


def train(config: TrainConfig, *, resume: bool = False, graph: Graph | None = None, plan: Plan | None = None,
          specs: Mapping[str, RoleSpec] | None = None) -> TrainResult:
    """Run ``config.steps`` steps (from the latest checkpoint when ``resume``); write metrics and a curve.

    ``graph``, ``plan`` and ``specs`` are built from ``config`` unless given: a caller that made them (the
    classic API, a notebook) passes the values themselves, and the run executes exactly those.
    """
    run_dir = Path(config.output_dir).resolve()  # Ray workers run elsewhere: every path they see is absolute
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(asdict(config), indent=2))
    data = setup.records(config)
    model_dir, tokenizer = setup.prepare_model(config, run_dir, data)
    graph = graph or setup.build_graph(config)
    if plan is None:
        plan = setup.build_plan(config, graph, setup.max_prompt_tokens(data, tokenizer), model_dir)
    else:
        setup.check_role_entries(config, graph, plan)
    specs = specs or setup.role_specs(config, graph, model_dir, plan)
    (run_dir / "plan.json").write_text(plan.to_json())  # what ran, for `hybridflow report` and reruns
    checkpoint = latest_checkpoint(run_dir) if resume else None
    start = checkpoint_step(checkpoint) if checkpoint else 0
    loader = setup.prompt_loader(config, data, tokenizer)
    writer = MetricsWriter(run_dir, tensorboard=config.tensorboard, resume_step=start if resume else None)
    history: list[dict[str, float]] = []
    with Controller(graph, plan, specs=specs,
                    executor=setup.make_executor(config), seed=config.seed, services=setup.services(config, plan),
                    driver_roles={r.name: setup.reward_scorer(config, tokenizer) for r in graph.roles
                                  if not r.kind.needs_gpu}) as controller:
        if checkpoint is not None:
            controller.load_checkpoint(str(checkpoint / "roles"))
        progress = _Progress(range(start, config.steps), enabled=config.progress,
                             label=f"{config.algorithm} from step {start}")
        for step in progress:
            began = time.perf_counter()
            result = controller.step(loader.batch(step), step=step)
            metrics = step_metrics(result, time.perf_counter() - began, graph)
            writer.write(step, metrics)
            history.append({"step": step, **metrics})
            progress.show(metrics)
            if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
                save_checkpoint(run_dir, step + 1, controller.save_checkpoint, {"seed": config.seed})
    writer.close()
    curve = None
    if config.plot and writer.path.stat().st_size:
        title = f"{config.algorithm} on {config.data.path or config.data.task}"
        curve = plot_rewards(writer.path, run_dir / "reward_curve.png", title=title)
    return TrainResult(run_dir=run_dir, metrics_path=writer.path, curve_path=curve, history=history,
                       start_step=start)


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
