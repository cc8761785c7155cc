"""Rank functions of the vision tests (spawned gloo ranks import them by name)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from harness import context, layout, rank_rows, role_spec

from hybridflow.graph import RoleKind
from hybridflow.planner import Sharding
from hybridflow.runtime.batch import Batch


def fsdp_logprobs(rank: int, world_size: int, model_dir: str, wire: Any) -> dict[str, torch.Tensor]:
    """An FSDP (FULL_SHARD) frozen policy's log-probs of this rank's share of the rows, padded and packed."""
    from hybridflow.backends.fsdp import FsdpRoleEngine

    batch = rank_rows(Batch.from_wire(wire), rank, world_size)
    spec = dataclasses.replace(role_spec("ref", RoleKind.FROZEN_POLICY), model=model_dir)
    out = {}
    for padding in (True, False):
        engine = FsdpRoleEngine(spec, layout("ref", sharding=Sharding.FULL_SHARD, padding=padding,
                                             forward_micro_batch_size=1), context(rank, world_size))
        out["padded" if padding else "packed"] = engine.log_probs(batch)["logprobs"]
    return out
