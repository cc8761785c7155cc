"""Agents written against the ``openai`` SDK, and a hermes-like tool-call format, loaded by path
(``openai_agents.py:chatty``) as a user's would be."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from hybridflow.agents import EnvRecord, Message, ParsedTurn, ToolCall, ToolResult

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class HermesLike:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (a stand-in for the hermes format)."""

    def parse(self, text: str) -> ParsedTurn:
        calls, errors = [], []
        for match in _CALL.finditer(text):
            try:
                payload = json.loads(match.group(1))
                calls.append(ToolCall(name=payload["name"], arguments=payload.get("arguments", {}),
                                      text=match.group(0)))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                errors.append(f"bad tool call {match.group(1)!r}: {err}")
        return ParsedTurn(calls=tuple(calls), errors=tuple(errors))

    def result_messages(self, results: Sequence[ToolResult]) -> list[Message]:
        return [{"role": "tool", "name": r.call.name, "content": r.content} for r in results]


def chatty(client: Any, record: EnvRecord) -> float:
    """Two follow-up user turns whatever the model says (the tiny model's text is random); reward 0.25."""
    messages: list[Any] = [{"role": "user", "content": str(record.prompt)}]
    for follow_up in ("more", "again", "done"):
        reply = client.chat.completions.create(model="policy", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": follow_up}]
    return 0.25
