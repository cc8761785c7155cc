"""The shipped math reward: answer extraction and numeric / fraction / text equivalence."""

from __future__ import annotations

import pytest

from hybridflow.data import answers_equivalent, extract_answer, math_reward
from hybridflow.data.math_reward import math_reward_flexible


@pytest.mark.parametrize(("text", "answer"), [
    ("so the total is \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),  # the last box, nested braces kept
    ("3 + 4 = 7\n#### 7", "7"),
    ("#### 1,234.", "1,234"),
    ("The answer is: 18 dollars.", "18 dollars"),
    ("  72 ", "72"),  # a bare number is its own answer
    ("no marked answer, 5 then 6", None),
    ("cut off \\boxed{12", None),  # an unbalanced box is no answer
])
def test_extract_answer(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer


def test_flexible_extraction_takes_the_last_number() -> None:
    assert extract_answer("5 apples then 6", fallback="last_number") == "6"
    assert extract_answer("nothing here", fallback="last_number") is None
    assert math_reward_flexible("so 3 + 3 = 6", "6") == 1.0 and math_reward("so 3 + 3 = 6", "6") == 0.0


@pytest.mark.parametrize(("predicted", "truth"), [
    ("1,000", "1000"), ("0.5", "1/2"), ("\\frac{1}{2}", "0.5"), ("\\dfrac12", "1/2"), ("-3", "-3.0"),
    ("$18", "18"), ("18 \\text{ dollars}", "18"), ("50\\%", "50"), ("x = 4", "4"), ("0.333333", "1/3"),
    ("(1, 2)", "(1,2)"), ("\\left( 1,2 \\right)", "(1, 2)"), ("Yes", "yes"),
])
def test_equivalent_answers(predicted: str, truth: str) -> None:
    assert answers_equivalent(predicted, truth)


@pytest.mark.parametrize(("predicted", "truth"), [
    ("0.33", "1/3"), ("12", "21"), ("1/0", "0"), ("\\frac{12}{3}", "\\frac{1}{23}"), ("7", "-7"), ("", "0"),
])
def test_different_answers(predicted: str, truth: str) -> None:
    assert not answers_equivalent(predicted, truth)


def test_math_reward_against_bare_and_worked_ground_truths() -> None:
    assert math_reward("Half of 10 is 5.\n#### 5", "5") == 1.0
    assert math_reward("\\boxed{5}", "10 / 2 = 5\n#### 5") == 1.0  # a full GSM8K solution as ground truth
    assert math_reward("#### 6", "5") == 0.0
    assert math_reward("I am not sure", "5") == 0.0
    assert math_reward("#### 5", "5", data_source="openai/gsm8k", extra_info={"index": 0}) == 1.0
