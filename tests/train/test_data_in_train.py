"""``hybridflow train`` on files: verl parquet + math reward, TRL-style rewards, validation, trackers, retention."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.train.config import load_config
from hybridflow.train.loop import train

ROOT = Path(__file__).resolve().parents[2]
GSM8K = ROOT / "configs" / "data" / "gsm8k_style"
QUICK = ["model.sft_steps=3", "data.batch_size=4", "algorithm.options.n=2", "algorithm.options.max_new_tokens=4",
         "logging.progress=false", "logging.plot=false", "optim.actor.micro_batch_size=8"]
TRL_REWARD = '''
def length_penalty(prompts, completions, ground_truth, **columns):
    assert len(prompts) == len(completions) == len(ground_truth) == len(columns["data_source"])
    return [-0.01 * len(c if isinstance(c, str) else c[0]["content"]) for c in completions]
'''


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_verl_parquet_with_math_reward_validation_and_filtered_prompts(tmp_path: Path) -> None:
    reward_file = tmp_path / "rewards.py"
    reward_file.write_text(TRL_REWARD)
    result = train(load_config(None, [
        "algorithm=grpo", "steps=2", f"output_dir={tmp_path / 'run'}", f"data.path={GSM8K / 'train.parquet'}",
        f"data.val_path={GSM8K / 'test.parquet'}", "data.val_split=test", "data.max_prompt_length=160",
        f"data.reward=[math, {reward_file}:length_penalty]", "data.reward_weights=[1.0, 0.5]",
        "validation.every=1", "validation.samples=3", *QUICK]))
    first = result.history[0]
    # The example's prompts are 148..170 characters (tokens here): a 160-token limit drops some, and says how many.
    filtered = first["data/filtered_prompts"]
    assert 0 < filtered < 48 and first["data/train_prompts"] == 48 - filtered
    assert all("val/reward/mean" in row for row in result.history)
    # Two weighted functions: each one's own validation mean is reported, and the total is their weighted sum.
    assert first["val/reward/mean"] == pytest.approx(first["val/reward/math/mean"]
                                                     + 0.5 * first[f"val/reward/{reward_file}:length_penalty/mean"])
    samples = _rows(result.run_dir / "validation_samples.jsonl")
    assert len(samples) == 6 and {"step", "prompt", "response", "ground_truth", "reward"} <= set(samples[0])
    assert "####" in str(samples[0]["prompt"])  # the chat prompt went through the template, not str(list)


def test_data_path_without_reward_is_refused_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", f"data.path={GSM8K / 'train.parquet'}", f"output_dir={tmp_path}", *QUICK])
    assert code == 2 and "data.reward" in capsys.readouterr().err


def test_unknown_reward_lists_the_choices(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match=r"config key 'data\.reward'='maths' is neither a built-in reward.*math"):
        train(load_config(None, [f"data.path={GSM8K / 'train.parquet'}", "data.reward=maths", "steps=1",
                                 f"output_dir={tmp_path}", *QUICK]))


def test_keep_checkpoints_keeps_the_newest_with_their_hf_view(tmp_path: Path) -> None:
    train(load_config(None, ["steps=3", "checkpoint.every=1", "checkpoint.keep=2", f"output_dir={tmp_path}",
                             "data.num_examples=32", *QUICK]))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_000002", "step_000003"]
    for name in kept:
        assert (tmp_path / "checkpoints" / name / "hf" / "model.safetensors").is_file()
    assert (tmp_path / "final" / "generation_config.json").is_file()


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_optional_trackers_log_offline(tmp_path: Path, tracker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec(tracker) is None:
        pytest.skip(f"optional tracker {tracker} not installed (pip install {tracker})")
    for name in ("WANDB_MODE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(load_config(None, ["steps=2", f"output_dir={tmp_path}", "data.num_examples=32", "data.val_fraction=0.25",
                             "validation.every=2", f"logging.trackers=[jsonl, {tracker}]", *QUICK]))
    if tracker == "wandb":
        runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
        assert runs and runs[0].stat().st_size > 0
    else:
        import mlflow

        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
        run = client.search_runs([client.get_experiment_by_name("hybridflow").experiment_id])[0]
        history = client.get_metric_history(run.info.run_id, "reward/mean")
        assert [m.step for m in history] == [0, 1]
        assert "val/reward/mean" in run.data.metrics
        assert any(a.path == "validation_samples" for a in client.list_artifacts(run.info.run_id))


def test_unknown_tracker_is_named() -> None:
    with pytest.raises(ValueError, match=r"'logging\.trackers' has \['comet'\]"):
        load_config(None, ["logging.trackers=[comet]"])


@pytest.mark.slow
@pytest.mark.ray
def test_ray_run_validates_checkpoints_and_exports(tmp_path: Path) -> None:
    """Under Ray the policy's weights come back as an object reference; validation runs on the actors."""
    result = train(load_config(None, ["executor.name=ray", "steps=2", "checkpoint.every=1", "checkpoint.keep=1",
                                      f"output_dir={tmp_path}", "data.num_examples=32", "data.val_fraction=0.25",
                                      "validation.every=1", *QUICK]))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000002"]
    assert result.export_path is not None and (result.export_path / "model.safetensors").is_file()
    assert all(row["val/prompts"] == 8 for row in result.history)
