"""Sharded, resumable checkpoints of an FSDP2 model and its optimizer with torch DCP.

Each rank writes its own shards (no gather to rank 0); DCP reshards on load, so a checkpoint
saved on N ranks loads on M.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hybridflow.backends.common.checkpoint_errors import LOAD_ERRORS, unloadable


def save(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
         frozen: bool = True) -> None:
    """Model (and optimizer) shards of every rank into ``directory`` (a collective: every rank calls it).

    ``frozen=False`` leaves out parameters that do not train (a LoRA policy's base: its model directory's)."""
    import torch.distributed.checkpoint as dcp

    Path(directory).mkdir(parents=True, exist_ok=True)
    dcp.save(_state(model, optimizer, frozen=frozen), checkpoint_id=directory)


def load(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
         frozen: bool = True) -> None:
    """Restore what :func:`save` wrote (with the same ``frozen``), resharded onto this group's mesh."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not (Path(directory) / ".metadata").is_file():
        raise FileNotFoundError(f"no DCP checkpoint in {directory!r} (missing .metadata); was it saved by the fsdp "
                                "backend?")
    from torch.distributed.checkpoint.api import CheckpointException

    state = _state(model, optimizer, frozen=frozen)
    errors: tuple[type[BaseException], ...] = (CheckpointException, *LOAD_ERRORS)
    try:
        dcp.load(state, checkpoint_id=directory)
    except errors as err:  # a shard or .metadata truncated, garbled or missing
        raise unloadable(directory, err, backend="fsdp") from err
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=frozen))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, frozen: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    weights = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=not frozen))
    if not frozen:  # ignore_frozen_params keeps a frozen weight's tied alias (lm_head = embeddings): drop it too
        trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        weights = {name: value for name, value in weights.items() if name in trainable}
    state: dict[str, Any] = {"model": weights}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state
