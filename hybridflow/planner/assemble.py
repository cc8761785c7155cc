"""Turn a placement (role groups, their GPUs and layouts) into a :class:`Plan` with the model's estimates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridflow.planner.costs import Shape
from hybridflow.planner.layouts import GroupLayout
from hybridflow.planner.plan import GroupPlan, NodeEstimate, Plan, SearchStats
from hybridflow.planner.problem import Problem
from hybridflow.planner.schedule import DRIVER, Schedule, Sharing, compile_schedule, shared_step, stream_schedule


@dataclass(frozen=True)
class Placement:
    """One group of a plan before it becomes a :class:`GroupPlan`."""

    roles: tuple[str, ...]
    gpus: tuple[int, ...]
    shape: Shape
    layout: GroupLayout


def group_seconds(schedule: Schedule, groups: Sequence[Placement]) -> list[float]:
    """Per scheduled node, its seconds on its group (0 for driver nodes, which the schedule times)."""
    by_node: dict[str, float] = {}
    for group in groups:
        by_node.update(group.layout.node_seconds)
    return [by_node.get(name, 0.0) if g != DRIVER else 0.0 for name, g in zip(schedule.nodes, schedule.group_of,
                                                                               strict=True)]


def idle_fraction(step: float, groups: Sequence[Placement]) -> float:
    """Share of the used GPU-seconds a step leaves idle: the balance tie-break (lower is better)."""
    used = sum(len(g.gpus) for g in groups)
    if step <= 0 or used == 0:
        return 0.0
    return 1.0 - sum(g.layout.busy_seconds * len(g.gpus) for g in groups) / (step * used)


def build_plan(problem: Problem, groups: Sequence[Placement], *, search: SearchStats | None = None,
               problems: Sequence[str] = (), streamed: tuple[int, Sequence[Placement]] | None = None) -> Plan:
    """The plan for ``groups`` with node timings, totals and the bottleneck the schedule shows.

    ``streamed``: a sync step streamed in that many chunks, with the same groups costed on one chunk's rows
    (``schedule.stream_schedule``); a streamed node's estimate spans its first chunk's start to its last's end.
    """
    role_group = {role: index for index, group in enumerate(groups) for role in group.roles}
    schedule = compile_schedule(problem, role_group)
    latency = sum(group.layout.batch_latency_s for group in groups)
    sharing = Sharing.of(problem.cluster, [group.gpus for group in groups])
    seconds = group_seconds(schedule, groups)
    extra: dict[str, float] = {}
    if streamed is None:
        spans, span, latency = shared_step(schedule, seconds, latency, sharing)
    else:
        chunks, chunk_groups = streamed
        generate = problem.graph.lone_generate
        assert generate is not None and problem.mode.stream_chunks == chunks, "streaming a problem of other chunks"
        expanded, origin = stream_schedule(schedule, generate.name, problem.graph.streamed_followers, chunks)
        per_chunk = group_seconds(schedule, chunk_groups)
        pieces, span, _ = shared_step(expanded, [per_chunk[i] if chunk >= 0 else seconds[i] for i, chunk in origin],
                                      0.0, sharing)
        spans = [(min(a for (j, _), (a, _) in zip(origin, pieces, strict=True) if j == i),
                  max(b for (j, _), (_, b) in zip(origin, pieces, strict=True) if j == i))
                 for i in range(len(schedule.nodes))]
    step = span + problem.step_overhead_s
    extra["idle_fraction"] = round(idle_fraction(step, groups), 6)
    if problem.mode.pipeline == "async":
        extra["batch_latency_s"] = latency  # what modes.describe_mode explains the async step with
    nodes = tuple(
        NodeEstimate(node=name, group=None if g == DRIVER else g, seconds=end - start, start_s=start, end_s=end,
                     role=problem.node_role[name])
        for name, g, (start, end) in zip(schedule.nodes, schedule.group_of, spans, strict=True))
    cluster = problem.cluster
    plans = tuple(
        GroupPlan(gpus=group.gpus, hosts=tuple(cluster.machines[cluster.machine_index(g)].host for g in group.gpus),
                  device=group.shape.device.name, roles=group.roles, layouts=group.layout.layouts,
                  memory_per_gpu_bytes=group.layout.memory_bytes, capacity_bytes=group.shape.device.memory_bytes)
        for group in groups)
    return Plan(algorithm=problem.graph.name, groups=plans, driver_roles=problem.driver_roles, nodes=nodes,
                step_time_s=step, cross_group_bytes=schedule.cross_group_bytes,
                weight_sync_bytes=sum(group.layout.weight_sync_bytes for group in groups),
                weight_sync_seconds=sum(group.layout.weight_sync_seconds for group in groups),
                bottleneck=bottleneck(nodes, groups, step), feasible=not problems, problems=tuple(problems),
                search=search, extra=tuple(sorted(extra.items())),
                mode=problem.mode)


def bottleneck(nodes: Sequence[NodeEstimate], groups: Sequence[Placement], step: float) -> str:
    """The busiest group and its longest node, in words."""
    if not groups:
        return ""
    index = max(range(len(groups)), key=lambda i: groups[i].layout.busy_seconds)
    group = groups[index]
    mine = [n for n in nodes if n.group == index]
    longest = max(mine, key=lambda n: n.seconds) if mine else None
    share = group.layout.busy_seconds / step if step else 0.0
    what = f"; longest node {longest.node} ({longest.seconds:.3g} s)" if longest else ""
    return (f"group {index} ({', '.join(group.roles)} on {len(group.gpus)}x{group.shape.device.name}) busy "
            f"{share:.0%} of the step{what}")
