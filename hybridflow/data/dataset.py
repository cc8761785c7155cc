"""Prompt datasets (jsonl, parquet or a built-in task) and a loader whose batches depend only on the step.

Batches are a pure function of ``(seed, step)``, so a resumed run sees exactly the prompts the
uninterrupted run would have seen.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridflow.runtime.batch import Batch

Record = dict[str, str]


def load_records(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "ground_truth") -> list[Record]:
    """Records from a ``.jsonl`` or ``.parquet`` file with a prompt and a ground-truth column."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.path: no file {path}")
    if path.suffix == ".jsonl":
        rows: list[dict[str, Any]] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"data.path {path}: use a .jsonl or .parquet file")
    for i, row in enumerate(rows):
        for key in (prompt_key, answer_key):
            if key not in row:
                raise KeyError(f"{path} row {i} has no {key!r} column; columns: {sorted(row)}")
    return [{"prompt": str(r[prompt_key]), "ground_truth": str(r[answer_key])} for r in rows]


@dataclass(frozen=True, kw_only=True)
class PromptLoader:
    """Seeded, step-addressable batches of tokenised prompts (left-padded, with ``prompt_mask``)."""

    records: Sequence[Record]
    tokenizer: Any
    batch_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.batch_size <= len(self.records):
            raise ValueError(f"data.batch_size={self.batch_size} must be in 1..{len(self.records)} (dataset size)")

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    def batch(self, step: int) -> Batch:
        """The batch of training step ``step`` (0-based): records drawn without replacement per epoch."""
        per_epoch = len(self.records) // self.batch_size
        epoch, position = divmod(step, per_epoch)
        rows = self._order(epoch)[position * self.batch_size:(position + 1) * self.batch_size]
        return encode_prompts([self.records[i] for i in rows], self.tokenizer)


def encode_prompts(records: Sequence[Record], tokenizer: Any) -> Batch:
    """Tokenise prompts into left-padded ``prompts`` / ``prompt_mask`` plus a ``ground_truth`` column."""
    encoded = tokenizer([r["prompt"] for r in records], add_special_tokens=False, padding=True,
                        padding_side="left", return_tensors="pt")
    return Batch({"prompts": encoded["input_ids"], "prompt_mask": encoded["attention_mask"].to(torch.long)},
                 {"ground_truth": [r["ground_truth"] for r in records]})
