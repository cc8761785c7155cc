"""Prompt datasets (jsonl, parquet or a built-in task) and a loader whose batches depend only on the step.

Batches are a pure function of ``(seed, step)``, so a resumed run sees exactly the prompts the
uninterrupted run would have seen.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from hybridflow.data.images import image_column, image_refs, vision_messages
from hybridflow.data.records import GROUND_TRUTH, IMAGES, PROMPT, Record, check_prompt, render_prompt, reward_target
from hybridflow.data.sources import MissingColumnError, has_key, lookup, read_table
from hybridflow.data.vision_prompts import encode_vision_prompts
from hybridflow.fields import FieldError
from hybridflow.runtime.batch import Batch

# Where the ground truth is when ``answer_key`` is not given: our own column, then verl's RL parquet one.
ANSWER_KEYS = ("ground_truth", "reward_model.ground_truth")


def load_records(path: str | Path, *, prompt_key: str = "prompt", answer_key: str | None = None,
                 split: str = "train", field: str = "path") -> list[Record]:
    """Records from a ``.jsonl`` / ``.parquet`` file or a local HF ``datasets`` directory.

    ``prompt_key`` / ``answer_key`` name the columns (dotted keys reach nested ones, e.g.
    ``reward_model.ground_truth``); ``answer_key=None`` tries ``ground_truth`` then verl's
    ``reward_model.ground_truth``, and a file with neither in any row is prompt-only (every ground truth "",
    for reward functions that need none, as TRL allows). A prompt may be a string or chat messages (a
    ``messages`` column serves when there is no ``prompt``). The row's other columns (``data_source``,
    ``extra_info``...) are kept for reward functions. A row with an ``images`` or ``image`` column is a vision
    row: its images become ``images`` (:mod:`~hybridflow.data.images`, relative paths read from the data file's
    folder), its prompt chat messages with an image part per image.
    """
    table = read_table(path, split=split, field=field)
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    # Prompt-only (TRL's convention): no row names a ground truth, so every one gets "" and the reward functions
    # judge the response alone. A file where only some rows have one is a data error, named at the first row.
    prompt_only = answer_key is None and not any(has_key(row, k) for row in table.rows for k in ANSWER_KEYS)
    records = []
    for index, row in enumerate(table.rows):
        where = table.where(index)
        column = MESSAGES if prompt_key == PROMPT and PROMPT not in row and MESSAGES in row else prompt_key
        images = image_column(row)
        if images is None:
            prompt = check_prompt(lookup(row, column, where=where, field="prompt_key"), where)
            extras = {name: value for name, value in row.items() if name not in (column, GROUND_TRUTH)}
        else:
            refs = image_refs(row, images, where=where, base=folder)
            prompt = vision_messages(lookup(row, column, where=where, field="prompt_key"), len(refs), where=where)
            extras = {name: value for name, value in row.items() if name not in (column, GROUND_TRUTH, images)}
            extras[IMAGES] = refs
        if prompt_only:
            records.append({PROMPT: prompt, GROUND_TRUTH: "", **extras})
            continue
        key = answer_key or next((k for k in ANSWER_KEYS if has_key(row, k)), None)
        if key is None:
            raise MissingColumnError(f"{where}: no {ANSWER_KEYS[0]!r} column (nor verl's {ANSWER_KEYS[1]!r}), though "
                                     f"other rows have one; columns present: {sorted(row)}. Give every row its ground "
                                     "truth, or none (a prompt-only dataset), or set answer_key to the column "
                                     "that holds it (dotted keys reach nested columns)")
        answer = lookup(row, key, where=where, field="answer_key")
        if answer is None:
            raise ValueError(f"{where}: the ground truth {key!r} is null; every row needs one")
        records.append({PROMPT: prompt, GROUND_TRUTH: _as_text(answer), **extras})
    return records


MESSAGES = "messages"  # a chat dataset's conversation column: the prompt when the rows have no "prompt"


def _as_text(answer: Any) -> str:
    # Structured ground truths (a list of accepted answers...) reach reward functions as JSON they can parse.
    return answer if isinstance(answer, str) else json.dumps(answer) if isinstance(answer, list | dict) else str(answer)


@dataclass(frozen=True, kw_only=True)
class PromptLoader:
    """Seeded, step-addressable batches of tokenised prompts (left-padded, with ``prompt_mask``); with the model's
    ``processor``, records with images also carry their image inputs (:func:`encode_vision_prompts`)."""

    records: Sequence[Record]
    tokenizer: Any
    batch_size: int
    seed: int = 0
    processor: Any | None = None
    COUNTED: ClassVar[str] = "the dataset's size"  # what ``records`` holds, for the batch size's bound

    def __post_init__(self) -> None:
        if not 0 < self.batch_size <= len(self.records):
            raise FieldError("batch_size", self.batch_size, f"must be in 1..{len(self.records)} ({self.COUNTED})")

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    def batch(self, step: int) -> Batch:
        """The batch of training step ``step`` (0-based): records drawn without replacement per epoch."""
        per_epoch = len(self.records) // self.batch_size
        epoch, position = divmod(step, per_epoch)
        rows = self._order(epoch)[position * self.batch_size:(position + 1) * self.batch_size]
        return self.encode([self.records[i] for i in rows])

    def encode(self, records: Sequence[Record]) -> Batch:
        """One step's records as a batch: :func:`encode_prompts`, or :func:`encode_vision_prompts` with a processor."""
        if self.processor is not None:
            return encode_vision_prompts(records, self.processor)
        return encode_prompts(records, self.tokenizer)


def encode_prompts(records: Sequence[Record], tokenizer: Any) -> Batch:
    """Tokenise prompts into left-padded ``prompts`` / ``prompt_mask`` plus a ``ground_truth`` column.

    Chat-message prompts go through the tokenizer's chat template (normally done once, up front, by
    :func:`~hybridflow.data.prompts.prepare_records`). A record with more than a prompt and a ground
    truth yields a :class:`~hybridflow.data.records.GroundTruth` carrying the rest to the reward.
    """
    texts = [render_prompt(r[PROMPT], tokenizer, f"record {i}") for i, r in enumerate(records)]
    encoded = tokenizer(texts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    return Batch({"prompts": encoded["input_ids"], "prompt_mask": encoded["attention_mask"].to(torch.long)},
                 {"ground_truth": [reward_target(r) for r in records]})
