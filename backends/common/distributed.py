"""Joining the torch.distributed process group a sharded backend needs (FSDP, DeepSpeed).

The runtime's Ray executor initialises the default process group of each rank before it builds the
engines (:meth:`~hybridflow.runtime.worker.GroupWorker.init_collective`). Launched otherwise, a backend
joins from the standard ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` variables (``torchrun``),
or from an ``init_method`` in the role's options with the context's rank and world size.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.runtime.protocols import WorkerContext

_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def process_group_backend(device: str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if device.startswith("cuda") else "gloo"


def ensure_process_group(context: WorkerContext, options: Mapping[str, Any], *, role: str) -> None:
    """Initialise the default process group for ``context`` unless it already is, then check it matches.

    A group of one rank gets a private single-process group over an in-memory store (no TCP store, which
    would listen on every interface), so sharded code paths run unchanged on one device.
    """
    if context.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(context.device))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(options.get("timeout_s", 300)))
        backend = process_group_backend(context.device)
        init_method = options.get("init_method")
        if init_method is None and all(key in os.environ for key in _ENV_KEYS):
            dist.init_process_group(backend, timeout=timeout)
        elif init_method is None and context.world_size == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        elif init_method is None:
            raise RuntimeError(
                f"role {role!r}: rank {context.rank} of {context.world_size} has no torch.distributed process group; "
                "run it under the Ray executor, torchrun (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE), or set "
                "options.init_method (e.g. 'tcp://host:port')")
        else:
            dist.init_process_group(backend, init_method=str(init_method), rank=context.rank,
                                    world_size=context.world_size, timeout=timeout)
    if dist.get_world_size() != context.world_size or dist.get_rank() != context.rank:
        raise RuntimeError(
            f"role {role!r}: the default process group is rank {dist.get_rank()} of {dist.get_world_size()} but the "
            f"worker context says rank {context.rank} of {context.world_size}; a sharded backend needs one process "
            "per rank (use the Ray executor, not threads of the local executor)")


def all_ranks_finite(finite: bool) -> bool:
    """True when the flag holds on every rank of the default group (a MAX all-reduce of the failures)."""
    flag = torch.tensor([0.0 if finite else 1.0])
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() == 0.0)


def all_ranks_sum(values: list[float]) -> list[float]:
    """``values`` summed over every rank of the default group (the group a sharded engine trains over)."""
    flat = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        flat = flat.cuda()
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return [float(value) for value in flat.cpu()]


def all_ranks_max(value: int) -> int:
    """``value``'s maximum over every rank of the default group."""
    flat = torch.tensor([value], dtype=torch.long)
    if dist.get_backend() == "nccl":
        flat = flat.cuda()
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    return int(flat.item())
