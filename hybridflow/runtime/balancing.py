"""Token-balanced partitions of a step's rows: data-parallel shares and token-budget micro batches.

Torch-free: the heuristics see row lengths (tokens) only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balanced_partitions(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """``parts`` groups of row indices with equal row counts and token sums as even as the heuristic finds.

    Longest processing time first with a cardinality bound (the greedy step of verl's sequence balancing):
    rows in decreasing length, each to the group with the fewest tokens that still has room for
    ``len(lengths) / parts`` rows. Equal counts are what data-parallel ranks need (every rank runs the same
    number of rows and collectives). Within a group, indices are ascending; groups are ordered by their
    first row. Unbounded LPT is within 4/3 of the optimal largest sum (Graham 1969); the bound keeps it
    close when rows are many per group.
    """
    if parts < 1:
        raise ValueError(f"balanced_partitions: parts={parts} must be >= 1")
    if len(lengths) % parts:
        raise ValueError(f"balanced_partitions: {len(lengths)} rows do not split into {parts} equal groups; "
                         "pad the rows to a multiple first")
    room = len(lengths) // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, index) for index in range(parts)]  # (tokens, group) of the groups with room left
    order = sorted(range(len(lengths)), key=lambda row: (-lengths[row], row))
    for row in order:
        tokens, group = heapq.heappop(heap)
        groups[group].append(row)
        if len(groups[group]) < room:
            heapq.heappush(heap, (tokens + lengths[row], group))
    return sorted((sorted(group) for group in groups), key=lambda group: group[0] if group else len(lengths))


def token_micro_batches(lengths: Sequence[int], budget: int, *, count: int = 0) -> list[range]:
    """Consecutive rows cut into micro batches of at most ``budget`` tokens, greedily (each at least one row:
    a row longer than the budget is a micro batch of its own).

    ``count`` > the greedy number splits the micro batches with the most tokens (of two rows or more) at their
    token midpoint until there are ``count``: every rank of a sharded engine must run as many forward passes
    as the others. It needs ``count`` <= rows.
    """
    if budget < 1:
        raise ValueError(f"token_micro_batches: budget={budget} must be >= 1")
    if count > len(lengths):
        raise ValueError(f"token_micro_batches: count={count} micro batches of {len(lengths)} rows")
    cuts: list[range] = []
    start, used = 0, 0
    for row, tokens in enumerate(lengths):
        if row > start and used + tokens > budget:
            cuts.append(range(start, row))
            start, used = row, 0
        used += tokens
    if len(lengths):
        cuts.append(range(start, len(lengths)))
    while len(cuts) < count:
        index = max((i for i, cut in enumerate(cuts) if len(cut) > 1),
                    key=lambda i: sum(lengths[row] for row in cuts[i]))
        cut = cuts[index]
        half, used, split = sum(lengths[row] for row in cut) / 2, 0, cut.start + 1
        for row in cut[:-1]:
            used += lengths[row]
            split = row + 1
            if used >= half:
                break
        cuts[index:index + 1] = [range(cut.start, split), range(split, cut.stop)]
    return cuts


def balanced_order(lengths: Sequence[int], parts: int) -> list[int]:
    """A permutation of the rows whose ``parts`` consecutive equal chunks (``Batch.chunk``, how rows are sharded
    over data-parallel ranks) are the :func:`balanced_partitions` groups: ``batch.index(order)`` before sharding."""
    return [row for group in balanced_partitions(lengths, parts) for row in group]
