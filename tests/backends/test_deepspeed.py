"""The DeepSpeed backend on two gloo ranks: ZeRO stages against the torch reference, a bf16 ZeRO-3 critic."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("deepspeed", reason="needs DeepSpeed (the `deepspeed` extra)")
import deepspeed_ranks
from harness import context, layout, role_spec, run_ranks

from hybridflow.planner import Sharding

# The first run JIT-compiles a comm op (~55 s) and, for offload, DeepSpeed's CPU Adam (~75 s); both are
# cached under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), which CI keeps between runs.
STAGES = ["ZERO1", "ZERO2", "ZERO3", "NO_SHARD", "ZERO2+offload"]


@pytest.fixture(scope="module")
def deepspeed_results() -> list[dict[str, Any]]:
    """One two-rank spawn shared by the module's tests (start-up dominates on a small CPU)."""
    return run_ranks(deepspeed_ranks.all_checks, STAGES)


@pytest.mark.slow
def test_every_zero_stage_matches_the_torch_reference_on_the_first_step(deepspeed_results: list[dict[str, Any]]
                                                                        ) -> None:
    ranks = [result["first_step"] for result in deepspeed_results]
    reference: dict[str, Any] = ranks[0]["reference"]
    for stage in STAGES:
        loss = sum(r[stage]["loss"] for r in ranks) / len(ranks)
        assert loss == pytest.approx(reference["loss"], abs=1e-6), stage
        for result in ranks:
            if result[stage]["grad_norm"] is not None:  # stage 0 does not report it
                assert result[stage]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), stage
            # fp32 Adam on flat partitions vs per-tensor: the same update up to rounding.
            assert result[stage]["weight_gap"] < 1e-5, stage


@pytest.mark.slow
def test_bf16_zero3_critic_trains_and_resumes_and_a_zero3_policy_generates(deepspeed_results: list[dict[str, Any]]
                                                                            ) -> None:
    ranks = [result["critic"] for result in deepspeed_results]
    for result in ranks:
        assert result["moved"] > 0
        assert min(result["losses"][1:]) < result["losses"][0]
        assert result["restore_gap"] == 0.0
        assert result["resume_loss_gap"] < 1e-6
        assert result["resume_state_gap"] == 0.0
        assert result["generated_rows"] == 4
        assert result["load_gap"] < 1e-6
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


def test_offload_needs_a_sharded_stage() -> None:
    from hybridflow.backends.deepspeed import DeepSpeedOptions, build_config

    spec = role_spec(offload_optimizer=True)
    with pytest.raises(ValueError, match="offload_optimizer needs ZeRO stage >= 1"):
        build_config(spec, layout(sharding=Sharding.NO_SHARD), DeepSpeedOptions.from_spec(spec),
                     micro_batch_size=2)


def test_config_follows_the_layout() -> None:
    from hybridflow.backends.deepspeed import DeepSpeedOptions, build_config

    spec = role_spec(ds_config={"steps_per_print": 10})
    config = build_config(spec, layout(sharding=Sharding.FULL_SHARD, dtype="bf16"),
                          DeepSpeedOptions.from_spec(spec), micro_batch_size=4)
    assert config["zero_optimization"]["stage"] == 3
    assert config["bf16"] == {"enabled": True}
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["steps_per_print"] == 10


def test_a_rank_without_a_process_group_is_told_how_to_join() -> None:
    from hybridflow.backends.deepspeed import DeepSpeedRoleEngine

    with pytest.raises(RuntimeError, match="process group"):
        DeepSpeedRoleEngine(role_spec(), layout(), context(rank=1, world_size=2))


@pytest.mark.gpu
def test_zero2_bf16_on_one_cuda_device_trains() -> None:
    """NCCL path on one GPU (a private single-rank process group)."""
    from harness import rollout_batch
    from hybridflow.backends.deepspeed import DeepSpeedRoleEngine

    from hybridflow.registry import LOSSES
    from hybridflow.runtime.batch import Batch
    from hybridflow.runtime.protocols import WorkerContext
    from hybridflow.runtime.worker import SoloCollective

    ctx = WorkerContext(group=0, rank=0, world_size=1, device="cuda:0", collective=SoloCollective())
    engine = DeepSpeedRoleEngine(role_spec(), layout(dp=1, sharding=Sharding.ZERO2, dtype="bf16"), ctx)
    batch = Batch({k: v.cuda() for k, v in rollout_batch(4).tensors.items()})
    assert engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})["loss"] != 0
