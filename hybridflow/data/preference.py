"""Preference data for offline preference optimisation (DPO): TRL-format rows and a loader of paired rows.

A row is ``{"prompt", "chosen", "rejected"}`` (TRL's explicit-prompt preference format): plain strings, or
conversational, the prompt a list of ``{"role", "content"}`` messages and each completion the assistant's messages
that follow it (rendered through the tokenizer's chat template, as prompts are). A built-in task gives rule-built
pairs (:func:`preference_task_examples`): the chosen completion is the task's answer, the rejected one a corrupted
answer. :class:`PreferenceLoader` turns a step's pairs into two rows each (chosen, then rejected; the prompt on
both), tied by ``pair`` and told apart by ``chosen``, with the responses as a rollout would write them
(``responses``, ``response_mask``, ``loss_mask``), so graph nodes read them like generated rows.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from hybridflow.data.dataset import MESSAGES, PromptLoader, encode_prompts
from hybridflow.data.records import (
    GROUND_TRUTH,
    PROMPT,
    RAW_PROMPT,
    Messages,
    Record,
    check_prompt,
    is_chat,
    render_prompt,
)
from hybridflow.data.sources import MissingColumnError, lookup, read_table
from hybridflow.data.tasks import TASKS, Task, VisionExample
from hybridflow.runtime.batch import Batch

CHOSEN, REJECTED = "chosen", "rejected"
COMPLETIONS = (CHOSEN, REJECTED)
PAIR_FIELDS = ("prompts", "responses", "response_mask", "loss_mask", "pair", "chosen")
"""The fields :class:`PreferenceLoader` gives every step (beside ``prompt_mask`` and ``ground_truth``)."""


def load_preference_records(path: str | Path, *, prompt_key: str = "prompt", answer_key: str | None = None,
                            split: str = "train", field: str = "path") -> list[Record]:
    """Preference records from a ``.jsonl`` / ``.parquet`` file or a local HF ``datasets`` directory: each row's
    ``prompt_key`` column (``messages`` when there is no ``prompt``), ``chosen`` and ``rejected``. A row without
    one raises a one-line error naming the row and the column. ``answer_key``: a ground-truth column kept for
    validation's reward (none: ``""``); the row's other columns are kept."""
    table = read_table(path, split=split, field=field)
    records = []
    for index, row in enumerate(table.rows):
        where = table.where(index)
        column = MESSAGES if prompt_key == PROMPT and PROMPT not in row and MESSAGES in row else prompt_key
        prompt = check_prompt(lookup(row, column, where=where, field="prompt_key"), where)
        record: Record = {PROMPT: prompt, GROUND_TRUTH: "" if answer_key is None else str(row.get(answer_key, ""))}
        for name in COMPLETIONS:
            if row.get(name) is None:
                raise MissingColumnError(f"{where}: no {name!r} column; a preference row needs 'prompt', 'chosen' "
                                         f"and 'rejected' (columns present: {sorted(row)})")
            record[name] = check_completion(row[name], prompt, f"{where}: {name!r}")
        records.append({**{k: v for k, v in row.items() if k not in (column, *COMPLETIONS)}, **record})
    return records


def check_completion(completion: object, prompt: str | Messages, where: str) -> str | Messages:
    """A completion as a string (for a string prompt) or assistant messages (for a conversational one)."""
    if isinstance(prompt, str):
        if not isinstance(completion, str):
            raise ValueError(f"{where} is a {type(completion).__name__}; with a plain-text prompt the completions "
                             "are strings")
        return completion
    messages = check_prompt(completion, where)
    if isinstance(messages, str):
        raise ValueError(f"{where} is a string; with a conversational prompt the completions are lists of "
                         '{"role": "assistant", "content": ...} messages')
    return messages


def corrupt(answer: str, rng: random.Random) -> str:
    """``answer`` with one character replaced by another of its kind (a digit by a digit, else a letter of the
    tasks' alphabet ``a``-``h``), or with two characters swapped: a near miss the task's rule scores below 1."""
    if len(answer) > 1 and rng.random() < 0.5:
        i = rng.randrange(len(answer) - 1)
        swapped = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2:]
        if swapped != answer:
            return swapped
    i = rng.randrange(len(answer))
    pool = "0123456789" if answer[i].isdigit() else "abcdefgh"
    return answer[:i] + rng.choice([c for c in pool if c != answer[i]]) + answer[i + 1:]


def preference_task_examples(task: str | Task, count: int, *, seed: int = 0) -> list[Record]:
    """``count`` rule-built pairs of a built-in task: the prompt, its answer as ``chosen`` (and ground truth) and a
    corrupted answer (:func:`corrupt`) as ``rejected``, reproducible by seed."""
    found = TASKS.get(task) if isinstance(task, str) else task
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        example = found.make_example(rng)
        if isinstance(example, VisionExample):
            raise ValueError(f"task {found.name!r} has images: its rule-built preference pairs are not built; give "
                             "the pairs in a data file instead")
        prompt, answer = example
        records.append({PROMPT: prompt, GROUND_TRUTH: answer, CHOSEN: answer, REJECTED: corrupt(answer, rng)})
    return records


def completion_ids(record: Record, name: str, tokenizer: Any) -> list[int]:
    """The tokens of ``record[name]`` after its prompt, ending in EOS: a string completion as is, then EOS (as TRL
    adds); assistant messages as the chat template renders the whole conversation past the prompt's text."""
    completion = record[name]
    if isinstance(completion, str):
        return [*tokenizer(completion, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    messages = record[RAW_PROMPT] if RAW_PROMPT in record else record[PROMPT]  # a chat prompt's messages
    if not is_chat(messages):
        raise ValueError(f"a conversational {name!r} completion needs a conversational prompt, not {messages!r}")
    conversation: list[Any] = [*messages, *completion]
    whole = tokenizer.apply_chat_template(conversation, tokenize=False)
    prompt = render_prompt(record[PROMPT], tokenizer, f"the {name!r} completion's prompt")
    if not whole.startswith(prompt):
        raise ValueError(f"the chat template renders prompt + {name!r} without the prompt's text as a prefix, so the "
                         "completion's tokens cannot be told apart; use plain-text rows or another template")
    ids = tokenizer(whole[len(prompt):], add_special_tokens=False).input_ids
    return ids if ids and ids[-1] == tokenizer.eos_token_id else [*ids, tokenizer.eos_token_id]


def encode_pairs(records: Sequence[Record], tokenizer: Any) -> Batch:
    """Two rows per record, chosen then rejected: the prompt left-padded (``prompts``, ``prompt_mask``), the
    completion right-padded (``responses``, ``response_mask`` and the same ``loss_mask``), ``pair`` (the record's
    position) and ``chosen`` (1, 0). (2B, P), (2B, T), (2B,)."""
    rows = [record for record in records for _ in COMPLETIONS]
    completions = [completion_ids(record, name, tokenizer) for record in records for name in COMPLETIONS]
    width = max(len(ids) for ids in completions)
    responses = torch.full((len(rows), width), int(tokenizer.pad_token_id), dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for row, ids in enumerate(completions):
        responses[row, :len(ids)] = torch.tensor(ids)
        mask[row, :len(ids)] = 1
    prompts = encode_prompts(rows, tokenizer)
    pairs = torch.arange(len(records)).repeat_interleave(len(COMPLETIONS))
    chosen = torch.tensor([1, 0]).repeat(len(records))
    return Batch({**prompts.tensors, "responses": responses, "response_mask": mask, "loss_mask": mask.clone(),
                  "pair": pairs, "chosen": chosen}, prompts.non_tensors)


@dataclass(frozen=True, kw_only=True)
class PreferenceLoader(PromptLoader):
    """Seeded, step-addressable batches of preference pairs, ``batch_size`` pairs (twice as many rows) a step, drawn
    without replacement per epoch as :class:`~hybridflow.data.dataset.PromptLoader` draws prompts."""

    COUNTED: ClassVar[str] = "the pairs' count"

    def encode(self, records: Sequence[Record]) -> Batch:
        """One step's pairs as rows: :func:`encode_pairs`."""
        return encode_pairs(records, self.tokenizer)
