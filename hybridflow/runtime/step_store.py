"""One step's data where it already is: what each worker rank holds, and the controller's record of it.

The controller ships a node only the input fields its group's ranks do not hold yet this step, and
the ranks keep what they received and produced. Both sides key the fields by the data-parallel size
they were sharded for (roles of one group may shard rows differently). The controller's record
(:class:`StepLedger`) and the ranks' copies (:class:`RankStore`) agree by one rule: a field is held
when every rank's copy is exactly its share of the controller's rows, which fails only for outputs the
ranks returned at different widths (the gather right-pads them), so those are shipped again.

A streamed step's chunks are partitions of their own (``part``): each chunk's fields are held apart. When
the chunks join into the step's rows, ranks that take every row (data-parallel size 1) rebuild a field held
for every chunk the way the controller joined it (:class:`Join`: in chunk order, right-padded), so the
whole-batch nodes after the chunks (advantages, the update) need not ship it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.runtime.batch import Batch

ShardKey = tuple[int, int]
"""(group index, data-parallel size): ranks of one group hold a field once per way it was sharded."""

Part = int | None
"""The chunk partition a field belongs to; None for the step's rows."""


@dataclass(frozen=True)
class Join:
    """How field ``name`` of the joined rows comes from its copies in ``parts`` chunk partitions: concatenated
    in chunk order, chunk ``i`` right-padded (``left``: left-padded, computed prompts) to ``width`` with
    ``pads[i]`` (``width`` None: not padded)."""

    name: str
    parts: int
    width: int | None
    pads: tuple[float, ...]
    left: bool = False

    def rebuild(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.width is None:
            return torch.cat(list(pieces))
        pad = left_pad if self.left else right_pad
        return torch.cat([pad(piece, self.width, value) for piece, value in zip(pieces, self.pads, strict=True)])


def left_pad(value: torch.Tensor, width: int, pad: float) -> torch.Tensor:
    """``value`` (rows, w, ...) left-padded along dim 1 to ``width`` with ``pad``."""
    if value.shape[1] == width:
        return value
    extra = torch.full((value.shape[0], width - value.shape[1], *value.shape[2:]), pad, dtype=value.dtype)
    return torch.cat([extra, value], dim=1)


def right_pad(value: torch.Tensor, width: int, pad: float) -> torch.Tensor:
    """``value`` (rows, w, ...) right-padded along dim 1 to ``width`` with ``pad``."""
    if value.shape[1] == width:
        return value
    extra = torch.full((value.shape[0], width - value.shape[1], *value.shape[2:]), pad, dtype=value.dtype)
    return torch.cat([value, extra], dim=1)


class StepLedger:
    """The controller's record of the fields each group's ranks hold this step, and the bytes it sent."""

    def __init__(self, groups: int) -> None:
        self.token = 0
        self._held: dict[tuple[ShardKey, Part], set[str]] = {}
        self._joins: dict[ShardKey, tuple[Join, ...]] = {}
        self.shipped = [0] * groups  # tensor bytes sent to each group this step

    def begin_step(self) -> int:
        """Forget the last step; returns the new step's token (ranks drop what they kept under another)."""
        self.token += 1
        self._held, self._joins = {}, {}
        self.shipped = [0] * len(self.shipped)
        return self.token

    def rows_changed(self, joins: Sequence[Join] = ()) -> None:
        """The step's rows were regrouped (samples per prompt expanded, a filter's round): held shards are stale.
        ``joins``: the rows are the chunk partitions joined; ranks of one data-parallel shard that hold a field
        for every chunk rebuild it at their next call (:meth:`take_joins`), so it counts as held."""
        held, self._held, self._joins = self._held, {}, {}
        for key in {key for key, part in held if part is not None and key[1] == 1}:
            rebuilt = tuple(join for join in joins
                            if all(join.name in held.get((key, part), ()) for part in range(join.parts)))
            if rebuilt:
                self._joins[key] = rebuilt
                self._held[key, None] = {join.name for join in rebuilt}

    def take_joins(self, key: ShardKey) -> tuple[Join, ...]:
        """The fields ``key``'s ranks are to rebuild from their chunk copies, once (their next call)."""
        return self._joins.pop(key, ())

    def to_send(self, key: ShardKey, wanted: Iterable[str], part: Part = None) -> list[str]:
        held = self._held.setdefault((key, part), set())
        return [name for name in wanted if name not in held]

    def hold(self, key: ShardKey, names: Iterable[str], part: Part = None) -> None:
        self._held.setdefault((key, part), set()).update(names)

    def record_sent(self, group: int, batch: Batch) -> None:
        self.shipped[group] += batch.tensor_bytes


def exact_fields(per_rank: Sequence[Batch]) -> tuple[str, ...]:
    """Output fields every rank returned at the same width: the ranks' copies equal the gathered rows."""
    names = per_rank[0].keys() if per_rank else []
    return tuple(name for name in names if len({_width(batch[name]) for batch in per_rank}) == 1)


def _width(value: Any) -> tuple[int, ...]:
    return tuple(value.shape[1:])


class RankStore:
    """The fields one rank received or produced during the current step, by the dp size they were sharded for
    and the partition they belong to."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._token: int | None = None
        self._fields: dict[tuple[int, Part, str], Any] = {}

    def inputs(self, batch: Batch, *, token: int, fields: Sequence[str], dp: int, part: Part = None,
               joins: Sequence[Join] = ()) -> Batch:
        """``batch`` plus the ``fields`` it lacks, read from what this rank kept this step; keeps ``batch``.
        ``joins`` first rebuild fields of the step's rows from this rank's chunk copies."""
        if token != self._token:
            self._token, self._fields = token, {}
        for join in joins:
            self._fields[dp, None, join.name] = join.rebuild([self._fields[dp, i, join.name]
                                                              for i in range(join.parts)])
        self.keep(batch, dp, part)
        missing = [name for name in fields if name not in batch]
        for name in missing:
            if (dp, part, name) not in self._fields:
                names = sorted(n if p is None else f"{n}@chunk{p}" for d, p, n in self._fields if d == dp)
                raise KeyError(f"{self.where}: field {name!r} was neither sent nor kept this step; kept: {names}")
        kept = {name: self._fields[dp, part, name] for name in missing}
        return Batch.from_fields({**batch.tensors, **batch.non_tensors, **kept})

    def keep(self, batch: Batch, dp: int, part: Part = None) -> None:
        self._fields.update({(dp, part, k): v for k, v in (*batch.tensors.items(), *batch.non_tensors.items())})
