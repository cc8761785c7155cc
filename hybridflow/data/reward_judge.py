"""The ``chat`` shape of a reward service: an OpenAI-compatible chat endpoint as a judge.

Each sample is one ``POST {base URL}/chat/completions`` with the judge's ``model`` and one user message, the
``prompt_template`` filled with the sample's ``{prompt}``, ``{response}`` and ``{label}``; the reward is the last
number of the answer's ``choices[0].message.content``. The API key is read from the environment variable the
options name, sent as a bearer token and never put in a message.
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Mapping
from typing import Any

from hybridflow.data.reward_functions import Sample

DEFAULT_JUDGE_TEMPLATE = ("Rate how well the response answers the prompt, given the reference answer.\n\n"
                          "Prompt:\n{prompt}\n\nResponse:\n{response}\n\nReference answer:\n{label}\n\n"
                          "Reply with one number from 0 (wrong) to 1 (right), and nothing else.")
TEMPLATE_FIELDS = frozenset({"prompt", "response", "label"})
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class JudgeAnswerError(ValueError):
    """A judge's answer without a verdict (its text says what is missing)."""


def template_problem(template: str) -> str | None:
    """Why ``template`` cannot be filled with a sample (an unknown ``{field}``, a stray brace), or None."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        return f"is not a format string ({err}); write a literal brace as {{{{ or }}}}"
    unknown = sorted(names - TEMPLATE_FIELDS)
    if unknown:
        return f"names {unknown}; a template may use {sorted(TEMPLATE_FIELDS)}"
    return None


def chat_url(base_url: str) -> str:
    """The chat completions endpoint under an OpenAI-compatible base URL (``http://host:8000/v1``)."""
    return base_url.rstrip("/") + "/chat/completions"


def api_key_headers(variable: str | None) -> dict[str, str]:
    """The bearer header with the key in environment variable ``variable`` (none without one); a KeyError naming
    the variable, never its value, when it is unset or empty."""
    if variable is None:
        return {}
    key = os.environ.get(variable)
    if not key:
        raise KeyError(variable)
    return {"Authorization": f"Bearer {key}"}


def judge_payload(sample: Sample, *, model: str, template: str) -> dict[str, Any]:
    """The chat request that asks ``model`` to judge ``sample``."""
    content = template.format(prompt=sample.prompt_text, response=sample.response, label=sample.ground_truth)
    return {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0.0}


def judge_verdict(answer: Any) -> Any:
    """The last number in the answer's first choice (a float), or a :class:`JudgeAnswerError` saying what is amiss."""
    try:
        content = answer["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        keys = sorted(answer) if isinstance(answer, Mapping) else type(answer).__name__
        raise JudgeAnswerError(f"answered {keys} without choices[0].message.content; is it an OpenAI-compatible "
                               "chat completions endpoint?") from None
    if not isinstance(content, str):
        raise JudgeAnswerError(f"answered message content {content!r}, not text")
    numbers = _NUMBER.findall(content)
    if not numbers:
        clipped = content if len(content) <= 120 else content[:120] + "..."
        raise JudgeAnswerError(f"answered a verdict with no number: {clipped!r}; make the prompt template ask for "
                               "one number")
    return float(numbers[-1])
