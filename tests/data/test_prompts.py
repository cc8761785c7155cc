"""Chat prompts through the tokenizer's template, over-long prompts dropped and counted, row context kept."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
from data_files import verl_row, write_parquet

from hybridflow.data import GroundTruth, PromptLoader, char_tokenizer, encode_prompts, load_records, prepare_records


def test_chat_prompts_are_rendered_with_the_template_and_kept_raw(tmp_path: Path, chat_tokenizer: Any) -> None:
    records = load_records(write_parquet(tmp_path / "d.parquet", [verl_row("one plus one", "2")]))
    prepared = prepare_records(records, chat_tokenizer)
    record = prepared.records[0]
    assert record["prompt"] == "u:one plus one a:"  # the generation prompt is added
    assert record["raw_prompt"] == [{"role": "user", "content": "one plus one"}]
    assert prepared.filtered == 0 and prepared.longest_prompt_tokens == len("u:one plus one a:")
    # The batch the policy sees holds the rendered tokens, not the text of a Python list.
    batch = encode_prompts(prepared.records, chat_tokenizer)
    assert chat_tokenizer.decode(batch["prompts"][0], skip_special_tokens=True) == "u:one plus one a:"
    # encode_prompts renders on its own too, for callers that skip prepare_records.
    assert encode_prompts(records, chat_tokenizer)["prompts"].tolist() == batch["prompts"].tolist()


def test_a_tokenizer_without_a_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    records = load_records(write_parquet(tmp_path / "d.parquet", [verl_row("hi", "2")]))
    with pytest.raises(ValueError, match=r"data record 0: the prompt is a list of chat messages, but the tokenizer "
                                         r"\(\w+\) has no chat template"):
        prepare_records(records, char_tokenizer())


def test_long_prompts_are_dropped_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    records = [{"prompt": "a" * n, "ground_truth": "x"} for n in (3, 9, 4, 12)]
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.prompts"):
        prepared = prepare_records(records, char_tokenizer(), max_prompt_length=5)
    assert prepared.filtered == 2 and prepared.kept == 2
    assert [r["prompt"] for r in prepared.records] == ["aaa", "aaaa"]
    assert "dropped 2 of 4 prompts longer than max_prompt_length=5" in caplog.text
    with pytest.raises(ValueError, match=r"^max_prompt_length=2 tokens is shorter than all 4 prompts"):
        prepare_records(records, char_tokenizer(), max_prompt_length=2)
    with pytest.raises(ValueError, match=r"^max_prompt_length=0 must be a positive"):
        prepare_records(records, char_tokenizer(), max_prompt_length=0)


def test_row_context_rides_with_the_ground_truth(tmp_path: Path, chat_tokenizer: Any) -> None:
    rows = [verl_row(f"q{i}", str(i), i) for i in range(4)]
    prepared = prepare_records(load_records(write_parquet(tmp_path / "d.parquet", rows)), chat_tokenizer)
    loader = PromptLoader(records=prepared.records, tokenizer=chat_tokenizer, batch_size=2, seed=0)
    truths = list(loader.batch(1)["ground_truth"]) + list(loader.batch(0)["ground_truth"])
    assert sorted(truths) == ["0", "1", "2", "3"]  # still compares as the plain answer
    truth = next(t for t in truths if t == "3")
    assert isinstance(truth, GroundTruth)
    assert (truth.data_source, truth.extra_info) == ("openai/gsm8k", {"split": "train", "index": 3})
    assert truth.prompt == [{"role": "user", "content": "q3"}] and truth.columns["ability"] == "math"
    copy = pickle.loads(pickle.dumps(truth))  # Ray ships it between processes
    assert copy == "3" and copy.data_source == "openai/gsm8k" and copy.extra_info == truth.extra_info
    # Plain prompt/answer records stay plain strings.
    plain = encode_prompts([{"prompt": "ab", "ground_truth": "ba"}], char_tokenizer())
    assert type(plain["ground_truth"][0]) is str
