"""Whole weights out of a trainer and into a rollout on another group, and the wire format between them.

When a plan gives a policy's rollout GPUs of its own (``actor:rollout``), the controller ships the
trainer's weights there after every update: every trainer rank drains :func:`full_weights` (FSDP and
ZeRO-3 gather each parameter collectively), rank 0 packs them as numpy, and each rollout rank loads
them into its engine. A LoRA policy whose rollout takes adapters ships :func:`adapter_weights` alone
(:class:`AdapterShipment`). Under Ray the packed weights go from the trainer's node to the rollout's through
the object store without passing through the controller.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.runtime.batch import from_numpy, to_numpy
from hybridflow.runtime.protocols import AdapterModel, TrainedWeightSource, WeightSource

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # plan dtype names -> torch

StateWire = dict[str, tuple[str, np.ndarray]]
"""A state dict as ``{name: (torch dtype name, numpy array)}``: a :data:`~hybridflow.runtime.batch.Wire`
(same codec) without a batch's rule that every entry has the same number of rows."""

Shipment = tuple[StateWire, dict[str, str]]
"""Weights on their way to another group: the packed tensors and ``{alias: name}`` for tied copies,
which travel as a name rather than as bytes (the receiver points the alias at the tensor)."""


@dataclass(frozen=True, kw_only=True)
class AdapterShipment:
    """A LoRA policy's adapter on its way to a rollout that takes adapters (:class:`~hybridflow.runtime.protocols.
    AdapterSink`): the packed peft-named tensors and peft's ``adapter_config.json`` content. The base stays where
    the rollout loaded it, so only these bytes travel."""

    tensors: StateWire
    config: dict[str, Any]


def full_weights(engine: WeightSource, dtype: str, *, trained_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """An engine's whole weights, one tensor at a time, floating tensors cast to ``dtype`` (a plan dtype).

    Casting here makes the bytes that travel the planner's ``params x dtype`` estimate. ``trained_only`` (a sync to
    a rollout that loaded the same model) leaves out the weights that never train, where the engine names them
    (:class:`~hybridflow.runtime.protocols.TrainedWeightSource`: a frozen vision tower).
    """
    if dtype not in DTYPES:
        raise ValueError(f"weight dtype {dtype!r} must be one of {sorted(DTYPES)}")
    source = engine.iter_trained_weights() if trained_only and isinstance(engine, TrainedWeightSource) \
        else engine.iter_full_weights()
    for name, tensor in source:
        yield name, tensor.to(DTYPES[dtype]) if tensor.is_floating_point() else tensor


def adapter_weights(engine: AdapterModel, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """An engine's LoRA adapter (peft names), one tensor at a time, cast to ``dtype`` like :func:`full_weights`."""
    if dtype not in DTYPES:
        raise ValueError(f"weight dtype {dtype!r} must be one of {sorted(DTYPES)}")
    for name, tensor in engine.iter_adapter_weights():
        yield name, tensor.to(DTYPES[dtype]) if tensor.is_floating_point() else tensor


def state_to_wire(named: Iterable[tuple[str, torch.Tensor]]) -> StateWire:
    """Whole weights as numpy for another group (numpy through Ray's object store is ~20x faster than
    pickled torch tensors: shared/notes/cpu-stack.md)."""
    return {name: (str(tensor.dtype), to_numpy(tensor.contiguous())) for name, tensor in named}


def state_from_wire(wire: StateWire) -> dict[str, torch.Tensor]:
    """The tensors :func:`state_to_wire` packed."""
    return {name: from_numpy(dtype, array) for name, (dtype, array) in wire.items()}


def wire_bytes(wire: StateWire) -> int:
    return sum(array.nbytes for _, array in wire.values())


@dataclass(frozen=True, kw_only=True)
class WeightSyncStats:
    """One weight refresh of a rollout, reported per step: shipped to a detached rollout by the controller,
    or handed over in process by a hybrid engine (where ``largest_tensor_bytes`` is the most memory it
    held beyond the two engines' own weights)."""

    seconds: float  # from the trainer's first gather to the last rollout rank's load
    bytes: int  # one full copy, in the rollout's dtype (what leaves the trainer)
    tensors: int
    receivers: int = 1  # rollout ranks that loaded it
    largest_tensor_bytes: int = 0

    def metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        return {prefix + "seconds": self.seconds, prefix + "bytes": float(self.bytes),
                prefix + "tensors": float(self.tensors), prefix + "receivers": float(self.receivers),
                prefix + "largest_tensor_bytes": float(self.largest_tensor_bytes)}


class CountedWeights:
    """A (name, tensor) stream that counts what flows through it, for a :class:`WeightSyncStats`."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.named, self.bytes, self.tensors, self.largest = named, 0, 0, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.named:
            size = tensor.numel() * tensor.element_size()
            self.bytes += size
            self.tensors += 1
            self.largest = max(self.largest, size)
            yield name, tensor

    def stats(self, seconds: float) -> WeightSyncStats:
        return WeightSyncStats(seconds=seconds, bytes=self.bytes, tensors=self.tensors,
                               largest_tensor_bytes=self.largest)
