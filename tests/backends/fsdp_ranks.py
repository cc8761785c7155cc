"""Rank functions of the FSDP tests (run in spawned gloo processes by ``harness.run_ranks``)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from harness import context, layout, rank_rows, role_spec, rollout_batch

from hybridflow.graph import RoleKind
from hybridflow.planner import Sharding
from hybridflow.registry import LOSSES
from hybridflow.runtime.protocols import SamplingParams


def step_with_grads(engine: Any, batch: Any, full: Any, loss: str = "ppo_policy"
                    ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One train step with the registered ``loss``, recording whole gradients just before the optimizer applies
    them (``full`` makes a rank's gradient whole)."""
    grads: dict[str, torch.Tensor] = {}
    step = engine.optimizer.step

    def record(*args: Any, **kwargs: Any) -> Any:
        for name, param in engine.model.named_parameters():
            grads[name] = full(param.grad).detach().clone()
        return step(*args, **kwargs)

    engine.optimizer.step = record
    metrics = engine.train_step(batch, loss=LOSSES.get(loss), options={})
    engine.optimizer.step = step
    return metrics, grads


def first_step(rank: int, world_size: int, strategies: list[str]) -> dict[str, Any]:
    """Loss, gradient and updated-weight gaps between each FSDP strategy and the torch reference."""
    from hybridflow.backends.fsdp import FsdpRoleEngine
    from hybridflow.backends.fsdp.engine import full_value
    from hybridflow.backends.torch import TorchRoleEngine

    batch = rollout_batch(8)
    reference = TorchRoleEngine(role_spec(), layout(dp=1), context())
    ref_metrics, ref_grads = step_with_grads(reference, batch, lambda g: g)
    ref_state = reference.state_dict()
    out: dict[str, Any] = {"reference_loss": ref_metrics["loss"]}
    for strategy in strategies:
        engine = FsdpRoleEngine(role_spec(), layout(sharding=Sharding(strategy), shard_size=2),
                                context(rank, world_size))
        metrics, grads = step_with_grads(engine, rank_rows(batch, rank, world_size), full_value)
        state = engine.state_dict()
        out[strategy] = {
            "loss": metrics["loss"],
            "grad_gap": max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads),
            "grad_scale": max(float(g.abs().max()) for g in ref_grads.values()),
            "weight_gap": max(float((state[n] - ref_state[n]).abs().max()) for n in ref_state),
        }
    out["frozen_gaps"] = frozen_ops(rank, world_size)
    return out


def train_resume_generate(rank: int, world_size: int) -> dict[str, Any]:
    """bf16 + gradient checkpointing training, sharded checkpoint round trip, generation and frozen ops."""
    from hybridflow.backends.fsdp import FsdpRoleEngine

    spec, lay = role_spec(lr=3e-3, grad_clip=1.0), layout(dtype="bf16", gradient_checkpointing=True)
    engine = FsdpRoleEngine(spec, lay, context(rank, world_size))
    batch = rank_rows(rollout_batch(8, seed=1), rank, world_size)
    before = engine.state_dict()
    losses = [engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})["loss"] for _ in range(4)]
    after = engine.state_dict()
    out: dict[str, Any] = {"losses": losses, "moved": sum(float((after[n] - before[n]).abs().sum()) for n in after),
                           "checksum": float(sum(t.double().sum() for t in after.values()))}
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        torch.distributed.broadcast_object_list(shared, src=0)  # one directory for the group
        engine.save_checkpoint(shared[0])
        saved_next = engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})["loss"]
        fresh = FsdpRoleEngine(spec, lay, context(rank, world_size))
        fresh.load_checkpoint(shared[0])
        restored = fresh.state_dict()
        out["restore_gap"] = max(float((restored[n] - after[n]).abs().max()) for n in after)
        out["resumed_next_gap"] = abs(fresh.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})["loss"]
                                      - saved_next)
        torch.distributed.barrier()
    # Ranks sample different lengths: generation must not deadlock on per-forward all-gathers.
    generated = engine.generate(batch.select(["prompts", "prompt_mask"]),
                                SamplingParams(max_new_tokens=12, seed=rank, temperature=1.5))
    out["generated_width"] = generated["responses"].shape[1]
    out["logprobs"] = engine.log_probs(batch)["logprobs"]
    engine.load_state_dict(before)  # whole weights in, resharded onto the mesh
    out["load_gap"] = max(float((engine.state_dict()[n] - before[n]).abs().max()) for n in before)
    return out


def frozen_ops(rank: int, world_size: int) -> dict[str, Any]:
    """Reference log-probs, critic values and reward scores under FULL_SHARD vs the torch backend."""
    from hybridflow.backends.fsdp import FsdpRoleEngine
    from hybridflow.backends.torch import TorchRoleEngine

    batch = rollout_batch(8, seed=2)
    rows = rank_rows(batch, rank, world_size)
    gaps = {}
    for kind, op, field in ((RoleKind.FROZEN_POLICY, "log_probs", "logprobs"), (RoleKind.VALUE, "values", "values"),
                            (RoleKind.REWARD_MODEL, "score", "scores")):
        spec = role_spec("role", kind)
        fsdp = FsdpRoleEngine(spec, layout("role"), context(rank, world_size))
        torch_engine = TorchRoleEngine(spec, layout("role", dp=1), context())
        mine = getattr(fsdp, op)(rows)[field]
        theirs = getattr(torch_engine, op)(batch)[field].chunk(world_size)[rank]
        gaps[kind.value] = float((mine - theirs).abs().max())
    return gaps


def offload_step(rank: int, world_size: int) -> dict[str, Any]:
    """A layout offloading everything on CPU ranks: the engine reports it, applies no FSDP2 policy (it cannot run
    without an accelerator; the tensors are in host memory already) and trains as the resident engine does."""
    from hybridflow.backends.fsdp import FsdpRoleEngine

    batch = rank_rows(rollout_batch(8), rank, world_size)
    losses = {}
    for name, fields in (("resident", {}), ("offloaded", dict.fromkeys(("offload_params", "offload_grads",
                                                                       "offload_optimizer"), True))):
        engine = FsdpRoleEngine(role_spec(), layout(**fields), context(rank, world_size))
        losses[name] = [engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})["loss"] for _ in range(2)]
    return {"executed": engine.executed_layout(), "losses": losses}


def all_checks(rank: int, world_size: int, strategies: list[str]) -> dict[str, Any]:
    """Every FSDP scenario in one spawn (process start-up and imports dominate on a small CPU), tensor parallelism
    (tp = the two ranks) included."""
    import tp_ranks

    return {"first_step": first_step(rank, world_size, strategies),
            "train": train_resume_generate(rank, world_size),
            "tp": tp_ranks.tp_checks(rank, world_size, world_size),
            "offload": offload_step(rank, world_size)}
