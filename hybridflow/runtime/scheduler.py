"""One ready-set scheduler for every execution mode: a step is nodes run over row partitions.

A :class:`Partition` is rows and the nodes that run on them; a node is submitted as soon as its inputs
exist in its partition, and every partition in flight runs concurrently (each group's queue keeps its
calls in order). A mode is a :class:`PartitionSource`: the section of the graph it runs partition by
partition, the partitions (asked for again each time the last ones finished, so a filter decides whether
another round is needed), and how the finished partitions join into the step's rows. The rest of the
graph then runs once on the joined rows:

- a plain ``sync`` step: one partition of the whole graph;
- a streamed step (:mod:`.streaming`): a chunk partition per slice of the rows for the generate node and
  its row-wise followers, all at once, joined in row order;
- a filter (:mod:`.filtering`): its sampling section on one round's prompts at a time, until the kept
  groups fill the batch;
- ``one_step_off`` / ``async`` (:mod:`.pipeline`): the rollouter's rows, generated already, as a
  partition with nothing left to run.

Every partition goes through the step ledger (only fields a group lacks are shipped): a chunk partition's
fields are held apart (``part``), and when the chunks join, groups whose ranks hold a field for every chunk
rebuild it (:class:`~hybridflow.runtime.step_store.Join`) instead of receiving it again.

A node with a deadline of its own (``Node.deadline_s``: an LLM judge's) fails the step with
:class:`~hybridflow.runtime.errors.NodeTimeoutError` once its call has run that long (:class:`Deadlines`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridflow.graph import Graph, Node, Op
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.dispatch import Outcome
from hybridflow.runtime.errors import NodeTimeoutError
from hybridflow.runtime.step_store import Join
from hybridflow.runtime.weights import WeightSyncStats


@dataclass(frozen=True, kw_only=True)
class Partition:
    """Rows and the nodes to run on them. ``seed`` seeds the worker calls (``generate_seed``, when given, the
    generate node's); ``part``: the chunk partition's index (None: the step's rows); ``expanded``: False while
    the rows are prompts whose samples the generate node's arrival expands."""

    rows: Batch
    nodes: tuple[str, ...]
    seed: int
    generate_seed: int | None = None
    part: int | None = None
    expanded: bool = True

    def seed_of(self, node: Node) -> int:
        return self.generate_seed if node.op is Op.GENERATE and self.generate_seed is not None else self.seed


@dataclass
class StepRecord:
    """What a step's nodes reported: metrics, seconds (summed over partitions), spans and weight shipments.

    A node that runs on several partitions of a step (stream chunks, filter rounds) reports each time; its metric
    for the step is the mean over those reports weighted by their rows, except the ``summed`` ones (counts, such as
    a judge's unparsed verdicts: ``NodeState.summed_metrics``), which add up. Its span runs from its first call's
    start to its last call's end, in seconds since the record began (the step's start): the step's timeline, which
    the planner's node estimates (``start_s``, ``end_s``) predict."""

    metrics: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    shipments: dict[str, Future[WeightSyncStats]] = field(default_factory=dict)
    reports: dict[str, list[tuple[int, Mapping[str, float]]]] = field(default_factory=dict)
    began: float = field(default_factory=time.perf_counter)

    def add(self, node: Node, outcome: Outcome, *, summed: Collection[str] = ()) -> None:
        self.seconds[node.name] = self.seconds.get(node.name, 0.0) + outcome.seconds
        if outcome.started:
            start = outcome.started - self.began
            first, last = self.spans.get(node.name, (start, start + outcome.seconds))
            self.spans[node.name] = (min(first, start), max(last, start + outcome.seconds))
        prefix = f"{node.role}/" if node.role else f"{node.name}/"
        reports = self.reports.setdefault(node.name, [])
        reports.append((len(outcome.outputs), outcome.metrics))
        self.metrics.update({prefix + key: value for key, value in combined(reports, summed).items()})


def combined(reports: Sequence[tuple[int, Mapping[str, float]]], summed: Collection[str]) -> dict[str, float]:
    """One node's metrics over its reports of a step, ``(rows, metrics)`` each: ``summed`` keys add up, the others
    are the rows-weighted mean of the reports that have them (the plain mean where no report has rows)."""
    if len(reports) == 1:
        return dict(reports[0][1])
    out: dict[str, float] = {}
    for key in dict.fromkeys(key for _, metrics in reports for key in metrics):
        having = [(rows, metrics[key]) for rows, metrics in reports if key in metrics]
        total = sum(rows for rows, _ in having)
        if key in summed:
            out[key] = float(sum(value for _, value in having))
        elif total:
            out[key] = sum(rows * value for rows, value in having) / total
        else:
            out[key] = sum(value for _, value in having) / len(having)
    return out


class PartitionSource(Protocol):
    """A mode's partitions of one step (see the module docstring)."""

    @property
    def covers(self) -> frozenset[str]:
        """The nodes the source accounts for; the rest of the graph runs on the joined rows."""
        ...

    def next(self, finished: list[Batch]) -> list[Partition]:
        """The partitions to run now, given the rows of those that just finished ([] at first); [] ends."""
        ...

    def join(self, finished: list[Batch]) -> Batch:
        """The step's rows from every finished partition's rows."""
        ...

    def joins(self) -> tuple[Join, ...]:
        """How each field of the joined rows came from the chunk partitions' (() when the rows are no join)."""
        ...

    def close(self) -> None:
        """The whole step ran (its pools' time, its metrics)."""
        ...


class Deadlines:
    """The clocks of running nodes that set a deadline of their own. A node's clock starts when its call starts
    on its role's queue (seen within ``poll_s``), not while it waits there behind the group's earlier calls."""

    poll_s = 0.05

    def __init__(self) -> None:
        self._started: dict[Future[Outcome], float] = {}

    def wait_s(self, running: Mapping[Future[Outcome], tuple[Node, int]]) -> float | None:
        """How long the scheduler may wait before looking again (None: no running node has a deadline)."""
        return self.poll_s if any(node.deadline_s is not None for node, _ in running.values()) else None

    def check(self, running: Mapping[Future[Outcome], tuple[Node, int]]) -> None:
        """Raise :class:`NodeTimeoutError` for a running node past its deadline."""
        now = time.monotonic()
        for future, (node, _) in running.items():
            deadline = node.deadline_s
            if deadline is None or future.done():
                continue
            if future not in self._started:
                if future.running():
                    self._started[future] = now
                continue
            if now - self._started[future] > deadline:
                future.cancel()
                raise NodeTimeoutError(node=node.name, role=node.role, key=node.deadline_key, deadline_s=deadline)


Submit = Callable[[Node, Batch, int, "int | None"], "Future[Outcome]"]  # node, rows, seed, part


Balance = Callable[[Batch], "list[int] | None"]
"""A permutation of generated rows that balances their tokens over data-parallel ranks (None: keep the order)."""


class Scheduler:
    """Runs a step's partitions: ``submit`` starts a node's call, ``finished`` hears each node's outcome in
    order of completion, ``regrouped`` tells the ledger the step's rows changed (held shards are stale; its
    joins: how they came from chunk partitions).

    ``balance`` reorders the step's rows once they are generated, so each data-parallel rank's share holds
    about as many tokens as the others (:func:`~hybridflow.runtime.balancing.balanced_order`): once per
    partition of the step's rows, when its lone generate node finishes with nothing else in flight, or at its
    start when the rows arrive generated (an overlapped rollout's). The partition's rows come back in their
    own order."""

    def __init__(self, graph: Graph, *, submit: Submit, finished: Callable[[Node, Outcome], None],
                 regrouped: Callable[[Sequence[Join]], None], balance: Balance | None = None) -> None:
        self.graph, self._submit, self._finished, self._regrouped = graph, submit, finished, regrouped
        self._balance = balance

    def run(self, source: PartitionSource, *, seed: int) -> Batch:
        """The step's rows once ``source``'s partitions, then the rest of the graph, have run."""
        done: list[Batch] = []
        partitions = source.next([])
        while partitions:
            finished = self.run_partitions(partitions)
            done.extend(finished)
            partitions = source.next(finished)
        rows = source.join(done)
        rest = tuple(name for name in self.graph.order if name not in source.covers)
        if rest:
            rows = self.run_partitions([Partition(rows=rows, nodes=rest, seed=seed)], joins=source.joins())[0]
        source.close()
        return rows

    def run_partitions(self, partitions: Sequence[Partition], *, joins: Sequence[Join] = ()) -> list[Batch]:
        """Each partition's rows grown by its nodes' outputs; nodes outside a partition count as done in it.
        A partition of the step's rows runs alone (``joins``: how its rows came from chunk partitions)."""
        whole = [p for p in partitions if p.part is None]
        if whole and len(partitions) > 1:
            raise ValueError("a partition of the step's rows runs alone (the ledger tracks one set of rows)")
        states = [p.rows for p in partitions]
        undo: torch.Tensor | None = None
        if whole and not joins and "response_mask" in states[0] and whole[0].nodes:
            states[0], undo = self._balanced(states[0])
        if whole:
            self._regrouped(joins)
        expanded = [p.expanded for p in partitions]
        done = [{n.name for n in self.graph.nodes} - set(p.nodes) for p in partitions]
        pending = [list(p.nodes) for p in partitions]
        running: dict[Future[Outcome], tuple[Node, int]] = {}
        deadlines = Deadlines()
        while any(pending) or running:
            for index, partition in enumerate(partitions):
                for name in [n for n in pending[index] if set(self.graph.predecessors(n)) <= done[index]]:
                    node = self.graph.node(name)
                    if node.op is Op.GENERATE and not expanded[index]:
                        # The n samples of a prompt become n adjacent rows before rollout.
                        states[index], expanded[index] = states[index].repeat_interleave(
                            self.graph.samples_per_prompt), True
                        if partition.part is None:
                            self._regrouped(())
                    running[self._submit(node, states[index], partition.seed_of(node), partition.part)] = \
                        (node, index)
                    pending[index].remove(name)
            if not running:
                raise RuntimeError(f"nodes {pending} wait for inputs no node produces")
            finished, _ = wait(list(running), timeout=deadlines.wait_s(running), return_when=FIRST_COMPLETED)
            deadlines.check(running)
            for future in finished:
                node, index = running.pop(future)
                outcome = future.result()  # re-raises the node's error
                if len(outcome.outputs.keys()):
                    states[index] = states[index].union(outcome.outputs)
                self._finished(node, outcome)
                done[index].add(node.name)
                if (partitions[index].part is None and undo is None and not running
                        and node.name == getattr(self.graph.lone_generate, "name", None)):
                    states[index], undo = self._balanced(states[index])
                    if undo is not None:
                        self._regrouped(())
        if undo is not None:
            states[0] = states[0].index(undo)
        return states

    def _balanced(self, rows: Batch) -> tuple[Batch, torch.Tensor | None]:
        """``rows`` in the balancing order and the permutation that restores them (None: left as they are)."""
        order = self._balance(rows) if self._balance is not None else None
        if order is None:
            return rows, None
        permutation = torch.tensor(order, dtype=torch.long)
        return rows.index(permutation), torch.argsort(permutation)


@dataclass(frozen=True, kw_only=True)
class WholeStep:
    """A plain ``sync`` step: one partition of the whole graph on the step's prompts."""

    prompts: Batch
    graph: Graph
    seed: int

    @property
    def covers(self) -> frozenset[str]:
        return frozenset(self.graph.order)

    def next(self, finished: list[Batch]) -> list[Partition]:
        return [] if finished else [Partition(rows=self.prompts, nodes=tuple(self.graph.order), seed=self.seed,
                                              expanded=False)]

    def join(self, finished: list[Batch]) -> Batch:
        return finished[0]

    def joins(self) -> tuple[Join, ...]:
        return ()

    def close(self) -> None:
        return None
