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

import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hybridflow.graph import Graph, Node
from hybridflow.planner import Plan
from hybridflow.planner.execution import ExecutionMode
from hybridflow.planner.modes import overlap_blocker
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.filtering import with_uids
from hybridflow.runtime.rollout_state import ROLLOUT_STATE, ResumeWarning, read_state, write_state
from hybridflow.runtime.rollouter import Rollouter, RolloutStats, pool_metrics, staleness_metrics
from hybridflow.runtime.scheduler import Partition, StepRecord
from hybridflow.runtime.step_store import Join

# What ``Controller.step`` is told of later steps: the next step's prompt rows (one_step_off), or a function
# from a step to its prompt rows, None past the run's end (async, which looks up to ``max_staleness`` ahead).
Upcoming = Batch | Callable[[int], Batch | None] | None


def upcoming_rows(upcoming: Upcoming, step: int, *, current: int) -> Batch | None:
    """The prompt rows of ``step`` from what the caller gave at step ``current`` (a Batch: the next step's)."""
    if upcoming is None or isinstance(upcoming, Batch):
        return upcoming if step == current + 1 else None
    return upcoming(step)


def unused_rollout_state(directory: str, mode: ExecutionMode) -> None:
    """Warn when a checkpoint of an overlapped run is loaded by a ``sync`` one: its buffered samples go unused."""
    if (Path(directory) / ROLLOUT_STATE).is_file():
        warnings.warn(f"checkpoint {directory} holds the rollout state of an overlapped run; a "
                      f"{mode.pipeline} run does not use it: the resumed steps sample on-policy, unlike the run "
                      "that wrote it", ResumeWarning, stacklevel=3)


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


class Overlap:
    """The overlapped modes across steps: the rollouter, the trainer's policy version (its updates so far,
    counted from the step the run starts at) and when the last step ended (the pools' time runs on)."""

    def __init__(self, rollouter: Rollouter, *, samples: int, pipeline: str) -> None:
        self.rollouter, self.samples, self.pipeline = rollouter, samples, pipeline
        self.version = 0
        self._mark: tuple[float, RolloutStats] | None = None

    def save(self, directory: str) -> None:
        """Write the rollouter's work for later steps beside the roles' checkpoints (:mod:`.rollout_state`)."""
        state = self.rollouter.snapshot()
        try:
            write_state(directory, state)
        except TypeError as err:  # a non-tensor field safe_wire cannot carry: the checkpoint is still good
            (Path(directory) / ROLLOUT_STATE).unlink(missing_ok=True)
            warnings.warn(f"checkpoint {directory}: the rollout's batches for steps {state.steps} were not saved "
                          f"({err}); a run resumed from it regenerates them with the checkpoint's weights, so its "
                          "metrics differ from the uninterrupted run's", ResumeWarning, stacklevel=3)

    def load(self, directory: str) -> None:
        """Restore what :meth:`save` wrote; without it (an older checkpoint, another mode) warn what differs."""
        state = read_state(directory)
        why = ("it holds no rollout state (written by sync mode or by a hybridflow before exact overlapped "
               "resume)") if state is None else self.rollouter.restore(state)
        if why is not None:
            warnings.warn(f"checkpoint {directory}: {why}; this {self.pipeline} run resumes inexactly: the first "
                          f"{max(self.rollouter.k, 1)} resumed step(s) train on samples generated with the "
                          "checkpoint's weights (fresher than the uninterrupted run's), so metrics differ from "
                          "it from the first resumed step on", ResumeWarning, stacklevel=3)

    def source(self, prompts: Batch, *, step: int, upcoming: Upcoming, record: StepRecord) -> OverlappedStep:
        """This step's partition: its samples, once the rollouter generated them."""
        return OverlappedStep(self, prompts, step=step, upcoming=upcoming, record=record)


class OverlappedStep:
    """One ``one_step_off`` or ``async`` step (:mod:`.scheduler`): offer this and the next ``max_staleness``
    steps' prompts, take this step's samples when all are done; the rest of the graph (whose update ships
    weights on) runs on them, then the pools' metrics are taken."""

    def __init__(self, overlap: Overlap, prompts: Batch, *, step: int, upcoming: Upcoming,
                 record: StepRecord) -> None:
        self.overlap, self.prompts, self.step, self.upcoming, self.record = overlap, prompts, step, upcoming, record
        self.rows: Batch | None = None
        self.started, self.waited, self.depth = 0.0, 0.0, 0
        self.since, self.before = 0.0, RolloutStats()

    @property
    def covers(self) -> frozenset[str]:
        return frozenset([self.overlap.rollouter.node.name])

    def next(self, finished: list[Batch]) -> list[Partition]:
        if finished:
            return []
        overlap, rollouter, step = self.overlap, self.overlap.rollouter, self.step
        if not rollouter.started:  # the weights shipped at start (or after a checkpoint load) are this step's
            overlap.version = step
            if rollouter.restored:
                self._missing_from_checkpoint()
            rollouter.start(step)
        self.started = time.perf_counter()
        self.since, self.before = overlap._mark or (self.started, replace(rollouter.stats))
        for ahead in range(step, step + rollouter.k + 1):
            rows = self.prompts if ahead == step else upcoming_rows(self.upcoming, ahead, current=step)
            if rows is None and ahead > step:
                break  # no later step has prompts either (the run's last steps, or only the next one given)
            if rows is not None and not rollouter.offered(ahead):
                rollouter.offer(ahead, with_uids(rows, 0).repeat_interleave(overlap.samples))
        self.rows, self.depth = rollouter.take(step)
        self.waited = time.perf_counter() - self.started
        self.record.seconds[rollouter.node.name] = self.waited  # what the trainer waited for; the rest overlapped
        self.record.metrics.update(staleness_metrics(self.rows, overlap.version, rollouter.k))
        return [Partition(rows=self.rows, nodes=(), seed=0)]

    def _missing_from_checkpoint(self) -> None:
        """Warn when the restored state lacks steps the uninterrupted run had generated by now (a checkpoint of
        a run that stopped offering prompts before it, e.g. one written before the loop's prompt horizon)."""
        rollouter, step = self.overlap.rollouter, self.step
        missing = [ahead for ahead in range(step, step + rollouter.k)
                   if not rollouter.offered(ahead) and (ahead == step or upcoming_rows(
                       self.upcoming, ahead, current=step) is not None)]
        if missing:
            warnings.warn(f"the checkpoint's rollout state holds no samples of step(s) {missing} (the run that "
                          "wrote it offered none); they are generated with the checkpoint's weights, so those "
                          "steps' metrics differ from an uninterrupted run's", ResumeWarning, stacklevel=2)

    def join(self, finished: list[Batch]) -> Batch:
        return finished[0]

    def joins(self) -> tuple[Join, ...]:
        return ()

    def close(self) -> None:
        overlap, rows = self.overlap, self.rows
        assert rows is not None
        overlap.version += 1
        overlap._mark = (time.perf_counter(), replace(overlap.rollouter.stats))
        self.record.metrics.update(pool_metrics(self.before, overlap._mark[1], seconds=overlap._mark[0] - self.since,
                                                waited=self.waited, trained_tokens=int(rows["response_mask"].sum()),
                                                depth=self.depth))
