"""Applying FSDP2 (``fully_shard``) to a Hugging Face model for one of the plan's sharding strategies.

Strategy -> FSDP2 (torchtitan's mapping):

- ``FULL_SHARD``: a 1-D mesh; parameters resharded after forward (ZeRO-3).
- ``SHARD_GRAD_OP``: the same mesh, parameters kept between forward and backward (ZeRO-2).
- ``NO_SHARD``: a 2-D (replicate=world, shard=1) mesh: every rank holds everything, gradients all-reduced.
- ``HYBRID_SHARD``: a 2-D (replicate, shard) mesh: fully sharded inside groups of ``shard_size`` ranks
  (one machine), replicated across them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.planner import Sharding
from hybridflow.runtime.weights import DTYPES

# FSDP has no optimizer-only sharding: a plan that asks ZeRO names of this backend gets the nearest strategy.
_ZERO_EQUIVALENT = {Sharding.ZERO1: Sharding.SHARD_GRAD_OP, Sharding.ZERO2: Sharding.SHARD_GRAD_OP,
                    Sharding.ZERO3: Sharding.FULL_SHARD}


@dataclass(frozen=True, kw_only=True)
class ShardingSetup:
    """The resolved strategy: mesh shape and names, and whether to reshard after forward."""

    strategy: Sharding
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    reshard_after_forward: bool


def resolve_sharding(sharding: Sharding, *, world_size: int, shard_size: int = 0) -> ShardingSetup:
    """The mesh for ``sharding`` over ``world_size`` ranks. ``shard_size`` (HYBRID_SHARD) of 0 takes
    ``LOCAL_WORLD_SIZE`` (ranks per machine) when set, else the whole group."""
    strategy = _ZERO_EQUIVALENT.get(sharding, sharding)
    if strategy is Sharding.FULL_SHARD:
        return ShardingSetup(strategy=strategy, mesh_shape=(world_size,), mesh_names=("shard",),
                             reshard_after_forward=True)
    if strategy is Sharding.SHARD_GRAD_OP:
        return ShardingSetup(strategy=strategy, mesh_shape=(world_size,), mesh_names=("shard",),
                             reshard_after_forward=False)
    if strategy is Sharding.NO_SHARD:
        return ShardingSetup(strategy=strategy, mesh_shape=(world_size, 1), mesh_names=("replicate", "shard"),
                             reshard_after_forward=False)
    size = shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if size < 1 or world_size % size:
        raise ValueError(f"options.shard_size={size} must divide the group's {world_size} ranks for HYBRID_SHARD "
                         "(ranks sharded together, usually the GPUs of one machine)")
    return ShardingSetup(strategy=strategy, mesh_shape=(world_size // size, size),
                         mesh_names=("replicate", "shard"), reshard_after_forward=True)


def shard_model(model: Any, setup: ShardingSetup, *, device_type: str, param_dtype: str | None) -> Any:
    """``fully_shard`` each transformer block, then the root; returns the (same, now FSDP) model.

    Blocks are the classes HF lists in ``model._no_split_modules``; ``param_dtype`` (bf16/fp16) computes
    in that precision over fp32 master weights, with gradients reduced in fp32.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, setup.mesh_shape, mesh_dim_names=setup.mesh_names)
    policy = MixedPrecisionPolicy()
    if param_dtype is not None and param_dtype != "fp32":
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=setup.reshard_after_forward)
    # The root holds the embeddings and head; it runs last in forward, so keeping it saves an all-gather.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


def transformer_blocks(model: Any) -> list[torch.nn.Module]:
    """The modules HF says must not be split across devices (decoder layers), in model order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} lists no _no_split_modules: cannot find its transformer blocks "
                         "to shard; FSDP would shard only the root (set options.shard_blocks=false to accept it)")
    return blocks


def fsdp_modules(model: torch.nn.Module) -> list[Any]:
    """Every module ``fully_shard`` was applied to (blocks and root)."""
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]
