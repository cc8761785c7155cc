"""A hybridflow run as a calibration case: its ``plan.json`` (where each role ran, with which layout) and the
node times in its ``metrics.jsonl`` (``time/<node>``, ``time/step``), re-costed with the same planner inputs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridflow.graph import Graph, Workload
from hybridflow.planner.cluster import Cluster
from hybridflow.planner.lengths import LengthDistribution
from hybridflow.planner.metrics_file import metric, metrics_rows
from hybridflow.planner.models import ModelSpec
from hybridflow.planner.plan import Plan
from hybridflow.planner.published import MeasuredCase
from hybridflow.planner.settings import RunSettings

TIME_PREFIX = "time/"


def measured_node_times(path: str | Path, *, skip_steps: int = 1) -> dict[str, float]:
    """Mean seconds per node and per step over a run's records, after ``skip_steps`` warm-up steps."""
    timed = [(number, record) for number, record in metrics_rows(path) if f"{TIME_PREFIX}step" in record]
    if len(timed) <= skip_steps:
        raise ValueError(f"{path}: {len(timed)} timed steps, need more than skip_steps={skip_steps}; run longer "
                         "or pass --skip-steps 0")
    kept = timed[skip_steps:]
    sums: dict[str, float] = {}
    for number, record in kept:
        for key in record:
            value = metric(path, number, record, key) if key.startswith(TIME_PREFIX) else None
            if value is not None:
                sums[key.removeprefix(TIME_PREFIX)] = sums.get(key.removeprefix(TIME_PREFIX), 0.0) + value
    return {key: total / len(kept) for key, total in sums.items() if total > 0}


def layout_arguments(plan: Plan) -> dict[str, Any]:
    """evaluate_mapping keywords that pin each role to the layout it ran with."""
    layouts = [layout for group in plan.groups for layout in group.layouts]
    return {"data_parallel_size": {lay.role: lay.dp for lay in layouts},
            "rollout_tp": {lay.role: lay.rollout_tp for lay in layouts},
            "sharding": {lay.role: lay.sharding for lay in layouts}}


def settings_as_run(plan: Plan, settings: RunSettings, metrics: str | Path | None = None) -> RunSettings:
    """``settings`` with what the run executed: the plan's padding and token budgets (one per run when every GPU
    role's layout holds the same; the layouts are what the engines cut by) and, from its ``metrics.jsonl``, the
    response lengths it generated (``LengthDistribution.from_metrics``)."""
    layouts = [layout for group in plan.groups for layout in group.layouts]
    train = {layout.max_tokens_per_micro_batch for layout in layouts}
    forward = {layout.forward_max_tokens_per_micro_batch or layout.max_tokens_per_micro_batch for layout in layouts}
    changes: dict[str, Any] = {"padding": any(layout.padding for layout in layouts)}
    if len(train) == 1:
        changes["train_tokens_per_gpu"] = train.pop() or None
    if len(forward) == 1:
        changes["forward_tokens_per_gpu"] = forward.pop() or None
    if metrics is not None:
        changes["lengths"] = LengthDistribution.from_metrics(metrics)
    return replace(settings, **changes)


def case_from_run(run_dir: str | Path, *, graph: Graph, models: Mapping[str, ModelSpec], workload: Workload,
                  cluster: Cluster, settings: RunSettings, skip_steps: int = 1) -> MeasuredCase:
    """The run in ``run_dir`` (``plan.json`` + ``metrics.jsonl``) as a :class:`MeasuredCase`."""
    folder = Path(run_dir)
    for name in ("plan.json", "metrics.jsonl"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} not found: calibrate from a `hybridflow train` run directory")
    plan = Plan.from_json((folder / "plan.json").read_text())
    if plan.algorithm != graph.name:
        raise ValueError(f"{folder}/plan.json ran algorithm {plan.algorithm!r}, but the inputs name {graph.name!r}")
    measured = measured_node_times(folder / "metrics.jsonl", skip_steps=skip_steps)
    node_names = {node.name for node in graph.nodes} | {"step"}
    mapping = {role: group.gpus for group in plan.groups for role in group.roles}
    return MeasuredCase(id=str(folder), graph=graph, models=models, workload=workload, cluster=cluster,
                        mapping=mapping, layout=layout_arguments(plan), settings=settings,
                        micro_batch_sizes={lay.role: lay.micro_batch_size for g in plan.groups for lay in g.layouts},
                        measured={key: value for key, value in measured.items() if key in node_names},
                        stream_chunks=plan.mode.stream_chunks)
