"""The torchrun executor: one process per GPU started by ``torchrun``, rank 0 runs the controller.

The world is static: global rank ``g`` is plan GPU ``g``. Rank 0 runs the normal
:class:`~hybridflow.runtime.controller.Controller` and hosts its own rank's
:class:`~hybridflow.runtime.worker.GroupWorker`; every other rank runs :func:`serve`, answering
``start`` / ``run`` / ``call`` / ``stop`` requests until ``exit`` (see
:mod:`~hybridflow.runtime.torchrun_protocol`). Within a plan group, ranks average gradients through
a ``torch.distributed`` subgroup of the group's ranks.

Control traffic is serialised by one lock on rank 0, so under torchrun disjoint groups run one after
the other, never overlapping (correctness first; the Ray executor overlaps them).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from hybridflow.graph import Node
from hybridflow.planner import GroupPlan, Plan
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.collective import ProcessGroupCollective
from hybridflow.runtime.errors import RuntimeStepError, WorkerFailedError
from hybridflow.runtime.executor import NamedWorkerCalls, WorkerGroup, group_specs, rank_device
from hybridflow.runtime.liveness import Liveness
from hybridflow.runtime.protocols import RoleSpec
from hybridflow.runtime.step_store import Join
from hybridflow.runtime.torchrun_protocol import (
    Heartbeat,
    Heartbeats,
    RemoteError,
    Reply,
    Request,
    TorchrunWorld,
    current_world,
    recv_reply,
    recv_request,
    send_reply,
    send_request,
)
from hybridflow.runtime.worker import WORKER_CALLS, GroupWorker, NodeResult


def check_plan_fits(plan: Plan, world_size: int) -> None:
    """Every plan GPU must be a torchrun rank (global rank = GPU id)."""
    for index, group in enumerate(plan.groups):
        for gpu in group.gpus:
            if gpu >= world_size:
                raise ValueError(f"plan group {index} (roles {list(group.roles)}) uses GPU {gpu} but torchrun "
                                 f"started a world of {world_size} process(es), one per GPU; launch at least "
                                 f"{max(max(g.gpus) for g in plan.groups) + 1} processes (--nproc_per_node x "
                                 "--nnodes) or set num_gpus / the plan to fit")


@dataclass(frozen=True, kw_only=True)
class HostedWorker:
    """The worker this process holds for its plan group (if its GPU is in one)."""

    group: int
    worker: GroupWorker


def host_worker(world: TorchrunWorld, plan: Plan, specs: Mapping[str, RoleSpec]) -> HostedWorker | None:
    """Make every group's subgroup (all ranks, same order) and this rank's :class:`GroupWorker`."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=world.timeout_s)
    subgroups = [dist.new_group(ranks=list(g.gpus), timeout=timeout) if g.size > 1 else None for g in plan.groups]
    for index, group in enumerate(plan.groups):
        if world.rank not in group.gpus:
            continue
        rank = group.gpus.index(world.rank)
        device = rank_device(group.device, world.local_rank)
        collective = (ProcessGroupCollective(group=subgroups[index], rank=rank, world_size=group.size,
                                             device=device) if group.size > 1 else None)
        worker = GroupWorker(group=index, rank=rank, world_size=group.size, device=device,
                             specs=group_specs(group, specs), layouts=group.layouts, collective=collective)
        return HostedWorker(group=index, worker=worker)
    return None


class ControlPlane:
    """Rank 0's side of the protocol: one exchange (requests out, local work, replies in) at a time."""

    def __init__(self, world: TorchrunWorld, heartbeats: Heartbeats | None = None) -> None:
        self.world, self.heartbeats = world, heartbeats
        self._lock = threading.Lock()
        self._lost: WorkerFailedError | None = None

    @property
    def lost(self) -> bool:
        """True once a rank failed to take a request or to reply: the world cannot be used any more."""
        return self._lost is not None

    def exchange(self, requests: Mapping[int, Request], local: Callable[[], Any] | None, *,
                 lost: Callable[[int, RuntimeError], WorkerFailedError], where: Callable[[int], str],
                 node: str | None = None) -> tuple[Any, dict[int, Any]]:
        """Send ``requests`` (by global rank), run ``local`` here, gather every reply, then raise the
        first failure: a lost rank, else the local error, else the lowest rank's remote error."""
        with self._lock:
            if self._lost is not None:
                raise RuntimeStepError(f"the torchrun world lost a rank earlier ({self._lost}); restart the "
                                       "job", node=node) from self._lost
            for dst, request in requests.items():
                self._io(dst, lost, partial(send_request, self.world, dst, request, self.heartbeats))
            local_value, local_error = None, None
            if local is not None:
                try:
                    local_value = local()
                except Exception as err:  # raised below, once every peer has replied
                    local_error = err
            replies: dict[int, Reply] = {src: self._io(src, lost, partial(recv_reply, self.world, src, self.heartbeats))
                                         for src in requests}
        if local_error is not None:
            raise local_error
        for src, reply in sorted(replies.items()):
            if reply.error is not None:
                reply.error.reraise(where=where(src), node=node)
        return local_value, {src: reply.value for src, reply in replies.items()}

    def _io(self, rank: int, lost: Callable[[int, RuntimeError], WorkerFailedError], io: Callable[[], Any]) -> Any:
        try:
            return io()
        except RuntimeError as err:  # gloo: "Connection closed by peer" or "Timed out waiting ..."
            self._lost = lost(rank, err)
            raise self._lost from err


def _cause(rank: int, err: BaseException, timeout_s: float) -> str:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"torchrun rank {rank} unreachable (dead, or no reply within timeout_s={timeout_s:.0f}): {first_line}"


class TorchrunWorkerGroup(NamedWorkerCalls):
    """One plan group as rank 0 sees it: remote ranks over the control plane, rank 0's own worker in-process."""

    def __init__(self, index: int, group: GroupPlan, control: ControlPlane, local: GroupWorker | None) -> None:
        self.index, self.size, self.roles = index, group.size, group.roles
        self.ranks = group.gpus  # global rank of each group rank
        self.control, self.local = control, local

    def _exchange(self, request: Callable[[int], Request], local: Callable[[], Any] | None,
                  node: Node | None) -> list[Any]:
        """``request(group_rank)`` goes to each remote rank; ``local`` runs rank 0's part; values in rank order."""
        role = str(node.role) if node is not None and node.role else "/".join(self.roles)
        name = node.name if node is not None else None

        def lost(rank: int, err: RuntimeError) -> WorkerFailedError:
            return WorkerFailedError(role=role, rank=self.ranks.index(rank), group=self.index, node=name,
                                     cause=_cause(rank, err, self.control.world.timeout_s))

        def where(rank: int) -> str:
            return (f"torchrun rank {rank} (role {role!r} rank {self.ranks.index(rank)}, group {self.index}, "
                    f"node {name!r})")

        remote = {gpu: request(rank) for rank, gpu in enumerate(self.ranks) if gpu != 0}
        local_value, values = self.control.exchange(remote, local, lost=lost, where=where, node=name)
        return [local_value if gpu == 0 else values[gpu] for gpu in self.ranks]

    def run(self, node: Node, shards: Sequence[Batch], seed: int, *, token: int | None = None,
            fields: Sequence[str] = (), part: int | None = None, joins: Sequence[Join] = ()) -> list[NodeResult]:
        local = (partial(self.local.run, node, shards[self.ranks.index(0)], seed, token=token, fields=tuple(fields),
                         part=part, joins=tuple(joins))
                 if self.local is not None else None)
        results = self._exchange(
            lambda rank: Request(kind="run", group=self.index, args=(node, shards[rank].to_wire(), seed, token,
                                                                     tuple(fields), part, tuple(joins))), local, node)
        return [result if isinstance(result, NodeResult) else
                NodeResult(outputs=Batch.from_wire(result[0]), metrics=result[1], seconds=result[2])
                for result in results]

    def call(self, method: str, *args: Any, slow: bool = False) -> list[Any]:
        """``GroupWorker.<method>(*args)`` on every rank: rank 0's in process, the others' over the control plane
        (whose own timeout bounds every call, slow or not)."""
        local = partial(getattr(self.local, method), *args) if self.local is not None else None
        request = Request(kind="call", group=self.index, args=(method, *args))
        return self._exchange(lambda rank: request, local, None)

    def export_weights(self, role: str, dtype: str, adapter: bool = False, trained_only: bool = False) -> Any:
        # through the control plane, like any call
        return self.call("export_weights", role, dtype, adapter, trained_only)[0]

    def shutdown(self) -> None:
        return None  # the executor closes every rank's engines at once (a ``stop`` request)


class TorchrunExecutor:
    """Worker groups on the processes of a torchrun world; use on rank 0 while the other ranks :func:`serve`.

    ``worker_info`` holds each rank's :meth:`GroupWorker.info` (plus its global rank) once started, also
    written as JSON to ``info_path`` when given: a record of which process ran which role.
    """

    runs_overlapped = False  # one call stream to the ranks: overlapped modes would interleave two

    def __init__(self, world: TorchrunWorld | None = None, *, info_path: str | None = None,
                 liveness: Liveness | None = None) -> None:
        self.world, self.info_path = world, info_path
        self.liveness = liveness or Liveness()
        self.groups: list[TorchrunWorkerGroup] = []
        self.worker_info: list[dict[str, Any]] = []
        self._control: ControlPlane | None = None
        self._plan: Plan | None = None

    def start(self, plan: Plan, specs: Mapping[str, RoleSpec]) -> list[WorkerGroup]:
        world = self.world = self.world or current_world()
        if world.rank != 0:
            raise RuntimeError(f"TorchrunExecutor.start runs on rank 0 (the controller); rank {world.rank} "
                               "should call serve(world)")
        check_plan_fits(plan, world.world_size)
        for group_plan in plan.groups:
            group_specs(group_plan, specs)  # a missing spec fails here, before any rank builds anything
        control = self._control = ControlPlane(world, Heartbeats(self.liveness.heartbeat_timeout_s))
        self._plan = plan
        request = Request(kind="start", args=(plan, dict(specs)))
        hosted, _ = self._everyone(plan, request, partial(host_worker, world, plan, specs))
        self.groups = [TorchrunWorkerGroup(i, group_plan, control,
                                           hosted.worker if hosted is not None and hosted.group == i else None)
                       for i, group_plan in enumerate(plan.groups)]
        for group in self.groups:
            group.setup()
        self._record_workers()
        return list(self.groups)

    def _record_workers(self) -> None:
        self.worker_info = [{**info, "global_rank": group.ranks[info["rank"]]}
                            for group in self.groups for info in group.info()]
        if self.info_path:
            Path(self.info_path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.info_path).write_text(json.dumps(self.worker_info, indent=2))

    def _everyone(self, plan: Plan, request: Request, local: Callable[[], Any] | None) -> tuple[Any, dict[int, Any]]:
        assert self._control is not None and self.world is not None
        timeout_s = self.world.timeout_s

        def placed(rank: int) -> tuple[str, int, int]:
            for index, group in enumerate(plan.groups):
                if rank in group.gpus:
                    return "/".join(group.roles), group.gpus.index(rank), index
            return "(none)", 0, -1

        def lost(rank: int, err: RuntimeError) -> WorkerFailedError:
            role, group_rank, index = placed(rank)
            return WorkerFailedError(role=role, rank=group_rank, group=index, cause=_cause(rank, err, timeout_s))

        def where(rank: int) -> str:
            role, group_rank, index = placed(rank)
            return f"torchrun rank {rank} (role {role!r} rank {group_rank}, group {index}) during {request.kind!r}"

        requests = dict.fromkeys(range(1, self.world.world_size), request)
        return self._control.exchange(requests, local, lost=lost, where=where)

    def shutdown(self) -> None:
        """Drop every rank's workers; serving ranks keep serving (a new ``start`` may follow)."""
        plan, self._plan, groups, self.groups = self._plan, None, self.groups, []
        local = [group.local for group in groups if group.local is not None]
        # After a lost rank the world is unusable: raising here would only hide the error that lost it.
        if plan is not None and self._control is not None and not self._control.lost:
            self._everyone(plan, Request(kind="stop"), partial(_close_all, local))
        self._control = None


def _close_all(workers: Sequence[GroupWorker]) -> None:
    for worker in workers:
        worker.close()


def serve(world: TorchrunWorld) -> None:
    """A non-zero rank's loop: answer rank 0's requests until ``exit`` (or until rank 0 is gone)."""
    heartbeat = Heartbeat(world)
    try:
        _serve(world)
    finally:
        heartbeat.stop()


def _serve(world: TorchrunWorld) -> None:
    hosted: HostedWorker | None = None
    while True:
        request = recv_request(world)
        if request.kind == "exit":  # after a ``stop`` normally; after a failure rank 0 may not have sent one
            if hosted is not None:
                hosted.worker.close()
            return
        try:
            value = None
            if request.kind == "start":
                plan, specs = request.args
                hosted = host_worker(world, plan, specs)
            elif request.kind == "stop":
                if hosted is not None:
                    hosted.worker.close()
                hosted = None
            else:
                value = _handle(world, hosted, request)
            reply = Reply(value=value)
        except Exception as err:  # every failure goes back to rank 0, which re-raises it
            reply = Reply(error=RemoteError.capture(err))
        send_reply(world, reply)


def _handle(world: TorchrunWorld, hosted: HostedWorker | None, request: Request) -> Any:
    if hosted is None or hosted.group != request.group:
        held = f"group {hosted.group}" if hosted else "no group"
        raise RuntimeError(f"torchrun rank {world.rank} holds {held} but got a {request.kind!r} request for group "
                           f"{request.group}; the ranks disagree on the plan")
    if request.kind == "run":
        node, wire, seed, token, fields, part, joins = request.args
        return hosted.worker.run_wire(node, wire, seed, token=token, fields=fields, part=part, joins=joins)
    if request.kind == "call":
        method, *args = request.args
        if method not in WORKER_CALLS:
            raise ValueError(f"torchrun rank {world.rank}: {method!r} is not a worker call ({sorted(WORKER_CALLS)})")
        return getattr(hosted.worker, method)(*args)
    raise ValueError(f"torchrun rank {world.rank}: unknown request kind {request.kind!r}")


def stop_serving(world: TorchrunWorld) -> None:
    """Tell every serving rank to leave :func:`serve` (rank 0, once training is over or has failed).

    Best effort: a rank that is already gone cannot be told, and torchrun ends the job anyway.
    """
    for rank in range(1, world.world_size):
        try:
            send_request(world, rank, Request(kind="exit"))
        except RuntimeError:  # that rank is dead; the others still need their exit
            continue
