"""Step time as the makespan of the graph scheduled on its groups.

Nodes of one group run one at a time, in the order they become ready (first come, first served: the runtime
submits a node to its group's queue the moment its inputs exist, ``runtime/scheduler.py``; ties go to the graph's
topological order); nodes on different groups overlap when the graph allows; driver-side nodes never wait for a
group. Data crossing between groups, or between a group and the driver, travels through the single controller at
``driver_bandwidth``. Such a schedule can shorten when a node slows (a queue's order changes), so the search prunes
with :func:`lower_bound`, which holds for every order: the longest chain of the graph, and each group's first
possible start plus all of its work.

In ``one_step_off`` and ``async`` (``modes.py``) a detached generate node is *overlapped*: it starts as soon
as its group is free, without waiting for its inputs (those are the next step's prompts), and its consumers
wait only for the transfer of the batch it generated before. In ``async`` the step is also at least a
batch's latency plus the trainer's span, over ``max_staleness + 1`` (``step_span``).

A ``sync`` step streamed in chunks (``runtime/streaming.py``) is the same schedule with the generate node
and its row-wise followers split into one node per chunk (``stream_schedule``).

Logical GPUs that are processes on a CPU host share its cores (``Cluster.host_cores``, :class:`Sharing`):
when the busy GPUs of a host outnumber its cores, each busy node advances at ``cores / busy`` of its own
speed (processor sharing), so colocating three workers on two cores, or overlapping a two-GPU rollout
with a one-GPU trainer there, costs what it does on the machine. A node's rate never exceeds 1, so
:func:`lower_bound` holds for shared cores too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridflow.graph import Op
from hybridflow.planner.cluster import Cluster
from hybridflow.planner.modes import OVERLAPPED, async_step
from hybridflow.planner.plan import ROLLOUT_SUFFIX
from hybridflow.planner.problem import Problem
from hybridflow.planner.step_terms import driver_seconds

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


def serialise_driver_nodes(preds: list[list[tuple[int, float]]], group_of: Sequence[int]) -> None:
    """A driver node waits for every node before it in graph order and holds back every node after it: a
    controller that makes one call at a time (``overlays.ControllerOverlay.serial_driver``)."""
    for i, group in enumerate(group_of):
        if group == DRIVER:
            preds[i].extend((j, 0.0) for j in range(i))
            for k in range(i + 1, len(group_of)):
                preds[k].append((i, 0.0))


def compile_schedule(problem: Problem, role_group: Mapping[str, int]) -> Schedule:
    """The skeleton for roles placed as ``role_group`` (role -> group index)."""
    graph = problem.graph
    nodes = graph.order
    position = {name: i for i, name in enumerate(nodes)}
    group_of = tuple(DRIVER if problem.node_role[name] is None else role_group[str(problem.node_role[name])]
                     for name in nodes)
    preds: list[list[tuple[int, float]]] = [[] for _ in nodes]
    cross = 0
    for (src, dst), size in problem.edge_bytes.items():
        a, b = group_of[position[src]], group_of[position[dst]]
        moves = a != b or a == DRIVER
        if a != b and a != DRIVER and b != DRIVER:
            cross += size
        preds[position[dst]].append((position[src], size / problem.cluster.driver_bandwidth if moves else 0.0))
    driver = tuple(driver_seconds(problem, name) if group == DRIVER else 0.0 for name, group in zip(nodes, group_of,
                                                                                                  strict=True))
    if problem.overlay is not None and problem.overlay.serial_driver:
        serialise_driver_nodes(preds, group_of)
    overlapped: tuple[bool, ...] = ()
    if problem.mode.pipeline in OVERLAPPED:
        overlapped = tuple(str(problem.node_role[name]).endswith(ROLLOUT_SUFFIX) and graph.node(name).op is Op.GENERATE
                           for name in nodes)
    return Schedule(nodes=nodes, group_of=group_of, preds=tuple(tuple(p) for p in preds), driver_seconds=driver,
                    cross_group_bytes=cross, num_groups=max(role_group.values(), default=-1) + 1,
                    overlapped=overlapped, max_staleness=problem.mode.k if problem.mode.pipeline == "async" else None)


def ready_time(schedule: Schedule, i: int, end: Sequence[float], ahead: Sequence[bool]) -> float:
    """When node i's inputs are there, given its predecessors' ``end`` times (nan: not yet, then nan). An
    overlapped node waits for nothing; a predecessor that is overlapped made this step's input during the step
    before, so only its transfer is waited for."""
    if ahead[i]:
        return 0.0
    times = [(0.0 if ahead[pred] else end[pred]) + transfer for pred, transfer in schedule.preds[i]]
    return math.nan if any(math.isnan(t) for t in times) else max([0.0, *times])


def timeline(schedule: Schedule, seconds: Sequence[float]) -> list[tuple[float, float]]:
    """(start, end) of every node, given each group node's ``seconds`` (driver entries are ignored): each group
    takes its nodes in the order they become ready (the module docstring)."""
    count = len(schedule.nodes)
    ahead = schedule.overlapped or (False,) * count
    free = [0.0] * schedule.num_groups
    start, end = [math.nan] * count, [math.nan] * count
    for _ in range(count):
        # Of the nodes whose inputs are all placed, the one that starts first: a group node starts when it is
        # ready and its group is free, the earliest-ready first. A node not yet eligible waits for one that
        # starts no earlier, so it is ready no earlier: placing in start order is first come, first served.
        best: tuple[float, float, int] | None = None
        for i in range(count):
            if not math.isnan(start[i]):
                continue
            ready = ready_time(schedule, i, end, ahead)
            if math.isnan(ready):
                continue
            group = schedule.group_of[i]
            key = (ready if group == DRIVER else max(ready, free[group]), ready, i)
            best = key if best is None or key < best else best
        assert best is not None, "a schedule's predecessors come before their nodes"
        at, _, i = best
        group = schedule.group_of[i]
        start[i] = at
        end[i] = at + (schedule.driver_seconds[i] if group == DRIVER else seconds[i])
        if group != DRIVER:
            free[group] = end[i]
    return list(zip(start, end, strict=True))


def lower_bound(schedule: Schedule, seconds: Sequence[float]) -> float:
    """A step no schedule of these node times beats, whatever order the groups take their nodes in and however
    shared cores slow them: the longest chain of the graph (every node as early as its inputs allow), and per
    group its earliest possible start plus all of its nodes' seconds. It never falls when a node slows: the
    search prunes with it."""
    count = len(schedule.nodes)
    ahead = schedule.overlapped or (False,) * count
    earliest: list[float] = []
    end: list[float] = []
    for i, group in enumerate(schedule.group_of):  # predecessors come first
        earliest.append(ready_time(schedule, i, end, ahead))
        end.append(earliest[i] + (schedule.driver_seconds[i] if group == DRIVER else seconds[i]))
    work: dict[int, tuple[float, float]] = {}
    for i, group in enumerate(schedule.group_of):
        if group != DRIVER:
            first, busy = work.get(group, (earliest[i], 0.0))
            work[group] = (min(first, earliest[i]), busy + seconds[i])
    return max([0.0, *end, *(first + busy for first, busy in work.values())])


def step_span(schedule: Schedule, spans: Sequence[tuple[float, float]], latency_s: float = 0.0) -> float:
    """The step without its overhead, from ``timeline``'s spans; ``latency_s`` is an ``async`` batch's
    latency on the rollout pool (``GroupLayout.batch_latency_s``), ignored in the other modes."""
    end = max((stop for _, stop in spans), default=0.0)
    if schedule.max_staleness is None:
        return end
    trainer = max((stop for (_, stop), ahead in zip(spans, schedule.overlapped, strict=True) if not ahead), default=0.0)
    return async_step(end, trainer, latency_s, schedule.max_staleness)


@dataclass(frozen=True)
class Sharing:
    """Groups' logical GPUs on hosts with fewer cores than GPUs: ``cores`` per shared host, and per group its
    GPUs on each of those hosts (``devices[group][k]`` on the host of ``cores[k]``)."""

    cores: tuple[int, ...]
    devices: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, cluster: Cluster, group_gpus: Sequence[Sequence[int]]) -> Sharing | None:
        """The sharing of groups placed on ``group_gpus`` (GPU ids per group); None when no host shares."""
        if not cluster.shared_hosts():  # GPUs: nothing to count (the search asks at every leaf)
            return None
        machines = range(len(cluster.machines))
        return cls.of_counts(cluster, [[sum(cluster.machine_index(gpu) == m for gpu in gpus) for m in machines]
                                       for gpus in group_gpus])

    @classmethod
    def of_counts(cls, cluster: Cluster, group_counts: Sequence[Sequence[int]]) -> Sharing | None:
        """As :meth:`of`, from GPUs taken per machine (``group_counts[group][machine]``)."""
        shared = cluster.shared_hosts()
        if not shared:
            return None
        hosts = sorted(shared)
        devices = tuple(tuple(sum(count for machine, count in zip(cluster.machines, counts, strict=True)
                                  if machine.host == host) for host in hosts) for counts in group_counts)
        return cls(cores=tuple(shared[host] for host in hosts), devices=devices)

    def rates(self, busy_groups: Sequence[int]) -> dict[int, float]:
        """Each busy group's speed (<= 1) while ``busy_groups`` (one entry per running node) compute."""
        busy = [sum(self.devices[g][k] for g in busy_groups) for k in range(len(self.cores))]
        return {g: min([1.0] + [self.cores[k] / busy[k] for k in range(len(self.cores)) if self.devices[g][k]])
                for g in busy_groups}


def shared_timeline(schedule: Schedule, seconds: Sequence[float], sharing: Sharing | None) -> list[tuple[float, float]]:
    """``timeline`` with the groups' GPUs sharing their hosts' cores (processor sharing; module docstring).

    Events are node starts and ends: between two, every running node advances at its group's rate.
    Driver nodes and transfers take no GPU core.
    """
    if sharing is None:
        return timeline(schedule, seconds)
    count = len(schedule.nodes)
    ahead = schedule.overlapped or (False,) * count
    work = [schedule.driver_seconds[i] if g == DRIVER else float(seconds[i]) for i, g in enumerate(schedule.group_of)]
    start, end = [math.nan] * count, [math.nan] * count  # nan: not yet
    left = list(work)
    now = 0.0

    def waiting() -> list[tuple[float, int]]:
        """(ready time, node) of the nodes not started whose inputs are there by now."""
        return [(at, i) for i in range(count)
                if math.isnan(start[i]) and not math.isnan(at := ready_time(schedule, i, end, ahead)) and at <= now]

    while any(math.isnan(e) for e in end):
        busy = {schedule.group_of[i] for i in range(count) if not math.isnan(start[i]) and math.isnan(end[i])}
        for _, i in sorted(waiting()):  # first come, first served on each free group; the driver never waits
            group = schedule.group_of[i]
            if group == DRIVER or group not in busy:
                start[i] = now
                busy.add(group)
        running = [i for i in range(count) if not math.isnan(start[i]) and math.isnan(end[i])]
        rates = sharing.rates([schedule.group_of[i] for i in running if schedule.group_of[i] != DRIVER])
        speed = {i: rates.get(schedule.group_of[i], 1.0) for i in running}
        finished = [i for i in running if left[i] <= 1e-9 * max(1.0, work[i])]
        for i in finished:
            end[i] = now
        if finished:
            continue
        pending = [at for i in range(count)
                   if math.isnan(start[i]) and not math.isnan(at := ready_time(schedule, i, end, ahead))]
        step = min([left[i] / speed[i] for i in running] + [at - now for at in pending if at > now])
        for i in running:
            left[i] -= speed[i] * step
        now += step
    return list(zip(start, end, strict=True))


def shared_step(schedule: Schedule, seconds: Sequence[float], latency_s: float,
                sharing: Sharing | None) -> tuple[list[tuple[float, float]], float, float]:
    """(spans, step without its overhead, ``async``'s batch latency) with shared cores: the latency on the
    rollout pool stretches as its overlapped generation does (the same cores run both)."""
    spans = shared_timeline(schedule, seconds, sharing)
    ahead = schedule.overlapped or (False,) * len(spans)
    stretch = max([1.0] + [(end - begin) / seconds[i] for i, (begin, end) in enumerate(spans)
                           if ahead[i] and seconds[i] > 0])
    return spans, step_span(schedule, spans, latency_s * stretch), latency_s * stretch


def stream_schedule(schedule: Schedule, generate: str, followers: Sequence[str],
                    chunks: int) -> tuple[Schedule, tuple[tuple[int, int], ...]]:
    """The schedule of a sync step streamed in ``chunks`` (``runtime/streaming.py``), and each of its nodes'
    origin: (index in ``schedule``, chunk, or -1 for a node that runs once).

    The generate node and its row-wise ``followers`` become one node per chunk. Every generate chunk comes
    first (the runtime queues them on the rollout at once, so a follower on the rollout's own group runs
    after all of them), then the followers chunk by chunk: a follower's chunk waits only for its own chunk of
    its inputs, and a node that needs the whole batch for every chunk. Each chunk moves its share of the
    bytes; a driver node's chunk takes its share of the driver's seconds. Group nodes' chunk seconds are the
    caller's (the layouts costed on a chunk's rows).
    """
    index = schedule.index()
    section = {generate, *followers}
    origin: list[tuple[int, int]] = []
    for name in schedule.nodes:
        if name == generate:
            origin += [(index[name], chunk) for chunk in range(chunks)]
        elif followers and name == followers[0]:
            origin += [(index[follower], chunk) for chunk in range(chunks) for follower in followers]
        elif name not in section:
            origin.append((index[name], -1))
    position = {item: k for k, item in enumerate(origin)}
    preds: list[tuple[tuple[int, float], ...]] = []
    for node, chunk in origin:
        waits: list[tuple[int, float]] = []
        for pred, transfer in schedule.preds[node]:
            if schedule.nodes[pred] not in section:
                waits.append((position[(pred, -1)], transfer))
            elif chunk >= 0:
                waits.append((position[(pred, chunk)], transfer / chunks))
            else:
                waits += [(position[(pred, c)], transfer / chunks) for c in range(chunks)]
        preds.append(tuple(waits))
    expanded = Schedule(
        nodes=tuple(schedule.nodes[node] if chunk < 0 else f"{schedule.nodes[node]}#{chunk}" for node, chunk in origin),
        group_of=tuple(schedule.group_of[node] for node, _ in origin), preds=tuple(preds),
        driver_seconds=tuple(schedule.driver_seconds[node] / (chunks if chunk >= 0 else 1) for node, chunk in origin),
        cross_group_bytes=schedule.cross_group_bytes, num_groups=schedule.num_groups)
    return expanded, tuple(origin)
