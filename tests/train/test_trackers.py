"""Trackers: tables as markdown, a missing optional package named with its install line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridflow.train.trackers import make_trackers, markdown_table


def test_markdown_table_escapes_cells() -> None:
    text = markdown_table([{"prompt": "a|b", "response": "x\ny", "reward": 1.0}])
    assert text.splitlines() == ["| prompt | response | reward |", "|---|---|---|", "| a\\|b | x\\ny | 1.0 |"]
    assert markdown_table([]) == "(no rows)"


def test_a_missing_tracker_package_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # a None entry makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match=r"pip install wandb \(or drop wandb from logging\.trackers\)"):
        make_trackers(["jsonl", "wandb"], tmp_path, name="run", config={})


def test_jsonl_alone_adds_no_tracker(tmp_path: Path) -> None:
    assert make_trackers(["jsonl"], tmp_path, name="run", config={}) == []
