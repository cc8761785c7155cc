"""Where a node runs and how its rows get there: one target per role placement.

The controller asks a role's target to run a node on the step's state. A :class:`GroupTarget` ships
the group only the input fields its ranks do not hold yet (:mod:`~hybridflow.runtime.step_store`),
splits rows over the data-parallel ranks and gathers the outputs; a :class:`DriverTarget` scores in the
controller's process (reward functions). :class:`Served` wraps either with the role's request bound and
the reward cache (:mod:`~hybridflow.runtime.service`): it sends whole rows, in requests.

Every call reaches a role through its target, on the role's queue (a group runs its calls one at a time,
in order): ``submit`` for the step's rows, ``submit_rows`` for a request of other rows (a stream chunk, a
rollouter batch, validation prompts), which ships every input and leaves nothing held. Both record the
bytes they ship in the step ledger; the queue and the worker calls stay private to this module.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from hybridflow.graph import Node
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.executor import WorkerGroup
from hybridflow.runtime.protocols import Scorer
from hybridflow.runtime.service import RoleServices, serve
from hybridflow.runtime.step_store import Join, Part, ShardKey, StepLedger, exact_fields
from hybridflow.runtime.worker import NodeResult, companion_fields, port_batch


@dataclass(frozen=True)
class Outcome:
    """What a node produced (graph field names, the step's rows), its metrics, its wall seconds and when its call
    started on its queue (``time.perf_counter()`` in the controller's process; 0.0: not known)."""

    outputs: Batch
    metrics: Mapping[str, float]
    seconds: float
    started: float = 0.0


class Target(Protocol):
    """Runs a role's nodes on its queue: ``submit`` for the step's rows (or a chunk partition of them,
    ``part``), through the ledger; ``submit_rows`` for a request of other rows; ``on_start`` runs on the queue
    just before the call (what the role holds then is exact)."""

    def submit(self, node: Node, state: Batch, seed: int, *, part: Part = None) -> Future[Outcome]:
        ...

    def submit_rows(self, node: Node, rows: Batch, seed: int, *,
                    on_start: Callable[[], None] | None = None) -> Future[Outcome]:
        ...


RunRows = Callable[[Node, Batch, int], tuple[Batch, Mapping[str, float]]]


def _request(run_rows: RunRows, node: Node, rows: Batch, seed: int, on_start: Callable[[], None] | None) -> Outcome:
    if on_start is not None:
        on_start()
    start = time.perf_counter()
    outputs, metrics = run_rows(node, rows, seed)
    return Outcome(outputs, metrics, time.perf_counter() - start, start)


def node_inputs(node: Node, state: Batch) -> list[str]:
    """The fields a worker node reads: its inputs and their companions (``prompt_mask`` with ``prompts``, the
    mask of whatever field its ``prompts`` port reads)."""
    return [*node.inputs, *(mask for mask in companion_fields(node) if mask in state)]


class GroupTarget:
    """A role on a worker group: rows split over its ``dp`` ranks, tensor-parallel peers get the same rows."""

    def __init__(self, group: WorkerGroup, dp: int, pool: ThreadPoolExecutor, ledger: StepLedger) -> None:
        self.group, self.dp, self.ledger = group, dp, ledger
        self._pool = pool  # the group's dispatcher: a group runs its nodes one at a time, in order

    @property
    def key(self) -> ShardKey:
        return self.group.index, self.dp

    def submit(self, node: Node, state: Batch, seed: int, *, part: Part = None) -> Future[Outcome]:
        wanted = node_inputs(node, state)
        send = state.select(self.ledger.to_send(self.key, wanted, part))
        self.ledger.record_sent(self.group.index, send)
        # The group runs its calls in order, so what this call ships is there for the next one; the first
        # call after chunks joined has the ranks rebuild the joined fields they hold.
        self.ledger.hold(self.key, wanted, part)
        joins = self.ledger.take_joins(self.key) if part is None else ()
        return self._pool.submit(self._run_step, node, send, seed, len(state), self.ledger.token, tuple(wanted),
                                 part, joins)

    def _run_step(self, node: Node, send: Batch, seed: int, rows: int, token: int, fields: tuple[str, ...],
                  part: Part, joins: tuple[Join, ...]) -> Outcome:
        start = time.perf_counter()
        leaders = self._run(node, send, seed, token=token, fields=fields, part=part, joins=joins)
        self.ledger.hold(self.key, exact_fields([r.outputs for r in leaders]), part)
        outputs, metrics = _gathered(leaders, rows)
        return Outcome(outputs, metrics, time.perf_counter() - start, start)

    def submit_rows(self, node: Node, rows: Batch, seed: int, *,
                    on_start: Callable[[], None] | None = None) -> Future[Outcome]:
        return self._pool.submit(_request, self._run_rows, node, rows.select(node_inputs(node, rows)), seed, on_start)

    def _run_rows(self, node: Node, rows: Batch, seed: int) -> tuple[Batch, Mapping[str, float]]:
        self.ledger.record_sent(self.group.index, rows)
        return _gathered(self._run(node, rows, seed), len(rows))

    def _run(self, node: Node, inputs: Batch, seed: int, *, token: int | None = None, fields: tuple[str, ...] = (),
             part: Part = None, joins: tuple[Join, ...] = ()) -> list[NodeResult]:
        """Each data-parallel shard of ``inputs`` to its ranks; returns one result per shard (its leader's)."""
        padded, _ = inputs.pad_to_multiple(self.dp)
        chunks = padded.chunk(self.dp) if len(inputs.keys()) else [inputs] * self.dp
        per_dp = self.group.size // self.dp
        shards = [chunks[rank // per_dp] for rank in range(self.group.size)]
        return self.group.run(node, shards, seed, token=token, fields=fields, part=part, joins=joins)[::per_dp]


def _gathered(leaders: list[NodeResult], rows: int) -> tuple[Batch, dict[str, float]]:
    outputs = Batch.concat([r.outputs for r in leaders])
    if len(outputs.keys()):
        outputs = outputs.slice(0, rows)  # drop the padding rows
    keys = sorted({key for r in leaders for key in r.metrics})
    metrics = {key: float(torch.tensor([r.metrics[key] for r in leaders if key in r.metrics]).mean())
               for key in keys}
    return outputs, metrics


class DriverTarget:
    """A reward function scoring in the controller's process."""

    def __init__(self, scorer: Scorer, pool: ThreadPoolExecutor) -> None:
        self.scorer = scorer
        self._pool = pool

    def submit(self, node: Node, state: Batch, seed: int, *, part: Part = None) -> Future[Outcome]:
        return self._pool.submit(timed, lambda: self._run_rows(node, state, seed))

    def submit_rows(self, node: Node, rows: Batch, seed: int, *,
                    on_start: Callable[[], None] | None = None) -> Future[Outcome]:
        return self._pool.submit(_request, self._run_rows, node, rows, seed, on_start)

    def _run_rows(self, node: Node, rows: Batch, seed: int) -> tuple[Batch, Mapping[str, float]]:
        result = self.scorer(port_batch(node, rows))
        if "scores" not in result:
            raise KeyError(f"driver scorer for node {node.name!r} returned {result.keys()}, not 'scores'")
        return result.select(["scores"]).rename({"scores": node.outputs[0]}), {}


class Served:
    """A target behind its role's limits, for the forward nodes they apply to (:meth:`RoleServices.applies`):
    reward cache hits first, then requests of at most ``request_rows`` rows, at most
    ``max_concurrent_requests`` in flight. ``lock`` (one per multi-rank group) lets one request at a time
    reach the group: concurrent requests could reach ranks in different orders and deadlock a collective."""

    def __init__(self, inner: GroupTarget | DriverTarget, services: RoleServices,
                 lock: threading.Lock | None = None) -> None:
        self._inner, self.services, self._lock = inner, services, lock

    def submit(self, node: Node, state: Batch, seed: int, *, part: Part = None) -> Future[Outcome]:
        if not self.services.applies(node):
            return self._inner.submit(node, state, seed, part=part)
        if part is not None:  # a chunk goes to the role as it is (no cache), one request at a time
            return self.submit_rows(node, state, seed)
        inputs = self._inputs(node, state)
        requests = partial(self._run_rows, node, seed=seed)
        return self._inner._pool.submit(timed, lambda: serve(node, inputs, requests, self.services))

    def submit_rows(self, node: Node, rows: Batch, seed: int, *,
                    on_start: Callable[[], None] | None = None) -> Future[Outcome]:
        # A request already: it goes to the role as it is, one at a time on a multi-rank group.
        return self._inner._pool.submit(_request, self._run_rows, node, self._inputs(node, rows), seed, on_start)

    def _inputs(self, node: Node, state: Batch) -> Batch:
        return state.select(node_inputs(node, state)) if isinstance(self._inner, GroupTarget) else state

    def _run_rows(self, node: Node, rows: Batch, seed: int) -> tuple[Batch, Mapping[str, float]]:
        if self._lock is None:
            return self._inner._run_rows(node, rows, seed)
        with self._lock:
            return self._inner._run_rows(node, rows, seed)


def timed(run: Callable[[], tuple[Batch, Mapping[str, float]]]) -> Outcome:
    """``run()``'s (outputs, metrics) with the seconds it took."""
    start = time.perf_counter()
    outputs, metrics = run()
    return Outcome(outputs, metrics, time.perf_counter() - start, start)
