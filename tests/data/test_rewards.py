"""Reward functions: the three signatures, checked at load time; weights; values that must be finite floats."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from data_files import verl_row, write_parquet

from hybridflow.data import (
    RewardSignatureError,
    RuleScorer,
    char_tokenizer,
    encode_prompts,
    load_records,
    load_reward_functions,
    prepare_records,
    reward_scorer,
)
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.errors import RewardFunctionError
from hybridflow.train.setup import check_reward_configured


def scored_batch(records: list[dict[str, Any]], responses: list[str], tokenizer: Any) -> Batch:
    """What a score node receives: prompts, the given responses and the ground truths, selected like the runtime."""
    prompts = encode_prompts(records, tokenizer)
    encoded = tokenizer(responses, add_special_tokens=False, padding=True, padding_side="right", return_tensors="pt")
    full = prompts.union(Batch({"responses": encoded["input_ids"],
                                "response_mask": encoded["attention_mask"].to(torch.long)}))
    # The runtime hands a score node only these fields (hybridflow.runtime.worker.port_batch).
    return full.select(["prompts", "prompt_mask", "responses", "response_mask", "ground_truth"])


PLAIN = [{"prompt": "rev ab=", "ground_truth": "ba"}, {"prompt": "rev cd=", "ground_truth": "dc"}]


def exact(response: str, ground_truth: str) -> float:
    return float(response == ground_truth)


def test_old_two_argument_rules_keep_working() -> None:
    tokenizer = char_tokenizer()
    scores = RuleScorer(exact, tokenizer)(scored_batch(PLAIN, ["ba", "xx"], tokenizer))["scores"]
    assert scores.tolist() == [1.0, 0.0]


def test_verl_context_reaches_per_sample_and_verl_style_functions(tmp_path: Path, chat_tokenizer: Any) -> None:
    rows = [verl_row("two", "2", 0), verl_row("three", "3", 1)]
    records = prepare_records(load_records(write_parquet(tmp_path / "d.parquet", rows)), chat_tokenizer).records
    batch = scored_batch(records, ["2", "4"], chat_tokenizer)
    seen: list[tuple[Any, ...]] = []

    def keyword_rule(response: str, ground_truth: str, *, data_source: str | None = None,
                     extra_info: dict[str, Any] | None = None) -> float:
        seen.append((ground_truth, data_source, extra_info))
        return float(response == ground_truth)

    def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
        return 10.0 if data_source == "openai/gsm8k" and solution_str == ground_truth else 0.0

    assert RuleScorer(keyword_rule, chat_tokenizer)(batch)["scores"].tolist() == [1.0, 0.0]
    assert seen[1] == ("3", "openai/gsm8k", {"split": "train", "index": 1})
    assert RuleScorer(compute_score, chat_tokenizer)(batch)["scores"].tolist() == [10.0, 0.0]


def test_trl_batched_functions_get_prompts_completions_and_columns(tmp_path: Path, chat_tokenizer: Any) -> None:
    rows = [verl_row("two", "2", 0), verl_row("three", "3", 1)]
    records = prepare_records(load_records(write_parquet(tmp_path / "d.parquet", rows)), chat_tokenizer).records
    calls: list[dict[str, Any]] = []

    def trl_style(prompts: list[Any], completions: list[Any], ability: list[str], **kwargs: Any) -> list[float]:
        calls.append({"prompts": prompts, "completions": completions, "ability": ability, **kwargs})
        return [float(c[0]["content"] == t) for c, t in zip(completions, kwargs["ground_truth"], strict=True)]

    scorer = reward_scorer([trl_style], chat_tokenizer)
    assert scorer(scored_batch(records, ["2", "2"], chat_tokenizer))["scores"].tolist() == [1.0, 0.0]
    call = calls[0]
    assert call["prompts"][0] == [{"role": "user", "content": "two"}]  # TRL's conversational format
    assert call["completions"][1] == [{"role": "assistant", "content": "2"}]
    assert call["ability"] == ["math", "math"] and call["data_source"] == ["openai/gsm8k"] * 2
    assert call["reward_model"][1] == {"style": "rule", "ground_truth": "3"}

    def needs_solution(completions: list[str], solution: list[str]) -> list[float]:
        return [0.0] * len(completions)

    with pytest.raises(KeyError, match=r"'needs_solution' needs data column\(s\) \['solution'\]"):
        reward_scorer([needs_solution], chat_tokenizer)(scored_batch(records, ["2", "2"], chat_tokenizer))


def test_weighted_functions_sum(tmp_path: Path) -> None:
    tokenizer = char_tokenizer()

    def length(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(len(c)) for c in completions]

    scorer = reward_scorer([exact, length], tokenizer, weights=[2.0, 0.5])
    batch = scored_batch(PLAIN, ["ba", "xxxx"], tokenizer)
    assert scorer(batch)["scores"].tolist() == [2.0 * 1 + 0.5 * 2, 0.5 * 4]
    with pytest.raises(ValueError, match=r"reward_weights=\[1\.0\] has 1 weights for 2 reward functions"):
        load_reward_functions([exact, length], weights=[1.0])


def test_signatures_are_checked_at_load_time_naming_the_function() -> None:
    def one_arg(response: str) -> float:
        return 0.0

    def extra_required(response: str, ground_truth: str, tolerance: float) -> float:
        return 0.0

    for fn, why in ((one_arg, "first two positional"), (extra_required, r"\['tolerance'\] need defaults")):
        with pytest.raises(RewardSignatureError, match=rf"'{fn.__name__}' has signature .*{why}.*Accepted signatures"):
            load_reward_functions(fn)
    with pytest.raises(RewardSignatureError, match="is a int, not a function"):
        load_reward_functions([3])  # type: ignore[list-item]
    with pytest.raises(KeyError, match=r"'nope' is neither a built-in reward function \['math', 'math_flexible'\]"):
        load_reward_functions("nope")
    assert load_reward_functions("reverse")[0].style == "per_sample"  # a task's rule by the task's name


def test_reward_from_a_users_file(tmp_path: Path) -> None:
    (tmp_path / "my_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if solution_str.strip() == ground_truth else 0.0\n")
    (loaded,) = load_reward_functions(f"{tmp_path / 'my_reward.py'}:compute_score")
    assert loaded.style == "verl" and loaded.name.endswith("my_reward.py:compute_score")


@pytest.mark.parametrize("bad", ["0.5", None, math.nan, math.inf, [1.0]])
def test_non_finite_or_non_float_values_name_function_sample_prompt_and_response(bad: Any) -> None:
    tokenizer = char_tokenizer()

    def broken(response: str, ground_truth: str) -> Any:
        return bad if ground_truth == "dc" else 1.0

    with pytest.raises(RewardFunctionError) as caught:
        RuleScorer(broken, tokenizer)(scored_batch(PLAIN, ["ba", "zz"], tokenizer))
    message = str(caught.value)
    assert "reward function 'broken' returned" in message and "sample 1" in message
    assert "prompt 'rev cd='" in message and "response 'zz'" in message
    assert caught.value.sample == 1


def test_batched_functions_must_return_one_value_per_completion() -> None:
    tokenizer = char_tokenizer()

    def short(prompts: list[str], completions: list[str]) -> list[float]:
        return [1.0]

    with pytest.raises(RewardFunctionError, match="must return a list of 2 floats, one per completion; it returned 1"):
        reward_scorer(short, tokenizer)(scored_batch(PLAIN, ["ba", "dc"], tokenizer))


def test_a_raising_rule_names_the_sample() -> None:
    tokenizer = char_tokenizer()

    def fails(response: str, ground_truth: str) -> float:
        raise ZeroDivisionError("boom")

    with pytest.raises(RewardFunctionError, match=r"'fails' raised ZeroDivisionError: boom on sample 0 \(prompt"):
        RuleScorer(fails, tokenizer)(scored_batch(PLAIN, ["ba", "dc"], tokenizer))


def test_a_data_file_without_a_reward_is_an_error_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"data.path is set \(rows.jsonl\) but data.reward is not"):
        check_reward_configured(data_path="rows.jsonl", reward=None)
    check_reward_configured(data_path="rows.jsonl", reward="math")
    check_reward_configured(data_path=None, reward=None)  # a built-in task brings its rule
