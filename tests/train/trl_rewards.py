"""Reward functions with TRL's signature, importable by module name (so the reward pool's workers load them)."""

from __future__ import annotations

from typing import Any


def short_answers(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """1 for a short completion, else 0; reads no ground truth (a prompt-only dataset)."""
    return [1.0 if len(_text(c)) <= 4 else 0.0 for c in completions]


def only_math(prompts: list[Any], completions: list[Any], task: list[str], **kwargs: Any) -> list[float | None]:
    """Scores the rows of the 'math' task only (None elsewhere: TRL's "not mine")."""
    return [float(len(_text(c)) % 2) if t == "math" else None for c, t in zip(completions, task, strict=True)]


def _text(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)
