"""Sharded, resumable checkpoints of an FSDP2 model and its optimizer with torch DCP.

Each rank writes its own shards (no gather to rank 0); DCP reshards on load, so a checkpoint
saved on N ranks loads on M.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Model (and optimizer) shards of every rank into ``directory`` (a collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    Path(directory).mkdir(parents=True, exist_ok=True)
    dcp.save(_state(model, optimizer), checkpoint_id=directory)


def load(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Restore what :func:`save` wrote, resharded onto this group's mesh."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if not (Path(directory) / ".metadata").is_file():
        raise FileNotFoundError(f"no DCP checkpoint in {directory!r} (missing .metadata); was it saved by the fsdp "
                                "backend?")
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state
