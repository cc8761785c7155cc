"""benchmarks/planner_ranking.py: the placements it measures and the rank correlation it reports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "planner_ranking.py"


@pytest.fixture(scope="module")
def ranking():
    spec = importlib.util.spec_from_file_location("planner_ranking", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_placement_on_two_gpus_up_to_swapping_them(ranking):
    chosen = ranking.placements(("actor", "critic", "reference", "reward"))
    assert len(chosen) == 9  # actor on 0; three roles on 0 or 1; and everything on both
    assert len({tuple(sorted((r, tuple(g)) for r, g in m.items())) for m in chosen.values()}) == 9
    for meshes in chosen.values():
        assert meshes["actor"] in ([0], [0, 1])
        groups = {tuple(gpus) for gpus in meshes.values()}
        # Colocated roles list exactly the same GPUs: a group on both GPUs holds every role.
        assert groups <= {(0,), (1,)} or groups == {(0, 1)}


def test_kendall_tau_counts_concordant_minus_discordant_pairs(ranking):
    assert ranking.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert ranking.kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert ranking.kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)


def test_kendall_tau_b_leaves_tied_pairs_out_of_the_range_as_scipy_does(ranking):
    from scipy.stats import kendalltau

    predicted, measured = [1, 1, 2, 3, 4, 4, 5, 6], [1.1, 0.9, 2, 3.2, 3.9, 4.4, 5, 6.1]
    assert ranking.kendall_tau_b(predicted, measured) == pytest.approx(kendalltau(predicted, measured).statistic)
    assert ranking.kendall_tau(predicted, measured) == pytest.approx(26 / 28)  # the two tied pairs score 0
    assert ranking.kendall_tau_b([1, 1, 1], [1, 2, 3]) == 0.0  # one list all ties: no ranking to score
