"""Token balancing (issue 22, item 2): equal-count data-parallel shares with even token sums, and token-budget
micro batches (``hybridflow/runtime/balancing.py``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridflow.runtime.balancing import balanced_order, balanced_partitions, token_micro_batches


def _sums(lengths: list[int], groups: list[list[int]]) -> list[int]:
    return [sum(lengths[row] for row in group) for group in groups]


def test_balanced_shares_beat_contiguous_chunks_on_sorted_lengths() -> None:
    lengths = [100, 90, 80, 70, 10, 9, 8, 7]  # a step whose long responses came first
    groups = balanced_partitions(lengths, 2)
    assert [len(group) for group in groups] == [4, 4]
    assert sorted(row for group in groups for row in group) == list(range(8))
    contiguous = [sum(lengths[:4]), sum(lengths[4:])]
    balanced = _sums(lengths, groups)
    assert max(contiguous) - min(contiguous) == 306
    assert max(balanced) - min(balanced) <= 10


@given(st.lists(st.integers(1, 500), min_size=1, max_size=48), st.integers(1, 6))
def test_balanced_shares_are_equal_sized_and_no_worse_than_the_longest_row(lengths: list[int], parts: int) -> None:
    lengths = lengths[:len(lengths) - len(lengths) % parts] or [1] * parts
    groups = balanced_partitions(lengths, parts)
    assert len(groups) == parts and {len(group) for group in groups} == {len(lengths) // parts}
    assert sorted(row for group in groups for row in group) == list(range(len(lengths)))
    sums = _sums(lengths, groups)
    # LPT under a count bound: each group's last row was added to the lightest open group.
    assert max(sums) - min(sums) <= max(lengths)


def test_balanced_partitions_name_the_bad_input() -> None:
    with pytest.raises(ValueError, match="3 rows do not split into 2"):
        balanced_partitions([1, 2, 3], 2)
    with pytest.raises(ValueError, match="parts=0"):
        balanced_partitions([1], 0)


def test_token_micro_batches_are_greedy_and_never_empty() -> None:
    lengths = [5, 5, 5, 20, 1, 1]
    cuts = token_micro_batches(lengths, 10)
    assert [list(cut) for cut in cuts] == [[0, 1], [2], [3], [4, 5]]  # the long row is a micro batch alone
    assert [list(cut) for cut in token_micro_batches(lengths, 1000)] == [list(range(6))]


@given(st.lists(st.integers(1, 64), min_size=1, max_size=40), st.integers(1, 128), st.integers(0, 40))
def test_token_micro_batches_cover_the_rows_in_order_within_budget(lengths: list[int], budget: int,
                                                                   extra: int) -> None:
    greedy = token_micro_batches(lengths, budget)
    count = min(len(lengths), len(greedy) + extra)
    for cuts in (greedy, token_micro_batches(lengths, budget, count=count)):
        assert [row for cut in cuts for row in cut] == list(range(len(lengths)))
        assert all(len(cut) >= 1 for cut in cuts)
        assert all(len(cut) == 1 or sum(lengths[row] for row in cut) <= budget for cut in cuts)
    assert len(token_micro_batches(lengths, budget, count=count)) == count


def test_balanced_order_makes_contiguous_chunks_the_balanced_groups() -> None:
    lengths = [100, 90, 80, 70, 10, 9, 8, 7]
    order = balanced_order(lengths, 2)
    assert sorted(order) == list(range(8))
    assert [order[:4], order[4:]] == balanced_partitions(lengths, 2)
