"""The executor contract and the in-process (local) executor.

An executor turns each :class:`~hybridflow.planner.GroupPlan` into a worker group: one
:class:`~hybridflow.runtime.worker.GroupWorker` per GPU of the group. The controller hands a
group one node at a time (a per-group dispatcher thread keeps a group's nodes in order) with one
shard of rows per rank; ``run`` blocks until every rank answered or one failed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol, TypeVar

from hybridflow.graph import Node
from hybridflow.planner import GroupPlan, Plan
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.collective import ThreadGroup
from hybridflow.runtime.protocols import RoleSpec
from hybridflow.runtime.step_store import Join
from hybridflow.runtime.worker import GroupWorker, NodeResult

T = TypeVar("T")


class WorkerGroup(Protocol):
    """The ranks of one colocation group, as the controller sees them. Each method reaches every rank and
    returns their answers in rank order, raising the first failure."""

    index: int
    size: int

    def run(self, node: Node, shards: Sequence[Batch], seed: int, *, token: int | None = None,
            fields: Sequence[str] = (), part: int | None = None, joins: Sequence[Join] = ()) -> list[NodeResult]:
        """Run ``node`` with ``shards[rank]`` on each rank. With a step ``token``, ``fields`` names every input
        the node reads: those missing from the shards come from what the ranks kept this step, for the chunk
        partition ``part`` (None: the step's rows), after ``joins`` rebuilt fields of the step's rows from the
        chunks' (:mod:`~hybridflow.runtime.step_store`)."""
        ...

    def setup(self) -> None:
        """Build every rank's engines."""
        ...

    def capabilities(self) -> list[dict[str, list[str]]]:
        """Each rank's ``{role: capability names}`` (:func:`~hybridflow.runtime.protocols.capabilities_of`)."""
        ...

    def info(self) -> list[dict[str, Any]]:
        """Where each rank runs (pid, host, Ray node and GPU ids)."""
        ...

    def save_checkpoint(self, directory: str) -> None:
        ...

    def load_checkpoint(self, directory: str) -> None:
        ...

    def export_weights(self, role: str, dtype: str, adapter: bool = False, trained_only: bool = False) -> Any:
        """``role``'s whole weights in ``dtype`` (``adapter``: its LoRA adapter alone; ``trained_only``: without the
        weights that never train, a frozen vision tower) as an opaque handle another group's :meth:`import_weights`
        accepts (the packed weights here; an object-store reference under Ray)."""
        ...

    def import_weights(self, role: str, weights: Any) -> list[dict[str, float]]:
        """Load exported weights into ``role`` on every rank; each rank's ``bytes``/``tensors``/``seconds``."""
        ...

    def shutdown(self) -> None:
        """Close every rank's engines and stop the ranks."""
        ...


class Executor(Protocol):
    """Starts the worker groups of a plan. ``runs_overlapped``: whether its groups take calls from two
    threads at once (a detached rollout generating while the trainer works: ``one_step_off``, ``async``)."""

    runs_overlapped: bool

    def start(self, plan: Plan, specs: Mapping[str, RoleSpec]) -> list[WorkerGroup]:
        ...

    def shutdown(self) -> None:
        ...


class NamedWorkerCalls:
    """The typed worker calls of a group whose ranks are reached by method name (Ray actors, torchrun ranks):
    each is :meth:`call` of a :data:`~hybridflow.runtime.worker.WORKER_CALLS` name; ``slow`` marks the calls
    that build engines or touch checkpoints (a group may give them a longer deadline)."""

    def call(self, method: str, *args: Any, slow: bool = False) -> list[Any]:
        raise NotImplementedError

    def setup(self) -> None:
        self.call("setup", slow=True)

    def capabilities(self) -> list[dict[str, list[str]]]:
        return self.call("capabilities")

    def info(self) -> list[dict[str, Any]]:
        return self.call("info")

    def ping(self) -> list[bool]:
        return self.call("ping")

    def save_checkpoint(self, directory: str) -> None:
        self.call("save_checkpoint", directory, slow=True)

    def load_checkpoint(self, directory: str) -> None:
        self.call("load_checkpoint", directory, slow=True)

    def import_weights(self, role: str, weights: Any) -> list[dict[str, float]]:
        return self.call("import_weights", role, weights)


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

    def _each(self, calls: Sequence[Callable[[], T]]) -> list[T]:
        """``calls[rank]()`` on each rank's thread, at once (collectives meet); results in rank order."""
        if self.size == 1:  # no thread hop for the common single-rank case
            return [calls[0]()]
        futures: list[Future[T]] = [pool.submit(call) for pool, call in zip(self._threads, calls, strict=True)]
        wait(futures, return_when=FIRST_EXCEPTION)
        return [future.result() for future in futures]

    def _all(self, method: Callable[[GroupWorker], T]) -> list[T]:
        return self._each([lambda worker=worker: method(worker) for worker in self.workers])  # type: ignore[misc]

    def run(self, node: Node, shards: Sequence[Batch], seed: int, *, token: int | None = None,
            fields: Sequence[str] = (), part: int | None = None, joins: Sequence[Join] = ()) -> list[NodeResult]:
        return self._each([lambda w=worker, s=shard: w.run(node, s, seed, token=token, fields=fields,  # type: ignore[misc]
                                                           part=part, joins=joins)
                           for worker, shard in zip(self.workers, shards, strict=True)])

    def setup(self) -> None:
        self._all(GroupWorker.setup)

    def capabilities(self) -> list[dict[str, list[str]]]:
        return self._all(GroupWorker.capabilities)

    def info(self) -> list[dict[str, Any]]:
        return self._all(GroupWorker.info)

    def ping(self) -> list[bool]:
        return self._all(GroupWorker.ping)

    def save_checkpoint(self, directory: str) -> None:
        self._all(lambda worker: worker.save_checkpoint(directory))

    def load_checkpoint(self, directory: str) -> None:
        self._all(lambda worker: worker.load_checkpoint(directory))

    def export_weights(self, role: str, dtype: str, adapter: bool = False, trained_only: bool = False) -> Any:
        return self._all(lambda worker: worker.export_weights(role, dtype, adapter, trained_only))[0]

    def import_weights(self, role: str, weights: Any) -> list[dict[str, float]]:
        return self._all(lambda worker: worker.import_weights(role, weights))

    def shutdown(self) -> None:
        try:
            self._all(GroupWorker.close)
        finally:
            for pool in self._threads:
                pool.shutdown(wait=False, cancel_futures=True)


class LocalExecutor:
    """Every worker group in the controller's process (tests, one device, debugging)."""

    runs_overlapped = True

    def __init__(self) -> None:
        self.groups: list[LocalWorkerGroup] = []

    def start(self, plan: Plan, specs: Mapping[str, RoleSpec]) -> list[WorkerGroup]:
        self.groups = [LocalWorkerGroup(i, group, group_specs(group, specs)) for i, group in enumerate(plan.groups)]
        for group in self.groups:
            group.setup()
        return list(self.groups)

    def shutdown(self) -> None:
        groups, self.groups = self.groups, []
        shut_down_all(groups)


def shut_down_all(groups: Sequence[WorkerGroup]) -> None:
    """Shut every group down, even when one fails to; re-raise the first failure afterwards."""
    failure: BaseException | None = None
    for group in groups:
        try:
            group.shutdown()
        except Exception as err:  # stop the other groups first
            failure = failure or err
    if failure is not None:
        raise failure
