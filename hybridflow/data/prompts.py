"""Ready records for a tokenizer: chat prompts rendered once, over-long prompts dropped and counted."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.data.records import PROMPT, RAW_PROMPT, Record, is_chat, render_prompt
from hybridflow.fields import FieldError

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PreparedRecords:
    """Records whose ``prompt`` is text for the policy; ``filtered`` over-long ones were dropped."""

    records: list[Record]
    filtered: int
    longest_prompt_tokens: int

    @property
    def kept(self) -> int:
        return len(self.records)


def prepare_records(records: Sequence[Record], tokenizer: Any, *, max_prompt_length: int | None = None,
                    name: str = "data", tools: Sequence[Mapping[str, Any]] | None = None) -> PreparedRecords:
    """Render chat prompts through ``tokenizer``'s template and drop prompts over ``max_prompt_length`` tokens.

    A chat prompt's messages stay in ``raw_prompt`` (TRL-style reward functions get them as ``prompts``).
    The number dropped is returned and logged, never silent; dropping every record is an error.
    ``name`` ("data", "validation") prefixes the messages. ``tools``: the function schemas a multi-turn rollout's
    environment offers, rendered into chat prompts.
    """
    if max_prompt_length is not None and max_prompt_length < 1:
        raise FieldError("max_prompt_length", max_prompt_length, "must be a positive number of tokens (or unset)")
    kept: list[Record] = []
    longest = 0
    for index, record in enumerate(records):
        prompt = record[PROMPT]
        text = render_prompt(prompt, tokenizer, f"{name} record {index}", tools=tools)
        tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if max_prompt_length is not None and tokens > max_prompt_length:
            continue
        longest = max(longest, tokens)
        kept.append({**record, PROMPT: text, RAW_PROMPT: prompt} if is_chat(prompt) else dict(record))
    filtered = len(records) - len(kept)
    if not kept:
        raise FieldError("max_prompt_length", max_prompt_length, f"tokens is shorter than all {len(records)} "
                         f"prompts of the {name} records; raise the limit")
    if filtered:
        log.warning("%s: dropped %d of %d prompts longer than max_prompt_length=%s tokens", name, filtered,
                    len(records), max_prompt_length)
    return PreparedRecords(records=kept, filtered=filtered, longest_prompt_tokens=longest)
