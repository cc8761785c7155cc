"""The FSDP2 backend on two gloo ranks: agreement with the torch reference, training, checkpoints, generation; and
tensor parallelism (FSDP2 x TP, tp=2): forward passes, updates, weight shipping, generation and checkpoints equal
the unsharded model's. The dp=2 x tp=2 version (four ranks) is ``benchmarks/tensor_parallel.py``, too slow for the
suite on two cores."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")
import fsdp_ranks
import torch
import tp_ranks
from harness import context, layout, role_spec, run_ranks

from hybridflow.planner import Sharding

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]


@pytest.fixture(scope="module")
def fsdp_results() -> list[dict[str, Any]]:
    """One two-rank spawn shared by the module's tests (start-up dominates on a small CPU)."""
    return run_ranks(fsdp_ranks.all_checks, STRATEGIES)


@pytest.mark.slow
def test_every_strategy_matches_the_torch_reference_on_the_first_step(fsdp_results: list[dict[str, Any]]) -> None:
    ranks = [result["first_step"] for result in fsdp_results]
    for strategy in STRATEGIES:
        # Each rank's loss is the mean over its half of the rows; their mean is the full batch's loss.
        loss = sum(r[strategy]["loss"] for r in ranks) / len(ranks)
        assert loss == pytest.approx(ranks[0]["reference_loss"], abs=1e-6), strategy
        for result in ranks:
            # fp32 on both sides; only the order of the gradient reduction differs.
            assert result[strategy]["grad_gap"] <= 1e-6 * max(1.0, result[strategy]["grad_scale"]), strategy
            assert result[strategy]["weight_gap"] < 1e-5, strategy
    for result in ranks:
        # Forward-only ops of frozen roles (reference, critic values, reward model) shard identically.
        assert max(result["frozen_gaps"].values()) < 1e-5, result["frozen_gaps"]


@pytest.mark.slow
def test_bf16_training_moves_weights_and_resumes_from_a_sharded_checkpoint(fsdp_results: list[dict[str, Any]]
                                                                           ) -> None:
    ranks = [result["train"] for result in fsdp_results]
    for result in ranks:
        assert result["moved"] > 0
        assert result["losses"][-1] < result["losses"][0]
        assert result["restore_gap"] == 0.0
        assert result["resumed_next_gap"] < 1e-6
        assert result["generated_width"] >= 1
        assert torch.isfinite(result["logprobs"]).all()
        assert result["load_gap"] == 0.0
    # Every rank gathers the same full weights (what a rollout engine receives).
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


def test_forward_passes_under_tensor_parallelism_equal_the_unsharded_model(fsdp_results: list[dict[str, Any]]) -> None:
    for result in (r["tp"] for r in fsdp_results):
        for name in ("logprobs_packed", "entropy_packed", "logprobs_padded", "entropy_padded", "values", "scores"):
            assert result[name] < 1e-5, (name, result[name])


@pytest.mark.slow
def test_a_tensor_parallel_update_equals_the_unsharded_one(fsdp_results: list[dict[str, Any]]) -> None:
    for result in (r["tp"] for r in fsdp_results):
        assert result["executed"]["tp"] == 2
        assert result["grad_gap"] < 1e-5  # clipped gradients, relative to the largest: the norm is right too
        norm, reference = result["grad_norm"]
        assert norm == pytest.approx(reference, rel=1e-5) and norm > 10 * tp_ranks.CLIP
        assert result["weight_gap"] < 1e-5
        assert result["restore_gap"] == 0.0  # DCP saves and restores the 2-D shards


@pytest.mark.slow
def test_weights_leave_a_tensor_parallel_engine_whole(fsdp_results: list[dict[str, Any]]) -> None:
    for result in (r["tp"] for r in fsdp_results):
        assert result["shapes"]
        assert result["initial_weight_gap"] == 0.0 and result["stream_gap"] == 0.0


@pytest.mark.slow
def test_tensor_parallel_peers_generate_alike(fsdp_results: list[dict[str, Any]]) -> None:
    for result in (r["tp"] for r in fsdp_results):
        assert result["greedy_equal"]
    # Same rows, same seed: the same tokens (else the peers' collectives would part).
    assert torch.equal(fsdp_results[0]["tp"]["sampled"], fsdp_results[1]["tp"]["sampled"])


@pytest.mark.slow
def test_lora_under_tensor_parallelism_is_refused_naming_tp(fsdp_results: list[dict[str, Any]]) -> None:
    assert "set tp=1" in fsdp_results[0]["tp"]["lora_refusal"]


@pytest.mark.slow
def test_an_offloading_layout_is_reported_and_trains_alike_on_cpu(fsdp_results: list[dict[str, Any]]) -> None:
    for result in (r["offload"] for r in fsdp_results):
        executed = result["executed"]
        assert executed["offload_params"] and executed["offload_grads"] and executed["offload_optimizer"]
        assert executed["offload_policy"] == "OffloadPolicy"  # CPUOffloadPolicy needs an accelerator
        assert result["losses"]["offloaded"] == result["losses"]["resident"]


def test_a_tp_that_does_not_divide_the_group_or_the_heads_is_refused() -> None:
    from hybridflow.backends.fsdp import FsdpRoleEngine
    from hybridflow.backends.fsdp.tensor_parallel import check_divisible

    from hybridflow.models import tiny_config

    with pytest.raises(ValueError, match=r"tp=2 must divide the group's 1 ranks"):
        FsdpRoleEngine(role_spec(), layout(tp=2, dp=1), context())
    config = tiny_config("tiny-qwen2", vocab_size=51)  # 4 heads, 2 key-value heads
    check_divisible(config, 2, role="actor")
    with pytest.raises(ValueError, match=r"tp=4 must divide the model's \{'num_key_value_heads': 2\}"):
        check_divisible(config, 4, role="actor")


def test_hybrid_shard_size_must_divide_the_group() -> None:
    from hybridflow.backends.fsdp.parallelize import resolve_sharding

    with pytest.raises(ValueError, match="shard_size=3"):
        resolve_sharding(Sharding.HYBRID_SHARD, world_size=4, shard_size=3)
    assert resolve_sharding(Sharding.HYBRID_SHARD, world_size=4, shard_size=2).mesh_shape == (2, 2)
    assert resolve_sharding(Sharding.FULL_SHARD, world_size=2).reshard_after_forward


def test_a_zero_stage_is_refused_naming_its_fsdp_equivalent() -> None:
    """The planner never gives FSDP a ZeRO name (its LayoutSupport leaves them out); a caller that does is told
    the FSDP strategy instead of having it swapped silently."""
    from hybridflow.backends.fsdp.parallelize import resolve_sharding

    with pytest.raises(ValueError, match=r"sharding=ZERO3: FSDP runs no ZeRO stage \(its equivalent: FULL_SHARD\)"):
        resolve_sharding(Sharding.ZERO3, world_size=2)


def test_a_rank_without_a_process_group_is_told_how_to_join() -> None:
    from hybridflow.backends.fsdp import FsdpRoleEngine

    with pytest.raises(RuntimeError, match="process group"):
        FsdpRoleEngine(role_spec(), layout(), context(rank=1, world_size=2))


@pytest.mark.gpu
def test_fsdp_on_one_cuda_device_trains() -> None:
    """NCCL path on one GPU (a private single-rank process group)."""
    from harness import rollout_batch
    from hybridflow.backends.fsdp import FsdpRoleEngine

    from hybridflow.registry import LOSSES
    from hybridflow.runtime.protocols import WorkerContext
    from hybridflow.runtime.worker import SoloCollective

    ctx = WorkerContext(group=0, rank=0, world_size=1, device="cuda:0", collective=SoloCollective())
    engine = FsdpRoleEngine(role_spec(), layout(dp=1, dtype="bf16"), ctx)
    batch = rollout_batch(4)
    batch = type(batch)({k: v.cuda() for k, v in batch.tensors.items()})
    metrics = engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
    assert metrics["grad_norm"] > 0
