"""Bad `hybridflow plan` input, as a user types it: one line (exit 2) naming the flag or the file as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.planner import ModelSpec

BASE = ["plan", "--cluster", "8xA100-80G"]


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0].removeprefix("hybridflow plan: error: ")


@pytest.mark.parametrize(("flags", "start"), [
    (["--model", "nan"], "--model nan: 'nan' is not a model name or size"),
    (["--model", "inf"], "--model inf: 'inf' is not a model name or size"),
    (["--model=-7e9"], "--model -7e9: '-7e9' is not a model name or size"),
    (["--model", "actor=nan", "--model", "llama3-8b"], "--model actor=nan: 'nan' is not a model name or size"),
    (["--model", "1e300"], "--model 1e300: a model of 1e+300 weights"),
    (["--model", "llama9"], "--model llama9: unknown model preset 'llama9'; presets: "),
    (["--model", "llama3-8b", "--batch-size", "-5"], "--batch-size=-5 must be at least 1 and at most 4194304"),
    (["--model", "llama3-8b", "--response-len", str(10**14)], "--response-len=100000000000000 must be at least 1 "
                                                               "and at most 1048576"),
    (["--model", "llama3-8b", "--max-tp", "0"], "--max-tp=0 must be at least 1"),
    (["--model", "llama3-8b", "--gpu-memory-utilization", "nan"], "--gpu-memory-utilization=nan must be a finite "
                                                                  "number in (0, 1]"),
])
def test_a_bad_flag_value_is_named_by_its_flag(flags: list[str], start: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    line = _error([*BASE, *flags], capsys)
    assert line.startswith(start), line
    if "not a model name" in start:
        assert "known: [" in line and "llama3-8b" in line


def test_a_bad_value_in_the_config_file_is_named_by_the_file_and_key(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "plan.yaml"
    config.write_text("cluster: 8xA100-80G\nbatch_size: 0\nmodels: {'*': llama3-8b}\n")
    assert _error(["plan", "--config", str(config)], capsys) == f"{config}: batch_size=0 must be at least 1 and at " \
                                                                "most 4194304"
    config.write_text("cluster: 8xA100-80G\nmodels: {actor: nan, '*': llama3-8b}\n")
    assert _error(["plan", "--config", str(config)], capsys).startswith(f"{config}: models.actor=nan: 'nan' is not")


def test_a_file_that_does_not_parse_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes: [\n")
    assert _error([*BASE[:1], "--cluster", str(broken), "--model", "llama3-8b"], capsys).startswith(
        f"cluster file '{broken}' is not valid YAML: line 2, column 1: ")
    assert _error([*BASE, "--config", str(broken), "--model", "llama3-8b"], capsys).startswith(
        f"--config '{broken}' is not valid YAML: line 2")
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    line = _error([*BASE, "--model", str(tmp_path)], capsys)
    assert line.startswith(f"--model {tmp_path}: model config '{tmp_path / 'config.json'}' is not valid JSON: line 1")


def test_model_spec_parse_refuses_non_finite_and_absurd_counts() -> None:
    for text in ("nan", "inf", "0", "-1B"):
        with pytest.raises(ValueError, match="is not a model name or size"):
            ModelSpec.parse(text)
    with pytest.raises(ValueError, match=r"must be positive and at most 1e\+16"):
        ModelSpec.parse("1e17")
    assert ModelSpec.parse("7e9").params == 7_000_000_000
