"""``hybridflow init`` writes a shipped config that loads; the shipped configs are package data."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.cli.init import templates
from hybridflow.train.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_init_writes_a_starter_config_that_loads(tmp_path: Path) -> None:
    out = tmp_path / "hybridflow.yaml"
    assert main(["init", str(out)]) == 0
    assert isinstance(load_config(out), TrainConfig)
    assert main(["init", str(out)]) != 0, "an existing file is not overwritten without --force"
    assert main(["init", str(out), "--template", "grpo_gsm8k_style", "--force"]) == 0
    assert load_config(out).data.reward == "math"


def test_unknown_template_lists_the_shipped_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init", str(tmp_path / "x.yaml"), "--template", "nope"]) == 2
    assert "grpo_reverse" in capsys.readouterr().err


def test_every_config_in_the_folder_ships() -> None:
    assert set(templates()) == {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert '"hybridflow.configs" = ["*.yaml"]' in (ROOT / "pyproject.toml").read_text()
    assert '_mapped("configs")' in (ROOT / "setup.py").read_text()
