"""Rank functions of the LoRA tests on sharded backends (spawned gloo ranks, ``harness.run_ranks``)."""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import torch
from harness import context, layout, rank_rows, role_spec, rollout_batch

from hybridflow.planner import Sharding
from hybridflow.registry import LOSSES
from hybridflow.runtime.protocols import AdapterSpec, RoleSpec

ADAPTERS = AdapterSpec(rank=4, alpha=8.0)


def lora_spec(**changes: Any) -> RoleSpec:
    return dataclasses.replace(role_spec(lr=1e-2, **changes), lora=ADAPTERS)


def steps(engine: Any, batch: Any, count: int) -> list[float]:
    return [engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})["loss"] for _ in range(count)]


def base_and_adapters(engine: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Whole (base, adapter) tensors of an engine, in the model's own names, copied."""
    from hybridflow.backends.common.peft_lora import is_adapter_key

    state = {name: tensor.detach().clone() for name, tensor in engine.whole_state(lambda _name: True)}
    return ({n: t for n, t in state.items() if not is_adapter_key(n)},
            {n: t for n, t in state.items() if is_adapter_key(n)})


def sharded_checks(rank: int, world_size: int, backend: str, sharding: str) -> dict[str, Any]:
    """A LoRA policy on ``backend`` against the torch engine: only adapters move, merged weights and adapters match,
    the base log-probs are the base model's, and an adapter checkpoint resumes exactly."""
    from hybridflow.backends.torch import TorchRoleEngine

    build = _engine_class(backend)
    batch = rollout_batch(8, seed=2)
    reference = TorchRoleEngine(lora_spec(), layout(dp=1), context())
    steps(reference, batch, 2)
    reference_merged = reference.state_dict()
    base_model = TorchRoleEngine(role_spec(), layout(dp=1), context())  # the same seed: the LoRA policy's base

    lay = layout(sharding=Sharding(sharding))
    engine = build(lora_spec(), lay, context(rank, world_size))
    rows = rank_rows(batch, rank, world_size)
    trainable = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    optimized = sum(p.numel() for group in _optimizer(engine).param_groups for p in group["params"])
    base_before, adapters_before = base_and_adapters(engine)
    steps(engine, rows, 2)
    base_after, adapters_after = base_and_adapters(engine)
    merged = engine.state_dict()
    out: dict[str, Any] = {
        "trainable": trainable, "optimized": optimized,
        "base_unchanged": all(torch.equal(base_before[n], base_after[n]) for n in base_before),
        "adapters_moved": all(not torch.equal(adapters_before[n], adapters_after[n]) for n in adapters_before),
        "merged_names": set(merged) == set(reference_merged),
        "merged_gap": max(float((merged[n] - reference_merged[n]).abs().max()) for n in reference_merged),
        "adapter_names": sorted(name for name, _ in engine.iter_adapter_weights()) == sorted(
            name for name, _ in reference.iter_adapter_weights()),
        "base_logprob_gap": float((engine.log_probs(rows, adapters=False)["logprobs"]
                                   - base_model.log_probs(rows)["logprobs"]).abs().max()),
    }
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        torch.distributed.broadcast_object_list(shared, src=0)  # one directory for the group
        engine.save_checkpoint(shared[0])
        out["checkpoint_bytes"] = _tree_bytes(shared[0]) if rank == 0 else 0
        out["checkpoint_model_keys"] = _checkpoint_model_keys(shared[0]) if backend == "fsdp" else []
        steps(engine, rows, 2)
        uninterrupted = engine.state_dict()
        fresh = build(lora_spec(), lay, context(rank, world_size))
        fresh.load_checkpoint(shared[0])
        steps(fresh, rows, 2)
        resumed = fresh.state_dict()
        out["resume_exact"] = all(torch.equal(resumed[n], uninterrupted[n]) for n in uninterrupted)
        out["resume_logprobs_exact"] = torch.equal(fresh.log_probs(rows)["logprobs"],
                                                   engine.log_probs(rows)["logprobs"])
        torch.distributed.barrier()
    out["model_bytes"] = sum(t.numel() * t.element_size() for t in reference_merged.values())
    for closing in (engine, fresh):
        closing.close()
    return out


def _engine_class(backend: str) -> Any:
    if backend == "fsdp":
        from hybridflow.backends.fsdp import FsdpRoleEngine

        return FsdpRoleEngine
    from hybridflow.backends.deepspeed import DeepSpeedRoleEngine

    return DeepSpeedRoleEngine


def _optimizer(engine: Any) -> torch.optim.Optimizer:
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:  # DeepSpeed wraps the torch optimizer
        optimizer = engine.engine.optimizer
    return getattr(optimizer, "optimizer", optimizer)


def _tree_bytes(directory: str) -> int:
    from pathlib import Path

    return sum(path.stat().st_size for path in Path(directory).rglob("*") if path.is_file())


def _checkpoint_model_keys(directory: str) -> list[str]:
    """The model entries of a DCP checkpoint (its metadata's keys under ``model.``)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(directory).read_metadata()
    return sorted(key for key in metadata.state_dict_metadata if key.startswith("model."))
