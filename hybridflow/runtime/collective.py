"""Data-parallel collectives: threads of one process (local executor) or processes (Ray, torchrun)."""

from __future__ import annotations

import threading
from typing import Any

import torch


class ThreadGroup:
    """Shared state of in-process ranks; :meth:`member` gives each rank its collective."""

    def __init__(self, world_size: int, *, timeout_s: float = 300.0) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout_s)
        self.slots: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        self.objects: list[Any] = [None] * world_size

    def member(self, rank: int) -> ThreadCollective:
        return ThreadCollective(self, rank)


class ThreadCollective:
    """All-reduce among threads: every rank sums the same slots in the same order, so results agree."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def all_reduce_mean(self, tensors: list[torch.Tensor]) -> None:
        group = self.group
        group.slots[self.rank] = [t.detach().clone() for t in tensors]
        group.barrier.wait()
        means = [torch.stack([group.slots[r][i] for r in range(self.world_size)]).mean(dim=0)
                 for i in range(len(tensors))]
        group.barrier.wait()  # nobody overwrites a slot before everyone has read it
        for tensor, mean in zip(tensors, means, strict=True):
            tensor.copy_(mean)

    def all_gather_object(self, value: Any) -> list[Any]:
        group = self.group
        group.objects[self.rank] = value
        group.barrier.wait()
        gathered = list(group.objects)
        group.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return gathered


class ProcessGroupCollective:
    """All-reduce over a torch.distributed process group: the default one (a Ray group's own gloo world)
    or a subgroup of a larger world (one plan group of a torchrun job)."""

    def __init__(self, *, rank: int, world_size: int, group: Any = None, device: str = "cpu") -> None:
        self.rank, self.world_size, self.group, self.device = rank, world_size, group, device

    def all_reduce_mean(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        if not tensors:
            return
        if len(tensors) == 1 and _reducible_in_place(tensors[0], self.device):  # an engine's own flat buffer
            dist.all_reduce(tensors[0], group=self.group)
            tensors[0] /= self.world_size
            return
        # One flat buffer on the collective's device: a single all-reduce, and CPU flags ride with GPU grads.
        flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float32) for t in tensors])
        dist.all_reduce(flat, group=self.group)
        flat /= self.world_size
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


    def all_gather_object(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def start_sum(self, tensor: torch.Tensor) -> Any:
        """Start summing ``tensor`` (contiguous, fp32, on the collective's device) over the ranks, in place."""
        import torch.distributed as dist

        return dist.all_reduce(tensor, group=self.group, async_op=True)


def _reducible_in_place(tensor: torch.Tensor, device: str) -> bool:
    return (tensor.dtype == torch.float32 and tensor.is_contiguous() and tensor.device == torch.device(device)
            and not tensor.requires_grad)
