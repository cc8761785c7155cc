"""Applying FSDP2 (``fully_shard``) to a Hugging Face model for one of the plan's sharding strategies.

Strategy -> FSDP2 (torchtitan's mapping):

- ``FULL_SHARD``: a 1-D mesh; parameters resharded after forward (ZeRO-3).
- ``SHARD_GRAD_OP``: the same mesh, parameters kept between forward and backward (ZeRO-2).
- ``NO_SHARD``: a 2-D (replicate=world, shard=1) mesh: every rank holds everything, gradients all-reduced.
- ``HYBRID_SHARD``: a 2-D (replicate, shard) mesh: fully sharded inside groups of ``shard_size`` ranks
  (one machine), replicated across them.

With tensor parallelism (``tp`` > 1) the mesh gains an innermost ``tp`` dimension (FSDP2 x TP, torchtitan's 2-D
parallelism): consecutive ranks split each block's projections (:mod:`.tensor_parallel`), and the data-parallel
dimensions above shard or replicate those splits as the strategy says. The controller gives the ranks of one
tensor-parallel slice the same rows (``runtime.dispatch``), which is why ``tp`` is innermost.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.planner import Sharding
from hybridflow.runtime.weights import DTYPES

_LOG = logging.getLogger(__name__)

# The FSDP strategy a ZeRO stage corresponds to, for the error that refuses one: a plan never gives this backend
# a ZeRO name (its LayoutSupport leaves them out, refused before any engine loads), so none is translated here.
_FSDP_NAME_OF = {Sharding.ZERO1: "none (ZeRO-1 shards optimizer states only)", Sharding.ZERO2: "SHARD_GRAD_OP",
                 Sharding.ZERO3: "FULL_SHARD"}


@dataclass(frozen=True, kw_only=True)
class ShardingSetup:
    """The resolved strategy: mesh shape and names, and whether to reshard after forward."""

    strategy: Sharding
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    reshard_after_forward: bool


def resolve_sharding(sharding: Sharding, *, world_size: int, shard_size: int = 0, tp: int = 1) -> ShardingSetup:
    """The data-parallel mesh for ``sharding`` over ``world_size`` data-parallel ranks (the group's ranks over
    ``tp``). ``shard_size`` (HYBRID_SHARD) of 0 takes the data-parallel ranks of one machine (``LOCAL_WORLD_SIZE``
    over ``tp``) when set, else the whole group."""
    if sharding in _FSDP_NAME_OF:
        raise ValueError(f"sharding={sharding.value}: FSDP runs no ZeRO stage (its equivalent: "
                         f"{_FSDP_NAME_OF[sharding]}); use backend deepspeed for ZeRO, or the FSDP strategy")
    strategy = sharding
    if strategy is Sharding.FULL_SHARD:
        return ShardingSetup(strategy=strategy, mesh_shape=(world_size,), mesh_names=("shard",),
                             reshard_after_forward=True)
    if strategy is Sharding.SHARD_GRAD_OP:
        return ShardingSetup(strategy=strategy, mesh_shape=(world_size,), mesh_names=("shard",),
                             reshard_after_forward=False)
    if strategy is Sharding.NO_SHARD:
        return ShardingSetup(strategy=strategy, mesh_shape=(world_size, 1), mesh_names=("replicate", "shard"),
                             reshard_after_forward=False)
    size = shard_size or max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size * tp)) // tp)
    if size < 1 or world_size % size:
        raise ValueError(f"options.shard_size={size} must divide the group's {world_size} ranks for HYBRID_SHARD "
                         "(ranks sharded together, usually the GPUs of one machine)")
    return ShardingSetup(strategy=strategy, mesh_shape=(world_size // size, size),
                         mesh_names=("replicate", "shard"), reshard_after_forward=True)


def offload_policy(offloaded: frozenset[str], *, device_type: str, role: str) -> Any:
    """FSDP2's policy for a layout's offloaded parts: ``CPUOffloadPolicy`` for parameters, gradients and optimizer
    states together (FSDP2 offloads the three at once), the default (nothing offloaded) otherwise.

    On a CPU device every tensor already lives in host memory, which is what offload asks, and FSDP2's policy
    refuses to run there ("Cannot access accelerator device"): the default policy is used, with a warning.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not offloaded:
        return OffloadPolicy()
    if offloaded != frozenset({"params", "grads", "optimizer"}):
        raise ValueError(f"RoleLayout({role}) offloads {sorted(offloaded)}: FSDP2's CPUOffloadPolicy keeps parameters, "
                         "gradients and optimizer states in host memory together; set offload_params, offload_grads "
                         "and offload_optimizer (a role's offload: [params, grads, optimizer]) or none")
    if device_type == "cpu":
        _LOG.warning("role %r: offload %s on device cpu: its tensors are in host memory already, FSDP2's "
                     "CPUOffloadPolicy (an accelerator's) is not applied", role, sorted(offloaded))
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=True)


def shard_model(model: Any, setup: ShardingSetup, *, device_type: str, param_dtype: str | None, tp: int = 1,
                offload: Any = None, role: str = "") -> Any:
    """``fully_shard`` each transformer block, then the root; returns the (same, now FSDP) model.

    Blocks are the classes HF lists in ``model._no_split_modules``; ``param_dtype`` (bf16/fp16) computes
    in that precision over fp32 master weights, with gradients reduced in fp32. ``tp`` > 1 splits each block
    over the innermost ``tp`` ranks first (:func:`.tensor_parallel.apply_tensor_parallel`). ``offload``: an FSDP2
    offload policy (:func:`offload_policy`); with ``CPUOffloadPolicy`` sharded parameters, gradients and optimizer
    states live in host memory, each block's parameters are copied in for its all-gather, and the optimizer steps
    on the CPU.
    """
    from hybridflow.backends.fsdp.tensor_parallel import apply_tensor_parallel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    names = setup.mesh_names + (("tp",) if tp > 1 else ())
    mesh = init_device_mesh(device_type, setup.mesh_shape + ((tp,) if tp > 1 else ()), mesh_dim_names=names)
    data_mesh = mesh[setup.mesh_names] if tp > 1 else mesh
    policy = MixedPrecisionPolicy()
    if param_dtype is not None and param_dtype != "fp32":
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    offload_policy = offload if offload is not None else OffloadPolicy()
    blocks = transformer_blocks(model)
    if tp > 1:
        apply_tensor_parallel(blocks, mesh["tp"], config=model.config, role=role)
    for block in blocks:
        fully_shard(block, mesh=data_mesh, mp_policy=policy, reshard_after_forward=setup.reshard_after_forward,
                    offload_policy=offload_policy)
    # The root holds the embeddings and head; it runs last in forward, so keeping it saves an all-gather.
    fully_shard(model, mesh=data_mesh, mp_policy=policy, reshard_after_forward=False, offload_policy=offload_policy)
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
