"""Train and validation records from a data config: a separate validation source or a held-out fraction."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hybridflow.data.dataset import load_records
from hybridflow.data.images import VisionData
from hybridflow.data.records import Record
from hybridflow.fields import FieldError


@dataclass(frozen=True, kw_only=True)
class DataFiles:
    """How prompt files are read and split: the keys a data config and a :class:`DataSpec` share.

    ``prompt_key`` / ``answer_key``: columns, dotted keys reach nested ones (``answer_key=None``:
    ``ground_truth``, else verl's ``reward_model.ground_truth``); ``split`` picks the split of a
    ``DatasetDict``. Validation: ``val_path`` (read with ``val_split``) or ``val_fraction`` held out.
    ``max_prompt_length``: prompts longer than this many tokens are dropped (and counted) by
    :func:`~hybridflow.data.prompts.prepare_records` once the tokenizer is known. ``vision``: how rows' images are
    read and resized (:class:`~hybridflow.data.images.VisionData`).
    """

    prompt_key: str = "prompt"
    answer_key: str | None = None
    split: str = "train"
    val_path: str | list[str] | None = None
    val_split: str = "test"
    val_fraction: float = 0.0
    max_prompt_length: int | None = None
    vision: VisionData = field(default_factory=VisionData)

    def __post_init__(self) -> None:
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise FieldError("max_prompt_length", self.max_prompt_length, "must be a positive number of tokens")
        if not 0.0 <= self.val_fraction < 1.0:
            raise FieldError("val_fraction", self.val_fraction, "must be in [0, 1) (0: none held out)")
        if self.val_path and self.val_fraction:
            raise FieldError("val_fraction", self.val_fraction, "with val_path set too: validate on a separate file "
                             "or on a held-out fraction, not both", related=("val_path",))


@dataclass(frozen=True, kw_only=True)
class DataSpec(DataFiles):
    """Where prompts come from: ``path`` (a ``.jsonl`` / ``.parquet`` file or a ``datasets.save_to_disk``
    directory), read as :class:`DataFiles` says; ``seed`` picks a held-out validation fraction."""

    path: str | list[str]
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class DataSplits:
    """Training records and validation records (empty when no validation was asked for)."""

    train: list[Record]
    validation: list[Record]


def paths(value: str | Sequence[str] | None) -> list[str]:
    """A path key's files: one path, or a list of them (``[]`` when unset)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


# How one file becomes records, with load_records' signature (preference rows: load_preference_records).
Reader = Callable[..., list[Record]]


def load_files(value: str | Sequence[str], files: DataFiles, *, split: str, field: str,
               reader: Reader = load_records) -> list[Record]:
    """The records of every file ``value`` names (``field``: how the caller names it, indexed in errors for a list),
    each read by ``reader``."""
    names = paths(value)
    if not names:
        raise FieldError(field, reason="is an empty list; name at least one data file")
    records: list[Record] = []
    for i, name in enumerate(names):
        records += reader(name, prompt_key=files.prompt_key, answer_key=files.answer_key, split=split,
                                field=field if isinstance(value, str) else f"{field}[{i}]")
    return records


def load_splits(spec: DataSpec, *, prefix: str = "", reader: Reader = load_records) -> DataSplits:
    """The records ``spec`` names, split into train and validation (errors name a file's field after ``prefix``:
    how the caller spells the spec), each file read by ``reader``."""
    train = load_files(spec.path, spec, split=spec.split, field=prefix + "path", reader=reader)
    if spec.val_path:
        validation = load_files(spec.val_path, spec, split=spec.val_split, field=prefix + "val_path", reader=reader)
        return DataSplits(train=train, validation=validation)
    if spec.val_fraction:
        train, validation = hold_out(train, spec.val_fraction, seed=spec.seed)
        return DataSplits(train=train, validation=validation)
    return DataSplits(train=train, validation=[])


def hold_out(records: list[Record], fraction: float, *, seed: int = 0) -> tuple[list[Record], list[Record]]:
    """``(train, validation)``: a seeded ``fraction`` of the records (at least one) held out, order kept."""
    count = max(1, math.ceil(fraction * len(records)))
    if count >= len(records):
        raise FieldError("val_fraction", fraction, f"of {len(records)} records leaves no training records")
    held = set(np.random.default_rng(seed).permutation(len(records))[:count].tolist())
    return ([r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held])
