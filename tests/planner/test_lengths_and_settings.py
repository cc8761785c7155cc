"""Response length distributions and run settings: fitted shapes, tails, and errors that name the key."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.planner.lengths import MAX_QUANTILE, LengthDistribution
from hybridflow.planner.settings import Offload, RunSettings, settings_from_dict


@given(mean=st.integers(50, 4000), ratio=st.floats(1.5, 20))
@settings(max_examples=40, deadline=None)
def test_lognormal_keeps_the_mean_and_puts_the_cap_at_its_top(mean, ratio):
    lengths = LengthDistribution.lognormal(mean=mean, max=mean * ratio)
    assert lengths.mean == pytest.approx(mean, rel=1e-3)
    assert lengths.max <= mean * ratio * (1 + 1e-9)
    assert lengths.quantile(MAX_QUANTILE / 2) < mean * ratio
    assert lengths.expected_max(10) <= lengths.expected_max(1000) <= lengths.max


def test_a_histogram_and_a_metrics_file(tmp_path):
    lengths = LengthDistribution.from_lengths([100, 100, 400])
    assert lengths.points == ((100.0, pytest.approx(2 / 3)), (400.0, pytest.approx(1 / 3)))
    assert lengths.mean == pytest.approx(200)
    assert lengths.mean_age() == pytest.approx((1e4 * 2 / 3 + 16e4 / 3) / (2 * 200))  # E[L^2] / (2 E[L])
    assert lengths.survivors(400) == [(0.0, 100.0, 1.0), (100.0, 400.0, pytest.approx(1 / 3))]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"response_length/mean": m, "response_length/max": 900})
                                 for m in (200, 300)))
    fitted = LengthDistribution.from_metrics(metrics)
    assert fitted.mean == pytest.approx(250, rel=1e-3) and fitted.max == pytest.approx(900)


def test_bad_lengths_say_what_to_give():
    with pytest.raises(ValueError, match=r"mean \(900\) <= max \(800\)"):
        LengthDistribution.lognormal(mean=900, max=800)
    with pytest.raises(ValueError, match="sum to 1"):
        LengthDistribution(((10.0, 0.5),))


def test_settings_from_config_keys():
    run = settings_from_dict({"max_response_len": 4096, "mini_batch_size": 256, "offload": {"actor": "params+optim"},
                              "gpu_memory_utilization": 0.6, "rollout_sleep": True}, mean_response_len=1024)
    assert run.lengths is not None and run.lengths.max == pytest.approx(4096)
    assert run.offload_of("actor") == Offload(params=True, optimizer=True)
    assert run.offload_of("critic") == Offload() and run.mini_batch_size == 256
    assert settings_from_dict({"max_prompt_len": 2048}, mean_response_len=512).max_prompt_len == 2048
    with pytest.raises(ValueError, match=r"unknown keys \['controller_batches'\]"):  # verl's, an overlay (overlays.py)
        settings_from_dict({"controller_batches": True}, mean_response_len=512)


@pytest.mark.parametrize(("data", "message"), [
    ({"mini_batch_size": "many"}, r"mini_batch_size='many' is not a int"),
    ({"mini_batch_size": 0}, r"mini_batch_size=0 must be a positive integer"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5 must be in \(0, 1\]"),
    ({"max_response_len": 100}, r"max_response_len=100 is below the mean"),
    ({"offload": {"actor": ["weights"]}}, r"offload.actor: unknown part 'weights'"),
    ({"rollout_sleep": "yes"}, r"rollout_sleep='yes' must be true or false"),
    ({"max_prompt_len": 0}, r"max_prompt_len=0 must be a positive integer"),
    ({"mini_batch": 4}, r"unknown keys \['mini_batch'\]"),
])
def test_bad_settings_name_the_key(data, message):
    with pytest.raises(ValueError, match=message):
        settings_from_dict(data, mean_response_len=512)


def test_run_settings_validate_on_construction():
    with pytest.raises(ValueError, match=r"RunSettings.epochs=0"):
        RunSettings(epochs=0)


def test_a_cap_within_a_rounding_error_of_the_mean_is_a_point_not_a_zero_width_lognormal() -> None:
    mean = 64.0
    lengths = LengthDistribution.lognormal(mean=mean, max=mean * 1.0000000000000002)
    assert lengths.mean == pytest.approx(mean) and lengths.max == pytest.approx(mean)
