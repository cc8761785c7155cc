"""SingleController: the tutorial's 8-GPU mapping runs end to end on CPU with logical GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow import DataParallelConfig, SingleController

TINY = "tiny-qwen2"


def tutorial(**overrides: object) -> DataParallelConfig:
    kwargs: dict[str, object] = dict(
        actor_model_device_mesh=[0, 1, 2, 3], critic_model_device_mesh=[0, 1, 2, 3],
        reward_model_device_mesh=[4, 5], reference_model_device_mesh=[4, 5],
        data_parallel_size=2, fsdp_sharding_strategy="FULL_SHARD",
    )
    kwargs.update(overrides)
    return DataParallelConfig(**kwargs)  # type: ignore[arg-type]


def controller(config: DataParallelConfig, tmp: Path, **settings: object) -> SingleController:
    run = {"steps": 2, "data.batch_size": 4, "algorithm.options.max_new_tokens": 6, "model.sft_steps": 5,
           "output_dir": str(tmp / "run"), **settings}
    return SingleController(config=config, actor_model=TINY, critic_model=TINY, reward_model=TINY,
                            reference_model=TINY, use_half_precision=True, settings=run)


def test_plan_reports_spare_gpus_and_compares_with_the_auto_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    check = controller(tutorial(), tmp_path).plan()
    assert check.unused_gpus == (6, 7)
    assert [sorted(g.roles) for g in check.manual.groups] == [["actor", "critic"], ["reference", "reward"]]
    assert [g.gpus for g in check.manual.groups] == [(0, 1, 2, 3), (4, 5)]
    # Every role is data parallel over its whole mesh; data_parallel_size=2 splits the actor's rollout.
    assert all(layout.dp == g.size and layout.tp == 1 for g in check.manual.groups for layout in g.layouts)
    assert check.manual.layout("actor").rollout_tp == 2
    assert check.auto.step_time_s <= check.manual.step_time_s
    out = capsys.readouterr().out
    assert "GPUs [6, 7] are unused" in out and "step time: auto" in out


def test_half_precision_is_fp16_on_t4_and_bf16_on_a100(tmp_path: Path):
    mixed = controller(tutorial(cluster="4xA100-80G+2xT4"), tmp_path)
    assert mixed.dtypes() == {"reward": "fp16", "reference": "fp16"}
    plan = mixed.manual_plan()
    assert plan.groups[1].device == "T4" and {lay.dtype for lay in plan.groups[1].layouts} == {"fp16"}
    assert controller(tutorial(), tmp_path).dtypes() == {"reward": "bf16", "reference": "bf16"}


def test_roles_without_a_mesh_or_model_are_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="critic_model_device_mesh is set but critic_model is missing"):
        SingleController(config=tutorial(), actor_model=TINY, reward_model=TINY, reference_model=TINY)
    with pytest.raises(ValueError, match="neither a local model directory"):
        SingleController(
            config=tutorial(), actor_model=TINY, critic_model="tiny-llama", reward_model=TINY,
            reference_model=TINY).fit()


@pytest.mark.slow
def test_a_sharding_strategy_runs_on_fsdp_and_needs_processes(tmp_path: Path):
    ctl = controller(tutorial(), tmp_path)  # FULL_SHARD, in this process
    with pytest.raises(ValueError, match=r"shards \['actor', 'critic', 'reference', 'reward'\] with the fsdp backend.*"
                                         r"'executor.name': 'ray'"):
        ctl.fit()
    assert not (tmp_path / "run").exists()  # refused before anything was written or loaded


def test_tutorial_mapping_trains_end_to_end_with_cache_and_request_bound(tmp_path: Path):
    # Replicas on the torch backend, in this process; its native rollout has no tensor parallelism, so the
    # actor's 4 GPUs are 4 rollout engines (data_parallel_size=2 would ask for rollout_tp=2).
    config = tutorial(reward_model_micro_batch_size=2, reward_model_max_concurrent_requests=2,
                      fsdp_sharding_strategy="NO_SHARD", data_parallel_size=None)
    config.enable_reward_cache = True
    config.reward_cache_size = 64
    ctl = controller(config, tmp_path)
    result = ctl.fit()
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    # PPO ran every node of the graph on the mapped groups.
    nodes = {"time/critic_update", "time/actor_update", "time/reward_score", "time/reference_ref_logprob"}
    assert nodes <= set(rows[0])
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert [g["gpus"] for g in plan["groups"]] == [[0, 1, 2, 3], [4, 5]]
    # 4 prompts x 1 sample in requests of 2 rows x dp 2 = 4 rows: the bound of 2 is never passed.
    assert all(row["reward/peak_in_flight_requests"] <= 2 for row in rows)
    assert "reward_cache/hit_rate" in rows[-1]
    # Monitoring: bytes shipped to each group and tokens/s of every role node.
    assert rows[0]["transfer/to_group0_bytes"] > 0 and rows[0]["transfer/to_group1_bytes"] > 0
    assert rows[0]["throughput/reward_score_tokens_per_s"] > 0 and rows[0]["throughput/actor_generate_tokens_per_s"] > 0
    saved = ctl.save(tmp_path / "saved")
    assert (saved / "checkpoint" / "trainer.json").is_file() and (saved / "plan.json").is_file()
    assert ctl.save(saved) == saved  # a previous save is replaced; anything else is refused, left as it was
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    for target in (tmp_path / "mine", tmp_path):  # user files; a directory holding the run itself
        with pytest.raises((FileExistsError, ValueError), match="save"):
            ctl.save(target)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    ctl.load(saved)
    again = ctl.fit(steps=3)
    assert again.start_step == 2 and [row["step"] for row in again.history] == [2]


def test_a_rollout_mesh_of_its_own_is_planned_and_trained_with_weights_shipped(tmp_path: Path):
    ctl = controller(tutorial(rollout_device_mesh=[6, 7], fsdp_sharding_strategy="NO_SHARD"), tmp_path)
    check = ctl.plan(show=False)
    assert check.unused_gpus == ()
    assert check.manual.detached_rollouts == {"actor": "actor:rollout"}
    assert check.manual.groups[check.manual.group_index("actor:rollout")].gpus == (6, 7)
    assert check.manual.layout("actor:rollout").rollout_tp == 1  # data_parallel_size=2 engines on 2 GPUs
    result = ctl.fit(steps=1)
    row = json.loads(result.metrics_path.read_text().splitlines()[0])
    assert row["actor/weight_sync/receivers"] == 2 and row["actor/weight_sync/bytes"] > 0


def test_the_classic_api_runs_the_async_pipeline_on_its_rollout_mesh(tmp_path: Path):
    ctl = controller(tutorial(rollout_device_mesh=[6, 7], fsdp_sharding_strategy="NO_SHARD"), tmp_path, steps=3,
                     **{"pipeline.mode": "async", "pipeline.max_staleness": 2})
    rows = [json.loads(line) for line in ctl.fit().metrics_path.read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert all(0 <= row["pipeline/staleness_max"] <= 2 for row in rows)
    assert rows[0]["pipeline/rollout_tokens_per_s"] > 0  # later steps may find their batches generated already
