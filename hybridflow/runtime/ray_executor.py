"""The Ray executor: one placement group per GPU group, one actor per ``{"GPU": 1}`` bundle.

On a CPU machine, ``ray.init(num_gpus=N)`` declares N logical GPUs so the same plan runs anywhere.
Plan host ``h`` maps to the h-th GPU node (the driver's node first, then by node id); bundles are
pinned to their node with a label selector, so the roles run where the plan put them. Data crosses
as numpy (:meth:`Batch.to_wire`); a dead actor surfaces as :class:`WorkerFailedError` naming role and rank.
Every wait on the actors has a deadline and a heartbeat (:mod:`~hybridflow.runtime.liveness`): a hung
(stopped) actor fails the call within ``heartbeat_timeout_s + heartbeat_interval_s``, naming where it ran.

A locally started cluster listens on loopback only (:func:`_loopback_node`) and runs with Ray's token
authentication and a fresh random token per process, which keeps out other users of the same machine
(docs/security.md).

Device types are Ray custom resources named ``gpu_type:<plan device>`` (``gpu_type:A100-80G``), one
unit per GPU: start real nodes with ``ray start --num-gpus 8 --resources '{"gpu_type:A100-80G": 8}'``.
A bundle of a GPU group asks for one unit of its type only when the cluster declares at least one
``gpu_type:`` resource, so clusters started without them still run every plan (unchecked).

Over 400 lines on purpose: placement groups, the actors they hold and the deadlines of every wait on them share
one executor's state (the actors, their bundles, their heartbeats); the cluster connection and token
authentication are apart already (``ensure_ray``, ``enable_token_auth``).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hybridflow.graph import Node
from hybridflow.planner import GroupPlan, Plan
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.errors import WorkerFailedError
from hybridflow.runtime.executor import NamedWorkerCalls, WorkerGroup, group_specs, shut_down_all
from hybridflow.runtime.host_memory import ENV as HOST_MALLOC_ENV
from hybridflow.runtime.liveness import Liveness
from hybridflow.runtime.protocols import RoleSpec
from hybridflow.runtime.ray_reaper import start_reaper
from hybridflow.runtime.step_store import Join
from hybridflow.runtime.worker import WORKER_CALLS, GroupWorker, NodeResult

WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
              "HF_HUB_OFFLINE": "1"}
READY_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 10.0  # a ray_address that does not accept a TCP connection within this is refused
# Off, Ray keeps a loopback node address (see _loopback_node).
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
CLOSE_TIMEOUT_S = 30.0  # engines get this long to stop (vLLM) before their actors are killed
# Logical GPUs a locally started CPU-only cluster declares, so later plans in the same process fit too.
MIN_LOGICAL_GPUS = 8
# Ray custom resource prefix naming a node's GPU type; Ray's own ``accelerator_type:`` resources use
# other names (``A100`` for every A100 variant) and count nodes rather than GPUs, so they cannot be used.
GPU_TYPE_PREFIX = "gpu_type:"
_PLACEMENT_GROUP_RESOURCE = re.compile(r"_group_(\d+_)?[0-9a-f]{16,}$")
# Actor methods in this concurrency group run on a thread of their own, so a ping is answered while a
# long node runs in the default group (whose single thread keeps a rank's calls in order).
HEARTBEAT_GROUP = "heartbeat"


def ensure_ray(*, address: str | None, num_gpus: int, num_cpus: int | None = None) -> None:
    """Connect to ``address``, or start a local cluster on loopback.

    Without CUDA the local cluster declares ``max(num_gpus, 8)`` logical GPUs; with CUDA Ray counts them.
    """
    import ray
    import torch

    if address:
        check_reachable(address)  # even with Ray already up in this process: a bad address is named, not ignored
    if ray.is_initialized():
        if address:
            _check_same_cluster(address, ray.get_runtime_context().gcs_address)
        return
    with _keep_sigterm_handler():
        _init_ray(ray, torch, address=address, num_gpus=num_gpus, num_cpus=num_cpus)


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """Put back a SIGTERM handler the caller installed (``hybridflow train``'s, which stops the run like Ctrl-C):
    ``ray.init`` replaces it with ``sys.exit``, which ends the driver without shutting the run down."""
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if on_main else None
    try:
        yield
    finally:
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)


def _init_ray(ray: Any, torch: Any, *, address: str | None, num_gpus: int, num_cpus: int | None) -> None:
    # The driver's malloc policy reaches its workers (hybridflow.runtime.host_memory).
    policy = {HOST_MALLOC_ENV: os.environ[HOST_MALLOC_ENV]} if HOST_MALLOC_ENV in os.environ else {}
    env = {"env_vars": {**WORKER_ENV, **policy}}
    if address:
        # A cluster someone started: its auth mode is theirs (`ray start` with RAY_AUTH_MODE=token is safe).
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address=address, runtime_env=env, log_to_driver=False)
    else:
        enable_token_auth()
        start_reaper(os.environ["RAY_AUTH_TOKEN"])  # a SIGKILLed driver must not leave the cluster running
        logical = None if torch.cuda.is_available() else max(num_gpus, MIN_LOGICAL_GPUS)
        # address="local": always a cluster of our own, never another user's that happens to run here.
        # enable_metrics_collection off: the dashboard agent then serves no unauthenticated Prometheus page.
        with _loopback_node():
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 2, num_gpus=logical,
                     include_dashboard=False, _node_ip_address="127.0.0.1", runtime_env=env, log_to_driver=False,
                     _system_config={"enable_metrics_collection": False})


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """Start the local cluster with node address 127.0.0.1, so every server of it binds to loopback.

    Ray 2.60 swaps ``_node_ip_address="127.0.0.1"`` for the machine's routable address unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is off (its macOS/Windows default, read into
    ``ray_constants.ENABLE_RAY_CLUSTER`` at import); given a loopback node address, GCS, raylet, workers,
    the dashboard agent (HTTP, gRPC, ``/metrics``), the runtime-env agent and the autoscaler's and API
    server's metrics pages all bind to 127.0.0.1 (``tests/reliability/test_ray_liveness.py`` lists them
    against docs/security.md). The variable reaches the cluster's processes through their environment and
    is put back afterwards, so clusters started later by hand (``ray.cluster_utils``) are unaffected.
    """
    from ray._private import ray_constants

    saved_flag, saved_env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(LOCAL_ONLY_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[LOCAL_ONLY_ENV] = "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(LOCAL_ONLY_ENV, None)
        else:
            os.environ[LOCAL_ONLY_ENV] = saved_env


def _check_same_cluster(address: str, connected: str) -> None:
    """Refuse ``address`` when this process is connected to another cluster: its workers would start there."""
    import socket

    def endpoint(text: str) -> tuple[str, int] | None:
        found = re.fullmatch(r"\[?([^\]/]+?)\]?:(\d+)", text.strip())
        if found is None:
            return None
        try:
            return socket.gethostbyname(found.group(1)), int(found.group(2))
        except OSError:
            return found.group(1), int(found.group(2))

    wanted, current = endpoint(address), endpoint(connected)
    if wanted is not None and current is not None and wanted != current:
        raise RuntimeError(f"ray_address {address!r}: this process is already connected to the Ray cluster at "
                           f"{connected}; call ray.shutdown() first, or leave ray_address unset to use that one")


def check_reachable(address: str, *, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse a ``host:port`` (or ``ray://host:port``) nobody listens on within ``timeout_s``, naming it.

    Ray 2.60's ``ray.init(address=...)`` retries an unreachable GCS without end; ``auto`` and other forms
    are left to Ray (they name a cluster on this machine).
    """
    import socket

    found = re.fullmatch(r"(?:ray://)?\[?([^\]/]+?)\]?:(\d+)", address.strip())
    if found is None:
        return
    host, port = found.group(1), int(found.group(2))
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        raise ConnectionError(f"Ray address {address!r}: nothing answers at {host}:{port} within {timeout_s:.0f} s "
                              f"({err}); start the cluster there (`ray start --head --port {port}`) or leave the "
                              "address unset to start a local one") from err


def enable_token_auth() -> None:
    """Turn on Ray's token authentication with a fresh random token for the cluster this process starts.

    The cluster listens on loopback only (:func:`_loopback_node`); the token keeps out other users of this
    machine, who could otherwise submit code to it. The token lives in this process's environment (inherited
    by the cluster's processes only), never on disk.
    """
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    refresh_auth_settings()


def refresh_auth_settings() -> None:
    """Make Ray re-read ``RAY_AUTH_*`` from the environment (it caches them when first used), e.g. after a
    caller restored them to join another cluster from the same process."""
    try:  # Ray 2.60's own test helpers refresh them the same way
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]
    except ImportError:  # a Ray without token auth: nothing cached to refresh
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def gpu_nodes() -> list[str]:
    """Alive nodes with GPUs, the driver's first, then by node id: plan host ``h`` is entry ``h``."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    ids = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0)
    return sorted(ids, key=lambda node: (node != here, node))


def gpu_type_resource(device: str) -> str | None:
    """The custom resource a bundle of a ``device`` group asks for; None for ``"cpu"`` groups."""
    return None if device == "cpu" else f"{GPU_TYPE_PREFIX}{device}"


def declared_gpu_types(resources: Mapping[str, float]) -> dict[str, int]:
    """``{device type: GPU count}`` from Ray resources (a node's or the cluster's)."""
    # Placed groups add derived resources (``gpu_type:T4_group_<pg id>``) that outlive their removal briefly.
    # Sorted, so the error messages that quote it read the same whatever order Ray reports.
    return {name.removeprefix(GPU_TYPE_PREFIX): int(count) for name, count in sorted(resources.items())
            if name.startswith(GPU_TYPE_PREFIX) and not _PLACEMENT_GROUP_RESOURCE.search(name)}


def check_device_type(index: int, group: GroupPlan, nodes: Sequence[str]) -> str | None:
    """The type resource each bundle of ``group`` asks for, after checking its planned nodes exist and have it.

    None when the group runs on ``cpu`` or the cluster declares no device types at all. A missing type
    raises at once, naming the group, the type and what the cluster has, rather than a placement that
    would never be satisfied.
    """
    import ray

    if max(group.hosts) >= len(nodes):
        raise ValueError(f"plan group {index} uses host {max(group.hosts)} but Ray has {len(nodes)} GPU "
                         "node(s); add nodes or plan for fewer machines")
    resource = gpu_type_resource(group.device)
    cluster = declared_gpu_types(ray.cluster_resources())
    if resource is None or not cluster:
        return None
    fix = (f"start nodes with --resources '{{\"{resource}\": N}}' or plan for the cluster's types "
           f"{sorted(cluster)}")
    what = f"plan group {index} ({'/'.join(group.roles)}, {group.size}x {group.device})"
    if cluster.get(group.device, 0) < group.size:
        raise ValueError(f"{what} needs {group.size} {resource} but the cluster declares {cluster}; {fix}")
    if len(nodes) > 1:  # bundles are pinned per host: each planned node must hold its share
        declared = {n["NodeID"]: declared_gpu_types(n["Resources"]) for n in ray.nodes() if n["Alive"]}
        for host in sorted(set(group.hosts)):
            needed, has = group.hosts.count(host), declared.get(nodes[host], {})
            if has.get(group.device, 0) < needed:
                raise ValueError(f"{what} needs {needed} {resource} on plan host {host} = Ray node "
                                 f"{nodes[host][:12]} (hosts are GPU nodes in order, driver's node first), "
                                 f"which declares {has or 'no device types'}; {fix}")
    return resource


class RayWorkerGroup(NamedWorkerCalls):
    """The actors of one group; calls go to all ranks at once and failures are mapped to roles and ranks."""

    def __init__(self, index: int, group: GroupPlan, specs: Sequence[RoleSpec], nodes: Sequence[str],
                 cpus_per_worker: float, type_resource: str | None = None, *, liveness: Liveness | None = None,
                 estimates: Mapping[str, float] | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.index, self.size, self.group = index, group.size, group
        self.roles = group.roles
        self.liveness = liveness or Liveness()
        self._estimates = dict(estimates or {})  # the plan's seconds per node
        self._measured: dict[str, float] = {}  # the slowest call of each node so far
        self._failed = False  # a rank failed or hung: shutdown kills without waiting on it
        self.where = [f"rank {rank}" for rank in range(group.size)]
        selectors = [{"ray.io/node-id": nodes[h]} for h in group.hosts] if len(nodes) > 1 else None
        bundles = [{"GPU": 1.0, "CPU": cpus_per_worker} | ({type_resource: 1.0} if type_resource else {})
                   for _ in group.gpus]
        self.placement_group = placement_group(bundles, strategy="PACK", bundle_label_selector=selectors,
                                               name=f"hybridflow-group{index}-{uuid.uuid4().hex[:8]}")
        try:
            ray.get(self.placement_group.ready(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as err:
            raise TimeoutError(f"plan group {index} ({group.size} {group.device} GPU bundles on hosts "
                               f"{sorted(set(group.hosts))}) "
                               f"was not placed within {READY_TIMEOUT_S:.0f}s; the cluster has "
                               f"{ray.cluster_resources()}") from err
        actor_cls = ray.remote(concurrency_groups={HEARTBEAT_GROUP: 1})(GroupWorker)  # type: ignore[call-overload]
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
        slow = self.liveness.setup_timeout_s
        # No heartbeat yet: an actor's process may take long to start on a loaded machine.
        infos = self._gather([a.info.remote() for a in self.actors], None, deadline_s=slow, heartbeat=False)
        self.where = [_where(info) for info in infos]
        if group.size > 1:
            address, port = self._gather([self.actors[0].rendezvous_address.remote()], None, deadline_s=slow)[0]
            self._gather([a.init_collective.remote(address, port) for a in self.actors], None, deadline_s=slow)

    def _gather(self, refs: Sequence[Any], node: Node | None, *, deadline_s: float | None = None,
                heartbeat: bool = True) -> list[Any]:
        """Results in rank order; the first dead actor or failed call raises at once (no waiting on peers),
        a rank without a heartbeat or past the deadline raises :class:`WorkerFailedError` naming it."""
        import ray

        started = time.monotonic()
        if deadline_s is None:
            name = node.name if node is not None else ""
            deadline_s = self.liveness.deadline_s(estimate_s=self._estimates.get(name, 0.0),
                                                  measured_s=self._measured.get(name, 0.0))
        index = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        remaining = list(refs)
        beats = _Heartbeats(self.actors, self.liveness)
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=self.liveness.heartbeat_interval_s)
            for ref in ready:
                results[index[ref]] = self._result(ref, index[ref], node)
            if not remaining:
                break
            pending = sorted(index[ref] for ref in remaining)
            if heartbeat:
                beats.check(pending, fail=lambda rank, cause, err=None: self._fail(rank, node, cause, err))
            waited = time.monotonic() - started
            if waited > deadline_s:
                raise self._fail(pending[0], node, f"no result after {waited:.0f}s, past the deadline of "
                                 f"{deadline_s:.0f}s (set liveness.call_timeout_s to change it)")
        if node is not None:
            self._measured[node.name] = max(self._measured.get(node.name, 0.0), time.monotonic() - started)
        return [results[rank] for rank in range(len(refs))]

    def _result(self, ref: Any, rank: int, node: Node | None) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as err:
            raise self._fail(rank, node, type(err).__name__, err) from err
        except ray.exceptions.RayTaskError as err:
            raise err.as_instanceof_cause() from None

    def _fail(self, rank: int, node: Node | None, cause: str, err: BaseException | None = None) -> WorkerFailedError:
        self._failed = True
        role = node.role if node is not None and node.role else "/".join(self.roles)
        failure = WorkerFailedError(role=str(role), rank=rank, group=self.index, node=node.name if node else None,
                                    cause=cause, where=self.where[rank] if rank < len(self.where) else None)
        if err is not None:
            failure.__cause__ = err
        return failure

    def run(self, node: Node, shards: Sequence[Batch], seed: int, *, token: int | None = None,
            fields: Sequence[str] = (), part: int | None = None, joins: Sequence[Join] = ()) -> list[NodeResult]:
        refs = [actor.run_wire.remote(node, shard.to_wire(), seed, token=token, fields=tuple(fields), part=part,
                                      joins=tuple(joins))
                for actor, shard in zip(self.actors, shards, strict=True)]
        return [NodeResult(outputs=Batch.from_wire(wire), metrics=metrics, seconds=seconds)
                for wire, metrics, seconds in self._gather(refs, node)]

    def call(self, method: str, *args: Any, slow: bool = False) -> list[Any]:
        """``GroupWorker.<method>(*args)`` on every actor (Ray addresses actor methods by name); ``slow``
        calls (engine building, checkpoint I/O) get ``liveness.setup_timeout_s``."""
        if method not in WORKER_CALLS:
            raise ValueError(f"{method!r} is not a worker call; worker calls: {sorted(WORKER_CALLS)}")
        deadline = self.liveness.setup_timeout_s if slow else None
        return self._gather([getattr(actor, method).remote(*args) for actor in self.actors], None, deadline_s=deadline)

    def export_weights(self, role: str, dtype: str, adapter: bool = False, trained_only: bool = False) -> Any:
        """Rank 0's packed weights as an object reference: they stay in this group's object store until
        the receivers pull them, and never pass through the controller (only the tensor counts do)."""
        parts = [actor.export_weights_parts.options(num_returns=2).remote(role, dtype, adapter, trained_only)
                 for actor in self.actors]
        self._gather([count for count, _ in parts], None)  # a failed or dead rank raises here, by rank
        return parts[0][1]

    def shutdown(self) -> None:
        """Close the engines (bounded: a hung rank must not hang the shutdown), then end the actors."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            if not self._failed:  # a failed rank's peers may sit in a collective with it: kill at once
                ray.get([actor.close.remote() for actor in self.actors], timeout=CLOSE_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # a dead or stuck rank: killing the actors below frees what it held
        finally:
            for actor in self.actors:
                ray.kill(actor)
            remove_placement_group(self.placement_group)


class RayExecutor:
    """Worker groups as Ray actors. Starts (or joins, with ``address``) a cluster when the plan starts."""

    runs_overlapped = True

    def __init__(self, *, address: str | None = None, cpus_per_worker: float = 0.25,
                 num_cpus: int | None = None, liveness: Liveness | None = None) -> None:
        self.address, self.cpus_per_worker, self.num_cpus = address, cpus_per_worker, num_cpus
        self.liveness = liveness or Liveness()
        self.groups: list[RayWorkerGroup] = []

    def start(self, plan: Plan, specs: Mapping[str, RoleSpec]) -> list[WorkerGroup]:
        ensure_ray(address=self.address, num_gpus=plan.num_gpus, num_cpus=self.num_cpus)
        nodes = gpu_nodes()
        # Every group is checked against the cluster before any actor starts: a plan the cluster cannot
        # hold fails in milliseconds, not after the first groups loaded their models.
        types = [check_device_type(index, group, nodes) for index, group in enumerate(plan.groups)]
        estimates = {estimate.node: estimate.seconds for estimate in plan.nodes}
        try:
            for index, (group_plan, type_resource) in enumerate(zip(plan.groups, types, strict=True)):
                self.groups.append(RayWorkerGroup(index, group_plan, group_specs(group_plan, specs), nodes,
                                                  self.cpus_per_worker, type_resource, liveness=self.liveness,
                                                  estimates=estimates))
            for group in self.groups:
                group.setup()
        except BaseException:
            self.shutdown()  # no half-started actors or placement groups left holding GPUs
            raise
        return list(self.groups)

    def shutdown(self) -> None:
        groups, self.groups = self.groups, []
        shut_down_all(groups)


class _Heartbeats:
    """One outstanding ``ping`` per rank still working on a call, sent every ``heartbeat_interval_s``."""

    def __init__(self, actors: Sequence[Any], liveness: Liveness) -> None:
        self.actors, self.liveness = actors, liveness
        self.sent: dict[int, tuple[Any, float]] = {}  # rank -> (ping reference, when sent)
        self.answered: dict[int, float] = {}

    def check(self, ranks: Sequence[int], *, fail: Any) -> None:
        """Send due pings to ``ranks``; raise ``fail(rank, cause)`` for a rank silent past the timeout."""
        import ray

        now = time.monotonic()
        for rank in ranks:
            if rank not in self.sent:
                if now - self.answered.get(rank, float("-inf")) >= self.liveness.heartbeat_interval_s:
                    ping = self.actors[rank].ping.options(concurrency_group=HEARTBEAT_GROUP).remote()
                    self.sent[rank] = (ping, now)
                continue
            ping, at = self.sent[rank]
            if ray.wait([ping], timeout=0)[0]:
                try:
                    ray.get(ping)
                except ray.exceptions.RayActorError as err:
                    raise fail(rank, type(err).__name__, err) from err
                del self.sent[rank]
                self.answered[rank] = now
            elif now - at > self.liveness.heartbeat_timeout_s:
                raise fail(rank, f"no heartbeat for {now - at:.0f}s (liveness.heartbeat_timeout_s="
                           f"{self.liveness.heartbeat_timeout_s:g}): the process is stopped, frozen or unreachable")


def _where(info: Mapping[str, Any]) -> str:
    """``host H (Ray node N, pid P)`` from a rank's :meth:`GroupWorker.info`."""
    node = f"Ray node {str(info['node_id'])[:12]}, " if info.get("node_id") else ""
    return f"host {info.get('host', '?')} ({node}pid {info.get('pid', '?')})"
