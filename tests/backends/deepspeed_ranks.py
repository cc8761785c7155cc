"""Rank functions of the DeepSpeed tests (run in spawned gloo processes by ``harness.run_ranks``)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from harness import context, layout, rank_rows, role_spec, rollout_batch

from hybridflow.graph import RoleKind
from hybridflow.planner import Sharding
from hybridflow.registry import LOSSES
from hybridflow.runtime.protocols import SamplingParams


def first_step(rank: int, world_size: int, stages: list[str]) -> dict[str, Any]:
    """Loss, gradient norm and updated-weight gaps of each ZeRO stage against the torch reference (fp32)."""
    from hybridflow.backends.deepspeed import DeepSpeedRoleEngine
    from hybridflow.backends.torch import TorchRoleEngine

    batch = rollout_batch(8)
    reference = TorchRoleEngine(role_spec(), layout(dp=1), context())
    ref_metrics = reference.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
    ref_state = reference.state_dict()
    out: dict[str, Any] = {"reference": ref_metrics}
    for name in stages:
        stage, _, offload = name.partition("+")  # "ZERO2+offload": optimizer states and step on the CPU
        spec = role_spec(offload_optimizer=bool(offload))
        engine = DeepSpeedRoleEngine(spec, layout(sharding=Sharding(stage)),
                                     context(rank, world_size))
        metrics = engine.train_step(rank_rows(batch, rank, world_size), loss=LOSSES.get("ppo_policy"), options={})
        state = engine.state_dict()
        out[name] = {"loss": metrics["loss"], "grad_norm": metrics.get("grad_norm"),
                      "weight_gap": max(float((state[n] - ref_state[n]).abs().max()) for n in ref_state)}
    return out


def critic_zero3_bf16(rank: int, world_size: int) -> dict[str, Any]:
    """A bf16 ZeRO-3 critic trains, checkpoints and resumes; a ZeRO-3 policy generates and syncs weights."""
    from hybridflow.backends.deepspeed import DeepSpeedRoleEngine

    # A small step: at 3e-3 Adam overshoots this tiny bf16 critic on AVX2 kernels (its loss rose at step 2).
    spec = role_spec("critic", RoleKind.VALUE, lr=5e-4, grad_clip=1.0)
    lay = layout("critic", sharding=Sharding.ZERO3, dtype="bf16", gradient_checkpointing=True)
    critic = DeepSpeedRoleEngine(spec, lay, context(rank, world_size))
    batch = rank_rows(rollout_batch(8, seed=4), rank, world_size)
    before = critic.state_dict()
    losses = [critic.train_step(batch, loss=LOSSES.get("value"), options={})["loss"] for _ in range(4)]
    after = critic.state_dict()
    out: dict[str, Any] = {"losses": losses, "checksum": float(sum(t.double().sum() for t in after.values())),
                           "moved": sum(float((after[n].float() - before[n].float()).abs().sum()) for n in after)}
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        torch.distributed.broadcast_object_list(shared, src=0)
        critic.save_checkpoint(shared[0])
        torch.manual_seed(5)  # the value head has dropout: same masks for the step after save and after load
        next_loss = critic.train_step(batch, loss=LOSSES.get("value"), options={})["loss"]
        next_state = critic.state_dict()
        critic.load_checkpoint(shared[0])
        out["restore_gap"] = max(float((critic.state_dict()[n].float() - after[n].float()).abs().max()) for n in after)
        torch.manual_seed(5)
        out["resume_loss_gap"] = abs(critic.train_step(batch, loss=LOSSES.get("value"), options={})["loss"] - next_loss)
        resumed = critic.state_dict()  # equal only if the optimizer's moments were restored too
        out["resume_state_gap"] = max(float((resumed[n].float() - next_state[n].float()).abs().max()) for n in after)
        torch.distributed.barrier()
    policy = DeepSpeedRoleEngine(role_spec(), layout(sharding=Sharding.ZERO3),
                                 context(rank, world_size))
    generated = policy.generate(batch.select(["prompts", "prompt_mask"]),
                                SamplingParams(max_new_tokens=10, seed=rank, temperature=1.5))
    out["generated_rows"] = len(generated)
    state = policy.state_dict()
    policy.load_state_dict({name: value + 0.01 for name, value in state.items()})
    out["load_gap"] = max(float((policy.state_dict()[n] - state[n] - 0.01).abs().max()) for n in state)
    return out


def all_checks(rank: int, world_size: int, stages: list[str]) -> dict[str, Any]:
    """Every DeepSpeed scenario in one spawn (process start-up and imports dominate on a small CPU)."""
    return {"first_step": first_step(rank, world_size, stages), "critic": critic_zero3_bf16(rank, world_size)}
