"""TRL's data habits: None rewards, prompt-only and chat ``messages`` rows, lists of files, per-function means."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridflow.data import load_reward_functions
from hybridflow.data.dataset import load_records
from hybridflow.data.reward_functions import Sample
from hybridflow.data.rewards import RewardScorer
from hybridflow.data.sources import MissingColumnError
from hybridflow.data.splits import DataSpec, load_splits
from hybridflow.runtime.errors import RewardFunctionError


def _samples(*sources: str) -> list[Sample]:
    return [Sample(index=i, prompt="p", prompt_text="p", response=f"r{i}", ground_truth="", data_source=s)
            for i, s in enumerate(sources)]


def math_only(prompts: list[Any], completions: list[Any], data_source: list[str], **_: Any) -> list[float | None]:
    return [1.0 if s == "math" else None for s in data_source]


def code_only(prompts: list[Any], completions: list[Any], data_source: list[str], **_: Any) -> list[float | None]:
    return [0.5 if s == "code" else None for s in data_source]


def test_a_none_reward_is_skipped_for_that_function_only() -> None:
    scorer = RewardScorer(rewards=load_reward_functions([math_only, code_only], weights=[2.0, 4.0]), tokenizer=None)
    total, parts = scorer.score(_samples("math", "code", "math"))
    assert total == [2.0, 2.0, 2.0] and parts["math_only"] == [1.0, None, 1.0]
    assert scorer.drain_means() == {"reward/math_only/mean": 1.0, "reward/code_only/mean": 0.5}
    assert scorer.drain_means() == {}
    scorer.score(_samples("math"), track=False)
    assert scorer.drain_means() == {}
    with pytest.raises(RewardFunctionError, match=r"every reward function \(\['math_only', 'code_only'\]\) returned "
                                                  r"None for sample 1") as caught:
        scorer.score(_samples("math", "prose"))
    assert caught.value.sample == 1


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_prompt_only_and_messages_rows(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "hi"}]
    records = load_records(_jsonl(tmp_path / "a.jsonl", [{"messages": chat, "topic": "x"}, {"prompt": "yo"}]))
    assert records == [{"prompt": chat, "ground_truth": "", "topic": "x"}, {"prompt": "yo", "ground_truth": ""}]
    mixed = _jsonl(tmp_path / "m.jsonl", [{"prompt": "a", "ground_truth": "1"}, {"prompt": "b"}])
    with pytest.raises(MissingColumnError, match=r"m.jsonl line 2: .*though other rows have one"):
        load_records(mixed)


def test_lists_of_train_and_validation_files(tmp_path: Path) -> None:
    first = _jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "ground_truth": "1"}])
    second = _jsonl(tmp_path / "b.jsonl", [{"prompt": "b", "ground_truth": "2"}, {"prompt": "c", "ground_truth": "3"}])
    splits = load_splits(DataSpec(path=[first, second], val_path=[second]))
    assert [r["prompt"] for r in splits.train] == ["a", "b", "c"] and len(splits.validation) == 2
    with pytest.raises(FileNotFoundError, match=r"^path\[1\]: no file"):
        load_splits(DataSpec(path=[first, str(tmp_path / "missing.jsonl")]))
    with pytest.raises(ValueError, match="empty list"):
        load_splits(DataSpec(path=[]))
