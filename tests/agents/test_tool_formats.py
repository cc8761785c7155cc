"""Hermes and compact tool-call parsing: calls, ids, and model-readable errors instead of exceptions."""

from __future__ import annotations

import pytest

from hybridflow.agents.formats import CompactFormat, HermesFormat
from hybridflow.agents.protocols import ToolCall, ToolCallFormat, ToolResult
from hybridflow.agents.tools import calculator_tool
from hybridflow.registry import TOOL_FORMATS

CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'


def test_hermes_parses_one_call_with_an_id_and_its_text() -> None:
    turn = HermesFormat().parse(f"Let me compute.\n{CALC}")
    assert turn.errors == ()
    (call,) = turn.calls
    assert (call.name, dict(call.arguments), call.id) == ("calculator", {"expression": "2+3"}, "call_0")
    assert call.text == CALC


def test_hermes_parses_several_calls_without_whitespace_in_order() -> None:
    text = "".join(f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{i}"}}}}</tool_call>'
                   for i in range(5))
    turn = HermesFormat().parse(text)
    assert [call.arguments["expression"] for call in turn.calls] == ["0", "1", "2", "3", "4"]
    assert [call.id for call in turn.calls] == [f"call_{i}" for i in range(5)]


def test_hermes_accepts_arguments_as_a_json_string_and_missing_arguments() -> None:
    text = ('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7*6\\"}"}</tool_call>'
            '<tool_call>{"name": "clock"}</tool_call>')
    turn = HermesFormat().parse(text)
    assert turn.errors == ()
    assert [dict(call.arguments) for call in turn.calls] == [{"expression": "7*6"}, {}]


@pytest.mark.parametrize(("body", "expected"), [
    ('{"name": "calculator", "arguments": {"expression": "1"}', "invalid JSON"),
    ('["calculator"]', "expected a JSON object"),
    ('{"arguments": {}}', '"name" must be a non-empty string'),
    ('{"name": 3, "arguments": {}}', '"name" must be a non-empty string'),
    ('{"name": "calculator", "arguments": [1, 2]}', '"arguments" of \'calculator\' must be a JSON object'),
    ('{"name": "calculator", "arguments": "not json"}', "is a string that is not a JSON object"),
])
def test_hermes_reports_malformed_calls_as_errors(body: str, expected: str) -> None:
    turn = HermesFormat().parse(f"<tool_call>{body}</tool_call> and {CALC}")
    assert len(turn.errors) == 1 and expected in turn.errors[0], turn.errors
    assert turn.errors[0].startswith("tool call 1:")
    assert [call.name for call in turn.calls] == ["calculator"]  # the good call after it still parses


def test_hermes_unclosed_call_is_an_error_and_the_next_call_still_parses() -> None:
    turn = HermesFormat().parse('<tool_call>{"name": "calculator"' + CALC)
    assert len(turn.errors) == 1 and "never closed" in turn.errors[0]
    assert len(turn.calls) == 1
    trailing = HermesFormat().parse(f"{CALC}<tool_call>{{")
    assert len(trailing.calls) == 1 and "never closed" in trailing.errors[0]


def test_no_calls_is_an_empty_turn() -> None:
    turn = HermesFormat().parse("The answer is 5.")
    assert turn.calls == () and turn.errors == ()


def test_result_messages_are_tool_messages_in_order() -> None:
    calls = [ToolCall(name="calculator", arguments={}, id=f"call_{i}") for i in range(2)]
    results = [ToolResult(call=call, content=str(i)) for i, call in enumerate(calls)]
    for call_format in (HermesFormat(), CompactFormat()):
        messages = call_format.result_messages(results)
        assert [(m["role"], m["name"], m["content"], m["tool_call_id"]) for m in messages] == [
            ("tool", "calculator", "0", "call_0"), ("tool", "calculator", "1", "call_1")]


def test_compact_fills_the_single_required_parameter_and_balances_parentheses() -> None:
    call_format = CompactFormat(tools={"calculator": calculator_tool()})
    turn = call_format.parse("first @calculator(12*34) then @calculator((1+2)*(3+4)) done")
    assert turn.errors == ()
    assert [dict(call.arguments) for call in turn.calls] == [{"expression": "12*34"},
                                                              {"expression": "(1+2)*(3+4)"}]
    assert [call.text for call in turn.calls] == ["@calculator(12*34)", "@calculator((1+2)*(3+4))"]
    assert [call.id for call in turn.calls] == ["call_0", "call_1"]


def test_compact_unknown_tool_and_unclosed_call_are_errors() -> None:
    call_format = CompactFormat(tools={"calculator": calculator_tool()})
    unknown = call_format.parse("@search(cats) @calculator(1+1)")
    assert len(unknown.calls) == 1 and "unknown tool 'search'" in unknown.errors[0]
    assert "calculator" in unknown.errors[0]  # the valid tools are listed
    unclosed = call_format.parse("@calculator((1+2)")
    assert unclosed.calls == () and "never closed" in unclosed.errors[0]
    assert call_format.parse("mail me at a@b.c").calls == ()


def test_both_formats_are_registered_and_satisfy_the_protocol() -> None:
    for name, cls in (("hermes", HermesFormat), ("compact", CompactFormat)):
        built = TOOL_FORMATS.get(name)(tools={"calculator": calculator_tool()})
        assert isinstance(built, cls) and isinstance(built, ToolCallFormat)
