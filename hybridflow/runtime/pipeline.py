"""Execution modes of a run: ``sync`` (every node of a step in turn) and ``one_step_off``.

In ``one_step_off`` a policy's rollout on GPUs of its own generates the batch of step t+1 while the trainer
works on step t (verl's one-step-off-policy pipeline, AReaL's staleness 1). The controller submits the
next batch's generation to the rollout group at the start of step t, before the weights of step t's update
are queued there, so it samples with the weights of the update before; the trainer then trains on samples
one update old. Every sample carries ``policy_version``, the number of updates behind the weights that
generated it; the step reports ``pipeline/staleness_mean`` and ``pipeline/staleness_max`` (updates between
those weights and the trainer's). The first step of a run (or of a resume) has nothing prefetched and
generates on the spot.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hybridflow.graph import Graph, Node, Op
from hybridflow.planner import Plan
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.dispatch import Target, node_inputs
from hybridflow.runtime.filtering import with_uids

PIPELINES = ("sync", "one_step_off", "async")

# What ``Controller.step`` is told of later steps: the next step's prompt rows (one_step_off), or a function
# from a step to its prompt rows, None past the run's end (async, which looks up to ``max_staleness`` ahead).
Upcoming = Batch | Callable[[int], Batch | None] | None


def upcoming_rows(upcoming: Upcoming, step: int, *, current: int) -> Batch | None:
    """The prompt rows of ``step`` from what the caller gave at step ``current`` (a Batch: the next step's)."""
    if upcoming is None or isinstance(upcoming, Batch):
        return upcoming if step == current + 1 else None
    return upcoming(step)


def check_pipeline(pipeline: str, graph: Graph, plan: Plan) -> Node | None:
    """The generate node a ``one_step_off`` or ``async`` run overlaps (None for ``sync``); raises naming what is
    missing."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline={pipeline!r} must be one of {list(PIPELINES)}")
    if pipeline == "sync":
        return None
    generates = [node for node in graph.nodes if node.op is Op.GENERATE]
    if len(generates) != 1 or graph.filter_node is not None:
        raise ValueError(f"pipeline={pipeline} overlaps one generate node with the rest of the step; the "
                         f"{graph.name} graph has {len(generates)} generate node(s)"
                         f"{' and a filter' if graph.filter_node is not None else ''}: use pipeline=sync")
    policy = str(generates[0].role)
    if policy not in plan.detached_rollouts:
        raise ValueError(f"pipeline={pipeline} needs the rollout of {policy!r} on GPUs of its own (a plan role "
                         f"'{policy}:rollout', e.g. meshes: {{'{policy}:rollout': [...]}}); this plan colocates it, "
                         "so generation could not overlap training: use pipeline=sync or detach the rollout")
    return generates[0]


@dataclass
class Prefetched:
    """The next step's rows with their generated fields, and the weights version that produced them."""

    rows: Future[Batch]
    version: int


class OneStepOff:
    """Generation of step t+1 on the rollout group, submitted while step t runs (see the module docstring)."""

    def __init__(self, node: Node, target: Target, pool: ThreadPoolExecutor, samples: int) -> None:
        self.node, self.target, self.pool, self.samples = node, target, pool, samples
        self.updates = 0  # updates applied to the trainer's weights so far
        self.pending: Prefetched | None = None

    def submit(self, prompts: Batch, seed: int) -> None:
        """Generate ``prompts`` (the next step's) on the rollout group, behind its queued work."""
        rows = with_uids(prompts, 0).repeat_interleave(self.samples)
        inputs = rows.select(node_inputs(self.node, rows))
        future = self.pool.submit(self._generate, rows, inputs, seed)
        self.pending = Prefetched(rows=future, version=self.updates)

    def _generate(self, rows: Batch, inputs: Batch, seed: int) -> Batch:
        outputs, _ = self.target.run_rows(self.node, inputs, seed)
        return rows.union(outputs)

    def take(self) -> tuple[Batch, int] | None:
        """The prefetched rows of this step and their version, or None when nothing was prefetched."""
        pending, self.pending = self.pending, None
        return None if pending is None else (pending.rows.result(), pending.version)

    def stamp(self, rows: Batch, version: int, *, prefetched: bool) -> tuple[Batch, dict[str, float]]:
        """``rows`` with ``policy_version`` per sample, and the staleness metrics against the trainer now."""
        versions = torch.full((len(rows),), version, dtype=torch.long)
        staleness = (self.updates - versions).float()
        metrics = {"pipeline/staleness_mean": float(staleness.mean()),
                   "pipeline/staleness_max": float(staleness.max()), "pipeline/prefetched": float(prefetched)}
        return Batch({**rows.tensors, "policy_version": versions}, rows.non_tensors), metrics
