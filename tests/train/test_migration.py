"""The flat keys of before the sections still load, moved to their sections with a warning naming both."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.train.config import TrainConfig, load_config
from hybridflow.train.config_keys import walk
from hybridflow.train.migration import MOVED
from hybridflow.train.rundir import _sectioned, differing_keys

FLAT = """\
algorithm: grpo
algorithm_options: {n: 2}
actor: {lr: 0.002}
critic: {lr: 0.004}
executor: local
placement: manual
cluster: 2xCPU
meshes: {actor: [0], reference: [1]}
pipeline: sync
stream_chunks: 2
checkpoint_every: 5
keep_checkpoints: 2
validation_every: 3
trackers: [jsonl]
progress: false
console_metrics_every: 4
reward_cache_size: 16
liveness: {heartbeat_timeout_s: 40}
planner_settings: {mean_response_len: 6}
"""

SECTIONED = """\
algorithm: {name: grpo, options: {n: 2}}
optim: {actor: {lr: 0.002}, critic: {lr: 0.004}}
executor: {name: local, liveness: {heartbeat_timeout_s: 40}}
placement:
  mode: manual
  cluster: 2xCPU
  meshes: {actor: [0], reference: [1]}
  planner: {mean_response_len: 6}
pipeline: {mode: sync, stream_chunks: 2}
checkpoint: {every: 5, keep: 2}
validation: {every: 3}
logging: {trackers: [jsonl], progress: false, console_every: 4}
data: {reward_cache_size: 16}
"""


def test_a_flat_config_loads_as_its_sectioned_twin_with_one_warning_per_key(tmp_path: Path) -> None:
    (tmp_path / "flat.yaml").write_text(FLAT)
    (tmp_path / "sectioned.yaml").write_text(SECTIONED)
    with pytest.warns(FutureWarning) as caught:
        flat = load_config(tmp_path / "flat.yaml")
    messages = [str(w.message) for w in caught]
    assert "config key 'stream_chunks' is now 'pipeline.stream_chunks' (docs/migrating.md); the old spelling will " \
           "be refused in a later release" in messages
    assert any("'liveness.heartbeat_timeout_s' is now 'executor.liveness.heartbeat_timeout_s'" in m for m in messages)
    assert any("'actor.lr' is now 'optim.actor.lr'" in m for m in messages)
    assert len(messages) == 16  # one a key (meshes' two roles are one key each)
    assert flat == load_config(tmp_path / "sectioned.yaml") != TrainConfig()


def test_an_old_override_moves_and_a_section_mapping_is_not_an_old_key(recwarn: pytest.WarningsRecorder) -> None:
    with pytest.warns(FutureWarning, match="'max_staleness' is now 'pipeline.max_staleness'"):
        old = load_config(None, ["pipeline=async", "max_staleness=2"])
    assert (old.pipeline.mode, old.pipeline.max_staleness) == ("async", 2)
    recwarn.clear()
    new = load_config(None, ["pipeline={mode: async, max_staleness: 2}"])
    assert new == old and not [w for w in recwarn if w.category is FutureWarning]


def test_a_plain_value_is_its_sections_short_field_without_a_warning(recwarn: pytest.WarningsRecorder) -> None:
    short = load_config(None, ["algorithm=ppo", "executor=ray", "placement=auto", "pipeline=async",
                               "placement.cluster=2xCPU"])
    assert not [w for w in recwarn if w.category is FutureWarning]
    assert short == load_config(None, ["algorithm.name=ppo", "executor.name=ray", "placement.mode=auto",
                                       "pipeline.mode=async", "placement.cluster=2xCPU"])
    assert (short.algorithm.name, short.executor.name, short.placement.mode, short.pipeline.mode) == (
        "ppo", "ray", "auto", "async")
    with pytest.raises(TypeError, match=r"config key 'optim' must be a mapping, got 'adam'"):
        load_config(None, ["optim=adam"])  # a section without a short field takes no plain value


def test_every_old_key_has_a_real_home() -> None:
    for old, new in MOVED.items():
        assert walk(TrainConfig, new)[0] != "unknown", f"{old} -> {new}"
        assert walk(TrainConfig, old)[0] in ("unknown", "section"), f"{old} is still a key of the root"


def test_the_retired_tensorboard_switch_names_its_replacement() -> None:
    with pytest.raises(ValueError, match=r"'tensorboard' is retired: list it in 'logging\.trackers'"):
        load_config(None, ["tensorboard=false"])


def test_a_checkpoint_fingerprint_of_the_flat_config_matches_its_sectioned_run() -> None:
    saved = {"pipeline": "sync", "max_staleness": 1, "placement": "default", "planner_settings.lengths_from": None,
             "validate_before_train": False, "checkpoint_every": 2, "actor.lr": 0.001, "algorithm": "grpo",
             "algorithm_options.n": 4}
    current = {"pipeline.mode": "sync", "pipeline.max_staleness": 1, "placement.mode": "default",
               "placement.planner.lengths_from": None, "optim.actor.lr": 0.001, "algorithm.name": "grpo",
               "algorithm.options.n": 4}
    assert differing_keys(_sectioned(saved), current) == []
    assert differing_keys(_sectioned({**saved, "max_staleness": 2}), current) == ["pipeline.max_staleness: 2 -> 1"]
