"""``hybridflow init`` writes a shipped config that loads, and the data files a template names next to it; the
shipped configs and their data are package data."""

from __future__ import annotations

import importlib.resources
import sys
import tomllib
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hybridflow.cli import main
from hybridflow.cli.init import template_data, templates, write_template
from hybridflow.data import load_records
from hybridflow.train.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs" / "data" / "gsm8k_style"


def test_init_writes_a_starter_config_that_loads(tmp_path: Path) -> None:
    out = tmp_path / "hybridflow.yaml"
    assert main(["init", str(out)]) == 0
    assert isinstance(load_config(out), TrainConfig)
    assert main(["init", str(out)]) != 0, "an existing file is not overwritten without --force"
    assert main(["init", str(out), "--template", "grpo_gsm8k_style", "--force"]) == 0
    assert load_config(out).data.reward == "math"


def test_a_template_s_data_is_written_next_to_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run" / "my_run.yaml"
    assert main(["init", str(out), "--template", "grpo_gsm8k_style"]) == 0
    monkeypatch.chdir(tmp_path)  # the paths hold from another directory than the config's
    data = load_config(out).data
    assert data.path == str(tmp_path / "run" / "data" / "gsm8k_style" / "train.parquet")
    assert data.val_path == str(tmp_path / "run" / "data" / "gsm8k_style" / "test.parquet")
    for written, split, rows in ((data.path, "train", 48), (data.val_path, "test", 16)):
        assert pq.read_table(written).to_pylist() == pq.read_table(SHIPPED / f"{split}.parquet").to_pylist()
        records = load_records(written)
        assert len(records) == rows and records[0]["data_source"] == "gsm8k_style" and records[0]["ground_truth"]
    assert "configs/data/gsm8k_style/t" not in out.read_text() and f"--config {out}" in out.read_text()


def test_existing_data_files_are_never_overwritten_without_force(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    first = tmp_path / "a.yaml"
    assert main(["init", str(first), "--template", "grpo_gsm8k_style"]) == 0
    # An identical copy is kept: a second config in the same folder shares it.
    assert main(["init", str(tmp_path / "b.yaml"), "--template", "grpo_gsm8k_style"]) == 0
    train = tmp_path / "data" / "gsm8k_style" / "train.parquet"
    train.write_bytes(b"my own rows")
    capsys.readouterr()
    assert main(["init", str(tmp_path / "c.yaml"), "--template", "grpo_gsm8k_style"]) != 0
    err = capsys.readouterr().err
    assert str(train) in err and "--force" in err
    assert train.read_bytes() == b"my own rows" and not (tmp_path / "c.yaml").exists(), "nothing was written"
    assert main(["init", str(tmp_path / "c.yaml"), "--template", "grpo_gsm8k_style", "--force"]) == 0
    assert train.read_bytes() == (SHIPPED / "train.parquet").read_bytes()


def test_init_reads_the_installed_package_through_importlib_resources(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed ``hybridflow.configs`` may be a zip (no file system paths): read it as package resources."""
    archive = tmp_path / "site.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("shipped_configs/__init__.py", "")
        for path in (ROOT / "configs").rglob("*"):
            if path.is_file() and path.suffix in {".yaml", ".parquet"}:
                zf.write(path, f"shipped_configs/{path.relative_to(ROOT / 'configs').as_posix()}")
    monkeypatch.syspath_prepend(str(archive))
    root = importlib.resources.files("shipped_configs")
    assert not isinstance(root, Path)
    assert set(templates(root)) == set(templates())
    out = tmp_path / "elsewhere" / "cfg.yaml"
    written = write_template("grpo_gsm8k_style", out, root=root)
    assert [p.name for p in written] == ["train.parquet", "test.parquet"]
    assert load_config(out).data.path == str(written[0]) and len(load_records(written[0])) == 48
    sys.modules.pop("shipped_configs", None)


def test_unknown_template_lists_the_shipped_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init", str(tmp_path / "x.yaml"), "--template", "nope"]) == 2
    assert "grpo_reverse" in capsys.readouterr().err


def test_every_config_in_the_folder_ships_with_its_data() -> None:
    assert set(templates()) == {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert '_mapped("configs")' in (ROOT / "setup.py").read_text()
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    configs = ROOT / "configs"
    shipped = {p for pattern in patterns["hybridflow.configs"] for p in configs.glob(pattern)}
    files = {p for p in configs.rglob("*") if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts}
    assert files and files <= shipped, f"not package data: {sorted(map(str, files - shipped))}"
    for name, text in templates().items():
        for entry in template_data(text):  # a template's data lives in configs/, and a checkout runs it as is
            assert (ROOT / entry).is_file(), f"{name}: {entry}"
    assert template_data(templates()["grpo_gsm8k_style"]) == ["configs/data/gsm8k_style/train.parquet",
                                                             "configs/data/gsm8k_style/test.parquet"]
