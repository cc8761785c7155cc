"""The deadline a worker call gets: fixed, or derived from the plan and measured times with a floor."""

from __future__ import annotations

import pytest

from hybridflow.runtime.liveness import Liveness


def test_a_derived_deadline_has_a_floor_and_follows_the_slowest_estimate() -> None:
    live = Liveness(min_timeout_s=60, timeout_factor=10)
    assert live.deadline_s() == 60
    assert live.deadline_s(estimate_s=2.0, measured_s=1.0) == 60
    assert live.deadline_s(estimate_s=2.0, measured_s=30.0) == 300
    assert Liveness(call_timeout_s=5).deadline_s(estimate_s=100) == 5
    assert Liveness(heartbeat_interval_s=1, heartbeat_timeout_s=4).hang_bound_s == 5


@pytest.mark.parametrize("fields", [{"heartbeat_timeout_s": 0}, {"call_timeout_s": -1}, {"timeout_factor": 0},
                                    {"heartbeat_interval_s": 5, "heartbeat_timeout_s": 1}])
def test_bad_values_name_the_field(fields: dict[str, float]) -> None:
    """The runtime names its own field; the config layer spells it as the user's key (tests/reliability/test_bounds)."""
    with pytest.raises(ValueError, match="^" + list(fields)[-1] + "="):
        Liveness(**fields)
