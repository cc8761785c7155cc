"""The cost model: seconds and bytes per GPU of one role's nodes under one layout on one group shape.

Every formula is written out in ``docs/planner.md``. Costs depend on the group only through its
:class:`Shape` (device type and GPUs per machine), which is what lets the search memoise them.

One file over 400 lines on purpose: it is the model docs/planner.md writes out term by term, one function per
term, read side by side with that page; split, the terms a step's time adds up would sit in several modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from hybridflow.graph import NodeLoad, Op, RoleKind
from hybridflow.planner.calibration import DEFAULT_CONSTANTS, Constants
from hybridflow.planner.devices import DTYPE_BYTES, DeviceSpec
from hybridflow.planner.flops import (
    LM_HEAD_KINDS,
    NONMATMUL_HBM_EFFICIENCY,
    flops_per_token,
    nonmatmul_bytes_per_token,
    vision_flops_per_token,
    vision_nonmatmul_bytes_per_token,
)
from hybridflow.planner.models import ModelSpec
from hybridflow.planner.offload import HostTraffic, TrainerShard, forward_traffic, host_seconds, update_traffic
from hybridflow.planner.overlays import ControllerOverlay, controller_seconds
from hybridflow.planner.plan import RoleLayout, Sharding
from hybridflow.planner.settings import DEFAULT_SETTINGS, RunSettings

# Efficiencies (train MFU, HBM, decode, host link) and overheads are calibrated: see calibration.py.
COLLECTIVE_LATENCY_S = 20e-6  # fixed cost of one collective call (NCCL launch + hops)
INTER_NODE_LATENCY_S = 50e-6  # a small collective across machines: NIC and switch hops, about 2.5x NVLink's
EAGER_LAYER_OVERHEAD_S = 250e-6  # per layer and decode step without CUDA graphs: ~20 launches + Python dispatch
USABLE_MEMORY = 0.9  # fraction of device memory a plan may use; the rest is CUDA context and fragmentation
DRIVER_SECONDS_PER_ROW = 1e-6  # driver-side compute nodes and reward functions, per sequence
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34  # Korthikanti et al. 2022, per layer, 16-bit, with flash attention
FULL_SHARDS = (Sharding.FULL_SHARD, Sharding.ZERO3, Sharding.HYBRID_SHARD)
FSDP_SHARDINGS = (Sharding.FULL_SHARD, Sharding.SHARD_GRAD_OP, Sharding.HYBRID_SHARD)  # torch FSDP's own names
FORWARD_OPS = (Op.LOGPROB, Op.REF_LOGPROB, Op.VALUES, Op.SCORE)


@dataclass(frozen=True)
class Shape:
    """What a group's cost depends on: its device type and how many GPUs it has on each machine."""

    device: DeviceSpec
    counts: tuple[int, ...]  # GPUs per machine, descending
    inter: float = 25e9  # the cluster's inter-node bandwidth per GPU (bytes/s)
    run: RunSettings = DEFAULT_SETTINGS  # the run's step recipe (lengths, mini-batches, offload...)
    constants: Constants = DEFAULT_CONSTANTS  # the device's calibrated efficiencies
    overlay: ControllerOverlay | None = None  # another framework's costs, when pricing its runs (overlays.py)

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

    def span_bandwidth(self, ranks: int) -> float:
        """Per-GPU bandwidth of a collective over ``ranks`` consecutive GPUs: NVLink while they share a
        machine, the inter-node link once they span machines."""
        return self.device.link_bandwidth if ranks <= self.counts[-1] else min(self.device.link_bandwidth, self.inter)

    def latency(self, ranks: int) -> float:
        """Fixed cost of one small collective over ``ranks`` consecutive GPUs."""
        return COLLECTIVE_LATENCY_S if ranks <= self.counts[-1] else INTER_NODE_LATENCY_S

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


def efficiency(tokens_per_micro_batch: float, constants: Constants = DEFAULT_CONSTANTS) -> float:
    """Achieved fraction of the device's GEMM ceiling (``DeviceSpec.matmul_flops``) for a micro batch of this many
    tokens per GPU: small ones underfill."""
    return constants.train_mfu * tokens_per_micro_batch / (tokens_per_micro_batch + constants.eff_half_tokens)


def ring_seconds(bytes_per_gpu: float, ranks: int, bandwidth: float) -> float:
    """An all-gather or reduce-scatter of ``bytes_per_gpu`` (the full buffer) over ``ranks`` GPUs."""
    if ranks <= 1:
        return 0.0
    return bytes_per_gpu * (ranks - 1) / ranks / bandwidth + COLLECTIVE_LATENCY_S


def shard_ranks(layout: RoleLayout, shape: Shape) -> int:
    """How many ranks split one pipeline stage's parameters and states: the stage's ranks (``dp / pp``: each
    stage holds its own layers, so its shards spread over its own data and sequence parallel ranks, as FSDP and
    Megatron's distributed optimizer over DP x CP do), or one machine's worth for HYBRID_SHARD."""
    stage = max(1, layout.dp // layout.pp)
    if layout.sharding is Sharding.HYBRID_SHARD:
        return max(1, min(stage, layout.shard_size or shape.counts[-1] // layout.tp))
    return stage


def stage_params(model: ModelSpec, layout: RoleLayout) -> float:
    """Weights one GPU's tensor/pipeline/expert slice holds before data-parallel sharding: experts split
    over the expert-parallel ranks (one expert per rank slice, Megatron's ETP=1), else with the dense parts. A
    vision tower splits over TP and sits whole on the first stage (the GPU the slice is sized for)."""
    dense = (model.params - model.expert_params) / layout.tp
    experts = model.expert_params / (layout.ep if layout.ep > 1 else layout.tp)
    return (dense + experts) / layout.pp + model.vision_params / layout.tp


def adapter_stage_params(model: ModelSpec, layout: RoleLayout) -> float:
    """A LoRA adapter's weights on one GPU's tensor/pipeline slice (split as the layers they adapt); 0 without."""
    return model.adapter_params / (layout.tp * layout.pp)


def trainable_stage_params(model: ModelSpec, layout: RoleLayout) -> float:
    """The weights one GPU's slice trains before data-parallel sharding: the adapter's, or all of them; a frozen
    vision tower's never."""
    tower = model.trained_vision_params / layout.tp
    if model.adapter is not None:
        return adapter_stage_params(model, layout) + tower
    return stage_params(model, layout) - model.vision_params / layout.tp + tower


def state_bytes(model: ModelSpec, kind: RoleKind, layout: RoleLayout, shape: Shape) -> tuple[float, float, float]:
    """Resident (weights, gradients, optimizer states) bytes per GPU by sharding strategy, before offload.

    With a LoRA adapter the weights are the frozen base plus the adapter, in the role's dtype; gradients and
    optimizer states are the adapter's alone."""
    unit = DTYPE_BYTES[layout.dtype]
    params = stage_params(model, layout) + adapter_stage_params(model, layout)
    shards = shard_ranks(layout, shape)
    if not kind.trainable:
        return params * unit / (shards if layout.sharding in FULL_SHARDS else 1), 0.0, 0.0
    trained = trainable_stage_params(model, layout)
    # Mixed precision keeps fp32 master weights and Adam m, v (12 bytes); pure fp32 only m, v (8 bytes).
    states = trained * (8 if layout.dtype == "fp32" else 12)
    weights, grads = params * unit, trained * unit
    if layout.sharding is Sharding.NO_SHARD:
        return weights, grads, states
    if layout.sharding is Sharding.ZERO1:
        return weights, grads, states / shards
    if layout.sharding in (Sharding.ZERO2, Sharding.SHARD_GRAD_OP):
        return weights, grads / shards, states / shards
    return weights / shards, grads / shards, states / shards


def offloaded_bytes(model: ModelSpec, kind: RoleKind, layout: RoleLayout, shape: Shape) -> float:
    """Bytes per GPU the role keeps in host memory between its phases (they return for each phase)."""
    offload = shape.run.offload_of(layout.role)
    weights, grads, states = state_bytes(model, kind, layout, shape)
    return weights * offload.params + grads * offload.grads + states * offload.optimizer


def static_bytes(model: ModelSpec, kind: RoleKind, layout: RoleLayout, shape: Shape) -> int:
    """Resident weights (+ gradients and Adam states for trainable roles) per GPU, less what is offloaded."""
    return int(sum(state_bytes(model, kind, layout, shape)) - offloaded_bytes(model, kind, layout, shape))


ZERO_SHARDINGS = (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3)


def trainer_shard(model: ModelSpec, layout: RoleLayout, shape: Shape) -> TrainerShard:
    """A trainable role's state on one GPU as offload moves it (``offload.TrainerShard``). The parameter shard is
    the fp32 master under FSDP (FSDP2 keeps it as the sharded parameter and casts it at the all-gather, hybridflow's
    fsdp backend), the role's dtype under ZeRO (the fp32 master stays with DeepSpeed's CPU optimizer); every
    sharding but NO_SHARD splits the stored state over the shard ranks (FSDP2 stores shards under SHARD_GRAD_OP
    too)."""
    shards = 1 if layout.sharding is Sharding.NO_SHARD else shard_ranks(layout, shape)
    stored = DTYPE_BYTES[layout.dtype] if layout.sharding in ZERO_SHARDINGS else DTYPE_BYTES["fp32"]
    trained = trainable_stage_params(model, layout) / shards
    return TrainerShard(unshard_bytes=(stage_params(model, layout) + adapter_stage_params(model, layout)) * stored
                        / shards, gradient_bytes=trained * grad_reduce_bytes(layout),
                        weight_bytes=trained * DTYPE_BYTES[layout.dtype], trained_params=trained,
                        units=model.layers / layout.pp)


def per_unshard(kind: RoleKind, shape: Shape) -> bool:
    """Whether a role's offload is priced as hybridflow runs it (``Framework.trainable_offload``); a frozen role's
    always is (FSDP's own CPU offload, which verl's reference runs too)."""
    return not kind.trainable or shape.run.framework.trainable_offload == "per_unshard"


def grad_reduce_bytes(layout: RoleLayout) -> int:
    """Bytes a gradient element moves in its reduction: fp32 under FSDP's mixed precision (``MixedPrecisionPolicy(
    reduce_dtype=torch.float32)`` in hybridflow's fsdp backend, as verl's FSDP workers configure it by default),
    else the role's dtype."""
    return DTYPE_BYTES["fp32"] if layout.sharding in FSDP_SHARDINGS else DTYPE_BYTES[layout.dtype]


def _gather_buffer(model: ModelSpec, layout: RoleLayout) -> int:
    """FSDP holds two unsharded layers at a time (the current and the prefetched one): decoder layers, wider than
    a vision tower's blocks."""
    if layout.sharding not in FULL_SHARDS:
        return 0
    layers = stage_params(model, layout) - model.vision_params / layout.tp
    return int(2 * layers * layout.pp / model.layers * DTYPE_BYTES[layout.dtype])


def _activation_layer_bytes(model: ModelSpec, tokens: float, layout: RoleLayout) -> float:
    return ACTIVATION_BYTES_PER_TOKEN_HIDDEN * tokens * model.hidden * DTYPE_BYTES[layout.dtype] / 2 / layout.tp


def _adapter_activation_bytes(model: ModelSpec, tokens: float, layout: RoleLayout) -> float:
    """What a LoRA adapter's backward keeps per layer beyond the frozen model's activations
    (``LoraPlan.saved_inputs_per_token``; a dropout mask of one byte beside each dropped-out input)."""
    if model.adapter is None:
        return 0.0
    per_token = model.adapter.saved_inputs_per_token(model)
    unit = DTYPE_BYTES[layout.dtype] + (1 if model.adapter.dropout > 0 else 0)
    return per_token * unit * tokens / layout.tp


def _logit_bytes(model: ModelSpec, kind: RoleKind, tokens: float, tp: int) -> float:
    """fp32 logits over the vocabulary for policies; value and reward heads emit one number per token."""
    return tokens * model.vocab * 4 / tp if kind in LM_HEAD_KINDS else 0.0


def _tp_seconds(model: ModelSpec, tokens: float, collectives_per_layer: int, layout: RoleLayout, shape: Shape,
                tp: int) -> float:
    if tp <= 1:
        return 0.0
    size = tokens * model.hidden * DTYPE_BYTES[layout.dtype]
    per_call = 2 * size * (tp - 1) / tp / shape.device.link_bandwidth + COLLECTIVE_LATENCY_S
    return collectives_per_layer * model.layers * per_call


@dataclass(frozen=True)
class Batching:
    """How one pass over a step's rows splits on one GPU: optimizer steps, micro batches, tokens."""

    tokens_per_gpu: float  # every token this GPU processes in the pass (all epochs)
    seq: float  # tokens of one sequence (prompt + response as the pass sees it)
    micro_tokens: float  # tokens per GPU in one micro batch
    micro_batches: int  # micro batches per GPU in the pass (all epochs and mini-batches)
    optimizer_steps: int
    attention_seq: float = 0.0  # the sequence length a token attends over, token-weighted (0: ``seq``)
    rows_per_gpu: float = 0.0  # sequences this GPU's data rank processes in the pass (all epochs)


def sequence_tokens(load: NodeLoad, shape: Shape) -> float:
    """One sequence as a forward/update pass sees it: the mean response when packed, the max when padded."""
    rows = max(load.sequences, 1)
    prompt = load.prompt_tokens / rows
    lengths = shape.run.lengths
    if lengths is None:
        return prompt + load.response_tokens / rows
    return prompt + (lengths.max if shape.run.padding else lengths.mean)


def packed_sequence_tokens(load: NodeLoad, shape: Shape) -> float:
    """The length of the sequence a token belongs to, averaged over tokens: ``E[s²]/E[s]`` with ``s = prompt +
    response`` (a long sequence holds more of the tokens); the mean length when every response has one."""
    lengths = shape.run.lengths
    if lengths is None:
        return sequence_tokens(load, shape)
    prompt = load.prompt_tokens / max(load.sequences, 1)
    return (prompt * prompt + 2 * prompt * lengths.mean + lengths.second_moment) / (prompt + lengths.mean)


def attention_tokens(load: NodeLoad, shape: Shape) -> float:
    """The keys a token's causal attention costs ``2·L·H·d`` FLOPs for, as the runtime runs it.

    Packed sequences attend only within themselves, on every device: flash-attention varlen on GPUs, causal
    ``sdpa`` per sequence elsewhere (``backends/common/varlen.py``): :func:`packed_sequence_tokens`. Padded rows
    attend over the row, causally where the kernel skips what a token cannot see (``DeviceSpec.varlen_attention``,
    flash-attention); on CPU transformers' masked ``sdpa`` computes the whole square of the row (``prompt +
    max``), twice the causal half the formula counts."""
    if not shape.run.padding:
        return packed_sequence_tokens(load, shape)
    return sequence_tokens(load, shape) if shape.device.varlen_attention else 2 * sequence_tokens(load, shape)


def batching(load: NodeLoad, layout: RoleLayout, shape: Shape, *, train: bool) -> Batching:
    """Mini-batches x epochs for an update (one optimizer step each), dynamic token budgets or row micro
    batches; sequence parallel ranks share a sequence, pipeline stages share the layers."""
    run = shape.run
    rows = max(load.sequences, 1)
    seq = sequence_tokens(load, shape)
    data_ranks = max(1, layout.dp // (layout.sp * layout.pp))
    mini_rows = min(run.mini_batch_size or rows, rows) if train else rows
    minis = math.ceil(rows / mini_rows) * (run.epochs if train else 1)
    rows_rank = math.ceil(mini_rows / data_ranks)  # per data rank per mini-batch
    tokens_rank = rows_rank * seq / layout.sp  # per GPU of an SP group, per mini-batch
    # The layout's own budget (a role's fixed one, else the run's, as the planner writes it) is what runs.
    budget = ((layout.max_tokens_per_micro_batch or run.train_tokens_per_gpu) if train else
              (layout.forward_max_tokens_per_micro_batch or run.forward_tokens_per_gpu))
    if budget:
        # An SP group shares each row: its rows are cut on their whole length against the budget x sp (verl).
        micro = budget_micro_batches(load, shape, rows_rank, tokens_rank * layout.sp, budget * layout.sp)
        micro_tokens = tokens_rank / micro
    else:
        rows_micro = min(layout.micro_batch_size if train else
                         (layout.forward_micro_batch_size or layout.micro_batch_size), rows_rank)
        micro = math.ceil(rows_rank / max(rows_micro, 1))
        micro_tokens = rows_micro * seq / layout.sp
    return Batching(tokens_per_gpu=minis * tokens_rank / layout.pp, seq=seq, micro_tokens=micro_tokens,
                    micro_batches=minis * micro, optimizer_steps=minis if train else 0,
                    attention_seq=attention_tokens(load, shape), rows_per_gpu=float(minis * rows_rank))


def budget_micro_batches(load: NodeLoad, shape: Shape, rows: int, tokens: float, budget: float) -> int:
    """Micro batches the runtime cuts ``rows`` rows of ``tokens`` tokens into under a token budget
    (``runtime.balancing.token_micro_batches``: consecutive rows, greedily, at least one row each).

    Padded, every row costs ``prompt + max``: ``floor(budget / row)`` rows a micro batch. Packed, a greedy cut
    leaves each micro batch short of the budget by the part of the next row that would have fit; that row is
    drawn length-biased, so the gap is on average half the token-weighted row length (``E[s²]/(2E[s])``,
    renewal theory), and a micro batch holds ``budget - E[s²]/(2E[s])`` tokens (at least one row)."""
    if shape.run.padding:
        return max(1, math.ceil(rows / max(1, int(budget // sequence_tokens(load, shape)))))
    mean = sequence_tokens(load, shape)
    fill = max(budget - packed_sequence_tokens(load, shape) / 2, mean, 1.0)
    return max(1, min(rows, math.ceil(tokens / fill)), math.ceil(tokens / budget))


def nonmatmul_seconds(model: ModelSpec, kind: RoleKind, batch: Batching, layout: RoleLayout, shape: Shape,
                      passes: int) -> float:
    """The pass's memory-bound ops (:func:`nonmatmul_bytes_per_token`) over this GPU's tokens at the elementwise
    kernels' share of HBM bandwidth (``NONMATMUL_HBM_EFFICIENCY``); tensor-parallel ranks split the activations."""
    tokens = batch.tokens_per_gpu / layout.tp
    bandwidth = shape.device.hbm_bandwidth * NONMATMUL_HBM_EFFICIENCY
    return nonmatmul_bytes_per_token(model, kind, passes) * tokens / bandwidth


def vision_passes(model: ModelSpec, passes: int) -> int:
    """Passes the tower runs in a pass of the language model's ``passes``: one while it is frozen (nothing before it
    needs gradients, so autograd runs no backward through it), all of them when it trains."""
    return passes if model.trained_vision_params else 1


def vision_seconds(model: ModelSpec, load: NodeLoad, batch: Batching, layout: RoleLayout, shape: Shape,
                   passes: int) -> float:
    """The vision tower over this GPU's images in a forward or update pass (:func:`vision_flops_per_token`,
    :func:`vision_nonmatmul_bytes_per_token`): every row's visual tokens on each rank of its data-parallel rank's
    sequence-parallel group (the tower runs on whole images before the sequence is split), matmuls split over TP
    at the efficiency of a micro batch's patches; 0 for a text-only model or load."""
    vision = model.vision
    if vision is None or not load.row_image_tokens:
        return 0.0
    tokens = batch.rows_per_gpu * load.row_image_tokens
    runs = vision_passes(model, passes)
    flops = vision_flops_per_token(vision, load.row_image_tokens, runs) * tokens / layout.tp
    micro_patches = batch.micro_tokens * layout.sp / max(batch.seq, 1.0) * load.row_image_tokens
    compute = flops / (shape.device.matmul_flops(layout.dtype)
                       * efficiency(micro_patches * vision.patches_per_token, shape.constants))
    memory = vision_nonmatmul_bytes_per_token(vision, runs) * tokens / layout.tp
    return compute + memory / (shape.device.hbm_bandwidth * NONMATMUL_HBM_EFFICIENCY)


def vision_activation_bytes(model: ModelSpec, load: NodeLoad, batch: Batching, layout: RoleLayout,
                            *, train: bool) -> float:
    """The tower's activations at its peak on one GPU, for a micro batch's patches: two blocks' worth while it runs
    forward only (frozen, or a forward pass); when an update trains it, every block's (under gradient checkpointing
    each block's input and one block's full set), as ``update_cost`` counts a decoder layer's."""
    vision = model.vision
    if vision is None or not load.row_image_tokens:
        return 0.0
    patches = batch.micro_tokens * layout.sp / max(batch.seq, 1.0) * load.row_image_tokens * vision.patches_per_token
    unit = DTYPE_BYTES[layout.dtype]
    block = ACTIVATION_BYTES_PER_TOKEN_HIDDEN * patches * vision.hidden * unit / 2 / layout.tp
    if not (train and model.trained_vision_params):
        return 2 * block
    if layout.gradient_checkpointing:
        return vision.depth * patches * vision.hidden * unit + block
    return vision.depth * block


def moe_slowdown(model: ModelSpec, shape: Shape) -> float:
    """How much longer a token's matmuls take when its expert share runs at ``moe_efficiency``."""
    if not model.is_moe:
        return 1.0
    share = model.active_expert_params / model.active
    return 1 - share + share / shape.constants.moe_efficiency


def _compute_seconds(model: ModelSpec, kind: RoleKind, batch: Batching, layout: RoleLayout, shape: Shape,
                     passes: int) -> float:
    peak = shape.device.matmul_flops(layout.dtype)
    per_token = flops_per_token(model, batch.attention_seq or batch.seq, passes, train=batch.optimizer_steps > 0,
                                head=kind in LM_HEAD_KINDS)
    flops = per_token * batch.tokens_per_gpu / layout.tp * moe_slowdown(model, shape)
    bubble = 1.0
    if layout.pp > 1:  # 1F1B: (micro batches + stages - 1) slots for the micro batches of each mini-batch
        per_mini = batch.micro_batches / max(batch.optimizer_steps, 1)
        bubble = (per_mini + layout.pp - 1) / per_mini
    return flops * bubble / (peak * efficiency(batch.micro_tokens, shape.constants))


def parallel_comm_seconds(model: ModelSpec, batch: Batching, layout: RoleLayout, shape: Shape,
                           passes: int) -> float:
    """Tensor-parallel all-reduces, Ulysses all-to-alls and MoE expert all-to-alls over the pass."""
    unit = DTYPE_BYTES[layout.dtype]
    seconds = batch.micro_batches * _tp_seconds(model, batch.micro_tokens, 2 * max(passes - 1, 1),
                                                layout, shape, layout.tp) / layout.pp
    layers = model.layers / layout.pp
    if layout.sp > 1:  # q, k, v in and the attention output back, per layer and pass
        size = 4 * batch.micro_tokens * model.hidden * unit / layout.tp * (layout.sp - 1) / layout.sp
        seconds += batch.micro_batches * passes * layers * (size / shape.span_bandwidth(layout.sp)
                                                            + COLLECTIVE_LATENCY_S)
    if model.is_moe and layout.ep > 1:
        # Dispatch and combine: a token goes to each rank holding one of its k experts (at most ep of them);
        # expert-parallel ranks are consecutive GPUs (Megatron with expert TP 1).
        copies = min(model.experts_per_token, layout.ep)
        size = 2 * batch.micro_tokens * copies * model.hidden * unit * (layout.ep - 1) / layout.ep
        seconds += batch.micro_batches * passes * layers * (size / shape.span_bandwidth(layout.ep)
                                                            + shape.latency(layout.ep))
    return seconds


def overlapped(busy: float, beside: float, units: float, shape: Shape) -> float:
    """A pass whose compute stream is ``busy`` for that long, with ``beside`` seconds of FSDP all-gathers,
    reduce-scatters and the host copies feeding them on their own streams: FSDP prefetches each unit's (decoder
    layer's) all-gather while the unit before it computes and reduce-scatters its gradients while the next one runs
    backward (PyTorch FSDP's forward/backward prefetch; Zhao et al., "PyTorch FSDP", VLDB 2023, section 3.3), so the
    pass waits for the first unit's share and for whatever the compute cannot cover. A device whose collectives
    block the rank (a CPU on gloo) adds them."""
    if not shape.device.overlaps_collectives:
        return busy + beside
    return max(busy, beside) + beside / max(units, 1.0)


def _shard_ring(nbytes: float, layout: RoleLayout, shape: Shape) -> float:
    """An all-gather or reduce-scatter of ``nbytes`` (the full buffer) over the role's shard group."""
    ranks = shard_ranks(layout, shape)
    return ring_seconds(nbytes, ranks, shape.span_bandwidth(ranks * layout.tp))


def _param_gathers(model: ModelSpec, layout: RoleLayout, shape: Shape, count: int) -> float:
    if layout.sharding not in FULL_SHARDS:
        return 0.0
    return count * _shard_ring(stage_params(model, layout) * DTYPE_BYTES[layout.dtype], layout, shape)


def forward_cost(model: ModelSpec, kind: RoleKind, load: NodeLoad, layout: RoleLayout, shape: Shape) -> Cost:
    """A forward-only pass (logprob, ref_logprob, values, score): one pass of :func:`flops_per_token` and the
    memory-bound ops, with FSDP's gathers (and a frozen role's offloaded shard) beside it."""
    batch = batching(load, layout, shape, train=False)
    compute = _compute_seconds(model, kind, batch, layout, shape, 1)
    compute += nonmatmul_seconds(model, kind, batch, layout, shape, 1) + vision_seconds(model, load, batch, layout,
                                                                                          shape, 1)
    comm = parallel_comm_seconds(model, batch, layout, shape, 1)
    gather = _param_gathers(model, layout, shape, batch.micro_batches)
    offload = shape.run.offload_of(layout.role)
    moved = state_bytes(model, kind, layout, shape)[0] * offload.params
    swap = 0.0
    if not kind.trainable:
        # FSDP's own CPU offload (FSDP1 CPUOffload(offload_params=True), FSDP2 CPUOffloadPolicy; what verl's
        # reference always runs and hybridflow's fsdp backend runs) copies a frozen shard in at every unshard, once
        # a micro batch, beside the all-gather it feeds, and writes nothing back.
        gather += batch.micro_batches * host_seconds(moved, shape)
    elif per_unshard(kind, shape):  # the same for a trainable role's fp32 shard (offload.forward_traffic)
        traffic = forward_traffic(offload, trainer_shard(model, layout, shape), unshards=batch.micro_batches,
                                  shape=shape)
        gather += traffic.beside
        moved = traffic.transient_bytes
    else:  # verl's manual offload: a trainable role's weights come in for the phase, leave after it
        swap = 2 * host_seconds(moved, shape)
    tokens = batch.micro_tokens
    transient = (2 * _activation_layer_bytes(model, tokens, layout) + _logit_bytes(model, kind, tokens, layout.tp)
                 + moved + vision_activation_bytes(model, load, batch, layout, train=False))
    fixed = shape.constants.phase_overhead_s + batch.micro_batches * shape.constants.micro_batch_overhead_s
    fixed += controller_seconds(load, shape)
    passes = overlapped(compute + comm, gather, model.layers / layout.pp, shape)
    return Cost(passes + swap + fixed, int(transient) + _gather_buffer(model, layout))


def update_cost(model: ModelSpec, kind: RoleKind, load: NodeLoad, layout: RoleLayout, shape: Shape) -> Cost:
    """Forward + backward (3 passes of :func:`flops_per_token`, 4 with recomputation) over every mini-batch and
    epoch, gradient sync (FSDP's beside the passes) and an optimizer step per mini-batch, offloaded state in and
    out once per phase."""
    batch = batching(load, layout, shape, train=True)
    passes = 4 if layout.gradient_checkpointing else 3
    compute = _compute_seconds(model, kind, batch, layout, shape, passes)
    compute += nonmatmul_seconds(model, kind, batch, layout, shape, passes) + vision_seconds(model, load, batch, layout,
                                                                                               shape, passes)
    comm = parallel_comm_seconds(model, batch, layout, shape, passes)
    grad_bytes = trainable_stage_params(model, layout) * grad_reduce_bytes(layout)
    ranks, bandwidth = shard_ranks(layout, shape), shape.collective_bandwidth
    beside = after = 0.0  # gradient sync on its own streams during the passes, and after them
    if layout.sharding in FULL_SHARDS:
        # Parameters gathered for every micro batch's forward and backward; its gradients reduce-scattered. FSDP
        # (and ZeRO-3) run these beside the passes.
        beside = (_param_gathers(model, layout, shape, 2 * batch.micro_batches)
                  + batch.micro_batches * _shard_ring(grad_bytes, layout, shape))
        replicas = max(1, layout.dp // layout.pp) // ranks
        if layout.sharding is Sharding.HYBRID_SHARD and replicas > 1:
            beside += batch.optimizer_steps * 2 * ring_seconds(grad_bytes / ranks, replicas, shape.inter)
    else:
        # One all-reduce (reduce-scatter + all-gather) per optimizer step; ZeRO gathers updated shards instead.
        data = max(1, layout.dp // layout.pp)
        after = batch.optimizer_steps * 2 * ring_seconds(grad_bytes, data, bandwidth)
    offload = shape.run.offload_of(layout.role)
    traffic = HostTraffic()  # hybridflow's offload (offload.update_traffic); verl's per-phase swap is below
    if per_unshard(kind, shape):
        full = layout.sharding in FULL_SHARDS  # two unshards and a reduce-scatter per micro batch
        traffic = update_traffic(offload, trainer_shard(model, layout, shape),
                                 unshards=batch.micro_batches * (2 if full else 1),
                                 reductions=batch.micro_batches if full else batch.optimizer_steps,
                                 reductions_beside=full, steps=batch.optimizer_steps, shape=shape)
    passes_seconds = (overlapped(compute + comm, beside + traffic.beside, model.layers / layout.pp, shape) + after
                      + traffic.after)
    weights, grads, states = state_bytes(model, kind, layout, shape)
    # The optimizer step reads and writes the trained weights only (a LoRA adapter's, not the frozen base).
    trained = weights if model.adapter is None else (
        adapter_stage_params(model, layout) * DTYPE_BYTES[layout.dtype] / (ranks if layout.sharding in FULL_SHARDS
                                                                           else 1))
    optimizer = batch.optimizer_steps * 2 * (trained + grads + states) / (shape.device.hbm_bandwidth
                                                                          * shape.constants.hbm_efficiency)
    if not traffic.device_optimizer:  # it steps on the host (in traffic.after)
        optimizer = 0.0
    moved = weights * offload.params + grads * offload.grads + states * offload.optimizer
    swap = 0.0 if per_unshard(kind, shape) else 2 * host_seconds(moved, shape)
    tokens = batch.micro_tokens
    layer = _activation_layer_bytes(model, tokens, layout)
    layers = model.layers / layout.pp
    layer += _adapter_activation_bytes(model, tokens, layout)
    if layout.gradient_checkpointing:
        activations = layers * tokens * model.hidden * DTYPE_BYTES[layout.dtype] + layer
    else:
        activations = layers * layer
    activations += vision_activation_bytes(model, load, batch, layout, train=True)
    passes_peak = activations + 2 * _logit_bytes(model, kind, tokens, layout.tp) + 2 * _gather_buffer(model, layout)
    if per_unshard(kind, shape):  # the offloaded state never comes back whole: a unit's copies at a time
        transient = passes_peak + traffic.transient_bytes
    else:
        # verl's swap: offloaded weights and gradients are back for forward and backward; offloaded optimizer
        # states only for the optimizer step, when the activations are gone.
        transient = max(passes_peak + weights * offload.params + grads * offload.grads, moved)
    launches = batch.micro_batches * passes + batch.optimizer_steps
    fixed = shape.constants.phase_overhead_s + launches * shape.constants.micro_batch_overhead_s
    fixed += controller_seconds(load, shape)
    return Cost(passes_seconds + optimizer + swap + fixed, int(transient))
