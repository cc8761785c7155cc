"""One step's data where it already is: what each worker rank holds, and the controller's record of it.

The controller ships a node only the input fields its group's ranks do not hold yet this step, and
the ranks keep what they received and produced. Both sides key the fields by the data-parallel size
they were sharded for (roles of one group may shard rows differently). The controller's record
(:class:`StepLedger`) and the ranks' copies (:class:`RankStore`) agree by one rule: a field is held
when every rank's copy is exactly its share of the controller's rows, which fails only for outputs the
ranks returned at different widths (the gather right-pads them), so those are shipped again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hybridflow.runtime.batch import Batch

ShardKey = tuple[int, int]
"""(group index, data-parallel size): ranks of one group hold a field once per way it was sharded."""


class StepLedger:
    """The controller's record of the fields each group's ranks hold this step, and the bytes it sent."""

    def __init__(self, groups: int) -> None:
        self.token = 0
        self._held: dict[ShardKey, set[str]] = {}
        self.shipped = [0] * groups  # tensor bytes sent to each group this step

    def begin_step(self) -> int:
        """Forget the last step; returns the new step's token (ranks drop what they kept under another)."""
        self.token += 1
        self._held = {}
        self.shipped = [0] * len(self.shipped)
        return self.token

    def rows_changed(self) -> None:
        """The step's rows were regrouped (samples per prompt expanded): held shards are stale."""
        self._held = {}

    def to_send(self, key: ShardKey, wanted: Iterable[str]) -> list[str]:
        held = self._held.setdefault(key, set())
        return [name for name in wanted if name not in held]

    def hold(self, key: ShardKey, names: Iterable[str]) -> None:
        self._held.setdefault(key, set()).update(names)

    def record_sent(self, group: int, batch: Batch) -> None:
        self.shipped[group] += batch.tensor_bytes


def exact_fields(per_rank: Sequence[Batch]) -> tuple[str, ...]:
    """Output fields every rank returned at the same width: the ranks' copies equal the gathered rows."""
    names = per_rank[0].keys() if per_rank else []
    return tuple(name for name in names if len({_width(batch[name]) for batch in per_rank}) == 1)


def _width(value: Any) -> tuple[int, ...]:
    return tuple(value.shape[1:])


class RankStore:
    """The fields one rank received or produced during the current step, by the dp size they were sharded for."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._token: int | None = None
        self._fields: dict[tuple[int, str], Any] = {}

    def inputs(self, batch: Batch, *, token: int, fields: Sequence[str], dp: int) -> Batch:
        """``batch`` plus the ``fields`` it lacks, read from what this rank kept this step; keeps ``batch``."""
        if token != self._token:
            self._token, self._fields = token, {}
        self.keep(batch, dp)
        missing = [name for name in fields if name not in batch]
        for name in missing:
            if (dp, name) not in self._fields:
                raise KeyError(f"{self.where}: field {name!r} was neither sent nor kept this step; kept: "
                               f"{sorted(self._fields)}")
        kept = {name: self._fields[dp, name] for name in missing}
        return Batch.from_fields({**batch.tensors, **batch.non_tensors, **kept})

    def keep(self, batch: Batch, dp: int) -> None:
        self._fields.update({(dp, k): v for k, v in (*batch.tensors.items(), *batch.non_tensors.items())})
