"""Built-in tasks, rule rewards and prompt files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from hybridflow.data import TASKS, PromptLoader, char_accuracy, char_tokenizer, load_records, task_examples


@pytest.mark.parametrize("name", ["reverse", "sort", "arithmetic"])
def test_tasks_reward_the_answer_fully_and_a_wrong_one_less(name: str) -> None:
    task = TASKS.get(name)
    prompt, answer = task.make_example(random.Random(0))
    assert prompt.endswith("=") and task.reward(answer, answer) == 1.0
    assert task.reward("x" + answer[1:], answer) < 1.0 and task.reward("", answer) == 0.0
    assert len(answer) <= task.max_answer_chars


def test_examples_are_reproducible_and_answers_are_right() -> None:
    assert task_examples("sort", 5, seed=3) == task_examples("sort", 5, seed=3)
    for record in task_examples("reverse", 20):
        assert record["ground_truth"] == record["prompt"][4:-1][::-1]
    for record in task_examples("arithmetic", 20):
        a, b = record["prompt"][:-1].split("+")
        assert int(record["ground_truth"]) == int(a) + int(b)


def test_char_accuracy_gives_partial_credit_by_position() -> None:
    assert char_accuracy("abcd", "abce") == 0.75
    assert char_accuracy("ab", "abcd") == 0.5


def test_unknown_task_lists_the_valid_ones() -> None:
    with pytest.raises(KeyError, match="reverse"):
        TASKS.get("chess")


def test_prompts_from_jsonl_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"rev {w}=", "ground_truth": w[::-1]} for w in ("abc", "hgf", "dead")]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    assert load_records(tmp_path / "p.jsonl") == rows == load_records(tmp_path / "p.parquet")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(KeyError, match="'prompt' column"):
        load_records(tmp_path / "bad.jsonl")


def test_loader_batches_depend_only_on_the_step() -> None:
    records = task_examples("reverse", 40)
    loader = PromptLoader(records=records, tokenizer=char_tokenizer(), batch_size=8, seed=1)
    first, again = loader.batch(7), PromptLoader(records=records, tokenizer=char_tokenizer(), batch_size=8,
                                                 seed=1).batch(7)
    assert list(first["ground_truth"]) == list(again["ground_truth"])
    epoch = {g for step in range(5) for g in loader.batch(step)["ground_truth"]}
    assert len(epoch) == len({r["ground_truth"] for r in records})  # one epoch sees every record once
    assert first["prompt_mask"][:, -1].all(), "prompts must be left-padded"
