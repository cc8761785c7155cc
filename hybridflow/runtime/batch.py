"""A typed batch of rows: tensor fields (torch) and non-tensor fields (numpy object arrays).

Every field has the same number of rows. Token fields may differ in width across batches;
:meth:`Batch.concat` right-pads them. The wire format for Ray is plain numpy: a torch tensor through
the object store is ~20x slower than the same bytes as a numpy array (shared/notes/cpu-stack.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

Wire = dict[str, tuple[str, np.ndarray]]


@dataclass(frozen=True)
class Batch:
    """Rows of named fields; immutable (methods return new batches sharing storage where they can)."""

    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: Mapping[str, Any] = field(default_factory=dict)  # stored as numpy object arrays

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", dict(self.tensors))
        object.__setattr__(self, "non_tensors", {k: _object_array(v) for k, v in self.non_tensors.items()})
        sizes = {name: len(value) for name, value in self._items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the number of rows: {sizes}")
        overlap = set(self.tensors) & set(self.non_tensors)
        if overlap:
            raise ValueError(f"Batch fields {sorted(overlap)} are both tensor and non-tensor")

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> Batch:
        """Tensors stay tensors; anything else (lists of strings...) becomes a non-tensor field."""
        tensors = {k: v for k, v in fields.items() if isinstance(v, torch.Tensor)}
        return cls(tensors, {k: v for k, v in fields.items() if k not in tensors})

    def _items(self) -> Iterable[tuple[str, Any]]:
        yield from self.tensors.items()
        yield from self.non_tensors.items()

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the tensor fields (what a transfer of this batch moves, strings aside)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __len__(self) -> int:
        for _, value in self._items():
            return len(value)
        return 0

    def __contains__(self, name: object) -> bool:
        return name in self.tensors or name in self.non_tensors

    def __getitem__(self, name: str) -> Any:
        if name in self.tensors:
            return self.tensors[name]
        if name in self.non_tensors:
            return self.non_tensors[name]
        raise KeyError(f"batch has no field {name!r}; fields: {self.keys()}")

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    def select(self, names: Iterable[str], *, strict: bool = True) -> Batch:
        """Only the named fields (missing ones raise unless ``strict`` is False)."""
        wanted = [n for n in names if strict or n in self]
        for name in wanted:
            self[name]
        return Batch({n: self.tensors[n] for n in wanted if n in self.tensors},
                     {n: self.non_tensors[n] for n in wanted if n in self.non_tensors})

    def rename(self, mapping: Mapping[str, str]) -> Batch:
        """Fields renamed by ``mapping`` (old -> new); others keep their name."""
        return Batch({mapping.get(k, k): v for k, v in self.tensors.items()},
                     {mapping.get(k, k): v for k, v in self.non_tensors.items()})

    def union(self, other: Batch) -> Batch:
        """Fields of both; a field present in both must be the same object or equal."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        for name in set(self.keys()) & set(other.keys()):
            if self[name] is not other[name] and not _equal(self[name], other[name]):
                raise ValueError(f"union: field {name!r} differs between the two batches")
        return Batch({**self.tensors, **other.tensors}, {**self.non_tensors, **other.non_tensors})

    def slice(self, start: int, stop: int) -> Batch:
        return Batch({k: v[start:stop] for k, v in self.tensors.items()},
                     {k: v[start:stop] for k, v in self.non_tensors.items()})

    def index(self, rows: torch.Tensor) -> Batch:
        """Rows picked by an index tensor (a permutation, a repeat...)."""
        picked = rows.numpy()
        return Batch({k: v[rows] for k, v in self.tensors.items()},
                     {k: v[picked] for k, v in self.non_tensors.items()})

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of ``size`` rows (the last may be shorter)."""
        if size < 1:
            raise ValueError(f"split size {size} must be >= 1")
        return [self.slice(i, i + size) for i in range(0, len(self), size)]

    def chunk(self, parts: int) -> list[Batch]:
        """``parts`` consecutive, equal pieces; pad first (:meth:`pad_to_multiple`) if rows don't divide."""
        if parts < 1 or len(self) % parts:
            raise ValueError(f"cannot chunk {len(self)} rows into {parts} equal parts; pad_to_multiple first")
        size = len(self) // parts
        return [self.slice(i * size, (i + 1) * size) for i in range(parts)]

    def repeat_interleave(self, repeats: int) -> Batch:
        """Each row ``repeats`` times, copies adjacent (the n samples of a prompt stay contiguous)."""
        return self.index(torch.arange(len(self)).repeat_interleave(repeats))

    def pad_to_multiple(self, multiple: int) -> tuple[Batch, int]:
        """Rows padded (by repeating the last row) to a multiple of ``multiple``; returns the pad count.

        A padding row's ``response_mask`` and ``loss_mask`` are all zeros: it holds no response tokens, so a
        loss normalised by the mini batch's token and sequence counts gives it no weight (and counts it in neither).
        """
        pad = -len(self) % multiple
        if pad == 0:
            return self, 0
        rows = torch.cat([torch.arange(len(self)), torch.full((pad,), len(self) - 1)])
        padded = self.index(rows)
        masks = {}
        for name in ("response_mask", "loss_mask"):
            if name in padded.tensors:
                masks[name] = padded.tensors[name].clone()
                masks[name][len(self):] = 0
        return Batch({**padded.tensors, **masks}, padded.non_tensors), pad

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order; 2-D tensor fields of different widths are right-padded with 0."""
        if not batches:
            return Batch()
        names = batches[0].keys()
        for b in batches[1:]:
            if sorted(b.keys()) != sorted(names):
                raise ValueError(f"concat: batches have different fields {sorted(b.keys())} vs {sorted(names)}")
        tensors = {k: _cat_padded([b.tensors[k] for b in batches]) for k in batches[0].tensors}
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in batches[0].non_tensors}
        return Batch(tensors, non_tensors)

    def to_wire(self) -> Wire:
        """Numpy arrays (and dtype names) that Ray's object store ships without pickling torch."""
        wire: Wire = {k: (str(v.dtype), to_numpy(v)) for k, v in self.tensors.items()}
        wire.update({k: ("object", v) for k, v in self.non_tensors.items()})
        return wire

    @classmethod
    def from_wire(cls, wire: Wire) -> Batch:
        tensors: dict[str, torch.Tensor] = {}
        non_tensors: dict[str, np.ndarray] = {}
        for name, (dtype, array) in wire.items():
            if dtype == "object":
                non_tensors[name] = array
            else:
                tensors[name] = from_numpy(dtype, array)
        return cls(tensors, non_tensors)


def left_padded(sequences: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences as left-padded ``prompts`` and their ``prompt_mask``, both (B, longest) long tensors."""
    width = max(len(sequence) for sequence in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, width - len(sequence):] = torch.tensor(list(sequence), dtype=torch.long)
        mask[row, width - len(sequence):] = 1
    return ids, mask


def _object_array(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray) and value.dtype == object:
        return value
    array = np.empty(len(value), dtype=object)
    array[:] = list(value)
    return array


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's data as numpy (bf16 as its raw 16-bit words: numpy has no bfloat16)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy()
    return tensor.numpy()


def from_numpy(dtype: str, array: np.ndarray) -> torch.Tensor:
    """The tensor :func:`to_numpy` packed, given its torch dtype name (``str(tensor.dtype)``)."""
    # Arrays from the object store are read-only; torch wants writable memory.
    tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    return tensor.view(torch.bfloat16) if dtype == "torch.bfloat16" else tensor


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    if tensors[0].dim() == 2:
        width = max(t.shape[1] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors]
    return torch.cat(tensors)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(np.array_equal(a, b))
