"""Whole weights out of a trainer and into a rollout on another group, and the wire format between them.

When a plan gives a policy's rollout GPUs of its own (``actor:rollout``), the controller ships the
trainer's weights there after every update: every trainer rank drains :func:`full_weights` (FSDP and
ZeRO-3 gather each parameter collectively), rank 0 packs them as numpy, and each rollout rank loads
them into its engine. Under Ray the packed weights go from the trainer's node to the rollout's through
the object store without passing through the controller.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # plan dtype names -> torch

StateWire = dict[str, tuple[str, np.ndarray]]
"""A state dict as ``{name: (torch dtype name, numpy array)}``: what Ray's object store ships cheaply."""

Shipment = tuple[StateWire, dict[str, str]]
"""Weights on their way to another group: the packed tensors and ``{alias: name}`` for tied copies,
which travel as a name rather than as bytes (the receiver points the alias at the tensor)."""


def full_weights(engine: Any, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """An engine's whole weights, one tensor at a time, floating tensors cast to ``dtype`` (a plan dtype).

    Engines that gather shards (``iter_full_weights``: FSDP, DeepSpeed) stream; others give ``state_dict``.
    Casting here makes the bytes that travel the planner's ``params x dtype`` estimate.
    """
    if dtype not in DTYPES:
        raise ValueError(f"weight dtype {dtype!r} must be one of {sorted(DTYPES)}")
    stream = getattr(engine, "iter_full_weights", None)
    named = stream() if stream is not None else engine.state_dict().items()
    for name, tensor in named:
        yield name, tensor.to(DTYPES[dtype]) if tensor.is_floating_point() else tensor


def tied_aliases(engine: Any) -> dict[str, str]:
    """``{alias: name}`` for weights an engine's model holds twice under two names (tied embeddings).

    A state dict lists a tied ``lm_head.weight`` beside ``embed_tokens.weight``; only one needs to
    travel. Engines without a ``model`` module have none to report.
    """
    model = getattr(engine, "model", None)
    if not isinstance(model, torch.nn.Module):
        return {}
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def state_to_wire(named: Iterable[tuple[str, torch.Tensor]]) -> StateWire:
    """Whole weights as numpy for another group (bf16 travels as its raw 16-bit words, numpy has no bf16).

    Through Ray's object store numpy is ~20x faster than pickled torch tensors (shared/notes/cpu-stack.md).
    """
    wire: StateWire = {}
    for name, tensor in named:
        tensor = tensor.detach().cpu().contiguous()
        raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        wire[name] = (str(tensor.dtype), raw.numpy())
    return wire


def state_from_wire(wire: StateWire) -> dict[str, torch.Tensor]:
    """The tensors :func:`state_to_wire` packed (read-only object-store arrays are copied once)."""
    state = {}
    for name, (dtype, array) in wire.items():
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
        state[name] = tensor.view(torch.bfloat16) if dtype == "torch.bfloat16" else tensor
    return state


def wire_bytes(wire: StateWire) -> int:
    return sum(array.nbytes for _, array in wire.values())


@dataclass(frozen=True, kw_only=True)
class ShipStats:
    """One shipment of a policy's weights to its rollout group, as the controller reports it per step."""

    seconds: float  # from the trainer's first gather to the last rollout rank's load
    bytes: int  # one full copy, in the rollout's dtype (what leaves the trainer group)
    tensors: int
    receivers: int  # rollout ranks that loaded it

    def metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        return {prefix + "seconds": self.seconds, prefix + "bytes": float(self.bytes),
                prefix + "tensors": float(self.tensors), prefix + "receivers": float(self.receivers)}
