"""What moving a policy's weights into its rollout engine costs: the in-place refresh of a colocated engine, its
wake/sleep, the shipment to a rollout on GPUs of its own and that engine's load (``docs/planner.md``, "Weight
sync"). Seconds and bytes per GPU, on a group :class:`~hybridflow.planner.costs.Shape`."""

from __future__ import annotations

from hybridflow.graph import RoleKind
from hybridflow.planner.costs import (
    COLLECTIVE_LATENCY_S,
    Shape,
    host_seconds,
    per_unshard,
    ring_seconds,
    shard_ranks,
    state_bytes,
    trainer_shard,
)
from hybridflow.planner.devices import DTYPE_BYTES
from hybridflow.planner.models import ModelSpec
from hybridflow.planner.offload import host_is_device_memory
from hybridflow.planner.plan import RoleLayout, Sharding

WEIGHT_TENSOR_S = 1e-3  # per weight tensor refreshed: its gather/broadcast call, conversion and engine load
ADAPTER_LOAD_S = 10e-3  # one in-memory LoRA load (vLLM add_lora): the engine takes the whole adapter in one call


def adapter_only(model: ModelSpec) -> bool:
    """Whether an update sends the rollout engine only a LoRA adapter (``LoraPlan.sync == "adapter"``: vLLM),
    its base loaded once; otherwise the engine takes the merged full weights."""
    return model.adapter is not None and model.adapter.sync == "adapter"


def sync_payload(model: ModelSpec, layout: RoleLayout) -> tuple[float, float]:
    """(bytes of one copy, fixed seconds) an update sends the rollout engine: the adapter in the role's dtype and
    one in-memory LoRA load (``ADAPTER_LOAD_S``), or the full (for LoRA: merged) weights and ``WEIGHT_TENSOR_S``
    per tensor. A vision tower goes only when it trains (frozen, the engine keeps the copy it loaded)."""
    tower = model.trained_vision_params * DTYPE_BYTES[layout.dtype]
    if adapter_only(model):
        return model.adapter_params * DTYPE_BYTES[layout.dtype] + tower, ADAPTER_LOAD_S
    return model.params * DTYPE_BYTES[layout.dtype] + tower, tensor_seconds(model)


def weight_sync(model: ModelSpec, layout: RoleLayout, shape: Shape) -> tuple[float, int]:
    """Seconds and bytes per GPU to refresh the rollout engine's weights after an update (in place): a ring of
    the engine's shard, and ``WEIGHT_TENSOR_S`` for each weight tensor (the refresh moves them one by one), or,
    adapter-only, a ring of the adapter's shard and one adapter load (:func:`sync_payload`)."""
    if layout.sharding is Sharding.NO_SHARD and layout.tp == layout.rollout_tp:
        return 0.0, 0
    full, fixed = sync_payload(model, layout)
    per_gpu = full / layout.rollout_tp
    seconds = ring_seconds(per_gpu, max(2, shape.size), shape.collective_bandwidth)
    return seconds + fixed, int(per_gpu)


def engine_switch(model: ModelSpec, kind: RoleKind, layout: RoleLayout, shape: Shape) -> float:
    """Seconds a colocated engine's wake and sleep cost per step: the engine's weights go to host memory
    and back when it sleeps (``RunSettings.rollout_sleep``), and an offloaded trainer's weights come in
    to be resharded into the engine: as hybridflow runs it (``per_unshard``) its parameter shard is copied in at the
    unshard and nothing is written back (on a CPU device nothing moves); verl's (``per_phase``) weights come in
    and leave again."""
    seconds = 0.0
    if shape.run.rollout_sleep:
        engine = (model.params + model.vision_params) * DTYPE_BYTES[layout.dtype] / layout.rollout_tp
        seconds += 2 * host_seconds(engine, shape)
    if kind.trainable and shape.run.offload_of(layout.role).params:
        if not per_unshard(kind, shape):
            seconds += 2 * host_seconds(state_bytes(model, kind, layout, shape)[0], shape)
        elif not host_is_device_memory(shape):
            seconds += host_seconds(trainer_shard(model, layout, shape).unshard_bytes, shape)
    return seconds


def weight_ship(model: ModelSpec, layout: RoleLayout, shape: Shape) -> tuple[float, int]:
    """Seconds and bytes to send a trainer's whole weights to a rollout on other GPUs after an update.

    The shards are gathered inside the trainer group, then one full copy leaves it, at the inter-node
    bandwidth (the rollout group may sit on another machine); receivers relay it among themselves
    (a broadcast tree), so the sender's link carries it once. The copy goes tensor by tensor (verl's
    one-step-off and fully-async syncs gather, broadcast and load each weight tensor in turn, without the
    checkpoint engine), so each tensor also costs ``WEIGHT_TENSOR_S``, as a colocated refresh does. Adapter-only
    (:func:`sync_payload`) the copy is the adapter's and goes in one load.
    """
    full, fixed = sync_payload(model, layout)
    gather = 0.0
    if layout.sharding is not Sharding.NO_SHARD:
        gather = ring_seconds(full / layout.tp, shard_ranks(layout, shape), shape.collective_bandwidth)
    return gather + full / shape.inter + COLLECTIVE_LATENCY_S + fixed, int(full)


def weight_load(model: ModelSpec, layout: RoleLayout, shape: Shape) -> float:
    """Seconds a detached rollout engine spends taking in the full weights shipped to it (``one_step_off``,
    ``async``: the rollout's GPUs receive the copy, so it adds to that pool's busy time). The same
    tensor-by-tensor loop as :func:`weight_ship` holds the engine: each tensor's ``load_weights`` call (adapter-only:
    the adapter's bytes and one load)."""
    full, fixed = sync_payload(model, layout)
    return full / shape.inter + COLLECTIVE_LATENCY_S + fixed


def tensor_seconds(model: ModelSpec) -> float:
    """``WEIGHT_TENSOR_S`` per weight tensor a refresh or shipment moves one by one (``ModelSpec.weight_tensors``)."""
    return model.weight_tensors * WEIGHT_TENSOR_S
