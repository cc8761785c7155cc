"""Step time as the makespan of the graph scheduled on its groups.

Nodes of one group run one after another in the graph's topological order; nodes on different groups
overlap when the graph allows; driver-side nodes never wait for a group. Data crossing between groups,
or between a group and the driver, travels through the single controller at ``driver_bandwidth``.
Every start and end time is a max or sum of durations, so the makespan never falls when a node slows:
that monotonicity is what makes the search's lower bounds valid.

In ``one_step_off`` and ``async`` (``modes.py``) a detached generate node is *overlapped*: it starts as soon
as its group is free, without waiting for its inputs (those are the next step's prompts), and its consumers
wait only for the transfer of the batch it generated before. In ``async`` the step is also at least a
batch's latency plus the trainer's span, over ``max_staleness + 1`` (``step_span``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridflow.graph import Op
from hybridflow.planner.costs import DRIVER_SECONDS_PER_ROW
from hybridflow.planner.modes import OVERLAPPED, async_step
from hybridflow.planner.plan import ROLLOUT_SUFFIX
from hybridflow.planner.problem import Problem

DRIVER = -1


@dataclass(frozen=True)
class Schedule:
    """A partition's schedule skeleton: where each node runs and what it waits for."""

    nodes: tuple[str, ...]  # in topological order
    group_of: tuple[int, ...]  # group index per node, DRIVER for driver-side nodes
    preds: tuple[tuple[tuple[int, float], ...], ...]  # (predecessor index, transfer seconds)
    driver_seconds: tuple[float, ...]  # duration of driver nodes (0 for group nodes)
    cross_group_bytes: int
    num_groups: int
    overlapped: tuple[bool, ...] = ()  # per node: generates a later step's batch (one_step_off, async); () none
    max_staleness: int | None = None  # async: the staleness bound of the batch-latency term; None otherwise

    def index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.nodes)}


def compile_schedule(problem: Problem, role_group: Mapping[str, int]) -> Schedule:
    """The skeleton for roles placed as ``role_group`` (role -> group index)."""
    graph = problem.graph
    nodes = graph.order
    position = {name: i for i, name in enumerate(nodes)}
    group_of = tuple(DRIVER if problem.node_role[name] is None else role_group[str(problem.node_role[name])]
                     for name in nodes)
    rows = problem.workload.sequences(graph)
    preds: list[list[tuple[int, float]]] = [[] for _ in nodes]
    cross = 0
    for (src, dst), size in problem.edge_bytes.items():
        a, b = group_of[position[src]], group_of[position[dst]]
        moves = a != b or a == DRIVER
        if a != b and a != DRIVER and b != DRIVER:
            cross += size
        preds[position[dst]].append((position[src], size / problem.cluster.driver_bandwidth if moves else 0.0))
    driver = tuple(rows * DRIVER_SECONDS_PER_ROW if group == DRIVER else 0.0 for group in group_of)
    overlapped: tuple[bool, ...] = ()
    if problem.pipeline in OVERLAPPED:
        overlapped = tuple(str(problem.node_role[name]).endswith(ROLLOUT_SUFFIX) and graph.node(name).op is Op.GENERATE
                           for name in nodes)
    return Schedule(nodes=nodes, group_of=group_of, preds=tuple(tuple(p) for p in preds), driver_seconds=driver,
                    cross_group_bytes=cross, num_groups=max(role_group.values(), default=-1) + 1,
                    overlapped=overlapped, max_staleness=problem.max_staleness if problem.pipeline == "async" else None)


def timeline(schedule: Schedule, seconds: Sequence[float]) -> list[tuple[float, float]]:
    """(start, end) of every node, given each group node's ``seconds`` (driver entries are ignored)."""
    free = [0.0] * schedule.num_groups
    ahead = schedule.overlapped or (False,) * len(schedule.nodes)
    spans: list[tuple[float, float]] = []
    for i, group in enumerate(schedule.group_of):
        start = 0.0
        for pred, transfer in schedule.preds[i] if not ahead[i] else ():
            start = max(start, (0.0 if ahead[pred] else spans[pred][1]) + transfer)
        if group == DRIVER:
            spans.append((start, start + schedule.driver_seconds[i]))
        else:
            start = max(start, free[group])
            free[group] = start + seconds[i]
            spans.append((start, free[group]))
    return spans


def makespan(schedule: Schedule, seconds: Sequence[float]) -> float:
    """The latest end: the step without its overhead, except for ``async``'s latency term (a lower bound)."""
    return max((end for _, end in timeline(schedule, seconds)), default=0.0)


def step_span(schedule: Schedule, spans: Sequence[tuple[float, float]], latency_s: float = 0.0) -> float:
    """The step without its overhead, from ``timeline``'s spans; ``latency_s`` is an ``async`` batch's
    latency on the rollout pool (``GroupLayout.batch_latency_s``), ignored in the other modes."""
    end = max((stop for _, stop in spans), default=0.0)
    if schedule.max_staleness is None:
        return end
    trainer = max((stop for (_, stop), ahead in zip(spans, schedule.overlapped, strict=True) if not ahead), default=0.0)
    return async_step(end, trainer, latency_s, schedule.max_staleness)
