"""Each new cost term against a hand computation on a made-up device with round numbers."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hybridflow.graph import NodeLoad, Op, RoleKind
from hybridflow.planner import ModelSpec, RoleLayout, Sharding
from hybridflow.planner.calibration import Constants
from hybridflow.planner.costs import (
    COLLECTIVE_LATENCY_S,
    Shape,
    attention_tokens,
    batching,
    efficiency,
    forward_cost,
    grad_reduce_bytes,
    parallel_comm_seconds,
    ring_seconds,
    static_bytes,
    update_cost,
)
from hybridflow.planner.devices import GB, GIB, TFLOPS, DeviceSpec
from hybridflow.planner.flops import NONMATMUL_HBM_EFFICIENCY, flops_per_token, nonmatmul_bytes_per_token
from hybridflow.planner.lengths import LengthDistribution
from hybridflow.planner.overlays import ControllerOverlay, controller_seconds
from hybridflow.planner.rollout import Engine, concurrency, generate_cost
from hybridflow.planner.settings import Framework, Offload, RunSettings
from hybridflow.planner.weight_moves import WEIGHT_TENSOR_S, engine_switch, weight_load, weight_ship, weight_sync

ROUND = DeviceSpec(name="ROUND", memory_bytes=100 * GIB, hbm_bandwidth=1000 * GB, flops=(("bf16", 100 * TFLOPS),),
                   link="NVLink", link_bandwidth=100 * GB, host_bandwidth=10 * GB)
# Overheads off and round efficiencies, so every term can be computed by hand.
PLAIN = Constants(train_mfu=0.5, eff_half_tokens=1000, hbm_efficiency=0.5, decode_mfu=0.5, prefill_mfu=0.5,
                  host_efficiency=0.5, decode_step_overhead_s=0.0, phase_overhead_s=0.0)
MODEL = ModelSpec(name="round", params=1_000_000_000, layers=10, hidden=1000, heads=10, kv_heads=10, vocab=1000)
ROWS, PROMPT, RESPONSE = 64, 100, 900
# A prefill multiplies by the decoder layers' weights: the embedding is a lookup, the head runs on sampled positions.
PREFILL_WEIGHTS = MODEL.params - 2 * MODEL.vocab * MODEL.hidden


def shape(run: RunSettings | None = None, gpus: int = 1, constants: Constants = PLAIN) -> Shape:
    return Shape(ROUND, (gpus,), 25e9, run=run or RunSettings(), constants=constants)


def load(op: Op) -> NodeLoad:
    return NodeLoad("n", op, ROWS, ROWS * PROMPT, ROWS * RESPONSE)


def test_efficiency_is_half_of_the_mfu_at_the_half_point():
    assert efficiency(1000, PLAIN) == pytest.approx(0.25)
    assert efficiency(3000, PLAIN) == pytest.approx(0.375)


def test_mini_batches_epochs_and_token_budget_split_the_pass():
    run = RunSettings(mini_batch_size=16, epochs=2, train_tokens_per_gpu=2500)
    layout = RoleLayout(role="actor", dp=4)
    batch = batching(load(Op.UPDATE), layout, shape(run, 4), train=True)
    # 64 rows / 16 per mini-batch x 2 epochs = 8 optimizer steps; 4 rows per rank per mini-batch of 1000
    # tokens = 4000 tokens, split by the 2500-token budget into 2 micro batches of 2000.
    assert batch.optimizer_steps == 8 and batch.micro_batches == 16
    assert batch.micro_tokens == pytest.approx(2000) and batch.tokens_per_gpu == pytest.approx(8 * 4000)


def test_packed_passes_see_the_mean_and_padded_ones_the_max():
    lengths = LengthDistribution.from_lengths([100, 300, 800])  # mean 400, max 800
    layout = RoleLayout(role="actor", dp=1)
    packed = batching(load(Op.LOGPROB), layout, shape(RunSettings(lengths=lengths)), train=False)
    padded = batching(load(Op.LOGPROB), layout, shape(RunSettings(lengths=lengths, padding=True)), train=False)
    assert packed.seq == pytest.approx(PROMPT + 400) and padded.seq == pytest.approx(PROMPT + 800)


def test_forward_seconds_by_hand():
    layout = RoleLayout(role="ref", dp=1, micro_batch_size=8, forward_micro_batch_size=8)
    cost = forward_cost(MODEL, RoleKind.FROZEN_POLICY, load(Op.REF_LOGPROB), layout, shape())
    seq = PROMPT + RESPONSE
    # Every weight but the input embedding (a lookup, not a matmul; the head is one) + causal attention.
    per_token = 2 * (MODEL.params - MODEL.vocab * MODEL.hidden) + 2 * MODEL.layers * MODEL.hidden * seq
    expected = ROWS * seq * per_token / (100e12 * efficiency(8 * seq, PLAIN))
    # Memory-bound ops: per layer 120 bytes per hidden unit + 10 per MLP unit (4 x hidden without a given
    # intermediate), and the logits row's 10 bytes per vocabulary entry, at the elementwise share of the 1000 GB/s.
    moved = MODEL.layers * (120 * 1000 + 10 * 4000) + 10 * 1000
    assert nonmatmul_bytes_per_token(MODEL, RoleKind.FROZEN_POLICY, 1) == moved
    expected += ROWS * seq * moved / (1000e9 * NONMATMUL_HBM_EFFICIENCY)
    assert per_token == flops_per_token(MODEL, seq, 1)
    assert cost.seconds == pytest.approx(expected, rel=1e-9)



def test_matmuls_run_on_the_devices_measured_gemm_ceiling():
    """The same pass on a device whose best GEMM reaches 0.8 of its datasheet: the matmul seconds grow by 1 / 0.8,
    the memory-bound ops' do not."""
    layout = RoleLayout(role="ref", dp=1, micro_batch_size=8, forward_micro_batch_size=8)
    capped = Shape(dataclasses.replace(ROUND, matmul_fraction=0.8), (1,), 25e9, run=RunSettings(), constants=PLAIN)
    full = forward_cost(MODEL, RoleKind.FROZEN_POLICY, load(Op.REF_LOGPROB), layout, shape()).seconds
    slow = forward_cost(MODEL, RoleKind.FROZEN_POLICY, load(Op.REF_LOGPROB), layout, capped).seconds
    seq = PROMPT + RESPONSE
    matmuls = ROWS * seq * flops_per_token(MODEL, seq, 1) / (100e12 * efficiency(8 * seq, PLAIN))
    assert slow - full == pytest.approx(matmuls * (1 / 0.8 - 1), rel=1e-9)
    assert capped.device.matmul_flops("bf16") == pytest.approx(80e12)

def test_memory_bound_ops_follow_the_passes_and_weigh_most_where_flops_outrun_bandwidth():
    """Backward moves twice the forward's bytes and recomputation once more; a value head has no logits row.
    The same pass on a device of 8x the FLOPs and the same HBM spends a larger share in those ops."""
    forward = nonmatmul_bytes_per_token(MODEL, RoleKind.POLICY, 1)
    assert nonmatmul_bytes_per_token(MODEL, RoleKind.POLICY, 4) == 4 * forward
    assert nonmatmul_bytes_per_token(MODEL, RoleKind.VALUE, 1) == forward - 10 * MODEL.vocab
    fast = DeviceSpec(name="FAST", memory_bytes=100 * GIB, hbm_bandwidth=1000 * GB, flops=(("bf16", 800 * TFLOPS),),
                      link="NVLink", link_bandwidth=100 * GB, host_bandwidth=10 * GB)
    layout = RoleLayout(role="ref", dp=1, micro_batch_size=8, forward_micro_batch_size=8)
    memory = ROWS * (PROMPT + RESPONSE) * forward / (1000e9 * NONMATMUL_HBM_EFFICIENCY)
    shares = []
    for device in (ROUND, fast):
        seconds = forward_cost(MODEL, RoleKind.POLICY, load(Op.LOGPROB), layout,
                               Shape(device, (1,), 25e9, run=RunSettings(), constants=PLAIN)).seconds
        shares.append(memory / seconds)
    assert shares[1] > 3 * shares[0]


def test_flops_count_the_head_only_where_logits_are_computed():
    """A value model's head is one column; recomputation reruns the decoder layers, not the head; attention's
    backward is 2.5 forwards (FlashAttention-2)."""
    seq = PROMPT + RESPONSE
    layers = 2 * (MODEL.params - 2 * MODEL.vocab * MODEL.hidden)
    head = 2 * MODEL.vocab * MODEL.hidden
    attention = 2 * MODEL.layers * MODEL.hidden * seq
    assert flops_per_token(MODEL, seq, 1, head=False) == layers + attention
    assert flops_per_token(MODEL, seq, 1) == layers + head + attention
    assert flops_per_token(MODEL, seq, 3) == 3 * (layers + head) + 3.5 * attention
    assert flops_per_token(MODEL, seq, 4) - flops_per_token(MODEL, seq, 3) == layers + attention
    layout = RoleLayout(role="n", dp=1, micro_batch_size=8, forward_micro_batch_size=8)
    policy = forward_cost(MODEL, RoleKind.FROZEN_POLICY, load(Op.REF_LOGPROB), layout, shape()).seconds
    value = forward_cost(MODEL, RoleKind.VALUE, load(Op.VALUES), layout, shape()).seconds
    logits = ROWS * seq * 10 * MODEL.vocab / (1000e9 * NONMATMUL_HBM_EFFICIENCY)  # the logits row's elementwise ops
    assert policy - value == pytest.approx(ROWS * seq * head / (100e12 * efficiency(8 * seq, PLAIN)) + logits)


def test_fsdp_reduces_gradients_in_fp32_beside_the_passes():
    """FULL_SHARD: two bf16 all-gathers and one fp32 reduce-scatter a micro batch. A GPU runs them on their own
    streams, so only the first layer's share shows past the compute; a CPU on gloo waits for all of them."""
    blocking = Shape(dataclasses.replace(ROUND, overlaps_collectives=False), (2,), 25e9, run=RunSettings(),
                     constants=PLAIN)
    layout = RoleLayout(role="actor", dp=2, micro_batch_size=8, sharding=Sharding.FULL_SHARD)
    waits = update_cost(MODEL, RoleKind.POLICY, load(Op.UPDATE), layout, blocking).seconds
    hides = update_cost(MODEL, RoleKind.POLICY, load(Op.UPDATE), layout, shape(gpus=2)).seconds
    micro_batches = ROWS // 2 // 8
    beside = micro_batches * (2 * ring_seconds(2 * MODEL.params, 2, 100e9) + ring_seconds(4 * MODEL.params, 2, 100e9))
    assert waits - hides == pytest.approx(beside * (1 - 1 / MODEL.layers), rel=1e-9)
    assert grad_reduce_bytes(layout) == 4
    assert grad_reduce_bytes(dataclasses.replace(layout, sharding=Sharding.ZERO3)) == 2  # DeepSpeed: the model's dtype


def test_a_frozen_offloaded_shard_comes_in_every_micro_batch():
    """FSDP's own CPU offload copies a frozen role's weights in at each unshard and never writes them back."""
    blocking = Shape(dataclasses.replace(ROUND, overlaps_collectives=False), (1,), 25e9,
                     run=RunSettings(offload={"ref": Offload(params=True)}), constants=PLAIN)
    resident = Shape(blocking.device, (1,), 25e9, run=RunSettings(), constants=PLAIN)
    layout = RoleLayout(role="ref", dp=1, forward_micro_batch_size=16)
    moved = forward_cost(MODEL, RoleKind.FROZEN_POLICY, load(Op.REF_LOGPROB), layout, blocking).seconds
    kept = forward_cost(MODEL, RoleKind.FROZEN_POLICY, load(Op.REF_LOGPROB), layout, resident).seconds
    assert moved - kept == pytest.approx(ROWS // 16 * 2 * MODEL.params / (10e9 * 0.5), rel=1e-9)


def test_update_pays_one_optimizer_step_per_mini_batch():
    layout = RoleLayout(role="actor", dp=1, micro_batch_size=8)
    one = update_cost(MODEL, RoleKind.POLICY, load(Op.UPDATE), layout, shape(RunSettings()))
    four = update_cost(MODEL, RoleKind.POLICY, load(Op.UPDATE), layout, shape(RunSettings(mini_batch_size=16)))
    resident = static_bytes(MODEL, RoleKind.POLICY, layout, shape())
    optimizer_step = 2 * resident / (1000e9 * 0.5)  # read and write every resident byte
    assert resident == 16 * MODEL.params
    assert four.seconds - one.seconds == pytest.approx(3 * optimizer_step, rel=1e-9)


def test_verls_offload_moves_its_bytes_over_the_host_link_and_frees_them():
    """verl's per-phase swap (``trainable_offload="per_phase"``); hybridflow's own: test_trainable_offload.py."""
    layout = RoleLayout(role="actor", dp=1, micro_batch_size=8)
    verl = Framework(name="verl", trainable_offload="per_phase")
    run = RunSettings(offload={"actor": Offload(params=True, optimizer=True)}, framework=verl)
    kept = update_cost(MODEL, RoleKind.POLICY, load(Op.UPDATE), layout, shape())
    moved = update_cost(MODEL, RoleKind.POLICY, load(Op.UPDATE), layout, shape(run))
    offloaded = (2 + 12) * MODEL.params  # bf16 weights and fp32 master + Adam states
    assert static_bytes(MODEL, RoleKind.POLICY, layout, shape(run)) == 16 * MODEL.params - offloaded
    assert moved.seconds - kept.seconds == pytest.approx(2 * offloaded / (10e9 * 0.5), rel=1e-9)
    # Offloaded weights are back for forward and backward; the optimizer states only for the step, when the
    # activations are gone: the peak is the larger of the two.
    passes = kept.transient_bytes + 2 * MODEL.params
    assert moved.transient_bytes == max(passes, offloaded)


def test_engine_sleep_and_an_offloaded_trainer_cost_host_transfers():
    layout = RoleLayout(role="actor", dp=2, rollout_tp=2)
    asleep = RunSettings(rollout_sleep=True, offload={"actor": Offload(params=True)},
                         framework=Framework(name="verl", trainable_offload="per_phase"))
    seconds = engine_switch(MODEL, RoleKind.POLICY, layout, shape(asleep, 2))
    engine_weights = MODEL.params * 2 / 2
    trainer_weights = MODEL.params * 2  # NO_SHARD: every rank holds them
    assert seconds == pytest.approx(2 * (engine_weights + trainer_weights) / (10e9 * 0.5), rel=1e-9)
    assert engine_switch(MODEL, RoleKind.POLICY, layout, shape(RunSettings(), 2)) == 0.0


def test_decode_step_is_the_slower_of_memory_and_compute():
    engine = Engine(MODEL, shape(), 1, 2)
    kv_token = 2 * MODEL.layers * MODEL.kv_heads * MODEL.head_dim * 2
    few = engine.step_seconds(1, 1000)
    assert few == pytest.approx((2 * MODEL.params + 1000 * kv_token) / (1000e9 * 0.5), rel=1e-9)
    many = engine.step_seconds(1000, 1000)
    compute = 1000 * (2 * MODEL.params + 4 * MODEL.layers * MODEL.hidden * 1000) / (100e12 * 0.5)
    memory = (2 * MODEL.params + 1000 * 1000 * kv_token) / (1000e9 * 0.5)
    assert many == pytest.approx(max(compute, memory), rel=1e-9)


def test_a_synchronous_rollout_waits_for_the_longest_response():
    """Point lengths: every sequence decodes together for ``RESPONSE`` steps; the tail adds steps at low load."""
    layout = RoleLayout(role="actor", dp=1, rollout_batch_size=ROWS)
    gen = NodeLoad("g", Op.GENERATE, ROWS, 8 * PROMPT, ROWS * RESPONSE)
    point = generate_cost(MODEL, gen, PROMPT, layout, shape())
    engine = Engine(MODEL, shape(), 1, 2)
    prefill = 2 * PREFILL_WEIGHTS * 8 * PROMPT / (100e12 * 0.5)
    assert point.seconds == pytest.approx(prefill + RESPONSE * engine.step_seconds(ROWS, PROMPT + RESPONSE / 2))
    tail = LengthDistribution(((450.0, 0.5), (1350.0, 0.5)))  # same mean, half the rows run 3x longer
    tailed = generate_cost(MODEL, gen, PROMPT, layout, shape(RunSettings(lengths=tail)))
    by_hand = prefill + 450 * engine.step_seconds(ROWS, PROMPT + 225) + 900 * engine.step_seconds(ROWS / 2,
                                                                                                  PROMPT + 900)
    assert tailed.seconds == pytest.approx(by_hand, rel=1e-9)


def test_continuous_batching_decodes_the_bulk_at_full_concurrency():
    layout = RoleLayout(role="actor", dp=1, rollout_batch_size=16)
    gen = NodeLoad("g", Op.GENERATE, ROWS, 8 * PROMPT, ROWS * RESPONSE)
    cost = generate_cost(MODEL, gen, PROMPT, layout, shape())
    engine = Engine(MODEL, shape(), 1, 2)
    prefill = 2 * PREFILL_WEIGHTS * 8 * PROMPT / (100e12 * 0.5)
    bulk_steps = (ROWS - 16) * RESPONSE / 16  # 48 sequences' tokens at 16 in flight
    context = PROMPT + RESPONSE / 2
    expected = prefill + (bulk_steps + RESPONSE) * engine.step_seconds(16, context)
    assert cost.seconds == pytest.approx(expected, rel=1e-9)


def test_kv_cache_left_after_weights_bounds_sequences_in_flight():
    run = RunSettings(gpu_memory_utilization=0.5, max_num_seqs=100_000)
    engine = Engine(MODEL, shape(run), 1, 2)
    lengths = LengthDistribution.point(RESPONSE)
    kv_token = 2 * MODEL.layers * MODEL.kv_heads * MODEL.head_dim * 2
    budget = 0.5 * 100 * GIB - 2 * MODEL.params
    expected = int(budget / (kv_token * (PROMPT + RESPONSE / 2)))
    assert concurrency(engine, 10_000, 10_000, PROMPT, lengths) == expected
    assert concurrency(engine, 10, 10_000, PROMPT, lengths) == 10
    capped = Engine(MODEL, shape(RunSettings(gpu_memory_utilization=0.5, max_num_seqs=64)), 1, 2)
    assert concurrency(capped, 10_000, 10_000, PROMPT, lengths) == 64


def test_rollout_tensor_parallel_across_machines_uses_the_inter_node_link():
    two_machines = Shape(ROUND, (8, 8), 5e9, constants=PLAIN)
    assert two_machines.span_bandwidth(8) == ROUND.link_bandwidth
    assert two_machines.span_bandwidth(16) == 5e9
    inside = Engine(MODEL, two_machines, 8, 2).step_seconds(64, 1000)
    across = Engine(MODEL, two_machines, 16, 2).step_seconds(64, 1000)
    assert across > inside  # half the weights per GPU, but every all-reduce crosses the slow link


def test_moe_flops_follow_active_weights_and_memory_follows_all():
    moe = ModelSpec.preset("qwen3-30b-a3b")
    assert moe.active < moe.params / 8
    layout = RoleLayout(role="actor", dp=1)
    assert static_bytes(moe, RoleKind.POLICY, layout, shape()) == pytest.approx(16 * moe.params, rel=1e-6)
    assert flops_per_token(moe, 0, 1) == 2 * (moe.active - moe.vocab * moe.hidden)  # the input embedding is a lookup
    # One token reads the dense weights and k of E experts; many tokens read every expert.
    dense = moe.params - moe.expert_params
    assert moe.weights_read(1) == pytest.approx(dense + moe.expert_params * 8 / 128)
    assert moe.weights_read(10_000) == pytest.approx(moe.params, rel=1e-6)


def test_expert_parallel_splits_experts_and_pays_all_to_all():
    moe = ModelSpec.preset("qwen3-30b-a3b")
    plain = RoleLayout(role="actor", dp=8, micro_batch_size=4)
    experts = RoleLayout(role="actor", dp=8, micro_batch_size=4, ep=8)
    eight = shape(gpus=8)
    expected = moe.params - moe.expert_params + moe.expert_params / 8
    assert static_bytes(moe, RoleKind.POLICY, experts, eight) == pytest.approx(16 * expected, rel=1e-6)
    batch = batching(load(Op.UPDATE), experts, eight, train=True)
    assert parallel_comm_seconds(moe, batch, plain, eight, 3) == 0.0
    # Dispatch + combine of each token's 8 expert copies, 7/8 of them to other ranks, per layer and pass.
    size = 2 * batch.micro_tokens * 8 * moe.hidden * 2 * 7 / 8
    by_hand = batch.micro_batches * 3 * moe.layers * (size / ROUND.link_bandwidth + COLLECTIVE_LATENCY_S)
    assert parallel_comm_seconds(moe, batch, experts, eight, 3) == pytest.approx(by_hand, rel=1e-9)


def test_latent_attention_caches_one_vector_per_layer():
    deepseek = ModelSpec.preset("deepseek-v3")
    assert deepseek.kv_bytes_per_token(2) == 61 * 576 * 2
    assert deepseek.params == 671_000_000_000 and deepseek.active == 37_000_000_000


def test_pipeline_bubble_by_hand():
    run = RunSettings(train_tokens_per_gpu=1000)
    flat = RoleLayout(role="actor", dp=4, micro_batch_size=1)
    staged = RoleLayout(role="actor", dp=4, micro_batch_size=1, pp=4)
    four = shape(run, 4)
    batch = batching(load(Op.UPDATE), staged, four, train=True)
    micro = batch.micro_batches
    ratio = (micro + 3) / micro
    assert math.isclose(batch.tokens_per_gpu, batching(load(Op.UPDATE), flat, four, train=True).tokens_per_gpu)
    flat_s = update_cost(MODEL, RoleKind.POLICY, load(Op.UPDATE), flat, four).seconds
    staged_s = update_cost(MODEL, RoleKind.POLICY, load(Op.UPDATE), staged, four).seconds
    assert staged_s > flat_s and ratio > 1
    assert static_bytes(MODEL, RoleKind.POLICY, staged, four) == static_bytes(MODEL, RoleKind.POLICY, flat, four) // 4


def test_hybrid_shard_size_sets_the_shard_group():
    layout = RoleLayout(role="actor", dp=16, sharding=Sharding.HYBRID_SHARD, shard_size=2)
    sixteen = Shape(ROUND, (8, 8), 25e9, constants=PLAIN)
    assert static_bytes(MODEL, RoleKind.POLICY, layout, sixteen) == 8 * MODEL.params  # 16 bytes over 2 GPUs


def test_packed_attention_sees_the_token_weighted_sequence_length():
    lengths = LengthDistribution.from_lengths([100, 300, 800])  # mean 400, E[L^2] = 743,333
    run = shape(RunSettings(lengths=lengths))
    # A token's sequence has length s = PROMPT + L with probability proportional to s: E[s^2] / E[s].
    expected = sum((PROMPT + x) ** 2 for x in (100, 300, 800)) / sum(PROMPT + x for x in (100, 300, 800))
    assert attention_tokens(load(Op.LOGPROB), run) == pytest.approx(expected, rel=1e-12)
    assert expected > PROMPT + 400  # the long sequence holds more of the tokens
    padded = shape(RunSettings(lengths=lengths, padding=True))
    assert attention_tokens(load(Op.LOGPROB), padded) == pytest.approx(PROMPT + 800)
    layout = RoleLayout(role="ref", dp=1, micro_batch_size=8, forward_micro_batch_size=8)
    batch = batching(load(Op.REF_LOGPROB), layout, run, train=False)
    cost = forward_cost(MODEL, RoleKind.FROZEN_POLICY, load(Op.REF_LOGPROB), layout, run)
    by_hand = (batch.tokens_per_gpu * flops_per_token(MODEL, expected, 1)
               / (100e12 * efficiency(batch.micro_tokens, PLAIN)))
    by_hand += (batch.tokens_per_gpu * nonmatmul_bytes_per_token(MODEL, RoleKind.FROZEN_POLICY, 1)
                / (1000e9 * NONMATMUL_HBM_EFFICIENCY))
    assert cost.seconds == pytest.approx(by_hand, rel=1e-9)


def test_verls_controller_overlay_ships_every_call_padded_to_the_caps():
    lengths = LengthDistribution.from_lengths([100, 300, 800])  # cap (max) 800
    constants = Constants(**{**PLAIN.__dict__, "controller_gbs": 2.0})
    run = RunSettings(lengths=lengths, max_prompt_len=256)
    verl = Shape(ROUND, (1,), 25e9, run=run, constants=constants, overlay=ControllerOverlay())
    assert controller_seconds(load(Op.LOGPROB), shape(run, constants=constants)) == 0.0  # hybridflow: no overlay
    # int64 prompts, responses, response mask, input ids, attention mask, positions; fp32 per-token fields.
    tokens = 8 * (256 + 2 * 800 + 3 * (256 + 800))
    policy = ROWS * (tokens + 4 * 800 * 2) / 2e9  # old log-probs and entropies come back
    update = ROWS * (tokens + 4 * 800 * 5) / 2e9  # old log-probs, advantages, returns, scores, rewards go in
    assert controller_seconds(load(Op.LOGPROB), verl) == pytest.approx(policy, rel=1e-12)
    assert controller_seconds(load(Op.UPDATE), verl) == pytest.approx(update, rel=1e-12)
    layout = RoleLayout(role="actor", dp=1, micro_batch_size=8)
    plain = update_cost(MODEL, RoleKind.POLICY, load(Op.UPDATE), layout, shape(run, constants=constants))
    shipped = update_cost(MODEL, RoleKind.POLICY, load(Op.UPDATE), layout, verl)
    assert shipped.seconds - plain.seconds == pytest.approx(update, rel=1e-9)
    gen = NodeLoad("g", Op.GENERATE, ROWS, 8 * PROMPT, ROWS * 400)
    rollout = RoleLayout(role="actor", dp=1, rollout_batch_size=ROWS)
    kept = shape(run, constants=constants)
    extra = generate_cost(MODEL, gen, PROMPT, rollout, verl).seconds - generate_cost(MODEL, gen, PROMPT, rollout,
                                                                                    kept).seconds
    assert extra == pytest.approx(ROWS * tokens / 2e9, rel=1e-9)  # a generate call returns the token tensors


def test_a_weight_refresh_pays_per_tensor_as_well_as_per_byte():
    assert MODEL.weight_tensors == 10 * 9 + 3
    moe = ModelSpec.preset("qwen3-30b-a3b")
    assert moe.weight_tensors == 48 * (9 + 3 * 128) + 3
    layout = RoleLayout(role="actor", dp=2, rollout_tp=2, sharding=Sharding.FULL_SHARD)
    two = shape(gpus=2)
    seconds, per_gpu = weight_sync(MODEL, layout, two)
    assert per_gpu == MODEL.params * 2 / 2
    assert seconds == pytest.approx(ring_seconds(per_gpu, 2, ROUND.link_bandwidth)
                                    + MODEL.weight_tensors * WEIGHT_TENSOR_S, rel=1e-12)


def test_weights_shipped_to_a_detached_rollout_pay_per_tensor_on_both_pools():
    # A FULL_SHARD trainer on 4 GPUs of one machine: gather the shards (a ring of N·b over 4 ranks at the
    # 100 GB/s link), one full bf16 copy out at the 25 GB/s inter-node link, and 1 ms for each of the 93
    # tensors the sync sends one by one (verl's NCCL loop: gather, broadcast, load_weights per tensor).
    trainer = RoleLayout(role="actor", dp=4, sharding=Sharding.FULL_SHARD)
    full = MODEL.params * 2  # 2 GB
    gather = full * 3 / 4 / (100 * GB) + COLLECTIVE_LATENCY_S  # 15 ms
    per_tensor = 93 * 1e-3
    seconds, shipped = weight_ship(MODEL, trainer, shape(gpus=4))
    assert shipped == full
    assert seconds == pytest.approx(gather + full / 25e9 + COLLECTIVE_LATENCY_S + per_tensor, rel=1e-12)
    assert seconds == pytest.approx(0.015 + 0.08 + 0.093 + 2 * COLLECTIVE_LATENCY_S, rel=1e-12)
    # The engine on the rollout's GPUs is held by the same loop: the copy's arrival plus each tensor's load.
    engine = RoleLayout(role="actor:rollout", dp=2, rollout_tp=1)
    assert weight_load(MODEL, engine, shape(gpus=2)) == pytest.approx(0.08 + COLLECTIVE_LATENCY_S + 0.093, rel=1e-12)
