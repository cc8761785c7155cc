"""``placement: auto | manual`` in the training config: the planner's plan is what runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.planner import Plan
from hybridflow.train.config import load_config
from hybridflow.train.loop import train

FAST = ["model.sft_steps=3", "data.batch_size=4", "data.num_examples=32", "algorithm.options.n=2",
        "algorithm.options.max_new_tokens=4", "logging.progress=false", "logging.plot=false", "steps=1"]


def run(tmp_path: Path, *overrides: str) -> dict:
    result = train(load_config(None, [*FAST, f"output_dir={tmp_path / 'run'}", *overrides]))
    assert [row["step"] for row in result.history] == [0]
    return json.loads((tmp_path / "run" / "plan.json").read_text())


def test_auto_placement_runs_the_planners_plan_on_a_mixed_cluster(tmp_path: Path):
    plan = run(tmp_path, "placement.mode=auto", "placement.cluster=2xA100-80G+2xT4",
               "algorithm.options.reward_kind=reward_model")
    assert plan["search"]["method"] != "manual"
    placed = sorted(role for group in plan["groups"] for role in group["roles"])
    assert placed == ["actor", "reference", "reward"]
    for group in plan["groups"]:  # every dtype the plan chose runs on its device: no bf16 on a T4
        assert group["device"] in ("A100-80G", "T4")
        assert all(lay["dtype"] != "bf16" or group["device"] != "T4" for lay in group["layouts"])


def test_manual_placement_follows_the_meshes(tmp_path: Path):
    plan = run(tmp_path, "placement.mode=manual", "placement.cluster=2xCPU",
               "placement.meshes={actor: [0], reference: [1]}")
    assert {tuple(g["gpus"]): tuple(g["roles"]) for g in plan["groups"]} == {(0,): ("actor",), (1,): ("reference",)}
    assert plan["driver_roles"] == ["reward"]  # the task's rule runs beside the controller


def test_manual_placement_names_what_is_missing(tmp_path: Path):
    with pytest.raises(KeyError, match=r"'placement\.meshes'.*missing \['reference'\]"):
        run(tmp_path, "placement.mode=manual", "placement.cluster=2xCPU", "placement.meshes={actor: [0, 1]}")
    with pytest.raises(ValueError, match=r"'placement\.meshes' is only read with placement\.mode=manual"):
        load_config(None, ["placement.meshes={actor: [0]}"])
    with pytest.raises(ValueError, match=r"'placement\.separate_rollout' is only read with placement\.mode=auto"):
        load_config(None, ["placement.separate_rollout=true", "placement.mode=manual"])
    with pytest.raises(KeyError, match=r"'reference:rollout'.*rollout on GPUs of its own: \['actor:rollout'\]"):
        run(tmp_path, "placement.mode=manual", "placement.cluster=3xCPU",
            "placement.meshes={actor: [0], reference: [1], 'reference:rollout': [2]}")


def test_manual_placement_can_give_the_rollout_its_own_gpus(tmp_path: Path):
    plan = run(tmp_path, "placement.mode=manual", "placement.cluster=3xCPU",
               "placement.meshes={actor: [0], 'actor:rollout': [1], reference: [2]}")
    assert {tuple(g["gpus"]): tuple(g["roles"]) for g in plan["groups"]} == {
        (0,): ("actor",), (1,): ("actor:rollout",), (2,): ("reference",)}
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    shipped, planned = metrics[0]["actor/weight_sync/bytes"], metrics[0]["weight_sync/planned_bytes"]
    assert planned == plan["weight_sync_bytes"] > 0
    assert abs(shipped - planned) / planned < 0.01  # the planner's params x dtype estimate is what travelled


def test_placement_uses_the_calibration_the_config_names(tmp_path: Path):
    from hybridflow.graph import load_graph
    from hybridflow.train.placement import planned

    base = [*FAST, "placement.mode=manual", "placement.cluster=2xH20",
            "placement.meshes={actor: [0, 1], reference: [0, 1]}"]
    graph = load_graph("grpo", n=2, max_new_tokens=4, reward_kind="reward_function")
    default = planned(load_config(None, base), graph, prompt_len=8)
    calibrated = planned(load_config(None, [*base, "placement.calibration=verl-published"]), graph, prompt_len=8)
    assert calibrated.step_time_s != default.step_time_s  # the fitted constants changed the costs
    with pytest.raises(FileNotFoundError, match="calibrate"):
        planned(load_config(None, [*base, f"placement.calibration={tmp_path / 'none.json'}"]), graph, prompt_len=8)
    with pytest.raises(ValueError, match=r"'placement\.calibration' is only read with placement"):
        load_config(None, [*FAST, "placement.calibration=verl-published"])


def plan_for(*overrides: str):
    from hybridflow.train import setup

    config = load_config(None, ["algorithm=grpo_no_ref", "algorithm.options={n: 8, max_new_tokens: 160}",
                                "data.batch_size=8", *overrides])
    return setup.build_plan(config, setup.build_graph(config), 16)


def test_planner_settings_give_the_planner_the_response_lengths(tmp_path: Path):
    manual = ["placement.mode=manual", "placement.cluster=3xCPU",
              "placement.meshes={actor: [0], 'actor:rollout': [1, 2]}",
              "pipeline.mode=async", "pipeline.max_staleness=2"]
    capped = plan_for(*manual)  # every response at max_new_tokens
    skewed = plan_for(*manual, "placement.planner={mean_response_len: 40}")
    assert skewed.step_time_s < capped.step_time_s
    metrics = tmp_path / "metrics.jsonl"  # an earlier run's lengths, as a user passes them
    metrics.write_text("".join(json.dumps({"step": i, "response_length/mean": 40.0, "response_length/max": 160.0})
                               + "\n" for i in range(3)))
    observed = plan_for(*manual, f"placement.planner={{lengths_from: '{metrics}'}}")
    assert observed.step_time_s < capped.step_time_s
    with pytest.raises(KeyError, match=r"unknown config key 'placement.planner.mean_len'"):
        plan_for(*manual, "placement.planner={mean_len: 40}")
    with pytest.raises(KeyError, match=r"'placement\.planner\.mini_batch_size' \(the run states it: "
                                           r"optim\.actor\.mini_batches\)"):
        plan_for(*manual, "placement.planner={mini_batch_size: 4}")
    with pytest.raises(ValueError, match=r"'placement\.planner\.mean_response_len'=400 must be .* max_new_tokens=160"):
        plan_for(*manual, "placement.planner={mean_response_len: 400}")
    with pytest.raises(ValueError, match=r"'placement\.planner' is only read with placement\.mode=auto or manual"):
        load_config(None, ["placement.planner={mean_response_len: 40}"])


def test_host_cores_make_logical_gpus_share_the_machine():
    colocated = ["placement.mode=manual", "placement.cluster=3xCPU", "placement.meshes={actor: [0, 1, 2]}"]
    assert plan_for(*colocated, "placement.host_cores=2").step_time_s > plan_for(*colocated).step_time_s
    assert plan_for(*colocated, "placement.host_cores=3").step_time_s == plan_for(*colocated).step_time_s
    assert plan_for(*colocated, "placement.host_cores=auto").feasible  # this machine's cores
    with pytest.raises(ValueError, match=r"'placement\.host_cores'='auto' counts this machine's cores"):
        plan_for("placement.mode=auto", "placement.cluster=2xA100-80G", "placement.host_cores=auto")
    with pytest.raises(ValueError, match=r"'placement\.host_cores'=0 must be a positive integer, 'auto'"):
        load_config(None, ["placement.mode=auto", "placement.host_cores=0"])
    with pytest.raises(TypeError,
                       match=r"'placement\.host_cores'='many': must be a int, got str; or must be one of \['auto'\]"):
        load_config(None, ["placement.mode=auto", "placement.host_cores=many"])


def test_plan_cli_on_a_train_config_prints_the_plan_the_run_executes(tmp_path: Path, capsys):
    from hybridflow.cli import main
    from hybridflow.train.prepare import prepare_run

    path = tmp_path / "run.yaml"
    path.write_text("algorithm: {name: grpo, options: {n: 2, max_new_tokens: 8}}\n"
                    "placement: {mode: auto, cluster: 2xCPU}\ndata: {task: reverse, batch_size: 8}\n"
                    "optim: {actor: {micro_batch_size: 4}}\n")
    assert main(["plan", "--config", str(path), "--json"]) == 0
    printed = Plan.from_json(capsys.readouterr().out)
    expected = prepare_run(load_config(path)).plan
    assert [g.layouts for g in printed.groups] == [g.layouts for g in expected.groups]
    assert printed.layout("actor").micro_batch_size == 4
    assert main(["plan", "--config", str(path), "--cluster", "4xCPU"]) == 2
    assert "drop the other options ['cluster']" in capsys.readouterr().err
