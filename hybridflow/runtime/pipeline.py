"""Execution modes of a run: ``sync``, ``one_step_off`` and ``async``.

``sync`` runs every node of a step in that step. The overlapped modes need the policy's rollout on GPUs of
its own: its generation runs on a rollouter (:mod:`.rollouter`) while the trainer works on earlier
samples. ``one_step_off`` is verl's one-step-off policy (AReaL's staleness 1): the rollout generates the
batch of step t+1, whole, with the weights of the update before, while the trainer trains on step t.
``async`` lets the rollout run up to ``max_staleness`` updates ahead, with partial rollouts. Every sample
carries ``policy_version``, the number of updates behind the weights that generated it; the step reports
``pipeline/staleness_mean`` and ``pipeline/staleness_max`` (updates between those weights and the
trainer's), and how busy each pool was.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.graph import Graph, Node
from hybridflow.planner import Plan
from hybridflow.planner.execution import ExecutionMode
from hybridflow.planner.modes import overlap_blocker
from hybridflow.runtime.batch import Batch

# What ``Controller.step`` is told of later steps: the next step's prompt rows (one_step_off), or a function
# from a step to its prompt rows, None past the run's end (async, which looks up to ``max_staleness`` ahead).
Upcoming = Batch | Callable[[int], Batch | None] | None


def upcoming_rows(upcoming: Upcoming, step: int, *, current: int) -> Batch | None:
    """The prompt rows of ``step`` from what the caller gave at step ``current`` (a Batch: the next step's)."""
    if upcoming is None or isinstance(upcoming, Batch):
        return upcoming if step == current + 1 else None
    return upcoming(step)


def check_pipeline(mode: ExecutionMode, graph: Graph, plan: Plan) -> Node | None:
    """The generate node a ``one_step_off`` or ``async`` run overlaps (None for ``sync``); raises naming what is
    missing (the graph's part is the planner's rule, :func:`~hybridflow.planner.modes.overlap_blocker`)."""
    if not mode.overlapped:
        return None
    pipeline = mode.pipeline
    blocker = overlap_blocker(graph, pipeline)
    generate = graph.lone_generate
    if blocker is not None or generate is None:
        raise ValueError(f"pipeline={pipeline}: {blocker}; use pipeline=sync")
    policy = str(generate.role)
    if policy not in plan.detached_rollouts:
        raise ValueError(f"pipeline={pipeline} needs the rollout of {policy!r} on GPUs of its own (a plan role "
                         f"'{policy}:rollout', e.g. meshes: {{'{policy}:rollout': [...]}}); this plan colocates it, "
                         "so generation could not overlap training: use pipeline=sync or detach the rollout")
    return generate
