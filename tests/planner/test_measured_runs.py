"""A hybridflow train run directory (plan.json + metrics.jsonl) as a calibration case."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hybridflow.cli import main
from hybridflow.graph import Workload, load_graph
from hybridflow.planner import Cluster, ModelSpec, evaluate_mapping
from hybridflow.planner.calibration import Calibration, Constants
from hybridflow.planner.measured import case_from_run, measured_node_times
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.settings import RunSettings

TRUTH = replace(Constants(), train_mfu=0.3)
INPUTS = {"algorithm": "grpo", "reward_kind": "reward_function", "cluster": "2xCPU", "models": {"*": "tiny"},
          "batch_size": 16, "prompt_len": 32, "response_len": 32, "n_samples": 4}


def write_run(folder, *, skipped_step_seconds: float = 99.0) -> dict[str, float]:
    """A run as `hybridflow train` leaves it, its node times made by the model under ``TRUTH``."""
    graph = load_graph("grpo", reward_kind="reward_function")
    models = {role: ModelSpec.preset("tiny") for role in ("actor", "reference")}
    workload = Workload(batch_size=16, prompt_len=32, response_len=32, n_samples=4)
    cluster = Cluster.parse("2xCPU")
    plan = evaluate_mapping(PlanRequest(graph, models, workload, cluster, calibration=Calibration(default=TRUTH)),
                            {"actor": (0, 1), "reference": (0, 1)})
    folder.mkdir()
    (folder / "plan.json").write_text(plan.to_json())
    times = {f"time/{node.node}": node.seconds for node in plan.nodes} | {"time/step": plan.step_time_s}
    warm_up = {key: skipped_step_seconds for key in times}
    lines = [json.dumps({"step": 0, **warm_up}), json.dumps({"step": 1, **times}), json.dumps({"step": 2, **times})]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "plan_inputs.yaml").write_text(json.dumps(INPUTS))  # JSON is YAML
    return {key.removeprefix("time/"): value for key, value in times.items()}


def test_node_times_skip_warm_up_steps(tmp_path):
    expected = write_run(tmp_path / "run")
    measured = measured_node_times(tmp_path / "run" / "metrics.jsonl", skip_steps=1)
    assert measured["step"] == pytest.approx(expected["step"])
    with pytest.raises(ValueError, match="need more than skip_steps=3"):
        measured_node_times(tmp_path / "run" / "metrics.jsonl", skip_steps=3)


def test_a_run_recosted_with_its_own_layouts_matches_under_the_true_constants(tmp_path):
    write_run(tmp_path / "run")
    graph = load_graph("grpo", reward_kind="reward_function")
    models = {role: ModelSpec.preset("tiny") for role in ("actor", "reference")}
    case = case_from_run(tmp_path / "run", graph=graph, models=models, cluster=Cluster.parse("2xCPU"),
                         workload=Workload(batch_size=16, prompt_len=32, response_len=32, n_samples=4),
                         settings=RunSettings())
    assert case.worst_ratio(Calibration(default=TRUTH)) == pytest.approx(1.0)
    assert case.worst_ratio(Calibration()) > 1.2


def test_calibrate_from_a_run_directory_recovers_the_constant(tmp_path, capsys):
    write_run(tmp_path / "run")
    out = tmp_path / "calibration.json"
    assert main(["calibrate", "--run", str(tmp_path / "run"), "--fit", "train_mfu", "--out", str(out)]) == 0
    assert Calibration.load(out).default.train_mfu == pytest.approx(0.3, rel=0.02)
    assert main(["calibrate", "--run", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "no planner inputs" in capsys.readouterr().err


def test_calibrate_from_a_train_run_directory_alone_reads_its_config_plan_and_lengths(tmp_path, capsys):
    from dataclasses import asdict

    from hybridflow.planner.lengths import LengthDistribution
    from hybridflow.train import placement, setup
    from hybridflow.train.config import load_config

    config = load_config(None, ["algorithm=grpo", "placement.num_gpus=2", "data.batch_size=8",
                                "data.max_prompt_length=24"])
    graph = setup.build_graph(config)
    lengths = LengthDistribution.from_lengths([8, 12, 20, 32])  # what from_metrics makes of mean 18, max 32
    truth = RunSettings(lengths=LengthDistribution.lognormal(mean=18, max=32))
    plan = evaluate_mapping(PlanRequest(graph, placement.role_models(config, graph),
                                        placement.workload(config, graph, 24, truth), placement.planner_cluster(config),
                                        settings=truth, calibration=Calibration(default=TRUTH)),
                            {"actor": (0, 1), "reference": (0, 1)})
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(asdict(config)))
    (folder / "plan.json").write_text(plan.to_json())
    times = {f"time/{node.node}": node.seconds for node in plan.nodes} | {"time/step": plan.step_time_s}
    rows = [{"step": step, "response_length/mean": lengths.mean, "response_length/max": lengths.max, **times}
            for step in range(3)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "calibration.json"
    assert main(["calibrate", "--run", str(folder), "--fit", "train_mfu", "--out", str(out)]) == 0
    assert Calibration.load(out).default.train_mfu == pytest.approx(0.3, rel=0.02)
    assert "1.00x" in capsys.readouterr().out  # re-costed exactly as planned, after the fit
