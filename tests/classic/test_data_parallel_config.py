"""DataParallelConfig: the tutorial's parameter names, validated with errors naming the parameter."""

from __future__ import annotations

import pytest

from hybridflow.classic.config import ConfigError, DataParallelConfig


def tutorial_config(**overrides: object) -> DataParallelConfig:
    kwargs: dict[str, object] = dict(
        actor_model_device_mesh=[0, 1, 2, 3],
        critic_model_device_mesh=[0, 1, 2, 3],
        reward_model_device_mesh=[4, 5],
        reference_model_device_mesh=[4, 5],
        data_parallel_size=2,
        fsdp_sharding_strategy="FULL_SHARD",
    )
    kwargs.update(overrides)
    return DataParallelConfig(**kwargs)  # type: ignore[arg-type]


def test_tutorial_mapping_colocates_equal_meshes_and_reports_spare_gpus():
    config = tutorial_config()
    assert config.colocation_groups() == [([0, 1, 2, 3], ["actor", "critic"]), ([4, 5], ["reward", "reference"])]
    assert config.unused_gpus == [6, 7]
    assert config.num_gpus == 8


def test_partially_overlapping_meshes_are_rejected_with_the_reason():
    with pytest.raises(ConfigError, match=r"partially overlaps .* on GPUs \[3\]") as err:
        tutorial_config(reward_model_device_mesh=[3, 4], reference_model_device_mesh=[3, 4])
    assert err.value.field == "reward_model_device_mesh"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"fsdp_sharding_strategy": "ZERO_INFINITY"}, "fsdp_sharding_strategy"),
        ({"actor_model_device_mesh": [0, 0, 1]}, "actor_model_device_mesh"),
        ({"actor_model_device_mesh": [-1]}, "actor_model_device_mesh"),
        ({"actor_model_device_mesh": []}, "actor_model_device_mesh"),
        ({"reward_model_device_mesh": [4, 9], "reference_model_device_mesh": [4, 9], "cluster": "8xA100-80G"},
         "reward_model_device_mesh"),
        ({"data_parallel_size": 3}, "data_parallel_size"),
        ({"rollout_device_mesh": [3, 6]}, "rollout_device_mesh"),
        ({"rollout_device_mesh": [6, 7, 8]}, "data_parallel_size"),
        ({"reward_model_micro_batch_size": 0}, "reward_model_micro_batch_size"),
        ({"critic_model_max_concurrent_requests": -2}, "critic_model_max_concurrent_requests"),
        ({"reward_cache_size": None}, "reward_cache_size"),
        ({"enable_reward_cache": "yes"}, "enable_reward_cache"),
    ],
)
def test_bad_values_name_the_parameter(overrides: dict[str, object], field: str):
    with pytest.raises(ConfigError) as err:
        tutorial_config(**overrides)
    assert err.value.field == field
    assert f"DataParallelConfig.{field}" in str(err.value)


def test_unknown_strategy_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"NO_SHARD.*SHARD_GRAD_OP.*FULL_SHARD"):
        tutorial_config(fsdp_sharding_strategy="full")


def test_attributes_set_after_construction_are_validated_and_rolled_back():
    config = tutorial_config()
    config.enable_reward_cache = True
    config.reward_cache_size = 128
    assert config.enable_reward_cache and config.reward_cache_size == 128
    with pytest.raises(ConfigError, match="partially overlaps"):
        config.critic_model_device_mesh = [2, 3, 4]
    assert config.critic_model_device_mesh == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="unknown parameter"):
        config.reward_model_micro_batchsize = 8  # type: ignore[attr-defined]


def test_per_role_knobs_are_read_by_role_name():
    config = tutorial_config(reward_model_micro_batch_size=8, reward_model_max_concurrent_requests=4)
    assert config.micro_batch_size("reward") == 8
    assert config.max_concurrent_requests("reward") == 4
    assert config.micro_batch_size("actor") is None
