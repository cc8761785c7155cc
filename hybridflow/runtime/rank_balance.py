"""Rows balanced over data-parallel ranks by length: one permutation of a step's generated rows.

The controller shards a node's rows over a role's ``dp`` ranks as consecutive equal chunks, so a rank whose
chunk holds the long responses sets the pace of every collective of the step. Once the rows are generated,
:class:`RankBalance` reorders them (:func:`~hybridflow.runtime.balancing.balanced_order`, LPT with equal row
counts, as verl's sequence balancing) for the least common multiple of the plan's data-parallel sizes: chunks
for that many ranks are balanced, and so are chunks for any divisor of it (each the union of balanced ones).
The scheduler undoes the permutation when the step's rows come back, so results stay in row order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridflow.planner import Plan
from hybridflow.runtime.balancing import balanced_order
from hybridflow.runtime.batch import Batch


def row_lengths(rows: Batch) -> list[int]:
    """Each row's real tokens (prompt + response): what a packed pass over it costs."""
    lengths = rows["response_mask"].sum(dim=1)
    if "prompt_mask" in rows:
        lengths = lengths + rows["prompt_mask"].sum(dim=1)
    return [int(length) for length in lengths.tolist()]


def rank_tokens(lengths: list[int], order: list[int] | None, parts: int) -> list[int]:
    """Tokens of each of ``parts`` consecutive equal chunks of the rows in ``order`` (None: as they are)."""
    rows = order if order is not None else list(range(len(lengths)))
    size = len(rows) // parts
    return [sum(lengths[row] for row in rows[rank * size:(rank + 1) * size]) for rank in range(parts)]


@dataclass
class RankBalance:
    """The scheduler's ``balance`` for ``parts`` ranks; ``metrics`` describe the last reorder (``dp_balance/``:
    the largest and smallest rank's tokens after it, and the largest before)."""

    parts: int
    metrics: dict[str, float] = field(default_factory=dict)

    def __call__(self, rows: Batch) -> list[int] | None:
        # Rows that do not split evenly are padded per call by the target: left in their order.
        if self.parts <= 1 or len(rows) % self.parts or "response_mask" not in rows:
            return None
        if "pair" in rows:  # preference pairs (DPO): a pair's two rows must stay on one rank, in one micro batch
            return None
        lengths = row_lengths(rows)
        order = balanced_order(lengths, self.parts)
        after, before = rank_tokens(lengths, order, self.parts), rank_tokens(lengths, None, self.parts)
        self.metrics = {"dp_balance/rank_tokens_max": float(max(after)),
                        "dp_balance/rank_tokens_min": float(min(after)),
                        "dp_balance/unbalanced_rank_tokens_max": float(max(before))}
        return order

    def take_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics


def rank_balance(plan: Plan) -> RankBalance:
    """The balance for ``plan``: the least common multiple of its layouts' data-parallel sizes."""
    return RankBalance(math.lcm(*(layout.dp for group in plan.groups for layout in group.layouts)))
