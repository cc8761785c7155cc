"""``hybridflow train``: metrics, curve and checkpoints are written; resuming reproduces the same steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.train.checkpoint import latest_checkpoint
from hybridflow.train.config import load_config
from hybridflow.train.loop import train

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "grpo_reverse.yaml"
QUICK = ["model.sft_steps=5", "data.batch_size=4", "data.num_examples=64", "algorithm.options.n=2",
         "algorithm.options.max_new_tokens=6", "logging.progress=false", "logging.plot=false"]
TIMING_KEYS = ("time/", "timeline/", "memory/", "throughput/")


def _deterministic(row: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_KEYS)}


def test_cli_trains_and_reports_where_outputs_are(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--config", str(CONFIG), "steps=2", f"output_dir={tmp_path}", *QUICK,
                 "logging.plot=true"])
    out = capsys.readouterr().out
    assert code == 0 and "metrics:" in out and "final model:" in out and "report:" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for key in ("reward/mean", "reward/std", "actor/entropy", "actor/clipfrac", "response_length/mean",
                "response_length/max", "time/actor_generate", "throughput/tokens_per_s", "memory/rss_gb",
                "data/filtered_prompts"):
        assert key in rows[0], key
    # The config's kl_coef is 0: nothing reads a reference, which is neither built nor run, so there is no KL.
    assert "kl" not in rows[0] and "time/reference_ref_logprob" not in rows[0]
    assert (tmp_path / "plots" / "reward.png").stat().st_size > 1000
    assert "data:image/png;base64," in (tmp_path / "report.html").read_text()
    assert (tmp_path / "final" / "model.safetensors").is_file()  # exported although checkpoint_every is 0
    assert any((tmp_path / "tensorboard").iterdir())


def test_cli_reports_a_bad_config_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--config", str(CONFIG), "actor.learning_rate=1"]) == 2
    assert "actor.learning_rate" in capsys.readouterr().err


def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    full = train(load_config(CONFIG, ["steps=4", "checkpoint.every=2", f"output_dir={tmp_path / 'full'}", *QUICK]))
    part_dir = tmp_path / "part"
    train(load_config(CONFIG, ["steps=2", "checkpoint.every=2", f"output_dir={part_dir}", *QUICK]))
    checkpoint = latest_checkpoint(part_dir)
    assert checkpoint is not None and checkpoint.name == "step_000002"
    assert not list((part_dir / "checkpoints").glob(".*.tmp")), "a temporary checkpoint dir was left behind"
    resumed = train(load_config(CONFIG, ["steps=4", "checkpoint.every=2", f"output_dir={part_dir}", *QUICK]),
                    resume=True)
    assert resumed.start_step == 2 and [h["step"] for h in resumed.history] == [2, 3]
    assert [_deterministic(h) for h in resumed.history] == [_deterministic(h) for h in full.history[2:]]
    steps_on_disk = [json.loads(line)["step"] for line in resumed.metrics_path.read_text().splitlines()]
    assert steps_on_disk == [0, 1, 2, 3]
