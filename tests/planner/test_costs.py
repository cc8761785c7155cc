"""The cost model's formulas move the right way: sharding saves memory, recomputation trades time for it,
training costs three forwards, decode is bound by weights and KV cache, more GPUs cut node time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridflow.graph import NodeLoad, Op, RoleKind
from hybridflow.planner import DEVICES, ModelSpec, RoleLayout, Sharding
from hybridflow.planner.costs import Shape, forward_cost, static_bytes, update_cost
from hybridflow.planner.rollout import generate_cost

LLAMA = ModelSpec.preset("llama3-8b")
A100 = Shape(DEVICES["A100-80G"], (8,))
ROWS, SEQ = 256, 1024
TRAIN = NodeLoad("update", Op.UPDATE, ROWS, ROWS * 512, ROWS * 512)
FORWARD = NodeLoad("logprob", Op.LOGPROB, ROWS, ROWS * 512, ROWS * 512)
ROLLOUT = NodeLoad("generate", Op.GENERATE, ROWS, 64 * 512, ROWS * 512)


def layout(**changes) -> RoleLayout:
    return replace(RoleLayout(role="actor", dp=8, tp=1, micro_batch_size=4), **changes)


def test_sharding_orders_resident_memory():
    sizes = {s: static_bytes(LLAMA, RoleKind.POLICY, layout(sharding=s), A100) for s in Sharding}
    assert sizes[Sharding.NO_SHARD] == pytest.approx(16 * LLAMA.params, rel=1e-6)  # 2 + 2 + 12 bytes per weight
    assert sizes[Sharding.NO_SHARD] > sizes[Sharding.ZERO1] > sizes[Sharding.SHARD_GRAD_OP] > sizes[Sharding.FULL_SHARD]
    assert sizes[Sharding.ZERO2] == sizes[Sharding.SHARD_GRAD_OP]
    assert sizes[Sharding.ZERO3] == sizes[Sharding.FULL_SHARD]
    frozen = static_bytes(LLAMA, RoleKind.FROZEN_POLICY, layout(), A100)
    assert frozen == 2 * LLAMA.params
    assert static_bytes(LLAMA, RoleKind.FROZEN_POLICY, layout(sharding=Sharding.FULL_SHARD), A100) == frozen // 8


def test_checkpointing_trades_time_for_activation_memory():
    plain = update_cost(LLAMA, RoleKind.POLICY, TRAIN, layout(), A100)
    ckpt = update_cost(LLAMA, RoleKind.POLICY, TRAIN, layout(gradient_checkpointing=True), A100)
    assert ckpt.transient_bytes < plain.transient_bytes / 3 and ckpt.seconds > plain.seconds


def test_training_costs_about_three_forwards():
    one_gpu = Shape(DEVICES["H100-80G"], (1,))
    train = update_cost(LLAMA, RoleKind.POLICY, TRAIN, layout(dp=1), one_gpu).seconds
    forward = forward_cost(LLAMA, RoleKind.POLICY, FORWARD, layout(dp=1), one_gpu).seconds
    assert 3.0 <= train / forward < 3.3  # 6N vs 2N FLOPs per token, plus the optimizer step


def test_decode_is_bound_by_weights_and_kv_cache():
    base = generate_cost(LLAMA, ROLLOUT, 512, layout(rollout_batch_size=32), A100)
    longer_load = replace(ROLLOUT, response_tokens=ROWS * 1024)
    longer = generate_cost(LLAMA, longer_load, 512, layout(rollout_batch_size=32), A100)
    more_kv = generate_cost(replace(LLAMA, kv_heads=32), ROLLOUT, 512, layout(rollout_batch_size=32), A100)
    assert longer.seconds > 1.9 * base.seconds and longer.transient_bytes > base.transient_bytes
    assert more_kv.seconds > base.seconds and more_kv.transient_bytes > base.transient_bytes
    faster_hbm = generate_cost(LLAMA, ROLLOUT, 512, layout(rollout_batch_size=32), Shape(DEVICES["H200"], (8,)))
    assert faster_hbm.seconds < base.seconds


def test_more_gpus_cut_node_time():
    small = forward_cost(LLAMA, RoleKind.POLICY, FORWARD, layout(dp=2), Shape(DEVICES["A100-80G"], (2,)))
    large = forward_cost(LLAMA, RoleKind.POLICY, FORWARD, layout(dp=8), A100)
    assert large.seconds < small.seconds / 3


def test_a_device_without_bf16_refuses_it():
    with pytest.raises(ValueError, match="T4 does not run bf16"):
        forward_cost(LLAMA, RoleKind.POLICY, FORWARD, layout(dp=2), Shape(DEVICES["T4"], (2,)))
