"""A graph's filter node at run time: which rows it keeps, and the pool of kept groups across rounds.

DAPO's dynamic sampling drops the prompts whose samples all scored the same and generates more until the
step again holds as many prompts as it started with. The controller reruns the filter's section on fresh
prompts (at most ``max_rounds`` more times) and pours each round's rows into a :class:`GroupPool`; when the
rounds run out first, groups the filter dropped fill the batch (their advantages are zero: no gradient),
so an update always sees the same number of rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hybridflow.graph import Graph, Node
from hybridflow.registry import COMPUTE_FNS
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.scheduler import Partition, StepRecord
from hybridflow.runtime.step_store import Join

LEFT_PADDED = ("prompts", "prompt_mask")


def with_uids(batch: Batch, start: int, *, replace: bool = False) -> Batch:
    """``batch`` with a ``uid`` per prompt row (``start``, ``start + 1``...), unless it has one and not ``replace``."""
    if "uid" in batch and not replace:
        return batch
    return Batch({**batch.tensors, "uid": torch.arange(start, start + len(batch))}, batch.non_tensors)


def keep_mask(node: Node, state: Batch) -> torch.Tensor:
    """The filter function's verdict on each row of ``state``: a bool tensor (B,)."""
    options = {key: value for key, value in node.options_dict.items() if key != "max_rounds"}
    fn = COMPUTE_FNS.get(str(node.fn))
    try:
        keep = torch.as_tensor(fn(*(state[name] for name in node.inputs), **options))
    except Exception as err:
        err.add_note(f"in filter node {node.name!r} (fn={node.fn!r}, inputs={list(node.inputs)})")
        raise
    if keep.shape != (len(state),):
        raise ValueError(f"filter node {node.name!r}: fn {node.fn!r} returned shape {tuple(keep.shape)}; it must "
                         f"return one bool per row, shape ({len(state)},)")
    return keep.bool()


class GroupPool:
    """Rows of every round, split into the groups (``uid``) the filter kept and those it dropped."""

    def __init__(self, target_groups: int) -> None:
        self.target = target_groups
        self.kept: list[Batch] = []
        self.dropped: list[Batch] = []
        self.generated_groups = 0

    def add(self, rows: Batch, keep: torch.Tensor) -> None:
        self.generated_groups += int(rows["uid"].unique().numel())
        for part, mask in ((self.kept, keep), (self.dropped, ~keep)):
            if bool(mask.any()):
                part.append(rows.index(mask.nonzero().squeeze(1)))

    @property
    def kept_groups(self) -> int:
        return sum(int(batch["uid"].unique().numel()) for batch in self.kept)

    @property
    def full(self) -> bool:
        return self.kept_groups >= self.target

    def take(self) -> Batch:
        """The first ``target`` kept groups, topped up with dropped ones when the rounds ran out."""
        rows = concat_rows(self.kept + self.dropped)
        order = list(dict.fromkeys(rows["uid"].tolist()))[:self.target]  # kept groups come first
        chosen = torch.isin(rows["uid"], torch.tensor(order))
        return rows.index(chosen.nonzero().squeeze(1))

    def metrics(self, rounds: int) -> dict[str, float]:
        kept = self.kept_groups
        return {"filter/rounds": float(rounds), "filter/generated_groups": float(self.generated_groups),
                "filter/kept_groups": float(kept), "filter/kept_fraction": kept / max(self.generated_groups, 1),
                "filter/filled_groups": float(max(self.target - kept, 0))}


class FilterRounds:
    """A filter's partitions (:mod:`.scheduler`): its sampling section on one round's prompts at a time, the
    filter poured into a :class:`GroupPool` after each, fresh prompts (``more(round)``) while the kept groups do
    not fill the batch and rounds remain; the pool's groups are the step's rows."""

    def __init__(self, graph: Graph, prompts: Batch, *, seed: int, record: StepRecord,
                 more: Callable[[int], Batch] | None) -> None:
        node = graph.filter_node
        assert node is not None
        self.node, self.prompts, self.seed, self.record, self.more = node, prompts, seed, record, more
        self.section = tuple(name for name in graph.order if name in graph.sampling_section)
        self.pool, self.rounds = GroupPool(len(prompts)), 0
        self.max_rounds = int(node.option("max_rounds", 0) or 0)

    @property
    def covers(self) -> frozenset[str]:
        return frozenset([*self.section, self.node.name])

    def next(self, finished: list[Batch]) -> list[Partition]:
        if finished:
            (rows,) = finished
            started = time.perf_counter()
            self.pool.add(rows, keep_mask(self.node, rows))
            seconds = self.record.seconds
            seconds[self.node.name] = seconds.get(self.node.name, 0.0) + time.perf_counter() - started
            self.rounds += 1
            if self.pool.full or self.rounds > self.max_rounds or self.more is None:
                return []
            self.prompts = with_uids(self.more(self.rounds - 1), self.rounds * len(self.prompts), replace=True)
        return [Partition(rows=self.prompts, nodes=self.section, seed=self.seed, expanded=False)]

    def join(self, finished: list[Batch]) -> Batch:
        self.record.metrics.update(self.pool.metrics(self.rounds))
        return self.pool.take()

    def joins(self) -> tuple[Join, ...]:
        return ()

    def close(self) -> None:
        return None


def concat_rows(batches: list[Batch]) -> Batch:
    """Rows of several rounds in one batch: prompts stay left-padded (responses are right-padded by concat)."""
    width = {name: max(batch[name].shape[1] for batch in batches) for name in LEFT_PADDED if name in batches[0]}
    padded = [Batch({**batch.tensors, **{name: torch.nn.functional.pad(batch[name], (w - batch[name].shape[1], 0))
                                         for name, w in width.items()}}, batch.non_tensors) for batch in batches]
    return Batch.concat(padded)
