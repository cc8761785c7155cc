"""The cost model: seconds and bytes per GPU of one role's nodes under one layout on one group shape.

Every formula is written out in ``docs/planner.md``. Costs depend on the group only through its
:class:`Shape` (device type and GPUs per machine), which is what lets the search memoise them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from hybridflow.graph import NodeLoad, Op, RoleKind
from hybridflow.planner.devices import DTYPE_BYTES, DeviceSpec
from hybridflow.planner.models import ModelSpec
from hybridflow.planner.plan import RoleLayout, Sharding

MFU_MAX = 0.5  # achievable fraction of dense peak FLOP/s for large micro batches (MFU of tuned FSDP/Megatron)
EFF_HALF_TOKENS = 512  # tokens per micro batch at which efficiency is half of MFU_MAX (small kernels underfill)
HBM_EFFICIENCY = 0.7  # achievable fraction of HBM bandwidth in memory-bound decode
COLLECTIVE_LATENCY_S = 20e-6  # fixed cost of one collective call (NCCL launch + hops)
USABLE_MEMORY = 0.9  # fraction of device memory a plan may use; the rest is CUDA context and fragmentation
DRIVER_SECONDS_PER_ROW = 1e-6  # driver-side compute nodes and reward functions, per sequence
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34  # Korthikanti et al. 2022, per layer, 16-bit, with flash attention

FULL_SHARDS = (Sharding.FULL_SHARD, Sharding.ZERO3, Sharding.HYBRID_SHARD)
FORWARD_OPS = (Op.LOGPROB, Op.REF_LOGPROB, Op.VALUES, Op.SCORE)


@dataclass(frozen=True)
class Shape:
    """What a group's cost depends on: its device type and how many GPUs it has on each machine."""

    device: DeviceSpec
    counts: tuple[int, ...]  # GPUs per machine, descending
    inter: float = 25e9  # the cluster's inter-node bandwidth per GPU (bytes/s)

    @cached_property
    def size(self) -> int:
        return sum(self.counts)

    @property
    def machines(self) -> int:
        return len(self.counts)

    @property
    def collective_bandwidth(self) -> float:
        """Per-GPU bandwidth of a ring over the whole group: the slowest hop sets it."""
        return self.device.link_bandwidth if self.machines == 1 else min(self.device.link_bandwidth, self.inter)

    def tp_allowed(self, tp: int) -> bool:
        """Tensor-parallel shards stay inside a machine: ``tp`` divides the group's count on every machine."""
        return all(count % tp == 0 for count in self._distinct)

    @cached_property
    def _distinct(self) -> frozenset[int]:
        return frozenset(self.counts)


@dataclass(frozen=True)
class Cost:
    """One node (or a role's share of a node) under a layout: seconds and peak transient bytes per GPU."""

    seconds: float
    transient_bytes: int


def efficiency(tokens_per_micro_batch: float) -> float:
    return MFU_MAX * tokens_per_micro_batch / (tokens_per_micro_batch + EFF_HALF_TOKENS)


def ring_seconds(bytes_per_gpu: float, ranks: int, bandwidth: float) -> float:
    """An all-gather or reduce-scatter of ``bytes_per_gpu`` (the full buffer) over ``ranks`` GPUs."""
    if ranks <= 1:
        return 0.0
    return bytes_per_gpu * (ranks - 1) / ranks / bandwidth + COLLECTIVE_LATENCY_S


def shard_ranks(layout: RoleLayout, shape: Shape) -> int:
    """How many DP ranks split the parameters: all of them, or one machine's worth for HYBRID_SHARD."""
    if layout.sharding is Sharding.HYBRID_SHARD:
        return max(1, min(layout.dp, shape.counts[-1] // layout.tp))
    return layout.dp


def static_bytes(model: ModelSpec, kind: RoleKind, layout: RoleLayout, shape: Shape) -> int:
    """Resident weights (+ gradients and Adam states for trainable roles) per GPU, by sharding strategy."""
    unit = DTYPE_BYTES[layout.dtype]
    params = model.params / layout.tp
    shards = shard_ranks(layout, shape)
    if not kind.trainable:
        return int(params * unit / (shards if layout.sharding in FULL_SHARDS else 1))
    # Mixed precision keeps fp32 master weights and Adam m, v (12 bytes); pure fp32 only m, v (8 bytes).
    optimizer = 8 if layout.dtype == "fp32" else 12
    weights, grads = params * unit, params * unit
    states = params * optimizer
    if layout.sharding is Sharding.NO_SHARD:
        total = weights + grads + states
    elif layout.sharding is Sharding.ZERO1:
        total = weights + grads + states / shards
    elif layout.sharding in (Sharding.ZERO2, Sharding.SHARD_GRAD_OP):
        total = weights + (grads + states) / shards
    else:
        total = (weights + grads + states) / shards
    return int(total)


def _gather_buffer(model: ModelSpec, layout: RoleLayout) -> int:
    """FSDP holds two unsharded layers at a time (the current and the prefetched one)."""
    if layout.sharding not in FULL_SHARDS:
        return 0
    return int(2 * model.params / model.layers / layout.tp * DTYPE_BYTES[layout.dtype])


def _activation_layer_bytes(model: ModelSpec, tokens: int, layout: RoleLayout) -> float:
    return ACTIVATION_BYTES_PER_TOKEN_HIDDEN * tokens * model.hidden * DTYPE_BYTES[layout.dtype] / 2 / layout.tp


def _logit_bytes(model: ModelSpec, kind: RoleKind, tokens: int, tp: int) -> float:
    """fp32 logits over the vocabulary for policies; value and reward heads emit one number per token."""
    return tokens * model.vocab * 4 / tp if kind in (RoleKind.POLICY, RoleKind.FROZEN_POLICY) else 0.0


def _tp_seconds(model: ModelSpec, tokens: int, collectives_per_layer: int, layout: RoleLayout, shape: Shape,
                tp: int) -> float:
    if tp <= 1:
        return 0.0
    size = tokens * model.hidden * DTYPE_BYTES[layout.dtype]
    per_call = 2 * size * (tp - 1) / tp / shape.device.link_bandwidth + COLLECTIVE_LATENCY_S
    return collectives_per_layer * model.layers * per_call


def forward_cost(model: ModelSpec, kind: RoleKind, load: NodeLoad, layout: RoleLayout, shape: Shape) -> Cost:
    """A forward-only pass (logprob, ref_logprob, values, score): 2·N FLOPs per token."""
    seq = load.tokens // max(load.sequences, 1)
    rows = math.ceil(load.sequences / layout.dp)
    mbs = min(layout.forward_micro_batch_size or layout.micro_batch_size, max(rows, 1))
    micro_batches = math.ceil(rows / mbs)
    peak = shape.device.peak_flops(layout.dtype)
    compute = 2 * model.params * rows * seq / layout.tp / (peak * efficiency(mbs * seq))
    tp_comm = micro_batches * _tp_seconds(model, mbs * seq, 2, layout, shape, layout.tp)
    gather = 0.0
    if layout.sharding in FULL_SHARDS:
        gather = micro_batches * ring_seconds(model.params / layout.tp * DTYPE_BYTES[layout.dtype],
                                              shard_ranks(layout, shape), shape.collective_bandwidth)
    transient = 2 * _activation_layer_bytes(model, mbs * seq, layout) + _logit_bytes(model, kind, mbs * seq,
                                                                                      layout.tp)
    return Cost(compute + tp_comm + gather, int(transient) + _gather_buffer(model, layout))


def update_cost(model: ModelSpec, kind: RoleKind, load: NodeLoad, layout: RoleLayout, shape: Shape) -> Cost:
    """Forward + backward (6·N FLOPs per token, 8·N with recomputation), gradient sync, optimizer step."""
    seq = load.tokens // max(load.sequences, 1)
    rows = math.ceil(load.sequences / layout.dp)
    mbs = min(layout.micro_batch_size, max(rows, 1))
    micro_batches = math.ceil(rows / mbs)
    unit = DTYPE_BYTES[layout.dtype]
    peak = shape.device.peak_flops(layout.dtype)
    flops_per_token = (8 if layout.gradient_checkpointing else 6) * model.params
    compute = flops_per_token * rows * seq / layout.tp / (peak * efficiency(mbs * seq))
    tp_comm = micro_batches * _tp_seconds(model, mbs * seq, 4, layout, shape, layout.tp)
    grad_bytes = model.params / layout.tp * unit
    ranks, bandwidth = shard_ranks(layout, shape), shape.collective_bandwidth
    if layout.sharding in FULL_SHARDS:
        # Parameters are gathered for every micro batch's forward and backward; gradients reduce-scattered.
        sync = (2 * micro_batches + 1) * ring_seconds(grad_bytes, ranks, bandwidth)
        if layout.sharding is Sharding.HYBRID_SHARD and layout.dp > ranks:
            sync += 2 * ring_seconds(grad_bytes / ranks, layout.dp // ranks, shape.inter)
    else:
        # One all-reduce (reduce-scatter + all-gather) per step; ZeRO variants gather updated shards instead.
        sync = 2 * ring_seconds(grad_bytes, layout.dp, bandwidth)
    optimizer_bytes = static_bytes(model, kind, layout, shape) * 2  # read and write every resident state once
    optimizer = optimizer_bytes / (shape.device.hbm_bandwidth * HBM_EFFICIENCY)
    tokens = mbs * seq
    layer = _activation_layer_bytes(model, tokens, layout)
    if layout.gradient_checkpointing:
        activations = model.layers * tokens * model.hidden * unit + layer
    else:
        activations = model.layers * layer
    transient = activations + 2 * _logit_bytes(model, kind, tokens, layout.tp) + 2 * _gather_buffer(model, layout)
    return Cost(compute + tp_comm + sync + optimizer, int(transient))


def generate_cost(model: ModelSpec, load: NodeLoad, prompt_len: int, layout: RoleLayout, shape: Shape) -> Cost:
    """Rollout: compute-bound prefill, then decode steps bound by reading weights and the KV cache.

    ``load.prompt_tokens`` counts each prompt once (shared by its samples); every sequence still attends
    to its whole ``prompt_len`` while decoding.
    """
    rtp, unit, device = layout.rollout_tp, DTYPE_BYTES[layout.dtype], shape.device
    engines = shape.size // rtp
    rows = max(load.sequences, 1)
    response = load.response_tokens // rows
    per_engine = math.ceil(rows / engines)
    batch = min(layout.rollout_batch_size or per_engine, per_engine)
    waves = math.ceil(per_engine / batch)
    peak = device.peak_flops(layout.dtype)
    prefill_tokens = math.ceil(load.prompt_tokens / engines)
    prefill = 2 * model.params * prefill_tokens / rtp / (peak * efficiency(batch * prompt_len))
    kv_split = min(rtp, model.kv_heads)
    kv_token = model.kv_bytes_per_token(unit) / kv_split
    context = prompt_len + response / 2
    weights = model.params * unit / rtp
    memory_s = (weights + batch * kv_token * context) / (device.hbm_bandwidth * HBM_EFFICIENCY)
    compute_s = 2 * model.params * batch / rtp / (peak * MFU_MAX)
    tp_s = 0.0
    if rtp > 1:
        size = 2 * batch * model.hidden * unit * (rtp - 1) / rtp
        tp_s = 2 * model.layers * (size / device.link_bandwidth + COLLECTIVE_LATENCY_S)
    decode = waves * response * (max(memory_s, compute_s) + tp_s)
    reuse = layout.sharding is Sharding.NO_SHARD and layout.tp == rtp
    kv_cache = batch * kv_token * (prompt_len + response)
    transient = (0 if reuse else weights) + kv_cache + batch * model.vocab * 4 / rtp
    return Cost(prefill + decode, int(transient))


def weight_sync(model: ModelSpec, layout: RoleLayout, shape: Shape) -> tuple[float, int]:
    """Seconds and bytes per GPU to refresh the rollout engine's weights after an update (in place)."""
    if layout.sharding is Sharding.NO_SHARD and layout.tp == layout.rollout_tp:
        return 0.0, 0
    per_gpu = model.params * DTYPE_BYTES[layout.dtype] / layout.rollout_tp
    return ring_seconds(per_gpu, max(2, shape.size), shape.collective_bandwidth), int(per_gpu)


def weight_ship(model: ModelSpec, layout: RoleLayout, shape: Shape) -> tuple[float, int]:
    """Seconds and bytes to send a trainer's whole weights to a rollout on other GPUs after an update.

    The shards are gathered inside the trainer group, then one full copy leaves it, at the inter-node
    bandwidth (the rollout group may sit on another machine); receivers relay it among themselves
    (a broadcast tree), so the sender's link carries it once.
    """
    full = model.params * DTYPE_BYTES[layout.dtype]
    gather = 0.0
    if layout.sharding is not Sharding.NO_SHARD:
        gather = ring_seconds(full / layout.tp, shard_ranks(layout, shape), shape.collective_bandwidth)
    return gather + full / shape.inter + COLLECTIVE_LATENCY_S, int(full)
