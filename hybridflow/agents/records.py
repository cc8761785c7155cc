"""Data rows as environment records (placeholder: the verl-extras mapping lands from wt-envs)."""

from __future__ import annotations

from typing import Any

from hybridflow.agents.protocols import EnvRecord


def env_record(index: int, ground_truth: str, prompt: str | list[Any] | None = None) -> EnvRecord:
    info = getattr(ground_truth, "extra_info", None) or {}
    if prompt is None:
        prompt = getattr(ground_truth, "prompt", None) or ""
    return EnvRecord(index=index, prompt=prompt, ground_truth=str(ground_truth), extra_info=info,
                     tools_kwargs=info.get("tools_kwargs") or {},
                     interaction_kwargs=info.get("interaction_kwargs") or {})
