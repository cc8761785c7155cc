"""docs/migrating.md followed as written: its files and commands train on the verl parquet with a TRL reward,
export, and load in transformers (vLLM in the export tests)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "migrating.md").read_text()
FAST = ["model.sft_steps=3", "logging.progress=false"]  # only speed: every other setting is the doc's


def _files() -> dict[str, str]:
    return dict(re.findall(r"<!-- file: (\S+) -->\n```python\n(.*?)```", DOC, re.DOTALL))


def _commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC, re.DOTALL)
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()
            if line.startswith(("hybridflow init", "hybridflow train", "hybridflow export"))]


@pytest.mark.slow
def test_the_walkthrough_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no clone here: ``init`` writes the data the config names
    for name, text in _files().items():
        (tmp_path / name).write_text(text)
    commands = _commands()
    assert [c[1] for c in commands] == ["init", "train", "export"]
    for command in commands:
        extra = FAST if command[1] == "train" else []
        assert main([*command[1:], *extra]) == 0, command
    run = tmp_path / "runs" / "gsm8k"
    assert (run / "final" / "model.safetensors").is_file() and (run / "step20_hf" / "model.safetensors").is_file()
    assert (run / "validation_samples.jsonl").stat().st_size > 0 and (run / "report.html").is_file()
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    loaded = subprocess.run([sys.executable, "load_export.py", str(run / "final")], capture_output=True, text=True,
                            env=env, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert "What is 2 + 3?" in loaded.stdout  # the built-in char tokenizer keeps its spaces (load_tokenizer)


def test_the_walkthrough_s_init_writes_the_data_its_train_command_reads(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast half of the walkthrough: ``init`` into a folder without a clone, the ``train`` command's config
    and overrides load, and its data files are there (and stay found from another directory)."""
    from hybridflow.data import load_records
    from hybridflow.train.config import load_config

    monkeypatch.chdir(tmp_path)
    init, train = _commands()[:2]
    assert main(init[1:]) == 0
    assert train[2] == "--config"
    config = load_config(train[3], train[4:])
    monkeypatch.chdir(ROOT)
    assert isinstance(config.data.path, str) and isinstance(config.data.val_path, str)
    assert Path(config.data.path).is_relative_to(tmp_path) and Path(config.data.val_path).is_relative_to(tmp_path)
    assert len(load_records(config.data.path)) == 48 and len(load_records(config.data.val_path)) == 16


def test_the_load_example_guards_its_vllm_start() -> None:
    """vLLM's engine processes import the script again: everything runs under the ``__main__`` guard."""
    import ast

    tree = ast.parse(_files()["load_export.py"])
    top = [node for node in tree.body if not isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef)]
    assert len(top) == 1 and isinstance(top[0], ast.If) and "__main__" in ast.unparse(top[0].test)
