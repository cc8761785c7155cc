"""The single controller: runs one step of a graph over a plan's worker groups.

Nodes are submitted as soon as their inputs exist. Each group has one dispatcher thread, so a
group runs its nodes one at a time in submission order while disjoint groups, and driver-side
work (compute nodes, reward functions), run concurrently: reward scoring on the driver overlaps
reference log-probs on a GPU group.

When the plan gives a policy's rollout GPUs of its own (``actor:rollout``), the policy's generate nodes
run there and the controller ships the trainer's weights to it: once at start, after each update of
the policy (within the same step, so the next rollout samples the new policy) and after a checkpoint
load. A LoRA policy whose rollout takes adapters (vLLM) ships the adapter alone, the base loaded there once.
Each shipment's seconds and bytes are step metrics (``actor/weight_sync/...``), beside the plan's
estimate (``weight_sync/planned_bytes``, ``weight_sync/planned_seconds``). A checkpoint of an overlapped
mode also holds the rollout's work for later steps (:mod:`.rollout_state`), so a resumed run continues as
the uninterrupted one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

from hybridflow.graph import Graph, Node, Op
from hybridflow.planner import Plan
from hybridflow.planner.execution import ExecutionMode
from hybridflow.planner.fleet import fleet_metrics
from hybridflow.registry import COMPUTE_FNS
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.checks import (
    adapter_shipping,
    check_capabilities,
    check_layouts,
    check_placement,
    check_streaming,
)
from hybridflow.runtime.dispatch import DriverTarget, GroupTarget, Outcome, Served, Target, timed
from hybridflow.runtime.errors import RuntimeStepError
from hybridflow.runtime.executor import Executor, LocalExecutor, WorkerGroup
from hybridflow.runtime.filtering import FilterRounds, with_uids
from hybridflow.runtime.pipeline import Overlap, Upcoming, check_pipeline, unused_rollout_state
from hybridflow.runtime.placement import with_rollout_specs
from hybridflow.runtime.protocols import NodeState, RoleSpec, Scorer
from hybridflow.runtime.rank_balance import rank_balance
from hybridflow.runtime.rollouter import Rollouter
from hybridflow.runtime.scheduler import PartitionSource, Scheduler, StepRecord, WholeStep
from hybridflow.runtime.service import RoleServices
from hybridflow.runtime.step_store import StepLedger
from hybridflow.runtime.streaming import StreamChunks
from hybridflow.runtime.weights import WeightSyncStats


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """The full batch after a step (every field the graph produced), metrics, per-node seconds (summed over the
    node's calls) and spans (its first call's start and its last call's end, seconds from the step's start)."""

    batch: Batch
    metrics: dict[str, float] = field(default_factory=dict)
    node_seconds: dict[str, float] = field(default_factory=dict)
    node_spans: dict[str, tuple[float, float]] = field(default_factory=dict)


def _agent_tokenizer(node: Node, specs: Mapping[str, RoleSpec]) -> Any:
    """The policy's tokenizer where a multi-turn node's turns are templated on the driver (else None)."""
    if not node.environment:
        return None
    from hybridflow.runtime.agent_rollout import role_tokenizer

    return role_tokenizer(specs[str(node.role)].model)


class Controller:
    """Executes ``graph`` on the worker groups an executor starts for ``plan``; use as a context manager.

    ``mode`` is the execution mode the steps run (default: the one the plan was costed for, ``plan.mode``);
    ``eos_token_id`` tells a finished response from one a partial rollout's segment cut."""

    def __init__(self, graph: Graph, plan: Plan, *, specs: Mapping[str, RoleSpec],
                 executor: Executor | None = None, driver_roles: Mapping[str, Scorer] | None = None,
                 seed: int = 0, services: RoleServices | None = None, mode: ExecutionMode | None = None,
                 eos_token_id: int | None = None, balance_ranks: bool = True) -> None:
        self.graph, self.plan, self.seed = graph, plan, seed
        # Generated rows reordered so data-parallel ranks get equal tokens (undone in the step's result).
        self.balance = rank_balance(plan) if balance_ranks else None
        self.mode = plan.mode if mode is None else mode
        self.services = services
        self.driver_roles = dict(driver_roles or {})
        check_placement(graph, plan, self.driver_roles)
        overlapped = check_pipeline(self.mode, graph, plan)
        check_streaming(graph, self.mode)
        # k+1 policy versions may be generating at once (a rollout keeping adapter versions keeps that many).
        specs = {name: replace(spec, policy_versions=self.mode.k + 1)
                 for name, spec in with_rollout_specs(plan, specs).items()}
        check_layouts(graph, plan, specs)  # before any engine loads a model
        self.executor = executor or LocalExecutor()
        if self.mode.overlapped and not self.executor.runs_overlapped:
            raise ValueError(f"pipeline={self.mode.pipeline!r}: the {type(self.executor).__name__} runs "
                             "pipeline='sync' only; use the Ray or local executor for overlapped modes")
        self.groups: list[WorkerGroup] = self.executor.start(plan, specs)
        self._dispatchers = [ThreadPoolExecutor(1, thread_name_prefix=f"dispatch{g.index}") for g in self.groups]
        self._driver = ThreadPoolExecutor(2, thread_name_prefix="driver")
        self.ledger = StepLedger(len(self.groups))
        self.node_states = _node_states(graph, {name: spec.model for name, spec in specs.items()})
        self._step_calls: list[tuple[Node, Future[Outcome] | None]] = []  # the step in flight's (abandon_step)
        try:
            self._adapter_shipping = adapter_shipping(plan, check_capabilities(graph, plan, self.groups))
            self._targets = self._make_targets()
            # one_step_off is the rollouter one update ahead on whole batches (ExecutionMode.segment_budget).
            self._overlap = None if overlapped is None else Overlap(Rollouter(
                overlapped, self._targets[self._placed_role(overlapped)], mode=self.mode, seed=seed,
                eos_token_id=eos_token_id, tokenizer=_agent_tokenizer(overlapped, specs)),
                samples=graph.samples_per_prompt, pipeline=self.mode.pipeline)
            self.sync_rollouts()
        except BaseException:
            self.shutdown()
            raise

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if getattr(self, "_overlap", None) is not None:
            self._overlap.rollouter.close()  # type: ignore[union-attr]
        for pool in [*self._dispatchers, self._driver]:
            pool.shutdown(wait=False, cancel_futures=True)
        self.executor.shutdown()

    def step(self, batch: Batch, *, step: int = 0, more: Callable[[int], Batch] | None = None,
             upcoming: Upcoming = None) -> StepResult:
        """Run every node once on ``batch`` (the dataset's prompt rows); return the grown batch.

        Rows without a ``uid`` get one per prompt (its position), which the n samples of the prompt share.
        A graph with a filter reruns the filter's section on ``more(round)`` (fresh prompt rows) until the
        kept groups fill the batch again, at most the filter's ``max_rounds`` times (:mod:`.filtering`).
        With ``pipeline=one_step_off`` or ``async``, ``upcoming`` gives later steps' prompt rows: a function from
        a step to its rows (None past the run's end), or the next step's Batch. The rollout generates up to
        ``max_staleness`` steps ahead (1 for one_step_off) and this step trains on what it generated
        (:mod:`.pipeline`, :mod:`.rollouter`). Every mode is partitions of the step's rows run by one
        scheduler (:mod:`.scheduler`).
        """
        self.ledger.begin_step()
        self._step_calls = []
        record = StepRecord()
        source = self._partitions(with_uids(batch, 0), step, record, more, upcoming)
        scheduler = Scheduler(self.graph, submit=self._submit, finished=partial(self._finished, record),
                              regrouped=self.ledger.rows_changed, balance=self.balance)
        state = scheduler.run(source, seed=self.seed + step)
        metrics = record.metrics
        if self.balance is not None:
            metrics.update(self.balance.take_metrics())
        for policy, shipment in record.shipments.items():
            metrics.update(shipment.result().metrics(f"{policy}/weight_sync/"))
        if self.plan.weight_sync_bytes:
            metrics["weight_sync/planned_bytes"] = float(self.plan.weight_sync_bytes)
            metrics["weight_sync/planned_seconds"] = self.plan.weight_sync_seconds
        metrics.update(fleet_metrics(self.plan))  # beside the server rollout's measured rollout/sync_s, sync_bytes
        if self.services is not None:
            metrics.update(self.services.metrics())
        for index, shipped in enumerate(self.ledger.shipped):
            metrics[f"transfer/to_group{index}_bytes"] = float(shipped)
        return StepResult(batch=state, metrics=metrics, node_seconds=record.seconds, node_spans=record.spans)

    def _partitions(self, prompts: Batch, step: int, record: StepRecord, more: Callable[[int], Batch] | None,
                    upcoming: Upcoming) -> PartitionSource:
        """The mode's partitions of this step (:mod:`.scheduler`)."""
        seed = self.seed + step
        if self._overlap is not None:
            return self._overlap.source(prompts, step=step, upcoming=upcoming, record=record)
        if self.mode.stream_chunks > 1:
            return StreamChunks(rows=prompts.repeat_interleave(self.graph.samples_per_prompt), graph=self.graph,
                                chunks=self.mode.stream_chunks, seed=seed)
        if self.graph.filter_node is not None:
            return FilterRounds(self.graph, prompts, seed=seed, record=record, more=more)
        return WholeStep(prompts=prompts, graph=self.graph, seed=seed)

    def _finished(self, record: StepRecord, node: Node, outcome: Outcome) -> None:
        """A node's outcome: its metrics and seconds, and the weights an update of a detached policy ships."""
        record.add(node, outcome, summed=getattr(self.node_states.get(node.name), "summed_metrics", ()))
        if node.op is Op.UPDATE and str(node.role) in self.plan.detached_rollouts:
            shipment = self._ship(str(node.role))  # a later update replaces it
            if self._overlap is not None:  # the rollout samples with these weights once they land
                shipment.add_done_callback(partial(_landed, self._overlap.rollouter, self._overlap.version + 1))
            record.shipments[str(node.role)] = shipment

    def generate(self, node: str, prompts: Batch, *, seed: int) -> Batch:
        """Run the generate node ``node`` alone on ``prompts`` (one sample per row: validation, evaluation);
        returns the rows with its outputs. Nothing else of the graph runs and no step state changes."""
        found = self.graph.node(node)
        if found.op is not Op.GENERATE:
            raise ValueError(f"node {node!r} is a {found.op} node; generate() runs generate nodes only")
        # A request on the role's queue: an async rollout may be generating there right now.
        outcome = self._targets[self._placed_role(found)].submit_rows(found, prompts, seed).result()
        return prompts.union(outcome.outputs)

    def abandon_step(self) -> bool:
        """Give up the step in flight (its caller stopped waiting, e.g. a SIGTERM's grace ran out): its calls not
        yet started are cancelled; a call already running finishes on its queue, before anything queued later
        (a checkpoint). Returns whether what a checkpoint holds is still as the last finished step left it: no
        update and no compute node keeping state across steps has started, and the mode does not overlap the
        rollout with training (its rollout state moves as soon as the step takes a batch)."""
        for _, call in self._step_calls:
            if call is not None:
                call.cancel()
        if self._overlap is not None:
            return False
        # A call still None was being submitted when the caller stopped waiting: it may have started.
        keeping = {name for name, state in self.node_states.items() if state.state_dict()}  # not a judge's counts
        return not any((node.op is Op.UPDATE or node.name in keeping)
                       and (call is None or not call.cancelled()) for node, call in self._step_calls)

    def _submit(self, node: Node, state: Batch, seed: int, part: int | None) -> Future[Outcome]:
        self._step_calls.append((node, None))
        if node.op is Op.COMPUTE:
            call = self._driver.submit(timed, lambda: _run_compute(node, state, self.node_states.get(node.name)))
        else:
            call = self._target(node).submit(node, state, seed, part=part)
        self._step_calls[-1] = (node, call)
        return call

    def _target(self, node: Node) -> Target:
        """Where ``node`` runs: its driver scorer, or its role's (or detached rollout's) group."""
        return self._targets[str(node.role) if node.role in self.driver_roles else self._placed_role(node)]

    def _make_targets(self) -> dict[str, Target]:
        """A target per placed role (a detached rollout is a role of its own), served when it has limits."""
        placed: dict[str, GroupTarget | DriverTarget] = {role: DriverTarget(scorer, self._driver)
                                                         for role, scorer in self.driver_roles.items()}
        for index, group in enumerate(self.plan.groups):
            for layout in group.layouts:
                placed[layout.role] = GroupTarget(self.groups[index], layout.dp, self._dispatchers[index],
                                                  self.ledger)
        if self.services is None:
            return dict(placed)
        locks = {index: threading.Lock() for index, group in enumerate(self.plan.groups) if group.size > 1}
        return {role: Served(target, self.services,
                             locks.get(-1 if role in self.driver_roles else self.plan.group_index(role) or 0))
                for role, target in placed.items()}

    def _placed_role(self, node: Node) -> str:
        return self.plan.runs_on(str(node.role), generates=node.op is Op.GENERATE)

    def _ship(self, policy: str) -> Future[WeightSyncStats]:
        """Send ``policy``'s weights to its rollout group, in order with both groups' other work."""
        rollout = self.plan.detached_rollouts[policy]
        source, target = self.plan.group_index(policy), self.plan.group_index(rollout)
        assert source is not None and target is not None
        dtype = self.plan.layout(rollout).dtype
        exported = self._dispatchers[source].submit(_timed_export, self.groups[source], policy, dtype,
                                                    self._adapter_shipping[policy])  # trained weights alone
        return self._dispatchers[target].submit(_import, self.groups[target], rollout, exported)

    def sync_rollouts(self) -> dict[str, WeightSyncStats]:
        """Ship every policy's weights to its detached rollout now (start, checkpoint load)."""
        shipments = {policy: self._ship(policy) for policy in self.plan.detached_rollouts}
        return {policy: shipment.result() for policy, shipment in shipments.items()}

    def save_checkpoint(self, directory: str) -> None:
        # Each group on its own queue, behind its queued work (an async rollout keeps generating meanwhile).
        saves = [self._dispatchers[i].submit(group.save_checkpoint, directory) for i, group in enumerate(self.groups)]
        for save in saves:
            save.result()
        if self.node_states:
            Path(directory).mkdir(parents=True, exist_ok=True)
            states = {name: state.state_dict() for name, state in self.node_states.items()}
            (Path(directory) / NODE_STATES).write_text(json.dumps(states))
        if self._overlap is not None:  # the batches later steps take, generated with weights the checkpoint lacks
            self._overlap.save(directory)

    def load_checkpoint(self, directory: str) -> None:
        """Load what :meth:`save_checkpoint` wrote, before the first step; a checkpoint that cannot resume this
        mode exactly (one without the rollout's state) warns with a
        :class:`~hybridflow.runtime.rollout_state.ResumeWarning` saying what differs."""
        for group in self.groups:
            group.load_checkpoint(directory)
        saved = Path(directory) / NODE_STATES
        if self.node_states and saved.is_file():
            for name, state in json.loads(saved.read_text()).items():
                self.node_states[name].load_state_dict(state)
        if self._overlap is not None:
            self._overlap.load(directory)
        else:
            unused_rollout_state(directory, self.mode)
        self.sync_rollouts()  # a rollout on its own GPUs still holds the weights from before the load


NODE_STATES = "node_states.json"  # beside the roles' checkpoints: driver-side state (adaptive KL coefficients)


def _timed_export(group: WorkerGroup, role: str, dtype: str, adapter: bool) -> tuple[Any, float]:
    started = time.perf_counter()  # the rollout loaded the policy's model: weights that never train stay there
    return group.export_weights(role, dtype, adapter, True), started


def _import(group: WorkerGroup, role: str, exported: Future[tuple[Any, float]]) -> WeightSyncStats:
    weights, started = exported.result()
    ranks = group.import_weights(role, weights)
    return WeightSyncStats(seconds=time.perf_counter() - started, bytes=int(ranks[0]["bytes"]),
                           tensors=int(ranks[0]["tensors"]), receivers=len(ranks))


def _landed(rollouter: Rollouter, version: int, shipment: Future[WeightSyncStats]) -> None:
    if shipment.exception() is None:  # a failed shipment is raised by the step that waits for it
        rollouter.weights_loaded(version)


def _node_states(graph: Graph, role_models: Mapping[str, str]) -> dict[str, NodeState]:
    """The state of each compute node whose function keeps one across steps (``fn.make_state``); a function that
    reads roles' tokenizers (``fn.reads_role_models``: an LLM judge's templates) also gets ``role_models``."""
    states = {}
    for node in graph.nodes:
        if node.op is Op.COMPUTE:
            fn = COMPUTE_FNS.get(str(node.fn))
            make_state = getattr(fn, "make_state", None)  # optional, see NodeState
            models = {"role_models": dict(role_models)} if getattr(fn, "reads_role_models", False) else {}
            state = make_state(**node.options_dict, **models) if make_state is not None else None
            if state is not None:
                states[node.name] = state
    return states


def _run_compute(node: Node, state: Batch, kept: NodeState | None = None) -> tuple[Batch, dict[str, float]]:
    fn = COMPUTE_FNS.get(str(node.fn))
    extra = {"state": kept} if kept is not None else {}
    try:
        result = fn(*(state[name] for name in node.inputs), **node.options_dict, **extra)
    except Exception as err:
        err.add_note(f"in compute node {node.name!r} (fn={node.fn!r}, inputs={list(node.inputs)})")
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # sys.exit() in a user's function must not end the run silently
        raise RuntimeStepError(f"compute node {node.name!r}: fn {node.fn!r} raised {type(err).__name__}"
                               f"({err}); a compute function must return its outputs or raise an Exception",
                               node=node.name) from err
    values = result if isinstance(result, tuple) else (result,)
    if len(values) != len(node.outputs):
        raise ValueError(f"compute node {node.name!r}: fn {node.fn!r} returned {len(values)} values for outputs "
                         f"{list(node.outputs)}")
    _check_finite(node, {name: state[name] for name in node.inputs}, dict(zip(node.outputs, values, strict=True)))
    return Batch.from_fields(dict(zip(node.outputs, values, strict=True))), kept.metrics() if kept else {}




def _check_finite(node: Node, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
    """A compute node that turns finite rows into NaN or inf (advantages of rewards near float32's limit, a user's
    function) fails here, naming the node, its function, the rows and their inputs, before a loss is non-finite.
    Rows whose inputs were not finite already (masked positions) are not its doing and pass."""
    import torch

    def rows_finite(value: Any, rows: int) -> torch.Tensor | None:
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim and len(value) == rows):
            return None
        return torch.isfinite(value.reshape(rows, -1)).all(dim=1)

    for name, value in outputs.items():
        finite = rows_finite(value, len(value)) if isinstance(value, torch.Tensor) and value.ndim else None
        if finite is None or bool(finite.all()):
            continue
        rows = len(value)
        known = {key: found for key, found in ((key, rows_finite(item, rows)) for key, item in inputs.items())
                 if found is not None}
        bad = [row for row in (~finite).nonzero().flatten().tolist() if all(bool(ok[row]) for ok in known.values())]
        if not bad:
            continue
        shown = {key: inputs[key][bad[0]].flatten()[:4].tolist() for key in known}
        raise RuntimeStepError(f"compute node {node.name!r} (fn {node.fn!r}) made non-finite {name!r} at rows "
                               f"{bad[:10]} from finite inputs (row {bad[0]}: {shown}); values near float32's limit "
                               "overflow it: rescale the rewards (or fix the function) so the loss stays finite",
                               node=node.name)
