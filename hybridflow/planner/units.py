"""Allocation units: how the search hands GPUs to a group.

``GpuUnits`` (exact): any number of GPUs on each machine of one type; identical machines with the same
free count are interchangeable, so only non-increasing takes across them are generated.
``MachineUnits`` (scalable): whole machines of one (type, size) class, counts on a geometric grid.
Both yield ``(device, counts per machine, token, next state)``; ``realise`` turns tokens into GPU ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from hybridflow.planner.cluster import Cluster

State = tuple[int, ...]
Token = tuple[tuple[int, int], ...]  # (machine or class index, GPUs or machines taken)
Option = tuple[str, tuple[int, ...], Token, State]


class Units(Protocol):
    """How GPUs are handed out; ``options`` never yields an empty allocation."""

    name: str

    def initial(self) -> State: ...

    def options(self, state: State) -> Iterator[Option]: ...

    def realise(self, tokens: Sequence[Token]) -> list[tuple[int, ...]]: ...


class GpuUnits:
    """Exact: every way to take GPUs from machines of one device type."""

    name = "exact (GPU units)"

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.by_device = {name: [i for i, m in enumerate(cluster.machines) if m.device.name == name]
                          for name in cluster.device_names}

    def initial(self) -> State:
        return tuple(machine.gpus for machine in self.cluster.machines)

    def options(self, state: State) -> Iterator[Option]:
        for device, machines in self.by_device.items():
            for take in self._takes(machines, state, 0, None):
                chosen = tuple((m, c) for m, c in zip(machines, take, strict=True) if c)
                if not chosen:
                    continue
                rest = list(state)
                for m, c in chosen:
                    rest[m] -= c
                yield device, tuple(sorted((c for _, c in chosen), reverse=True)), chosen, tuple(rest)

    def _takes(self, machines: list[int], state: State, pos: int, cap: int | None) -> Iterator[tuple[int, ...]]:
        if pos == len(machines):
            yield ()
            return
        m = machines[pos]
        same = pos > 0 and self._twin(machines[pos - 1], m, state)
        top = min(state[m], cap) if same and cap is not None else state[m]
        for count in range(top, -1, -1):
            for rest in self._takes(machines, state, pos + 1, count):
                yield (count, *rest)

    def _twin(self, a: int, b: int, state: State) -> bool:
        # Swapping two machines of equal size and equal free GPUs changes nothing, so fix their order.
        return self.cluster.machines[a].gpus == self.cluster.machines[b].gpus and state[a] == state[b]

    def realise(self, tokens: Sequence[Token]) -> list[tuple[int, ...]]:
        used = [0] * len(self.cluster.machines)
        groups = []
        for token in tokens:
            gpus: list[int] = []
            for m, count in token:
                first = self.cluster.machines[m].first_gpu + used[m]
                gpus.extend(range(first, first + count))
                used[m] += count
            groups.append(tuple(gpus))
        return groups


class MachineUnits:
    """Scalable: whole machines of one (device, GPUs per machine) class, counts on a geometric grid."""

    name = "machine units"

    def __init__(self, cluster: Cluster, ratio: float = 1.25) -> None:
        self.cluster = cluster
        classes: dict[tuple[str, int], list[int]] = {}
        for i, machine in enumerate(cluster.machines):
            classes.setdefault((machine.device.name, machine.gpus), []).append(i)
        self.classes = list(classes.items())
        self.grid = {key: grid(len(members), ratio) for key, members in self.classes}

    def initial(self) -> State:
        return tuple(len(members) for _, members in self.classes)

    def options(self, state: State) -> Iterator[Option]:
        for index, ((device, gpus), _) in enumerate(self.classes):
            free = state[index]
            for count in sorted({k for k in self.grid[(device, gpus)] if k <= free} | ({free} if free else set())):
                rest = list(state)
                rest[index] -= count
                yield device, (gpus,) * count, ((index, count),), tuple(rest)

    def realise(self, tokens: Sequence[Token]) -> list[tuple[int, ...]]:
        used = [0] * len(self.classes)
        groups = []
        for token in tokens:
            gpus: list[int] = []
            for index, count in token:
                members = self.classes[index][1][used[index]:used[index] + count]
                used[index] += count
                for m in members:
                    gpus.extend(self.cluster.machines[m].gpu_ids)
            groups.append(tuple(gpus))
        return groups


def grid(limit: int, ratio: float) -> list[int]:
    """1..8, then sizes growing by ``ratio`` (rounded), up to ``limit``."""
    sizes: list[int] = []
    size = 1.0
    while round(size) <= limit:
        if not sizes or round(size) != sizes[-1]:
            sizes.append(round(size))
        size = size + 1 if size < 8 else size * ratio
    return sizes
