"""A user's own tool, loaded by path as docs/agents.md shows (``user_tools.py:word_length``)."""

from __future__ import annotations

from hybridflow.agents import Tool


def word_length(*, timeout_s: float = 1.0) -> Tool:
    return Tool(name="word_length", description="The number of letters of a word.",
                parameters={"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
                fn=lambda word: str(len(word)), timeout_s=timeout_s)
