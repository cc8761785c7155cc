"""Rank functions of the vision tests (spawned gloo ranks import them by name)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from harness import context, layout, rank_rows, role_spec

from hybridflow.graph import RoleKind
from hybridflow.planner import Sharding
from hybridflow.runtime.batch import Batch


def fsdp_logprobs(rank: int, world_size: int, model_dir: str, wire: Any) -> dict[str, torch.Tensor]:
    """An FSDP (FULL_SHARD) frozen policy's log-probs of this rank's share of the rows, padded and packed."""
    from hybridflow.backends.fsdp import FsdpRoleEngine

    batch = rank_rows(Batch.from_wire(wire), rank, world_size)
    spec = dataclasses.replace(role_spec("ref", RoleKind.FROZEN_POLICY), model=model_dir)
    out = {}
    for padding in (True, False):
        engine = FsdpRoleEngine(spec, layout("ref", sharding=Sharding.FULL_SHARD, padding=padding,
                                             forward_micro_batch_size=1), context(rank, world_size))
        out["padded" if padding else "packed"] = engine.log_probs(batch)["logprobs"]
    return out


def fsdp_frozen_update(rank: int, world_size: int, model_dir: str, wire: Any) -> dict[str, Any]:
    """An FSDP (FULL_SHARD) policy with a frozen vision tower: its whole weights before and after one update of this
    rank's rows, the names its sync stream ships, and how many tower parameters hold optimizer state here."""
    from hybridflow.backends.fsdp import FsdpRoleEngine

    from hybridflow.registry import LOSSES
    from hybridflow.runtime.weights import full_weights

    batch = rank_rows(Batch.from_wire(wire), rank, world_size)
    spec = dataclasses.replace(role_spec("actor", RoleKind.POLICY), model=model_dir, freeze_vision_tower=True)
    engine = FsdpRoleEngine(spec, layout("actor", sharding=Sharding.FULL_SHARD, padding=True, micro_batch_size=1),
                            context(rank, world_size))
    before = {name: tensor.clone() for name, tensor in engine.iter_full_weights()}
    engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
    after = {name: tensor.clone() for name, tensor in engine.iter_full_weights()}
    shipped = [name for name, _ in full_weights(engine, "fp32", trained_only=True)]
    tower = [param for name, param in engine.model.named_parameters() if name.startswith("model.visual.")]
    return {"before": before, "after": after, "shipped": shipped,
            "tower_state": sum(1 for param in tower if engine.optimizer.state.get(param))}


def deepspeed_zero2_updates(rank: int, world_size: int, model_dir: str, wire: Any) -> dict[str, Any]:
    """A DeepSpeed ZeRO-2 policy's update over this rank's image rows against the torch engine's over all of them
    (``weight_gap``, fp32), then with a frozen vision tower: the tower parameters that moved (``tower_moved``) and
    the language-model ones that did (``text_moved``)."""
    from hybridflow.backends.deepspeed import DeepSpeedRoleEngine
    from hybridflow.backends.torch import TorchRoleEngine

    from hybridflow.registry import LOSSES

    whole = Batch.from_wire(wire)
    batch = rank_rows(whole, rank, world_size)
    spec = dataclasses.replace(role_spec("actor", RoleKind.POLICY), model=model_dir)
    reference = TorchRoleEngine(spec, layout("actor", dp=1, sharding=Sharding.NO_SHARD, padding=True), context())
    reference.train_step(whole, loss=LOSSES.get("ppo_policy"), options={})
    expected = reference.state_dict()
    out: dict[str, Any] = {}
    for frozen in (False, True):
        engine = DeepSpeedRoleEngine(dataclasses.replace(spec, freeze_vision_tower=frozen),
                                     layout("actor", sharding=Sharding.ZERO2, padding=True, micro_batch_size=1),
                                     context(rank, world_size))
        before = engine.state_dict()
        engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
        after = engine.state_dict()
        moved = [name for name in before if not torch.equal(before[name], after[name])]
        if not frozen:
            out["weight_gap"] = max(float((after[name] - expected[name]).abs().max()) for name in expected)
        out["frozen" if frozen else "trained"] = {
            "tower_moved": sum(name.startswith("model.visual.") for name in moved),
            "text_moved": sum(not name.startswith("model.visual.") for name in moved)}
    return out


def fsdp_critic(rank: int, world_size: int, model_dir: str, wire: Any) -> dict[str, Any]:
    """An FSDP (FULL_SHARD) vision-language critic: its values of this rank's rows, then the largest gap between its
    whole weights after one value update of them and the torch engine's after the same update of all the rows, and
    the largest change that update made (``step``)."""
    from hybridflow.backends.fsdp import FsdpRoleEngine
    from hybridflow.backends.torch import TorchRoleEngine

    from hybridflow.registry import LOSSES

    whole = Batch.from_wire(wire)
    spec = dataclasses.replace(role_spec("critic", RoleKind.VALUE), model=model_dir)
    reference = TorchRoleEngine(spec, layout("critic", dp=1, sharding=Sharding.NO_SHARD, padding=True), context())
    before = {name: tensor.clone() for name, tensor in reference.state_dict().items()}
    reference.train_step(whole, loss=LOSSES.get("value"), options={})
    expected = reference.state_dict()
    engine = FsdpRoleEngine(spec, layout("critic", sharding=Sharding.FULL_SHARD, padding=True, micro_batch_size=1,
                                         forward_micro_batch_size=1), context(rank, world_size))
    batch = rank_rows(whole, rank, world_size)
    values = engine.values(batch)["values"]
    engine.train_step(batch, loss=LOSSES.get("value"), options={})
    after = dict(engine.iter_full_weights())
    return {"values": values, "weight_gap": max(float((after[name] - expected[name]).abs().max()) for name in expected),
            "step": max(float((expected[name] - before[name]).abs().max()) for name in expected)}
