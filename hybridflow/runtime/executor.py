"""The executor contract and the in-process (local) executor.

An executor turns each :class:`~hybridflow.planner.GroupPlan` into a worker group: one
:class:`~hybridflow.runtime.worker.GroupWorker` per GPU of the group. The controller hands a
group one node at a time (a per-group dispatcher thread keeps a group's nodes in order) with one
shard of rows per rank; ``run`` blocks until every rank answered or one failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from hybridflow.graph import Node
from hybridflow.planner import GroupPlan, Plan
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.collective import ThreadGroup
from hybridflow.runtime.protocols import RoleSpec
from hybridflow.runtime.worker import GroupWorker, NodeResult


class WorkerGroup(Protocol):
    """The ranks of one colocation group, as the controller sees them.

    A group whose ``keeps_step_data`` is true accepts ``token``/``fields`` in :meth:`run`: ranks keep
    each step's fields, and the controller ships only the fields a group does not hold yet.
    """

    index: int
    size: int

    def run(self, node: Node, shards: Sequence[Batch], seed: int) -> list[NodeResult]:
        """Run ``node`` with ``shards[rank]`` on each rank; raise the first failure."""
        ...

    def call(self, method: str, *args: Any) -> list[Any]:
        """Call a :class:`GroupWorker` method on every rank (setup, checkpoints, info)."""
        ...

    def export_weights(self, role: str, dtype: str) -> Any:
        """``role``'s whole weights in ``dtype`` as an opaque handle another group's :meth:`import_weights`
        accepts (the packed weights here; an object-store reference under Ray)."""
        ...

    def import_weights(self, role: str, weights: Any) -> list[dict[str, float]]:
        """Load exported weights into ``role`` on every rank; each rank's ``bytes``/``tensors``/``seconds``."""
        ...

    def shutdown(self) -> None:
        ...


class Executor(Protocol):
    """Starts the worker groups of a plan."""

    def start(self, plan: Plan, specs: Mapping[str, RoleSpec]) -> list[WorkerGroup]:
        ...

    def shutdown(self) -> None:
        ...


def group_specs(group: GroupPlan, specs: Mapping[str, RoleSpec]) -> list[RoleSpec]:
    missing = [role for role in group.roles if role not in specs]
    if missing:
        raise KeyError(f"the plan places roles {missing} but no RoleSpec was given for them; specs: {sorted(specs)}")
    return [specs[role] for role in group.roles]


def rank_device(device: str, gpu: int) -> str:
    """Device string of a rank that owns global GPU ``gpu`` in this process."""
    return device if device == "cpu" else f"{device}:{gpu}"


class LocalWorkerGroup:
    """All ranks of a group in this process; each rank has its own thread so collectives can meet."""

    def __init__(self, index: int, group: GroupPlan, specs: Sequence[RoleSpec]) -> None:
        self.index, self.size = index, group.size
        threads = ThreadGroup(group.size) if group.size > 1 else None
        self.workers = [
            GroupWorker(group=index, rank=rank, world_size=group.size, device=rank_device(group.device, gpu),
                        specs=specs, layouts=group.layouts, collective=threads.member(rank) if threads else None)
            for rank, gpu in enumerate(group.gpus)
        ]
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"group{index}-rank{r}") for r in range(self.size)]

    def _all(self, calls: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        if self.size == 1:  # no thread hop for the common single-rank case
            method, args = calls[0]
            return [_call(self.workers[0], method, args)]
        futures: list[Future[Any]] = [pool.submit(_call, worker, method, args)
                                      for pool, worker, (method, args) in zip(self._threads, self.workers, calls,
                                                                              strict=True)]
        wait(futures, return_when=FIRST_EXCEPTION)
        return [future.result() for future in futures]

    keeps_step_data = True

    def run(self, node: Node, shards: Sequence[Batch], seed: int, *, token: int | None = None,
            fields: Sequence[str] = ()) -> list[NodeResult]:
        return list(self._all([("run", (node, shard, seed, token, tuple(fields))) for shard in shards]))

    def call(self, method: str, *args: Any) -> list[Any]:
        return self._all([(method, args)] * self.size)

    def export_weights(self, role: str, dtype: str) -> Any:
        return self.call("export_weights", role, dtype)[0]

    def import_weights(self, role: str, weights: Any) -> list[dict[str, float]]:
        return self.call("import_weights", role, weights)

    def shutdown(self) -> None:
        for pool in self._threads:
            pool.shutdown(wait=False, cancel_futures=True)


def _call(worker: GroupWorker, method: str, args: tuple[Any, ...]) -> Any:
    if method == "run":
        node, shard, seed, token, fields = args
        return worker.run(node, shard, seed, token=token, fields=fields)
    return getattr(worker, method)(*args)


class LocalExecutor:
    """Every worker group in the controller's process (tests, one device, debugging)."""

    def __init__(self) -> None:
        self.groups: list[LocalWorkerGroup] = []

    def start(self, plan: Plan, specs: Mapping[str, RoleSpec]) -> list[WorkerGroup]:
        self.groups = [LocalWorkerGroup(i, group, group_specs(group, specs)) for i, group in enumerate(plan.groups)]
        for group in self.groups:
            group.call("setup")
        return list(self.groups)

    def shutdown(self) -> None:
        for group in self.groups:
            group.shutdown()
        self.groups = []
