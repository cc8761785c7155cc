"""``hybridflow export`` (and ``SingleController.save``) never delete what they did not write.

OUT must be absent, empty, or a previous export (``--overwrite``); it may not be the checkpoint, hold it, or
lie inside its run's checkpoints. Every refusal happens before anything is written, and leaves OUT as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.train.config import load_config
from hybridflow.train.export import EXPORT_MARKER, ExportTargetError, check_export_target, write_dir_atomically
from hybridflow.train.loop import train

QUICK = ["model.sft_steps=3", "data.batch_size=4", "data.num_examples=32", "algorithm.options.n=2",
         "algorithm.options.max_new_tokens=4", "logging.progress=false", "logging.plot=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step torch run with a checkpoint (``checkpoints/step_000001``) and its final export."""
    run = tmp_path_factory.mktemp("export_target") / "run"
    train(load_config(None, ["steps=1", "checkpoint.every=1", f"output_dir={run}", *QUICK]))
    return run


def _listing(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def test_export_into_the_run_directory_is_refused_and_the_run_is_intact(
        run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = run / "checkpoints" / "step_000001"
    before = _listing(run)
    for out in (run, checkpoint, checkpoint / "hf", run / "checkpoints", run / "checkpoints" / "new"):
        assert main(["export", str(checkpoint), str(out), "--overwrite"]) == 2, out
        assert str(out) in capsys.readouterr().err
    assert _listing(run) == before


def test_export_into_a_directory_of_user_files_is_refused(run: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for flags in ([], ["--overwrite"]):
        assert main(["export", str(run / "checkpoints" / "step_000001"), str(mine), *flags]) == 2
        assert "export did not write" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep me" and _listing(mine) == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    assert main(["export", str(run / "checkpoints" / "step_000001"), str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_a_previous_export_is_replaced_only_with_overwrite(run: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint, out = run / "checkpoints" / "step_000001", tmp_path / "out"
    out.mkdir()  # an empty directory is as good as an absent one
    assert main(["export", str(checkpoint), str(out)]) == 0
    assert (out / EXPORT_MARKER).is_file() and (out / "model.safetensors").is_file()
    assert main(["export", str(checkpoint), str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["export", str(checkpoint), str(out), "--overwrite"]) == 0
    # The run's own final export is a previous export too: replaced with --overwrite, never silently.
    assert main(["export", str(checkpoint), str(run / "final")]) == 2
    capsys.readouterr()


def test_check_export_target_judges_paths_without_a_run(tmp_path: Path) -> None:
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    check_export_target(tmp_path / "elsewhere", checkpoint, overwrite=False)  # absent: fine
    check_export_target(tmp_path / "run" / "final", checkpoint, overwrite=False)  # beside the checkpoints: fine
    for out in (tmp_path, tmp_path / "run", checkpoint, checkpoint / "actor", tmp_path / "run" / "checkpoints" / "x"):
        with pytest.raises(ExportTargetError):
            check_export_target(out, checkpoint, overwrite=True)
    loose = tmp_path / "loose_checkpoint"  # a checkpoint folder copied out of its run
    loose.mkdir()
    with pytest.raises(ExportTargetError, match="checkpoints"):
        check_export_target(loose / "out", loose, overwrite=False)


def test_write_dir_atomically_refuses_to_replace_what_no_export_wrote(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.bin").write_bytes(b"1")
    with pytest.raises(ExportTargetError, match=EXPORT_MARKER):
        write_dir_atomically(out, lambda tmp: (tmp / EXPORT_MARKER).write_text("{}"))
    assert (out / "data.bin").read_bytes() == b"1"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary left behind


def test_calibrate_and_report_replace_only_files_they_wrote(run: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    assert main(["calibrate", "--run", str(run), "--out", str(notes)]) == 2
    assert "--out" in capsys.readouterr().err and notes.read_text() == '{"mine": true}'
    assert main(["calibrate", "--run", str(run), "--out", str(tmp_path)]) == 2
    metrics = (run / "metrics.jsonl").read_text()
    assert main(["report", str(run), "--html", str(run / "metrics.jsonl")]) == 2
    assert "--html" in capsys.readouterr().err and (run / "metrics.jsonl").read_text() == metrics
    assert main(["report", str(run), "--html", str(tmp_path / "page.html")]) == 0
    assert main(["report", str(run), "--html", str(tmp_path / "page.html")]) == 0  # its own page: replaced
