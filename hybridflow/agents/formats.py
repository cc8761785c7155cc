"""Tool-call formats: how calls appear in the model's text, and how their results return to it.

- :class:`HermesFormat` (``"hermes"``): the Qwen2/2.5 chat-template syntax,
  ``<tool_call>\\n{"name": "calculator", "arguments": {"expression": "2+3"}}\\n</tool_call>``; several calls
  per turn.
- :class:`CompactFormat` (``"compact"``): ``@calculator(12*34)``, a syntax a tiny character-level model learns in
  a few hundred steps; the text between the parentheses is the tool's single required argument.

Both answer with one ``{"role": "tool", "name": ..., "content": ...}`` message per result (HF Qwen templates
render ``role: tool`` as ``<tool_response>`` blocks). A call that cannot be parsed never raises: it becomes an
entry of :attr:`ParsedTurn.errors`, a short message the model is shown so it can correct itself.

Format factories take ``tools=`` (the environment's tools by name) so that every format is built the same way:
``TOOL_FORMATS.get(name)(tools=tools)``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.agents.protocols import Message, ParsedTurn, Tool, ToolCall, ToolResult
from hybridflow.registry import TOOL_FORMATS

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
_HERMES_EXAMPLE = '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'
_COMPACT_CALL = re.compile(r"@([A-Za-z_][A-Za-z0-9_-]*)\(")


def tool_messages(results: Sequence[ToolResult]) -> list[Message]:
    """One ``role: tool`` message per result, named after the tool and carrying the call's id."""
    messages: list[Message] = []
    for result in results:
        message: Message = {"role": "tool", "name": result.call.name, "content": result.content}
        if result.call.id:
            message["tool_call_id"] = result.call.id
        messages.append(message)
    return messages


class HermesFormat:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, as Qwen2/2.5 chat templates write them.

    ``arguments`` may also be a JSON string holding an object (some models emit that) and may be left out
    (a tool without parameters). ``tools`` is accepted for the common factory signature and not needed:
    hermes calls name their arguments.
    """

    def __init__(self, *, tools: Mapping[str, Tool] | None = None) -> None:
        self.tools = dict(tools or {})

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[str] = []
        position = 0
        while (start := text.find(HERMES_OPEN, position)) != -1:
            body_start = start + len(HERMES_OPEN)
            end = text.find(HERMES_CLOSE, body_start)
            next_open = text.find(HERMES_OPEN, body_start)
            if end == -1 or (next_open != -1 and next_open < end):
                errors.append(f"tool call {len(calls) + len(errors) + 1}: {HERMES_OPEN} is never closed; "
                              f"end each call with {HERMES_CLOSE}")
                if next_open == -1:
                    break
                position = next_open
                continue
            block = text[start:end + len(HERMES_CLOSE)]
            call, error = _parse_hermes_body(text[body_start:end], call_id=f"call_{len(calls)}", block=block)
            if call is not None:
                calls.append(call)
            else:
                errors.append(f"tool call {len(calls) + len(errors) + 1}: {error}")
            position = end + len(HERMES_CLOSE)
        return ParsedTurn(calls=tuple(calls), errors=tuple(errors))

    def result_messages(self, results: Sequence[ToolResult]) -> list[Message]:
        return tool_messages(results)


def _parse_hermes_body(body: str, *, call_id: str, block: str) -> tuple[ToolCall | None, str]:
    """The call in one ``<tool_call>`` block, or ``None`` and why not (a message for the model)."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON ({exc.msg} at character {exc.pos}); write {_HERMES_EXAMPLE}"
    if not isinstance(payload, dict):
        return None, f"expected a JSON object, got {type(payload).__name__}; write {_HERMES_EXAMPLE}"
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return None, f'"name" must be a non-empty string, got {name!r}'
    arguments: Any = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string holding an object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return None, f'"arguments" of {name!r} is a string that is not a JSON object ({exc.msg})'
    if not isinstance(arguments, dict):
        return None, f'"arguments" of {name!r} must be a JSON object, got {type(arguments).__name__}'
    return ToolCall(name=name, arguments=arguments, text=block, id=call_id), ""


class CompactFormat:
    """``@name(argument text)`` calls, e.g. ``@calculator(12*34)``; nested parentheses balance.

    The argument text goes to the tool's single required parameter (the first ``required`` property of its
    schema, else its first property), so the format needs the tools: ``CompactFormat(tools={"calculator": ...})``.
    An unknown name or an unclosed parenthesis is an error entry.
    """

    def __init__(self, *, tools: Mapping[str, Tool] | None = None) -> None:
        self.tools = dict(tools or {})

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[str] = []
        position = 0
        while (match := _COMPACT_CALL.search(text, position)) is not None:
            name, argument_start = match.group(1), match.end()
            end = _closing_parenthesis(text, argument_start)
            if end == -1:
                errors.append(f"@{name}( is never closed; end the call with )")
                break
            position = end + 1
            tool = self.tools.get(name)
            if tool is None:
                errors.append(f"unknown tool {name!r}; valid tools: {sorted(self.tools)}")
                continue
            argument = text[argument_start:end]
            parameter = main_parameter(tool)
            if parameter is None:
                if argument.strip():
                    errors.append(f"tool {name!r} takes no argument; call it as @{name}()")
                    continue
                arguments: dict[str, Any] = {}
            else:
                arguments = {parameter: argument}
            calls.append(ToolCall(name=name, arguments=arguments, text=match.group(0) + argument + ")",
                                  id=f"call_{len(calls)}"))
        return ParsedTurn(calls=tuple(calls), errors=tuple(errors))

    def result_messages(self, results: Sequence[ToolResult]) -> list[Message]:
        return tool_messages(results)


def main_parameter(tool: Tool) -> str | None:
    """The parameter a single-argument call fills: the first required property, else the first property."""
    required = tool.parameters.get("required") or ()
    if required:
        return str(required[0])
    properties = tool.parameters.get("properties") or {}
    return str(next(iter(properties))) if properties else None


def _closing_parenthesis(text: str, start: int) -> int:
    """The index of the ``)`` that closes the ``(`` just before ``start``, or -1."""
    depth = 1
    for index in range(start, len(text)):
        if text[index] == "(":
            depth += 1
        elif text[index] == ")":
            depth -= 1
            if depth == 0:
                return index
    return -1


TOOL_FORMATS.add("hermes", HermesFormat)
TOOL_FORMATS.add("compact", CompactFormat)
