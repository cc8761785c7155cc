"""``hybridflow report``: statistics come from the run's metrics, plots are real PNG files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.graph import Workload, load_graph
from hybridflow.monitor import plot_run, summarize
from hybridflow.monitor.report import planned_spans
from hybridflow.planner import Cluster, ModelSpec
from hybridflow.planner.manual import evaluate_mapping
from hybridflow.planner.request import PlanRequest


def write_run(run_dir: Path, rows: list[dict[str, float]]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run_dir


ROWS = [
    {"step": 0, "reward/mean": 0.1, "time/step": 2.0, "time/actor_generate": 1.5, "throughput/tokens_per_s": 100.0,
     "memory/rss_gb": 1.0, "reward_cache/hit_rate": 0.0},
    {"step": 1, "reward/mean": 0.3, "time/step": 1.0, "time/actor_generate": 0.5, "throughput/tokens_per_s": 300.0,
     "memory/rss_gb": 1.5, "reward_cache/hit_rate": 0.5},
    {"step": 2, "reward/mean": 0.5, "time/step": 1.5, "time/actor_generate": 1.0, "throughput/tokens_per_s": 200.0,
     "memory/rss_gb": 1.2, "reward_cache/hit_rate": 1.0, "kl": float("nan")},
]


def test_summary_statistics_follow_the_rows(tmp_path: Path):
    summary = summarize(write_run(tmp_path / "run", ROWS))
    reward = summary.get("reward/mean")
    assert (reward.first, reward.last, reward.minimum, reward.maximum) == (0.1, 0.5, 0.1, 0.5)
    assert reward.mean == pytest.approx(0.3)
    assert summary.steps == 3
    assert [m.name for m in summary.metrics][:2] == ["reward/mean", "time/step"]  # headline metrics first
    with pytest.raises(KeyError, match="kl"):  # only NaN: no statistics to show
        summary.get("kl")


def test_plots_are_png_files(tmp_path: Path):
    written = plot_run(write_run(tmp_path / "run", ROWS))
    # kl holds only NaN: no panel for it; the reward cache gets its own 0..1 axis.
    assert {p.name for p in written} == {"reward.png", "node_time.png", "throughput.png", "memory.png",
                                         "reward_cache.png"}
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_with_spans_gets_its_median_steps_timeline(tmp_path: Path):
    rows = [{**row, "timeline/actor_generate/start_s": 0.0, "timeline/actor_generate/end_s": row["time/actor_generate"]}
            for row in ROWS]
    written = plot_run(write_run(tmp_path / "run", rows))
    assert written[-1].name == "timeline.png" and written[-1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert planned_spans(tmp_path / "run") == {}  # no plan.json: the measured spans alone


def test_the_plans_spans_come_from_plan_json(tmp_path: Path):
    graph = load_graph("grpo", reward_kind="reward_function")
    models = {role: ModelSpec.preset("tiny-qwen2") for role in ("actor", "reference")}
    plan = evaluate_mapping(PlanRequest(graph, models, Workload(batch_size=8, prompt_len=8, response_len=8),
                                        Cluster.parse("2xCPU")), {"actor": [0], "reference": [1]})
    run_dir = write_run(tmp_path / "run", ROWS)
    (run_dir / "plan.json").write_text(plan.to_json())
    spans = planned_spans(run_dir)
    assert spans == {node.node: (node.start_s, node.end_s) for node in plan.nodes}
    assert spans["reference_ref_logprob"][0] >= spans["actor_generate"][1]  # it waits for the responses


@pytest.mark.parametrize("text", ["{not json", '{"algorithm": "grpo"}', "[1, 2]"])
def test_an_unreadable_plan_is_named_and_the_timeline_drawn_without_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str):
    rows = [{**row, "timeline/actor_generate/start_s": 0.0, "timeline/actor_generate/end_s": 0.5} for row in ROWS]
    run_dir = write_run(tmp_path / "run", rows)
    (run_dir / "plan.json").write_text(text)
    assert planned_spans(run_dir) == {}
    assert f"{run_dir / 'plan.json'} is not a readable plan" in capsys.readouterr().err
    assert plot_run(run_dir)[-1].name == "timeline.png"


def test_cli_prints_table_and_fails_clearly_without_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run_dir = write_run(tmp_path / "run", ROWS)
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "reward/mean" in out and "wrote" in out and (run_dir / "report.html").is_file()
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_weight_sync_is_listed_and_plotted_beside_the_plans_estimate(tmp_path: Path):
    rows = [{**row, "zeta/other": 1.0, "actor/weight_sync/seconds": 0.1 * (i + 1), "weight_sync/planned_seconds": 0.2,
             "actor/weight_sync/bytes": 8.0, "weight_sync/planned_bytes": 8.0} for i, row in enumerate(ROWS)]
    run_dir = write_run(tmp_path / "run", rows)
    names = [m.name for m in summarize(run_dir).metrics]
    assert names.index("actor/weight_sync/seconds") < names.index("zeta/other")
    assert names.index("weight_sync/planned_seconds") == names.index("actor/weight_sync/seconds") + 1
    assert "weight_sync.png" in {p.name for p in plot_run(run_dir)}
