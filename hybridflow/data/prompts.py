"""Ready records for a tokenizer: chat prompts rendered once, over-long prompts dropped and counted."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.data.images import CheckedImages, check_images, has_images
from hybridflow.data.records import PROMPT, RAW_PROMPT, Record, is_chat, render_prompt
from hybridflow.data.vision_prompts import image_tokens
from hybridflow.fields import FieldError

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PreparedRecords:
    """Records whose ``prompt`` is text for the policy; ``filtered`` over-long ones were dropped."""

    records: list[Record]
    filtered: int
    longest_prompt_tokens: int  # visual tokens included
    skipped_images: int = 0  # rows dropped for a bad image (bad_images="skip")
    image_tokens: int = 0  # the most visual tokens of a kept prompt (the planner's Workload.image_tokens)

    @property
    def kept(self) -> int:
        return len(self.records)


def prepare_records(records: Sequence[Record], tokenizer: Any, *, max_prompt_length: int | None = None,
                    name: str = "data", tools: Sequence[Mapping[str, Any]] | None = None, processor: Any | None = None,
                    bad_images: str = "error") -> PreparedRecords:
    """Render chat prompts through ``tokenizer``'s template and drop prompts over ``max_prompt_length`` tokens.

    A chat prompt's messages stay in ``raw_prompt`` (TRL-style reward functions get them as ``prompts``).
    The number dropped is returned and logged, never silent; dropping every record is an error.
    ``name`` ("data", "validation") prefixes the messages. ``tools``: the function schemas a multi-turn rollout's
    environment offers, rendered into chat prompts.

    Records with images (:mod:`~hybridflow.data.images`) need the model's ``processor``: every image is decoded
    once, a bad one raising an error that names its row and column, or, with ``bad_images="skip"``, dropping its
    row (counted in ``skipped_images``); a prompt's length counts its images' visual tokens after the processor's
    resize.
    """
    if max_prompt_length is not None and max_prompt_length < 1:
        raise FieldError("max_prompt_length", max_prompt_length, "must be a positive number of tokens (or unset)")
    skipped, sizes = 0, None
    if has_images(records):
        checked = _checked_images(records, processor, bad_images=bad_images, name=name)
        records, sizes, skipped = checked.records, checked.sizes, checked.skipped
    kept: list[Record] = []
    longest = most_visual = 0
    for index, record in enumerate(records):
        prompt = record[PROMPT]
        text = render_prompt(prompt, tokenizer, f"{name} record {index}", tools=tools)
        tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        visual = 0
        if sizes is not None:  # each placeholder token becomes the image's visual tokens.
            visual = sum(image_tokens(processor, size) for size in sizes[index])
            tokens += visual - len(sizes[index])
        if max_prompt_length is not None and tokens > max_prompt_length:
            continue
        longest, most_visual = max(longest, tokens), max(most_visual, visual)
        kept.append({**record, PROMPT: text, RAW_PROMPT: prompt} if is_chat(prompt) else dict(record))
    filtered = len(records) - len(kept)
    if not kept:
        raise FieldError("max_prompt_length", max_prompt_length, f"tokens is shorter than all {len(records)} "
                         f"prompts of the {name} records; raise the limit")
    if filtered:
        log.warning("%s: dropped %d of %d prompts longer than max_prompt_length=%s tokens", name, filtered,
                    len(records), max_prompt_length)
    return PreparedRecords(records=kept, filtered=filtered, longest_prompt_tokens=longest, skipped_images=skipped,
                           image_tokens=most_visual)


def _checked_images(records: Sequence[Record], processor: Any | None, *, bad_images: str,
                    name: str) -> CheckedImages:
    if processor is None:
        raise ValueError(f"{name}: the records have images, but no processor was given to read them; use a "
                         "vision-language model whose directory has a processor (preprocessor_config.json)")
    if bad_images not in ("error", "skip"):
        raise FieldError("bad_images", bad_images, "must be 'error' or 'skip'")
    checked = check_images(records, bad_images=bad_images)
    if not checked.records:
        raise ValueError(f"{name}: every one of the {len(records)} records has a bad image (the first: "
                         f"{checked.first_error}); fix the images")
    if checked.skipped:
        log.warning("%s: skipped %d of %d rows with a bad image (the first: %s)", name, checked.skipped, len(records),
                    checked.first_error)
    return checked
