"""Loading prompt records: formats, column keys, verl's parquet rows, validation splits and bad data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_files import verl_row, write_jsonl, write_parquet

from hybridflow.data import DataSpec, hold_out, load_records, load_splits
from hybridflow.data.sources import DataFileError, MissingColumnError

ROWS = [{"question": f"q{i}", "meta": {"answer": i * 2}, "level": i % 3} for i in range(6)]


def test_dotted_keys_reach_nested_columns_and_other_columns_are_kept(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    records = load_records(path, prompt_key="question", answer_key="meta.answer")
    assert records[2] == {"prompt": "q2", "ground_truth": "4", "meta": {"answer": 4}, "level": 2}


def test_verl_rows_load_as_is_from_parquet(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "train.parquet", [verl_row("1+1?", "2", 0), verl_row("2+3?", "5", 1)])
    records = load_records(path)  # no keys given: verl's reward_model.ground_truth is found
    assert records[1]["prompt"] == [{"role": "user", "content": "2+3?"}]
    assert records[1]["ground_truth"] == "5"
    assert records[1]["data_source"] == "openai/gsm8k" and records[1]["extra_info"] == {"split": "train", "index": 1}


def test_hf_datasets_directory_with_splits(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="the optional 'datasets' package is not installed")
    rows = [verl_row(f"q{i}", str(i), i) for i in range(4)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3]),
                          "test": datasets.Dataset.from_list(rows[3:])}).save_to_disk(str(tmp_path / "hf"))
    assert [r["ground_truth"] for r in load_records(tmp_path / "hf")] == ["0", "1", "2"]
    assert [r["ground_truth"] for r in load_records(tmp_path / "hf", split="test")] == ["3"]
    with pytest.raises(KeyError, match=r"no split 'validation'; its splits are \['test', 'train'\]"):
        load_records(tmp_path / "hf", split="validation")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "single"))
    assert len(load_records(tmp_path / "single")) == 4


def test_a_directory_not_written_by_datasets_is_refused(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataFileError, match="not one written by datasets' save_to_disk"):
        load_records(tmp_path / "plain")


def test_missing_key_names_file_line_key_and_columns(tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": "a", "ground_truth": "1"}), "", json.dumps({"prompt": "b", "answer": "2"})]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(MissingColumnError) as caught:
        load_records(path)
    message = str(caught.value)
    assert f"{path} line 3" in message  # 1-based, counting the blank line
    assert "'ground_truth'" in message and "['answer', 'prompt']" in message and "set answer_key" in message
    with pytest.raises(MissingColumnError, match=r"column 'meta' has keys \['answer'\]"):
        load_records(write_jsonl(tmp_path / "n.jsonl", ROWS), prompt_key="question", answer_key="meta.solution")


def test_parquet_errors_name_the_row(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": "a", "ground_truth": "1"}, {"prompt": "b",
                                                                                          "ground_truth": None}])
    with pytest.raises(ValueError, match=r"d.parquet row 2: the ground truth 'ground_truth' is null"):
        load_records(path)


def test_bad_json_and_empty_files_are_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "ground_truth": "1"}) + "\n{oops\n")
    with pytest.raises(DataFileError, match=r"bad.jsonl line 2: not valid JSON"):
        load_records(bad)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataFileError, match="has no rows"):
        load_records(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="prompt is a int"):
        load_records(write_jsonl(tmp_path / "int.jsonl", [{"prompt": 3, "ground_truth": "1"}]))
    with pytest.raises(ValueError, match="prompt message 0"):
        load_records(write_jsonl(tmp_path / "msg.jsonl", [{"prompt": [{"role": "user"}], "ground_truth": "1"}]))
    with pytest.raises(DataFileError, match=r"use a \.jsonl or \.parquet file"):
        load_records(write_jsonl(tmp_path / "d.csv", []))


def test_validation_from_a_file_or_a_held_out_fraction(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "ground_truth": str(i)} for i in range(20)]
    train_path, val_path = write_jsonl(tmp_path / "t.jsonl", rows), write_jsonl(tmp_path / "v.jsonl", rows[:3])
    separate = load_splits(DataSpec(path=str(train_path), val_path=str(val_path)))
    assert len(separate.train) == 20 and [r["prompt"] for r in separate.validation] == ["p0", "p1", "p2"]
    held = load_splits(DataSpec(path=str(train_path), val_fraction=0.25, seed=3))
    assert len(held.validation) == 5 and len(held.train) == 15
    assert {r["prompt"] for r in held.train}.isdisjoint(r["prompt"] for r in held.validation)
    assert held == load_splits(DataSpec(path=str(train_path), val_fraction=0.25, seed=3))  # reproducible
    assert load_splits(DataSpec(path=str(train_path))).validation == []
    with pytest.raises(ValueError, match="leaves no training records"):
        hold_out(rows[:1], 0.5)
    with pytest.raises(ValueError, match=r"^val_fraction=0\.1 with val_path set too"):
        DataSpec(path="x", val_path="y", val_fraction=0.1)
    with pytest.raises(ValueError, match=r"^val_fraction=1\.5 must be in \[0, 1\)"):
        DataSpec(path="x", val_fraction=1.5)
