"""The shipped GSM8K-style example (configs/data/gsm8k_style/): its script reproduces it, it loads as verl's
format, the math reward fits."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from hybridflow.data import load_records, math_reward, prepare_records, reward_scorer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "data"
SHIPPED = ROOT / "configs" / "data" / "gsm8k_style"  # package data of hybridflow.configs, one copy


def test_the_script_writes_the_shipped_files(tmp_path: Path) -> None:
    script = runpy.run_path(str(EXAMPLE / "make_gsm8k_style.py"))
    assert script["SHIPPED"] == SHIPPED, "the script's default output is the shipped copy"
    written = script["write"](tmp_path)
    for path in written:
        assert pq.read_table(path).to_pylist() == pq.read_table(SHIPPED / path.name).to_pylist()


def test_example_rows_load_render_and_score(chat_tokenizer: Any) -> None:
    train = load_records(SHIPPED / "train.parquet")
    test = load_records(SHIPPED / "test.parquet")
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
