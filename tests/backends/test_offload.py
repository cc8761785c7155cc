"""Offload as layout fields: what each backend builds from ``RoleLayout.offload_*`` (FSDP2's offload policy, the ZeRO
config), what it refuses, and, on a CUDA device, the peak memory it saves. On a CPU every tensor is in host memory
already: the engines there report the offload and move nothing (FSDP2's policy cannot run without an accelerator)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

pytest.importorskip("transformers")
from harness import layout, role_spec, rollout_batch

from hybridflow.planner import Sharding

EVERYTHING = {"offload_params": True, "offload_grads": True, "offload_optimizer": True}
WIDE = dataclasses.replace(role_spec(), model="tiny-qwen2-wide")  # 4x the tiny model's parameters


def test_fsdp_offloads_parameters_gradients_and_optimizer_states_together(caplog: pytest.LogCaptureFixture) -> None:
    from hybridflow.backends.fsdp.parallelize import offload_policy
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    everything = layout(**EVERYTHING).offloaded
    policy = offload_policy(everything, device_type="cuda", role="actor")
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory
    assert type(offload_policy(frozenset(), device_type="cuda", role="actor")) is OffloadPolicy
    with caplog.at_level(logging.WARNING):
        assert type(offload_policy(everything, device_type="cpu", role="actor")) is OffloadPolicy
    assert "host memory already" in caplog.text
    with pytest.raises(ValueError, match=r"offloads \['optimizer'\]: FSDP2's CPUOffloadPolicy keeps parameters, "
                                         r"gradients and optimizer states in host memory together"):
        offload_policy(layout(offload_optimizer=True).offloaded, device_type="cuda", role="actor")


def test_the_zero_config_follows_the_layouts_offload() -> None:
    from hybridflow.backends.deepspeed import DeepSpeedOptions, build_config

    def zero(sharding: Sharding, dp: int = 2, **fields: bool) -> dict:
        config = build_config(role_spec(), layout(sharding=sharding, dp=dp, **fields), DeepSpeedOptions(),
                              micro_batch_size=2, pin_memory=True)
        return {"zero": config["zero_optimization"], "optimizer": config.get("optimizer", {}).get("type")}

    assert zero(Sharding.ZERO3, **EVERYTHING) == {"zero": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}}, "optimizer": "AdamW"}  # DeepSpeed's CPU Adam
    assert zero(Sharding.ZERO2, offload_optimizer=True)["zero"] == {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert zero(Sharding.ZERO3, offload_params=True) == {
        "zero": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}, "optimizer": None}
    assert zero(Sharding.ZERO2) == {"zero": {"stage": 2}, "optimizer": None}  # a torch AdamW, nothing moved
    # One rank: every stage holds the same bytes, so the stage the offload needs is taken.
    assert zero(Sharding.NO_SHARD, dp=1, offload_params=True)["zero"]["stage"] == 3
    assert zero(Sharding.NO_SHARD, dp=1, offload_optimizer=True)["zero"]["stage"] == 1
    with pytest.raises(ValueError, match=r"offload_params needs ZeRO stage 3 .* sharding ZERO2 is stage 2"):
        zero(Sharding.ZERO2, offload_params=True)
    with pytest.raises(ValueError, match=r"offload_optimizer needs ZeRO stage >= 1"):
        zero(Sharding.NO_SHARD, offload_optimizer=True)


def test_backends_declare_the_offloads_they_run_and_refuse_the_rest_by_name() -> None:
    from hybridflow.registry import BACKENDS

    fsdp, deepspeed, torch_ = (BACKENDS.get(name).support for name in ("fsdp", "deepspeed", "torch"))
    full, optimizer = layout(**EVERYTHING), layout(offload_optimizer=True)
    assert fsdp.problems(full) == [] and deepspeed.problems(layout(sharding=Sharding.ZERO3, **EVERYTHING)) == []
    assert fsdp.problems(optimizer) == ["offload=['optimizer'] (it offloads ['grads', 'optimizer', 'params'] "
                                        "together); optimizer states alone (ZeRO-Offload) run on backend deepspeed"]
    assert deepspeed.problems(layout(sharding=Sharding.ZERO2, offload_optimizer=True)) == []
    assert deepspeed.problems(layout(sharding=Sharding.ZERO2, offload_params=True)) == [
        "offload=['params'] with sharding=ZERO2 (it offloads params under FULL_SHARD, ZERO3 only)"]
    assert torch_.problems(layout(dp=1, sharding=Sharding.NO_SHARD, offload_optimizer=True)) == [
        "offload=['optimizer'] (it keeps nothing in host memory)"]


@pytest.mark.gpu
def test_fsdp_cpu_offload_lowers_the_peak_gpu_memory_of_a_step() -> None:
    """One CUDA rank (a private process group): the step's peak allocated bytes with CPUOffloadPolicy are below the
    plain engine's by at least the two fp32 Adam moments (they never reach the GPU)."""
    import torch
    from hybridflow.backends.fsdp import FsdpRoleEngine

    from hybridflow.registry import LOSSES
    from hybridflow.runtime.protocols import WorkerContext
    from hybridflow.runtime.worker import SoloCollective

    ctx = WorkerContext(group=0, rank=0, world_size=1, device="cuda:0", collective=SoloCollective())
    batch = rollout_batch(4)
    batch = type(batch)({k: v.cuda() for k, v in batch.tensors.items()})
    peaks = {}
    for name, fields in (("resident", {}), ("offloaded", EVERYTHING)):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        engine = FsdpRoleEngine(WIDE, layout(dp=1, **fields), ctx)
        engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
        engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})  # Adam moments exist from here
        peaks[name] = torch.cuda.max_memory_allocated()
        params = sum(p.numel() for p in engine.model.parameters())
        assert engine.executed_layout()["offload_policy"] == ("CPUOffloadPolicy" if fields else "OffloadPolicy")
        del engine
    assert peaks["resident"] - peaks["offloaded"] >= 2 * 4 * params, peaks


@pytest.mark.gpu
def test_zero_offload_lowers_the_peak_gpu_memory_of_a_step() -> None:
    """ZeRO-3 with parameters and optimizer offloaded against plain ZeRO-3, one CUDA rank."""
    import torch
    from hybridflow.backends.deepspeed import DeepSpeedRoleEngine

    from hybridflow.registry import LOSSES
    from hybridflow.runtime.protocols import WorkerContext
    from hybridflow.runtime.worker import SoloCollective

    ctx = WorkerContext(group=0, rank=0, world_size=1, device="cuda:0", collective=SoloCollective())
    batch = rollout_batch(4)
    batch = type(batch)({k: v.cuda() for k, v in batch.tensors.items()})
    peaks = {}
    for name, fields in (("resident", {}), ("offloaded", EVERYTHING)):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        engine = DeepSpeedRoleEngine(WIDE, layout(dp=1, sharding=Sharding.ZERO3, **fields), ctx)
        engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
        peaks[name] = torch.cuda.max_memory_allocated()
        assert engine.executed_layout()["offload_params"] is bool(fields)
        engine.close()
        del engine
    assert peaks["offloaded"] < peaks["resident"], peaks
