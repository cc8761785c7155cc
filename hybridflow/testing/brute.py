"""The exhaustive reference: every partition of the roles × every allocation of GPUs to each group.

No symmetry breaking and no bounds; it shares only the definition of the model with the planner
(the per-group layout policy and the schedule). Use it on small clusters: its cost explodes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from hybridflow.planner.groups import GroupEvaluator
from hybridflow.planner.layouts import GroupLayout
from hybridflow.planner.problem import Problem
from hybridflow.planner.schedule import DRIVER, Sharing, compile_schedule, shared_step


def _partitions(items: Sequence[str]) -> Iterator[list[list[str]]]:
    """Set partitions via restricted growth strings (a different construction from the planner's)."""
    n = len(items)
    for labels in itertools.product(range(n), repeat=n):
        if labels[0] != 0 or any(labels[i] > max(labels[:i]) + 1 for i in range(1, n)):
            continue
        blocks: list[list[str]] = [[] for _ in range(max(labels) + 1)]
        for item, label in zip(items, labels, strict=True):
            blocks[label].append(item)
        yield blocks


def _allocations(problem: Problem) -> list[tuple[str, tuple[int, ...]]]:
    """Every (device, GPUs taken per machine) with at least one GPU, machines of other types at 0."""
    machines = problem.cluster.machines
    found: list[tuple[str, tuple[int, ...]]] = []
    for device in problem.cluster.device_names:
        ranges = [range(m.gpus + 1) if m.device.name == device else range(1) for m in machines]
        found.extend((device, take) for take in itertools.product(*ranges) if any(take))
    return found


def brute_force_step_time(problem: Problem) -> float | None:
    """The least modelled step time over the whole plan space, or None if nothing fits."""
    evaluator = GroupEvaluator(problem)
    allocations = _allocations(problem)
    capacity = tuple(m.gpus for m in problem.cluster.machines)
    best: float | None = None
    for blocks in _partitions(list(problem.role_names)):
        if any(policy in block and rollout in block for policy, rollout in problem.apart for block in blocks):
            continue  # a policy beside its own detached rollout is the colocated problem
        schedule = compile_schedule(problem, {role: i for i, block in enumerate(blocks) for role in block})
        options: list[list[tuple[tuple[int, ...], GroupLayout]]] = []
        for block in blocks:
            fits = []
            for device, take in allocations:
                group = evaluator.best(tuple(block), evaluator.shape(device, [c for c in take if c]))
                if group is not None:
                    fits.append((take, group))
            options.append(fits)
        for combo in itertools.product(*options):
            totals = [sum(column) for column in zip(*(take for take, _ in combo), strict=True)]
            if any(total > cap for total, cap in zip(totals, capacity, strict=True)):
                continue
            seconds: dict[str, float] = {}
            for _, group in combo:
                seconds.update(group.node_seconds)
            times = [0.0 if g == DRIVER else seconds[name] for name, g in zip(schedule.nodes, schedule.group_of,
                                                                                strict=True)]
            sharing = Sharing.of_counts(problem.cluster, [take for take, _ in combo])
            _, step, _ = shared_step(schedule, times, sum(group.batch_latency_s for _, group in combo), sharing)
            best = step if best is None or step < best else best
    return best
