"""``placement: auto | manual`` in the training config: the planner's plan is what runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.train.config import load_config
from hybridflow.train.loop import train

FAST = ["model.sft_steps=3", "data.batch_size=4", "data.num_examples=32", "algorithm_options.n=2",
        "algorithm_options.max_new_tokens=4", "progress=false", "tensorboard=false", "plot=false", "steps=1"]


def run(tmp_path: Path, *overrides: str) -> dict:
    result = train(load_config(None, [*FAST, f"output_dir={tmp_path / 'run'}", *overrides]))
    assert [row["step"] for row in result.history] == [0]
    return json.loads((tmp_path / "run" / "plan.json").read_text())


def test_auto_placement_runs_the_planners_plan_on_a_mixed_cluster(tmp_path: Path):
    plan = run(tmp_path, "placement=auto", "cluster=2xA100-80G+2xT4", "algorithm_options.reward_kind=reward_model")
    assert plan["search"]["method"] != "manual"
    placed = sorted(role for group in plan["groups"] for role in group["roles"])
    assert placed == ["actor", "reference", "reward"]
    for group in plan["groups"]:  # every dtype the plan chose runs on its device: no bf16 on a T4
        assert group["device"] in ("A100-80G", "T4")
        assert all(lay["dtype"] != "bf16" or group["device"] != "T4" for lay in group["layouts"])


def test_manual_placement_follows_the_meshes(tmp_path: Path):
    plan = run(tmp_path, "placement=manual", "cluster=2xCPU", "meshes={actor: [0], reference: [1]}")
    assert {tuple(g["gpus"]): tuple(g["roles"]) for g in plan["groups"]} == {(0,): ("actor",), (1,): ("reference",)}
    assert plan["driver_roles"] == ["reward"]  # the task's rule runs beside the controller


def test_manual_placement_names_what_is_missing(tmp_path: Path):
    with pytest.raises(KeyError, match=r"'meshes'.*missing \['reference'\]"):
        run(tmp_path, "placement=manual", "cluster=2xCPU", "meshes={actor: [0, 1]}")
    with pytest.raises(ValueError, match="only read with placement=manual"):
        load_config(None, ["meshes={actor: [0]}"])
    with pytest.raises(ValueError, match="'separate_rollout' is only read with placement=auto"):
        load_config(None, ["separate_rollout=true", "placement=manual"])
    with pytest.raises(KeyError, match=r"'reference:rollout'.*rollout on GPUs of its own: \['actor:rollout'\]"):
        run(tmp_path, "placement=manual", "cluster=3xCPU",
            "meshes={actor: [0], reference: [1], 'reference:rollout': [2]}")


def test_manual_placement_can_give_the_rollout_its_own_gpus(tmp_path: Path):
    plan = run(tmp_path, "placement=manual", "cluster=3xCPU",
               "meshes={actor: [0], 'actor:rollout': [1], reference: [2]}")
    assert {tuple(g["gpus"]): tuple(g["roles"]) for g in plan["groups"]} == {
        (0,): ("actor",), (1,): ("actor:rollout",), (2,): ("reference",)}
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    shipped, planned = metrics[0]["actor/weight_sync/bytes"], metrics[0]["weight_sync/planned_bytes"]
    assert planned == plan["weight_sync_bytes"] > 0
    assert abs(shipped - planned) / planned < 0.01  # the planner's params x dtype estimate is what travelled


def test_placement_uses_the_calibration_the_config_names(tmp_path: Path):
    from hybridflow.graph import load_graph
    from hybridflow.train.placement import planned

    base = [*FAST, "placement=manual", "cluster=2xH20", "meshes={actor: [0, 1], reference: [0, 1]}"]
    graph = load_graph("grpo", n=2, max_new_tokens=4, reward_kind="reward_function")
    default = planned(load_config(None, base), graph, prompt_len=8)
    calibrated = planned(load_config(None, [*base, "calibration=verl-published"]), graph, prompt_len=8)
    assert calibrated.step_time_s != default.step_time_s  # the fitted constants changed the costs
    with pytest.raises(FileNotFoundError, match="calibrate"):
        planned(load_config(None, [*base, f"calibration={tmp_path / 'none.json'}"]), graph, prompt_len=8)
    with pytest.raises(ValueError, match="'calibration' is only read with placement"):
        load_config(None, [*FAST, "calibration=verl-published"])
