"""The calculator tool: arithmetic values, and refusals of anything that is not arithmetic."""

from __future__ import annotations

import re

import pytest

from hybridflow.agents.tools import calculate, calculator_tool, evaluate_arithmetic
from hybridflow.registry import TOOLS


@pytest.mark.parametrize(("expression", "expected"), [
    ("2+3", "5"), ("12*34", "408"), ("(1 + 2) * -3", "-9"), ("7 / 2", "3.5"), ("6 / 2", "3"),
    ("7 // 2", "3"), ("-7 % 3", "2"), ("2 ** 10", "1024"), ("2 ** -1", "0.5"), ("0.1 + 0.2", "0.3"),
    ("+4", "4"), (" 1e3 ", "1000"),
])
def test_values(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


@pytest.mark.parametrize(("expression", "reason"), [
    ("__import__('os').system('true')", "unsupported syntax 'Call'"),
    ("x + 1", "unsupported syntax 'Name'"),
    ("(1).real", "unsupported syntax 'Attribute'"),
    ("'a' * 3", "unsupported syntax 'Constant'"),
    ("True + 1", "unsupported syntax 'Constant'"),
    ("1j * 2", "unsupported syntax 'Constant'"),
    ("2 ** 101", "exponent 101 too large"),
    ("9 ** 99 ** 2", "too large"),
    ("10 ** 100 * 10 ** 100 * 10 ** 100 * 10 ** 100 * 10 ** 100 * 10 ** 100 * 10 ** 100 * 10 ** 100 * 10 ** 100 "
     "* 10 ** 100 * 10", "more than 1000 digits"),
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"),
    ("10.0 ** 100 * 10.0 ** 100 * 10.0 ** 100 * 10.0 ** 100", "not a finite number"),
    ("(-8) ** 0.5", "not a real number"),
    ("2 +", "not an arithmetic expression"),
    ("[1, 2]", "unsupported syntax 'List'"),
])
def test_refusals_are_error_messages(expression: str, reason: str) -> None:
    result = calculate(expression)
    assert result.startswith("error:") and reason in result, result
    with pytest.raises(ValueError, match=re.escape(reason)):
        evaluate_arithmetic(expression)


def test_registered_factory_builds_the_tool() -> None:
    tool = TOOLS.get("calculator")(timeout_s=1.0)
    assert tool.name == "calculator" and tool.timeout_s == 1.0
    assert tool.schema()["function"]["parameters"]["required"] == ["expression"]
    assert tool.fn(expression="3*3") == "9"
    assert calculator_tool().fn is calculate
