"""The shipped GSM8K-style example: its script reproduces it, it loads as verl's format, the math reward fits."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from hybridflow.data import load_records, math_reward, prepare_records, reward_scorer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data"


def test_the_script_writes_the_shipped_files(tmp_path: Path) -> None:
    script = runpy.run_path(str(EXAMPLE / "make_gsm8k_style.py"))
    written = script["write"](tmp_path)
    for path in written:
        assert pq.read_table(path).to_pylist() == pq.read_table(EXAMPLE / "gsm8k_style" / path.name).to_pylist()


def test_example_rows_load_render_and_score(chat_tokenizer: Any) -> None:
    train = load_records(EXAMPLE / "gsm8k_style" / "train.parquet")
    test = load_records(EXAMPLE / "gsm8k_style" / "test.parquet")
    assert len(train) >= 32 and len(test) >= 8
    assert {r["prompt"][0]["content"] for r in train}.isdisjoint(r["prompt"][0]["content"] for r in test)
    for record in train:
        assert record["data_source"] == "gsm8k_style" and record["ability"] == "math"
        # The worked solution in extra_info ends in "#### answer": the math reward accepts it.
        assert math_reward(record["extra_info"]["answer"], record["ground_truth"]) == 1.0
        assert math_reward("#### 100000", record["ground_truth"]) == 0.0
    chat_tokenizer.chat_template = "{{ messages[0]['content'][:20] | lower }}"  # the char tokenizer is lowercase
    prepared = prepare_records(train, chat_tokenizer)
    assert prepared.filtered == 0 and isinstance(prepared.records[0]["prompt"], str)
    assert len(reward_scorer("math", chat_tokenizer).rewards) == 1
