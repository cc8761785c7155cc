"""Generation as an engine runs it: continuous batching over a distribution of response lengths.

Each engine (``rollout_tp`` GPUs) owns ``n`` of the step's sequences and keeps up to ``c`` in flight:
``c`` is bounded by the layout's batch, the engine's ``max_num_seqs`` and its KV cache (:func:`kv_blocks`:
vLLM's own sizing, ``gpu_memory_utilization x total - weights``, in blocks of ``KV_BLOCK_TOKENS``). vLLM admits
a sequence when its prompt's blocks are free, not its full length, so ``c`` is what the cache holds at the mean
context of a sequence in flight; when the survivors of the drain outgrow it, it preempts the newest and
recomputes them later (:func:`decode_seconds`). Prompts are prefilled once (shared by their samples). The
engine decodes ``(n - c) · mean / c`` steps at full concurrency, then its last cohort of ``c``
sequences drains with fewer in flight at every step; a synchronous step waits for the slowest
engine, the one holding the longest of all the step's responses (the ``rows/(rows+1)`` quantile).
A decode step costs ``max(memory, compute) + TP all-reduces + a fixed overhead``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridflow.graph import NodeLoad
from hybridflow.planner.costs import (
    EAGER_LAYER_OVERHEAD_S,
    USABLE_MEMORY,
    Cost,
    Shape,
    moe_slowdown,
)
from hybridflow.planner.devices import DTYPE_BYTES
from hybridflow.planner.flops import linear_mixer_flops, vision_flops_per_token
from hybridflow.planner.lengths import LengthDistribution
from hybridflow.planner.models import ModelSpec
from hybridflow.planner.overlays import controller_seconds
from hybridflow.planner.plan import RoleLayout, Sharding


@dataclass(frozen=True)
class Engine:
    """One rollout engine's per-GPU figures on a shape."""

    model: ModelSpec
    shape: Shape
    rtp: int
    unit: int

    @property
    def weights(self) -> float:
        """The engine's weights on one GPU: the language model and a vision tower, both split over its TP."""
        return (self.model.params + self.model.vision_params) * self.unit / self.rtp

    @property
    def kv_token(self) -> float:
        """KV bytes per token on one GPU: heads split over TP (replicated beyond ``kv_heads``); a latent
        cache is replicated on every TP rank."""
        if self.model.kv_latent_dim:
            return float(self.model.kv_bytes_per_token(self.unit))
        return self.model.kv_bytes_per_token(self.unit) / min(self.rtp, self.model.kv_heads)

    @property
    def state_sequence(self) -> float:
        """A sequence's linear-attention state on one GPU (heads split over TP); 0 without linear layers."""
        linear = self.model.linear_attention
        return self.model.state_bytes_per_sequence / min(self.rtp, linear.value_heads) if linear else 0.0

    @property
    def state_tokens(self) -> float:
        """A sequence's state in KV tokens' worth of cache: what it takes from the engine's pool beside its KV."""
        return self.state_sequence / self.kv_token if self.kv_token else 0.0

    def step_seconds(self, in_flight: float, context: float) -> float:
        """One decode step with ``in_flight`` sequences of ``context`` tokens each."""
        model, device, constants = self.model, self.shape.device, self.shape.constants
        weights = model.weights_read(in_flight)
        experts = weights - (model.params - model.expert_params)  # 0 for a dense model
        # A hybrid's linear layers read and write each sequence's fixed-size state every step instead of a KV
        # cache that grows with the context.
        read = ((weights - experts + experts / constants.moe_efficiency) * self.unit / self.rtp
                + in_flight * (context * self.kv_token + 2 * self.state_sequence))
        memory = read / (device.hbm_bandwidth * constants.hbm_efficiency)
        attention = 4 * model.attention_layers * model.heads * model.head_dim * context + linear_mixer_flops(model)
        multiplied = model.layer_matmul_params + model.head_params  # every sequence samples from its logits
        flops = in_flight * (2 * multiplied * moe_slowdown(model, self.shape) + attention) / self.rtp
        compute = flops / (device.matmul_flops(_dtype(self.unit, device.dtypes)) * constants.decode_mfu)
        comm = 0.0
        if self.rtp > 1:
            size = 2 * in_flight * model.hidden * self.unit * (self.rtp - 1) / self.rtp
            comm = 2 * model.layers * (size / self.shape.span_bandwidth(self.rtp) + self.shape.latency(self.rtp))
        eager = model.layers * EAGER_LAYER_OVERHEAD_S if self.shape.run.enforce_eager else 0.0
        run = self.shape.run
        serial = V0_SERIAL_STEP_CPU_S if run.framework.vllm_v0_engine and run.enforce_eager else 0.0
        return max(memory, compute) + comm + eager + serial + constants.decode_step_overhead_s


def _dtype(unit: int, dtypes: tuple[str, ...]) -> str:
    """The device dtype of this width (bf16 before fp16 for two bytes)."""
    for dtype in dtypes:
        if DTYPE_BYTES[dtype] == unit:
            return dtype
    return dtypes[0]


# CPU time of one decode step that vLLM's V0 engine spends with the GPU idle when the step's work runs serially
# (Framework.vllm_v0_engine under enforce_eager): gathering the sampled tokens, pythonizing them, processing outputs,
# scheduling and preparing the next step's inputs. vllm-project/vllm#6854 (the multi-step scheduling RFC, Llama 3 8B)
# measured "5-13ms of GPU bubble" per decode step from this; async output processing (vllm#7049) and multi-step
# scheduling hid it from 0.6.0, but vLLM 0.6's ModelConfig.verify_async_output_proc turns async output off under
# enforce_eager ("Since, enforce-eager is enabled, async output processor cannot be used", logged by verl's rollouts
# on vLLM 0.6.3) and verl's vendored engine keeps vLLM's default of one scheduler step. The low end of the range.
V0_SERIAL_STEP_CPU_S = 5e-3
# verl's vendored vLLM <= 0.6.3 (Framework.vllm_v0_engine) frees its cache engine after every rollout
# (free_cache_engine) and builds it again before the next (init_cache_engine): vLLM's CacheEngine allocates the GPU
# KV cache and a CPU swap cache of ``swap_space`` GiB per GPU (verl's LLM: 4), both with torch.zeros ("null block in
# CpuGpuBlockAllocator requires at least that block to be zeroed-out"). The pinned host block comes back from
# torch's caching host allocator; zeroing it runs on one thread (Ray's workers: OMP_NUM_THREADS=1), measured at
# 8.6 GB/s here (torch zero_ of 1 GiB, median of 7, on this session's 2-core Intel Xeon).
V0_SWAP_SPACE_BYTES = 4 * 2**30
HOST_ZERO_BYTES_S = 8.6e9

# vLLM's KV cache block (``--block-size``, default 16 tokens on CUDA): the cache is allocated and freed in blocks.
KV_BLOCK_TOKENS = 16


def kv_blocks(engine: Engine) -> int | None:
    """KV cache blocks per engine GPU as vLLM sizes them; None when the run gives no ``gpu_memory_utilization``.

    vLLM's share is per instance: ``gpu_memory_utilization x total`` less what its own profile run finds in it
    (the weights; activations of one ``max_num_batched_tokens`` batch are small beside them). Memory the process
    held before the engine started (trainer shards left on the GPU) is not taken out of the cache: vLLM refuses
    to start instead when the free memory is below its share (``Free memory on device ... is less than desired GPU
    memory utilization``), which :func:`generate_cost`'s transient bytes make the group's memory check catch."""
    run = engine.shape.run
    if run.gpu_memory_utilization is None:
        return None
    budget = run.gpu_memory_utilization * engine.shape.device.memory_bytes - engine.weights
    return max(0, int(budget // (KV_BLOCK_TOKENS * engine.kv_token)))


def kv_tokens(engine: Engine) -> float | None:
    """Tokens the engine's KV cache holds (:func:`kv_blocks` x ``KV_BLOCK_TOKENS``), None without a memory share."""
    blocks = kv_blocks(engine)
    return None if blocks is None else float(blocks * KV_BLOCK_TOKENS)


def concurrency(engine: Engine, per_engine: int, batch: int, prompt_len: float, lengths: LengthDistribution,
                resident: float = 0.0) -> int:
    """Sequences in flight: the layout's batch, ``max_num_seqs``, and what the KV cache (:func:`kv_tokens`) holds
    at the mean context of a sequence in flight (prompt + length-biased age): vLLM admits on the blocks a sequence
    holds now, so most of those admitted finish before they would have filled a full-length reservation.
    ``resident`` (trainer shards left on the GPU) does not shrink the cache (:func:`kv_blocks`)."""
    del resident  # vLLM's memory share is its own; the group's memory check prices the resident bytes
    run = engine.shape.run
    cap = min(per_engine, batch, run.max_num_seqs)
    cache = kv_tokens(engine)
    if cache is not None:
        cap = min(cap, max(1, int(cache / (prompt_len + lengths.mean_age() + engine.state_tokens))))
    return max(cap, 1)


def decode_seconds(engine: Engine, per_engine: int, in_flight: int, prompt_len: float,
                   lengths: LengthDistribution, rows: int) -> float:
    """Bulk steps at full concurrency, then the last cohort draining. The step waits for the slowest
    engine: the one that drew the longest of all ``rows`` responses.

    In the drain the survivors' contexts grow; once they hold more than the KV cache (:func:`kv_tokens`) vLLM
    preempts the newest (``RECOMPUTE``): the cache runs as many as it holds, the rest wait and their contexts are
    prefilled again when they return (:func:`preempted_seconds`)."""
    cohort = min(per_engine, in_flight)
    bulk_steps = (per_engine - cohort) * lengths.mean / in_flight
    seconds = bulk_steps * engine.step_seconds(in_flight, prompt_len + lengths.mean_age())
    cache = kv_tokens(engine)
    for start, end, alive in lengths.survivors(lengths.expected_max(rows)):
        running = max(1.0, cohort * alive)
        context = prompt_len + (start + end) / 2
        fits = running if cache is None else max(1.0, min(running, cache / (context + engine.state_tokens)))
        seconds += (end - start) * running / fits * engine.step_seconds(fits, context)
        if fits < running:
            seconds += preempted_seconds(engine, (running - fits) * (prompt_len + start))
    return seconds


def preempted_seconds(engine: Engine, tokens: float) -> float:
    """Recomputing ``tokens`` of preempted sequences' contexts when they are admitted again: a prefill on the
    engine (vLLM's default preemption mode recomputes rather than swapping the blocks to host memory)."""
    model, shape = engine.model, engine.shape
    peak = shape.device.matmul_flops(_dtype(engine.unit, shape.device.dtypes))
    return 2 * model.layer_matmul_params * tokens / engine.rtp / (peak * shape.constants.prefill_mfu)


def prefill_seconds(model: ModelSpec, tokens: float, layout: RoleLayout, shape: Shape) -> float:
    """One engine prefilling ``tokens``: compute-bound, 2 FLOPs a token per decoder-layer weight at ``prefill_mfu``
    of the device's GEMM ceiling. The head runs on one position a sequence (vLLM's ``LogitsProcessor`` keeps the
    sampled positions' hidden states before its matmul), which the per-step decode cost already counts."""
    peak = shape.device.matmul_flops(layout.dtype)
    return 2 * model.layer_matmul_params * tokens / layout.rollout_tp / (peak * shape.constants.prefill_mfu)


def vision_prefill_seconds(model: ModelSpec, load: NodeLoad, engines: int, layout: RoleLayout, shape: Shape) -> float:
    """One engine encoding its share of the node's images before their prefill (vLLM runs the tower once a prompt:
    ``load.image_tokens`` counts each shared prompt's image once), its matmuls split over the engine's TP at
    ``prefill_mfu``; 0 for a text-only model or load."""
    if model.vision is None or not load.image_tokens:
        return 0.0
    flops = vision_flops_per_token(model.vision, load.row_image_tokens, 1) * math.ceil(load.image_tokens / engines)
    peak = shape.device.matmul_flops(layout.dtype)
    return flops / layout.rollout_tp / (peak * shape.constants.prefill_mfu)


def cache_rebuild_seconds(engine: Engine) -> float:
    """Rebuilding a vendored V0 engine's cache for a rollout (``V0_SWAP_SPACE_BYTES``): zeroing its CPU swap space on
    one host thread and its GPU KV cache (:func:`kv_tokens`) at the HBM rate; 0 unless the engine is verl's vendored
    V0 one and sleeps between rollouts."""
    run = engine.shape.run
    if not (run.framework.vllm_v0_engine and run.rollout_sleep):
        return 0.0
    cache = (kv_tokens(engine) or 0.0) * engine.kv_token
    bandwidth = engine.shape.device.hbm_bandwidth * engine.shape.constants.hbm_efficiency
    return V0_SWAP_SPACE_BYTES / HOST_ZERO_BYTES_S + cache / bandwidth


def generate_cost(model: ModelSpec, load: NodeLoad, prompt_len: int, layout: RoleLayout, shape: Shape,
                  resident: float = 0.0) -> Cost:
    """Rollout: compute-bound prefill, then continuous-batching decode (see the module docstring).

    ``load.prompt_tokens`` counts each prompt once (shared by its samples); ``resident`` is what the role
    keeps on each GPU meanwhile (its static bytes), which the engine's memory share must hold too. ``prompt_len``
    is a prompt's text; a vision-language model's context holds its image's ``load.row_image_tokens`` too, which
    its tower encodes first (:func:`vision_prefill_seconds`).
    """
    rtp, unit = layout.rollout_tp, DTYPE_BYTES[layout.dtype]
    prompt_len += load.row_image_tokens
    engine = Engine(model, shape, rtp, unit)
    engines = max(1, shape.size // rtp)
    rows = max(load.sequences, 1)
    lengths = shape.run.response_lengths(max(1, load.response_tokens // rows))
    per_engine = math.ceil(rows / engines)
    in_flight = concurrency(engine, per_engine, layout.rollout_batch_size or per_engine, prompt_len, lengths,
                            resident)
    prefill = prefill_seconds(model, math.ceil(load.prompt_tokens / engines), layout, shape)
    prefill += vision_prefill_seconds(model, load, engines, layout, shape)
    decode = decode_seconds(engine, per_engine, in_flight, prompt_len, lengths, rows)
    reuse = layout.sharding is Sharding.NO_SHARD and layout.tp == rtp
    if shape.run.gpu_memory_utilization is not None:
        # The engine takes its whole share on top of what is resident; its share already holds the CUDA context
        # and graphs the usable fraction keeps aside, so the group's check reads resident + share <= total,
        # the check vLLM makes at start (kv_blocks).
        share = shape.run.gpu_memory_utilization * shape.device.memory_bytes
        transient = max(share - (1 - USABLE_MEMORY) * shape.device.memory_bytes, engine.weights)
    else:
        kv_cache = in_flight * engine.kv_token * (prompt_len + lengths.mean_age() + engine.state_tokens)
        transient = (0 if reuse else engine.weights) + kv_cache + in_flight * model.vocab * 4 / rtp
    dispatch = controller_seconds(load, shape, prompt_len)
    rebuild = cache_rebuild_seconds(engine)
    return Cost(prefill + decode + rebuild + shape.constants.phase_overhead_s + dispatch, int(transient))
