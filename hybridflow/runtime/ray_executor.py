"""The Ray executor: one placement group per GPU group, one actor per ``{"GPU": 1}`` bundle.

On a CPU machine, ``ray.init(num_gpus=N)`` declares N logical GPUs so the same plan runs anywhere.
Plan host ``h`` maps to the h-th GPU node (the driver's node first, then by node id); bundles are
pinned to their node with a label selector, so the roles run where the plan put them. Data crosses
as numpy (:meth:`Batch.to_wire`); a dead actor surfaces as :class:`WorkerFailedError` naming role and rank.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.graph import Node
from hybridflow.planner import GroupPlan, Plan
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.errors import WorkerFailedError
from hybridflow.runtime.executor import WorkerGroup, group_specs
from hybridflow.runtime.protocols import RoleSpec
from hybridflow.runtime.worker import GroupWorker, NodeResult

WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
              "HF_HUB_OFFLINE": "1"}
READY_TIMEOUT_S = 60.0
# Logical GPUs a locally started CPU-only cluster declares, so later plans in the same process fit too.
MIN_LOGICAL_GPUS = 8


def ensure_ray(*, address: str | None, num_gpus: int, num_cpus: int | None = None) -> None:
    """Connect to ``address``, or start a local cluster on loopback.

    Without CUDA the local cluster declares ``max(num_gpus, 8)`` logical GPUs; with CUDA Ray counts them.
    """
    import ray
    import torch

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 enables token auth by default
    env = {"env_vars": WORKER_ENV}
    # Ray puts the driver's working directory on the workers' sys.path. From a source checkout that
    # directory's ``hybridflow/`` (without the mapped ``hybridflow.backends``) would shadow the
    # installed package, so start Ray from a neutral directory.
    cwd = os.getcwd()
    os.chdir(tempfile.gettempdir())
    try:
        if address:
            ray.init(address=address, runtime_env=env, log_to_driver=False)
        else:
            logical = None if torch.cuda.is_available() else max(num_gpus, MIN_LOGICAL_GPUS)
            ray.init(num_cpus=num_cpus or os.cpu_count() or 2, num_gpus=logical, include_dashboard=False,
                     _node_ip_address="127.0.0.1", runtime_env=env, log_to_driver=False)
    finally:
        os.chdir(cwd)


def gpu_nodes() -> list[str]:
    """Alive nodes with GPUs, the driver's first, then by node id: plan host ``h`` is entry ``h``."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    ids = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0)
    return sorted(ids, key=lambda node: (node != here, node))


class RayWorkerGroup:
    """The actors of one group; calls go to all ranks at once and failures are mapped to roles and ranks."""

    def __init__(self, index: int, group: GroupPlan, specs: Sequence[RoleSpec], nodes: Sequence[str],
                 cpus_per_worker: float) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.index, self.size, self.group = index, group.size, group
        self.roles = group.roles
        if max(group.hosts) >= len(nodes):
            raise ValueError(f"plan group {index} uses host {max(group.hosts)} but Ray has {len(nodes)} GPU "
                             "node(s); add nodes or plan for fewer machines")
        selectors = [{"ray.io/node-id": nodes[h]} for h in group.hosts] if len(nodes) > 1 else None
        bundles = [{"GPU": 1.0, "CPU": cpus_per_worker} for _ in group.gpus]
        self.placement_group = placement_group(bundles, strategy="PACK", bundle_label_selector=selectors,
                                               name=f"hybridflow-group{index}-{uuid.uuid4().hex[:8]}")
        try:
            ray.get(self.placement_group.ready(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as err:
            raise TimeoutError(f"plan group {index} ({group.size} GPU bundles on hosts {sorted(set(group.hosts))}) "
                               f"was not placed within {READY_TIMEOUT_S:.0f}s; the cluster has "
                               f"{ray.cluster_resources()}") from err
        actor_cls = ray.remote(GroupWorker)
        device = group.device if group.device == "cpu" else f"{group.device}:0"  # Ray sets CUDA_VISIBLE_DEVICES
        self.actors: list[Any] = [
            actor_cls.options(
                num_gpus=1, num_cpus=cpus_per_worker, name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                     placement_group_bundle_index=rank),
            ).remote(group=index, rank=rank, world_size=group.size, device=device, specs=specs,
                     layouts=group.layouts)
            for rank in range(group.size)
        ]
        if group.size > 1:
            address, port = ray.get(self.actors[0].rendezvous_address.remote())
            self._gather([a.init_collective.remote(address, port) for a in self.actors], None)

    def _gather(self, refs: Sequence[Any], node: Node | None) -> list[Any]:
        """Results in rank order; the first dead actor or failed call raises at once (no waiting on peers)."""
        import ray

        index = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        remaining = list(refs)
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1)
            rank = index[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as err:
                role = node.role if node is not None and node.role else "/".join(self.roles)
                raise WorkerFailedError(role=str(role), rank=rank, group=self.index,
                                        node=node.name if node else None, cause=type(err).__name__) from err
            except ray.exceptions.RayTaskError as err:
                raise err.as_instanceof_cause() from None
        return [results[rank] for rank in range(len(refs))]

    keeps_step_data = True

    def run(self, node: Node, shards: Sequence[Batch], seed: int, *, token: int | None = None,
            fields: Sequence[str] = ()) -> list[NodeResult]:
        refs = [actor.run_wire.remote(node, shard.to_wire(), seed, token=token, fields=tuple(fields))
                for actor, shard in zip(self.actors, shards, strict=True)]
        return [NodeResult(outputs=Batch.from_wire(wire), metrics=metrics, seconds=seconds)
                for wire, metrics, seconds in self._gather(refs, node)]

    def call(self, method: str, *args: Any) -> list[Any]:
        return self._gather([getattr(actor, method).remote(*args) for actor in self.actors], None)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.placement_group)


class RayExecutor:
    """Worker groups as Ray actors. Starts (or joins, with ``address``) a cluster when the plan starts."""

    def __init__(self, *, address: str | None = None, cpus_per_worker: float = 0.25,
                 num_cpus: int | None = None) -> None:
        self.address, self.cpus_per_worker, self.num_cpus = address, cpus_per_worker, num_cpus
        self.groups: list[RayWorkerGroup] = []

    def start(self, plan: Plan, specs: Mapping[str, RoleSpec]) -> list[WorkerGroup]:
        ensure_ray(address=self.address, num_gpus=plan.num_gpus, num_cpus=self.num_cpus)
        nodes = gpu_nodes()
        try:
            for index, group_plan in enumerate(plan.groups):
                self.groups.append(RayWorkerGroup(index, group_plan, group_specs(group_plan, specs), nodes,
                                                  self.cpus_per_worker))
            for group in self.groups:
                group.call("setup")
        except BaseException:
            self.shutdown()  # no half-started actors or placement groups left holding GPUs
            raise
        return list(self.groups)

    def shutdown(self) -> None:
        for group in self.groups:
            group.shutdown()
        self.groups = []
