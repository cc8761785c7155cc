"""The single controller: runs one step of a graph over a plan's worker groups.

Nodes are submitted as soon as their inputs exist. Each group has one dispatcher thread, so a
group runs its nodes one at a time in submission order while disjoint groups, and driver-side
work (compute nodes, reward functions), run concurrently: reward scoring on the driver overlaps
reference log-probs on a GPU group.

When the plan gives a policy's rollout GPUs of its own (``actor:rollout``), the policy's generate nodes
run there and the controller ships the trainer's weights to it: once at start, after each update of
the policy (within the same step, so the next rollout samples the new policy) and after a checkpoint
load. Each shipment's seconds and bytes are step metrics (``actor/weight_sync/...``), beside the plan's
estimate (``weight_sync/planned_bytes``, ``weight_sync/planned_seconds``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Any

import torch

from hybridflow.graph import Graph, Node, Op, RoleKind
from hybridflow.planner import Plan, detachable_policies
from hybridflow.registry import COMPUTE_FNS
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.executor import Executor, LocalExecutor, WorkerGroup
from hybridflow.runtime.placement import with_rollout_specs
from hybridflow.runtime.protocols import RoleSpec, Scorer
from hybridflow.runtime.service import RoleServices, locked, serve
from hybridflow.runtime.weights import ShipStats
from hybridflow.runtime.worker import COMPANIONS, NodeResult, port_batch


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """The full batch after a step (every field the graph produced), metrics and per-node seconds."""

    batch: Batch
    metrics: dict[str, float] = field(default_factory=dict)
    node_seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Outcome:
    outputs: Batch
    metrics: Mapping[str, float]
    seconds: float
    kept: tuple[str, ...] = ()  # outputs the ranks kept exactly as gathered (same width on every rank)


class Controller:
    """Executes ``graph`` on the worker groups an executor starts for ``plan``; use as a context manager."""

    def __init__(self, graph: Graph, plan: Plan, *, specs: Mapping[str, RoleSpec],
                 executor: Executor | None = None, driver_roles: Mapping[str, Scorer] | None = None,
                 seed: int = 0, services: RoleServices | None = None) -> None:
        self.graph, self.plan, self.seed = graph, plan, seed
        self.services = services
        self.driver_roles = dict(driver_roles or {})
        _check_placement(graph, plan, self.driver_roles)
        self.executor = executor or LocalExecutor()
        self.groups: list[WorkerGroup] = self.executor.start(plan, with_rollout_specs(plan, specs))
        self._dispatchers = [ThreadPoolExecutor(1, thread_name_prefix=f"dispatch{g.index}") for g in self.groups]
        self._driver = ThreadPoolExecutor(2, thread_name_prefix="driver")
        self._token = 0
        # (group, dp) -> fields every rank of that group already holds for this step, sharded by dp.
        self._resident: dict[tuple[int, int], set[str]] = {}
        self._shipped: list[int] = []  # tensor bytes sent to each group this step
        try:
            self.sync_rollouts()
        except BaseException:
            self.shutdown()
            raise

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        for pool in [*self._dispatchers, self._driver]:
            pool.shutdown(wait=False, cancel_futures=True)
        self.executor.shutdown()

    def step(self, batch: Batch, *, step: int = 0) -> StepResult:
        """Run every node once on ``batch`` (the dataset's prompt rows); return the grown batch."""
        state, done = batch, set[str]()
        self._token += 1
        self._resident = {}
        self._shipped = [0] * len(self.groups)
        pending = list(self.graph.order)
        running: dict[Future[_Outcome], Node] = {}
        shipments: dict[str, Future[ShipStats]] = {}
        expanded = False
        metrics: dict[str, float] = {}
        seconds: dict[str, float] = {}
        while pending or running:
            for name in [n for n in pending if set(self.graph.predecessors(n)) <= done]:
                node = self.graph.node(name)
                if node.op is Op.GENERATE and not expanded:
                    # The n samples of a prompt become n adjacent rows before rollout.
                    state, expanded = state.repeat_interleave(self.graph.samples_per_prompt), True
                    self._resident = {}  # kept shards hold the unexpanded rows
                running[self._submit(node, state, step)] = node
                pending.remove(name)
            finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in finished:
                node = running.pop(future)
                outcome = future.result()  # re-raises the node's error
                if outcome.kept:
                    self._resident[self._residency_key(node)].update(outcome.kept)
                state = state.union(outcome.outputs) if len(outcome.outputs.keys()) else state
                seconds[node.name] = outcome.seconds
                prefix = f"{node.role}/" if node.role else f"{node.name}/"
                metrics.update({prefix + key: value for key, value in outcome.metrics.items()})
                done.add(node.name)
                if node.op is Op.UPDATE and str(node.role) in self.plan.detached_rollouts:
                    shipments[str(node.role)] = self._ship(str(node.role))  # a later update replaces it in order
        for policy, shipment in shipments.items():
            metrics.update(shipment.result().metrics(f"{policy}/weight_sync/"))
        if self.plan.weight_sync_bytes:
            metrics["weight_sync/planned_bytes"] = float(self.plan.weight_sync_bytes)
            metrics["weight_sync/planned_seconds"] = self.plan.weight_sync_seconds
        if self.services is not None:
            metrics.update(self.services.metrics())
        for index, shipped in enumerate(self._shipped):
            metrics[f"transfer/to_group{index}_bytes"] = float(shipped)
        return StepResult(batch=state, metrics=metrics, node_seconds=seconds)

    def _submit(self, node: Node, state: Batch, step: int) -> Future[_Outcome]:
        if node.op is Op.COMPUTE:
            return self._driver.submit(_timed, _run_compute, node, state)
        served = self.services is not None and self.services.applies(node)
        if node.role in self.driver_roles:
            scorer = self.driver_roles[node.role]
            if served:
                assert self.services is not None
                return self._driver.submit(_timed, serve, node, state,
                                           partial(_run_driver_score, node, scorer=scorer), self.services)
            return self._driver.submit(_timed, _run_driver_score, node, state, scorer)
        index = self.plan.group_index(self._placed_role(node))
        assert index is not None
        group, layout = self.groups[index], self.plan.layout(self._placed_role(node))
        wanted = [*node.inputs, *(COMPANIONS[f] for f in node.inputs if f in COMPANIONS and COMPANIONS[f] in state)]
        if served or not getattr(group, "keeps_step_data", False):
            inputs = state.select(wanted)
            self._shipped[index] += inputs.tensor_bytes
            if not served:
                return self._dispatchers[index].submit(_run_on_group, group, node, inputs, layout.dp,
                                                       self.seed + step, len(state))
            assert self.services is not None
            lock = self.services.group_locks.setdefault(index, threading.Lock()) if group.size > 1 else None
            run = partial(_run_request, locked(lock, _run_on_group), group, node, layout.dp, self.seed + step)
            return self._dispatchers[index].submit(_timed, serve, node, inputs, run, self.services)
        # A group runs its calls in order, so what this call ships or produces is there for the next one.
        resident = self._resident.setdefault(self._residency_key(node), set())
        send = state.select([name for name in wanted if name not in resident])
        self._shipped[index] += send.tensor_bytes
        resident.update(wanted)
        return self._dispatchers[index].submit(_run_on_group, group, node, send, layout.dp, self.seed + step,
                                               len(state), {"token": self._token, "fields": tuple(wanted)})

    def _placed_role(self, node: Node) -> str:
        return self.plan.runs_on(str(node.role), generates=node.op is Op.GENERATE)

    def _residency_key(self, node: Node) -> tuple[int, int]:
        index = self.plan.group_index(self._placed_role(node))
        assert index is not None
        return index, self.plan.layout(self._placed_role(node)).dp

    def _ship(self, policy: str) -> Future[ShipStats]:
        """Send ``policy``'s weights to its rollout group, in order with both groups' other work."""
        rollout = self.plan.detached_rollouts[policy]
        source, target = self.plan.group_index(policy), self.plan.group_index(rollout)
        assert source is not None and target is not None
        dtype = self.plan.layout(rollout).dtype
        exported = self._dispatchers[source].submit(_timed_export, self.groups[source], policy, dtype)
        return self._dispatchers[target].submit(_import, self.groups[target], rollout, exported)

    def sync_rollouts(self) -> dict[str, ShipStats]:
        """Ship every policy's weights to its detached rollout now (start, checkpoint load)."""
        shipments = {policy: self._ship(policy) for policy in self.plan.detached_rollouts}
        return {policy: shipment.result() for policy, shipment in shipments.items()}

    def call(self, method: str, *args: Any) -> list[list[Any]]:
        """A worker method on every rank of every group (``info``, ``save_checkpoint``...)."""
        return [group.call(method, *args) for group in self.groups]

    def save_checkpoint(self, directory: str) -> None:
        self.call("save_checkpoint", directory)

    def load_checkpoint(self, directory: str) -> None:
        self.call("load_checkpoint", directory)
        self.sync_rollouts()  # a rollout on its own GPUs still holds the weights from before the load


def _check_placement(graph: Graph, plan: Plan, driver_roles: Mapping[str, Scorer]) -> None:
    for policy, rollout in plan.detached_rollouts.items():
        if policy not in detachable_policies(graph):
            raise ValueError(f"plan role {rollout!r}: only a trainable policy that generates can have a rollout on "
                             f"GPUs of its own, and {policy!r} is not one in the {graph.name} graph")
        if plan.group_index(rollout) == plan.group_index(policy):
            raise ValueError(f"plan role {rollout!r} shares {policy!r}'s group: a rollout on the policy's own GPUs "
                             f"is the ordinary colocated one; drop {rollout!r} from the plan")
    for role in graph.roles:
        if role.kind is RoleKind.REWARD_FUNCTION or role.name in plan.driver_roles:
            if role.name not in driver_roles:
                raise KeyError(f"role {role.name!r} runs on the driver but no scorer was given for it; pass "
                               f"driver_roles={{{role.name!r}: scorer}}")
        else:
            plan.group_index(role.name)  # raises, naming the plan's roles, if it is not placed
    for group in plan.groups:
        for layout in group.layouts:
            if layout.dp * layout.tp != group.size:
                raise ValueError(f"plan: role {layout.role!r} has dp={layout.dp} x tp={layout.tp} but its group has "
                                 f"{group.size} GPUs; dp * tp must equal the group size")


def _timed_export(group: WorkerGroup, role: str, dtype: str) -> tuple[Any, float]:
    started = time.perf_counter()
    return group.export_weights(role, dtype), started


def _import(group: WorkerGroup, role: str, exported: Future[tuple[Any, float]]) -> ShipStats:
    weights, started = exported.result()
    ranks = group.import_weights(role, weights)
    return ShipStats(seconds=time.perf_counter() - started, bytes=int(ranks[0]["bytes"]),
                     tensors=int(ranks[0]["tensors"]), receivers=len(ranks))


def _timed(fn: Any, *args: Any) -> _Outcome:
    start = time.perf_counter()
    outputs, metrics = fn(*args)
    return _Outcome(outputs, metrics, time.perf_counter() - start)


def _run_compute(node: Node, state: Batch) -> tuple[Batch, dict[str, float]]:
    fn = COMPUTE_FNS.get(str(node.fn))
    try:
        result = fn(*(state[name] for name in node.inputs), **node.options_dict)
    except Exception as err:
        err.add_note(f"in compute node {node.name!r} (fn={node.fn!r}, inputs={list(node.inputs)})")
        raise
    values = result if isinstance(result, tuple) else (result,)
    if len(values) != len(node.outputs):
        raise ValueError(f"compute node {node.name!r}: fn {node.fn!r} returned {len(values)} values for outputs "
                         f"{list(node.outputs)}")
    return Batch.from_fields(dict(zip(node.outputs, values, strict=True))), {}


def _run_request(run_on_group: Any, group: WorkerGroup, node: Node, dp: int, seed: int,
                 rows: Batch) -> tuple[Batch, Mapping[str, float]]:
    outcome: _Outcome = run_on_group(group, node, rows, dp, seed, len(rows))
    return outcome.outputs, outcome.metrics


def _run_driver_score(node: Node, state: Batch, scorer: Scorer) -> tuple[Batch, dict[str, float]]:
    result = scorer(port_batch(node, state))
    try:
        return result.select(["scores"]).rename({"scores": node.outputs[0]}), {}
    except KeyError as err:
        raise KeyError(f"driver scorer for node {node.name!r} returned {result.keys()}, not 'scores'") from err


def _run_on_group(group: WorkerGroup, node: Node, inputs: Batch, dp: int, seed: int, rows: int,
                  keep: Mapping[str, Any] | None = None) -> _Outcome:
    """Split rows over the data-parallel ranks, run, gather; tensor-parallel peers get the same rows.

    ``inputs`` may hold only some fields (``keep``: the ranks hold the rest); ``rows`` is the row count.
    """
    start = time.perf_counter()
    padded, _ = inputs.pad_to_multiple(dp)
    chunks = padded.chunk(dp) if len(inputs.keys()) else [inputs] * dp
    per_dp = group.size // dp
    shards = [chunks[rank // per_dp] for rank in range(group.size)]
    results = group.run(node, shards, seed, **keep) if keep else group.run(node, shards, seed)
    leaders: list[NodeResult] = results[::per_dp]
    outputs = Batch.concat([r.outputs for r in leaders])
    # A field the ranks returned at different widths was right-padded by the gather: their kept copies
    # are narrower than the controller's, so it must be shipped again rather than read from the ranks.
    names = outputs.keys() if keep else []
    kept = tuple(name for name in names if len({_width(r.outputs[name]) for r in leaders}) == 1)
    if len(outputs.keys()):
        outputs = outputs.slice(0, rows)  # drop the padding rows
    keys = sorted({key for r in leaders for key in r.metrics})
    metrics = {key: float(torch.tensor([r.metrics[key] for r in leaders if key in r.metrics]).mean())
               for key in keys}
    return _Outcome(outputs, metrics, time.perf_counter() - start, kept)


def _width(value: Any) -> tuple[int, ...]:
    return tuple(value.shape[1:])
