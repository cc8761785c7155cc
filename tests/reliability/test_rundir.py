"""Run directories: a fresh run refuses another run's directory, resume needs a checkpoint of the same
config and graph, a torn metrics line is repaired, config.json appears only once the run validated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.graph import load_graph
from hybridflow.train.config import load_config
from hybridflow.train.rundir import RunDirectoryError, begin_run, differing_keys, fingerprint, repair_metrics

QUICK = ["model.sft_steps=0", "data.batch_size=4", "data.num_examples=16", "algorithm.options.n=2",
         "algorithm.options.max_new_tokens=4", "logging.progress=false", "logging.plot=false", "logging.trackers=[]"]


def _train(tmp_path: Path, *args: str) -> int:
    return main(["train", f"output_dir={tmp_path / 'run'}", *QUICK, *args])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-step run with a checkpoint at step 2 (seed 0)."""
    root = tmp_path_factory.mktemp("finished")
    assert _train(root, "steps=2", "checkpoint.every=2") == 0
    return root / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, tmp_path / "run"))


def test_a_fresh_run_refuses_a_directory_holding_another_run(finished_run: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(finished_run, tmp_path)
    before = (run / "metrics.jsonl").read_text()
    assert _train(tmp_path, "steps=2", "seed=1") == 2
    err = capsys.readouterr().err
    assert "already holds a previous run" in err and "--resume" in err and "--overwrite" in err
    assert "Traceback" not in err
    assert (run / "metrics.jsonl").read_text() == before, "a refused run must not touch the old one"


def test_overwrite_replaces_the_previous_run(finished_run: Path, tmp_path: Path) -> None:
    run = _copy(finished_run, tmp_path)
    assert _train(tmp_path, "steps=1", "seed=1", "--overwrite") == 0
    assert not (run / "checkpoints").exists(), "the old run's checkpoints survived --overwrite"
    assert json.loads((run / "config.json").read_text())["seed"] == 1


def test_resume_with_another_seed_is_refused_naming_the_key(finished_run: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _copy(finished_run, tmp_path)
    assert _train(tmp_path, "steps=4", "seed=1", "--resume") == 2
    err = capsys.readouterr().err
    assert "seed: 0 -> 1" in err and "--allow-config-change" in err


def test_resume_from_with_allow_config_change_continues(finished_run: Path, tmp_path: Path) -> None:
    checkpoint = finished_run / "checkpoints" / "step_000002"
    assert main(["train", f"output_dir={tmp_path / 'other'}", *QUICK, "steps=3", "seed=1",
                 "--resume-from", str(checkpoint), "--allow-config-change"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "other" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2]


def test_resume_with_nothing_to_resume_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _train(tmp_path, "steps=2", "--resume") == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_resume_past_the_last_step_is_an_error(finished_run: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _copy(finished_run, tmp_path)
    assert _train(tmp_path, "steps=2", "--resume") == 2
    err = capsys.readouterr().err
    assert "nothing left to train" in err and "the run is finished" in err  # it ended with a checkpoint


def test_a_torn_metrics_line_is_repaired_and_reported(finished_run: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(finished_run, tmp_path)
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 2, "reward/me')  # a crash mid-write
    assert _train(tmp_path, "steps=3", "checkpoint.every=2", "--resume") == 0
    assert "dropped 1 torn line(s) (line 3)" in capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    assert (run / "checkpoints" / "step_000003").is_dir()  # the last step, though not a multiple of 2


def test_config_json_is_written_only_after_validation(finished_run: Path, tmp_path: Path) -> None:
    run = _copy(finished_run, tmp_path)
    before = (run / "config.json").read_text()
    assert _train(tmp_path, "steps=4", "--resume", "roles.nope.backend=torch") == 2
    assert (run / "config.json").read_text() == before
    assert _train(tmp_path / "fresh", "optim.actor.micro_batch_size=0") == 2
    assert not (tmp_path / "fresh" / "run" / "config.json").exists()


def test_resume_and_overwrite_together_are_refused(tmp_path: Path) -> None:
    config = load_config(None, QUICK)
    with pytest.raises(RunDirectoryError, match="contradict"):
        begin_run(tmp_path, config, load_graph("grpo"), resume=True, overwrite=True)


def test_overwrite_refuses_a_directory_of_other_files(tmp_path: Path) -> None:
    (tmp_path / "thesis.tex").write_text("years of work")
    with pytest.raises(RunDirectoryError, match=r"thesis\.tex"):
        begin_run(tmp_path, load_config(None, QUICK), load_graph("grpo"), overwrite=True)
    assert (tmp_path / "thesis.tex").exists()


def test_fingerprint_ignores_run_only_keys_and_names_changed_ones() -> None:
    graph = load_graph("grpo", n=2)
    base = fingerprint(load_config(None, QUICK), graph)
    same = fingerprint(load_config(None, [*QUICK, "steps=99", "executor.name=ray", "output_dir=elsewhere"]), graph)
    assert differing_keys(base, same) == []
    changed = fingerprint(load_config(None, [*QUICK, "optim.actor.lr=0.5", "algorithm.options.n=3"]),
                          load_graph("grpo", n=3))
    keys = [line.split(":")[0] for line in differing_keys(base, changed)]
    assert keys == ["algorithm.options.n", "graph", "optim.actor.lr"]


def test_repair_metrics_keeps_whole_rows(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n[1, 2]\n{"step": 1}\n{"ste')
    assert repair_metrics(path) == 2
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'


def test_the_latest_checkpoint_is_the_highest_step_not_the_last_name(tmp_path: Path) -> None:
    from hybridflow.train.checkpoint import latest_checkpoint

    for name in ("step_999999", "step_1000000", "step_notes", ".step_2000000.tmp"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        (tmp_path / "checkpoints" / name / "trainer.json").write_text("{}")
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step_1000000"


def test_the_last_step_is_checkpointed() -> None:
    """So --resume of a finished run finds it finished (above) instead of training its last steps again; the
    torn-metrics test above resumes a 3-step run with checkpoint_every=2 through that path."""
    from hybridflow.train.loop import checkpoint_due

    config = load_config(None, [*QUICK, "steps=5", "checkpoint.every=2"])
    assert [step for step in range(5) if checkpoint_due(step, config)] == [1, 3, 4]
    assert not any(checkpoint_due(step, load_config(None, [*QUICK, "steps=5"])) for step in range(5))


def test_overwrite_accepts_the_folders_the_trackers_wrote(tmp_path: Path) -> None:
    for name in ("wandb", "mlruns", "checkpoints"):
        (tmp_path / name / "inner").mkdir(parents=True)
    (tmp_path / "config.json").write_text("{}")
    begin_run(tmp_path, load_config(None, QUICK), load_graph("grpo"), overwrite=True)
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "mlruns").exists()


def test_the_summary_names_tensorboard_only_when_it_is_on(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from hybridflow.cli.train import summary

    result = SimpleNamespace(history=[{"reward/mean": 0.5}], start_step=0, metrics_path=tmp_path / "metrics.jsonl",
                             run_dir=tmp_path, curve_path=None, report_path=None, export_path=None)
    assert not any("tensorboard" in line for line in summary(result, load_config(None, QUICK)))
    on = summary(result, load_config(None, [*QUICK, "logging.trackers=[tensorboard]"]))
    assert any(line.startswith("tensorboard:") for line in on)
