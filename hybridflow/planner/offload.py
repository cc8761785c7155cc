"""What a trainable role's CPU offload costs as hybridflow runs it (``Framework.trainable_offload="per_unshard"``).

FSDP2's ``CPUOffloadPolicy`` (hybridflow's fsdp backend) keeps a role's sharded parameters, gradients and optimizer
states in host memory: each unit's (decoder layer's) shard is copied in at its all-gather, its reduced gradients
are copied out after its reduce-scatter, and the fused AdamW steps the host tensors on the rank's host thread.
ZeRO-Offload (the deepspeed backend) moves the same parts: gradient partitions out after their reduction, the step
on the host (DeepSpeed's CPU Adam), the updated 16-bit partition back in; with ZeRO-3's ``offload_param`` the
partitions come in at each gather. Nothing here is fitted: bytes over the host link (``costs.host_seconds``) and
the host optimizer's measured rate (``HOST_OPTIMIZER_BYTES_S``). ``costs.update_cost`` and ``costs.forward_cost``
compute the bytes and counts; verl's per-phase swap (``per_phase``) stays there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridflow.planner.settings import Offload

if TYPE_CHECKING:
    from hybridflow.planner.costs import Shape

# Fused AdamW (torch.optim.AdamW(fused=True), what hybridflow's fsdp backend builds) over fp32 CPU tensors on one
# thread, counted as every byte of HOST_ADAM_BYTES_PER_PARAM read or written once: benchmarks/host_optimizer.py,
# docs/benchmarks.md ("The host optimizer's rate").
HOST_OPTIMIZER_BYTES_S = 25e9
HOST_ADAM_BYTES_PER_PARAM = 2 * (4 + 4 + 4 + 4)  # fp32 weight, gradient and both moments, read and written


@dataclass(frozen=True, kw_only=True)
class TrainerShard:
    """One GPU's share of a trainable role's state as offload moves it (bytes; parameters as counts)."""

    unshard_bytes: float  # the parameter shard one unshard copies in
    gradient_bytes: float  # the reduced gradient shard one reduction copies out
    weight_bytes: float  # the updated trained shard in the role's dtype (ZeRO-Offload copies it back in)
    trained_params: float  # parameters this GPU's optimizer steps
    units: float  # the units (decoder layers) a pass unshards one after another


@dataclass(frozen=True, kw_only=True)
class HostTraffic:
    """Seconds an offloaded role's pass or update spends on the host link and the host, per GPU."""

    beside: float = 0.0  # copies on the collectives' streams, overlapping the passes (costs.overlapped)
    after: float = 0.0  # after the passes: copies that follow a reduction or a step, and the host optimizer step
    device_optimizer: bool = True  # the optimizer step runs on the device (its states are there)
    transient_bytes: float = 0.0  # device bytes the copies hold at once: two units' shards in, one's gradients out


def host_seconds(nbytes: float, shape: Shape) -> float:
    """Moving ``nbytes`` per GPU between device and host memory (all GPUs of a machine in parallel)."""
    return nbytes / (shape.device.host_bandwidth * shape.constants.host_efficiency)


def host_is_device_memory(shape: Shape) -> bool:
    """A CPU logical GPU's tensors live in host memory already: offload moves nothing there (hybridflow's fsdp
    backend applies no ``CPUOffloadPolicy`` on a CPU device, ``backends/fsdp/parallelize.offload_policy``)."""
    return shape.device.link == "host"


def host_optimizer_seconds(params: float) -> float:
    """One fused AdamW step over ``params`` fp32 parameters on the host."""
    return params * HOST_ADAM_BYTES_PER_PARAM / HOST_OPTIMIZER_BYTES_S


def update_traffic(offload: Offload, shard: TrainerShard, *, unshards: int, reductions: int, reductions_beside: bool,
                   steps: int, shape: Shape) -> HostTraffic:
    """An update's offload, per unshard: ``unshards`` copies of the parameter shard in (beside the all-gathers they
    feed), ``reductions`` of the gradient shard out (beside the passes when the reduce-scatters are, else after),
    and per optimizer step either the host step (optimizer states in host memory) or, when only one of parameters
    and optimizer is offloaded, the updated weights across the link once (ZeRO-Offload: in; ZeRO-3's
    ``offload_param`` alone: out)."""
    if not offload.any or host_is_device_memory(shape):
        return HostTraffic()
    params_in = unshards * host_seconds(shard.unshard_bytes, shape) if offload.params else 0.0
    grads_out = 0.0
    if offload.grads or offload.optimizer:  # a host optimizer steps on host gradients
        grads_out = reductions * host_seconds(shard.gradient_bytes, shape)
    after = 0.0 if reductions_beside else grads_out
    beside = params_in + (grads_out if reductions_beside else 0.0)
    if offload.optimizer:
        after += steps * host_optimizer_seconds(shard.trained_params)
    if offload.params != offload.optimizer:
        after += steps * host_seconds(shard.weight_bytes, shape)
    units = max(shard.units, 1.0)
    transient = ((2 * shard.unshard_bytes if offload.params else 0.0)
                 + (shard.gradient_bytes if offload.grads or offload.optimizer else 0.0)) / units
    return HostTraffic(beside=beside, after=after, device_optimizer=not offload.optimizer, transient_bytes=transient)


def forward_traffic(offload: Offload, shard: TrainerShard, *, unshards: int, shape: Shape) -> HostTraffic:
    """A forward-only pass of an offloaded trainable role: its parameter shard comes in at every unshard and is not
    written back."""
    if not offload.params or host_is_device_memory(shape):
        return HostTraffic()
    return HostTraffic(beside=unshards * host_seconds(shard.unshard_bytes, shape),
                       transient_bytes=2 * shard.unshard_bytes / max(shard.units, 1.0))
