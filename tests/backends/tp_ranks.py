"""Rank functions of the tensor-parallel tests: the FSDP backend with ``tp`` > 1 (FSDP2 x TP) against the unsharded
torch engine on the same weights (run in spawned gloo processes by ``harness.run_ranks``)."""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import torch
from fsdp_ranks import step_with_grads
from harness import context, layout, rank_rows, role_spec
from packing_ranks import grad_gap, masked_gap, ragged_batch

from hybridflow.graph import RoleKind
from hybridflow.planner import Sharding
from hybridflow.registry import LOSSES
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import AdapterSpec, SamplingParams

CLIP = 0.05  # below the first step's gradient norm (~1.5): the clipped update checks the norm too


def _weight_gap(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(float((state[name] - reference[name]).abs().max()) for name in reference)


def tp_checks(rank: int, world_size: int, tp: int) -> dict[str, Any]:
    """Forward passes (packed and padded), a clipped update, whole weights, generation and a checkpoint round trip
    on ``world_size`` ranks of ``tp``-way tensor parallelism (dp = world / tp), each against the torch engine."""
    from hybridflow.backends.fsdp import FsdpRoleEngine
    from hybridflow.backends.fsdp.engine import full_value
    from hybridflow.backends.torch import TorchRoleEngine

    dp = world_size // tp
    batch = ragged_batch()  # ragged prompts and responses: packed sequences with restarting position ids
    rows = rank_rows(batch, rank // tp, dp)  # tensor-parallel peers hold the same rows

    def split(kind: RoleKind, *, padding: bool = False, spec: Any = None) -> Any:
        spec = spec or role_spec(kind=kind, grad_clip=CLIP)
        return FsdpRoleEngine(spec, layout(dp=dp, tp=tp, rollout_tp=tp, sharding=Sharding.FULL_SHARD,
                                           micro_batch_size=2, padding=padding), context(rank, world_size))

    def whole(kind: RoleKind) -> Any:
        return TorchRoleEngine(role_spec(kind=kind, grad_clip=CLIP),
                               layout(dp=1, sharding=Sharding.NO_SHARD, micro_batch_size=len(batch), padding=True),
                               context())

    mask = rows["response_mask"]
    out: dict[str, Any] = {}
    reference = whole(RoleKind.FROZEN_POLICY)
    want = reference.log_probs(batch, with_entropy=True)
    frozen = {padding: split(RoleKind.FROZEN_POLICY, padding=padding) for padding in (False, True)}
    for padding, engine in frozen.items():
        got = engine.log_probs(rows, with_entropy=True)
        for name in ("logprobs", "entropy"):
            out[f"{name}_{'padded' if padding else 'packed'}"] = masked_gap(
                got[name], want[name].chunk(dp)[rank // tp], mask)
    out["values"] = masked_gap(split(RoleKind.VALUE).values(rows)["values"],
                               whole(RoleKind.VALUE).values(batch)["values"].chunk(dp)[rank // tp], mask)
    out["scores"] = float((split(RoleKind.REWARD_MODEL).score(rows)["scores"]
                           - whole(RoleKind.REWARD_MODEL).score(batch)["scores"].chunk(dp)[rank // tp]).abs().max())
    out.update(_update_checks(split(RoleKind.POLICY), whole(RoleKind.POLICY), rows, batch, full_value))
    out.update(_generation_checks(frozen[False], reference, rows))
    try:
        split(RoleKind.POLICY, spec=dataclasses.replace(role_spec(), lora=AdapterSpec(rank=4)))
        out["lora_refusal"] = ""
    except (TypeError, ValueError) as err:
        out["lora_refusal"] = str(err)
    return out


def _update_checks(engine: Any, reference: Any, rows: Batch, batch: Batch, full: Any) -> dict[str, Any]:
    """One clipped PPO step: gradients (after clipping), the reported norm, the updated whole weights, and the
    whole weights before it (what a rollout receives), against the unsharded engine; then a DCP round trip."""
    from hybridflow.backends.fsdp.engine import local_value

    out: dict[str, Any] = {"executed": engine.executed_layout(),
                           "local_param_bytes": sum(local_value(p).numel() * p.element_size()
                                                    for p in engine.model.parameters())}
    initial, reference_initial = engine.state_dict(), reference.state_dict()
    out["initial_weight_gap"] = _weight_gap(initial, reference_initial)
    out["shapes"] = all(initial[name].shape == value.shape for name, value in reference_initial.items())
    streamed = dict(engine.iter_full_weights())  # what detached rollouts and vLLM receive, tensor by tensor
    out["stream_gap"] = _weight_gap({name: value.cpu() for name, value in streamed.items()}, reference_initial)
    metrics, grads = step_with_grads(engine, rows, full)
    reference_metrics, reference_grads = step_with_grads(reference, batch, lambda grad: grad)
    out["grad_gap"] = grad_gap(grads, reference_grads)
    out["grad_norm"] = (metrics["grad_norm"], reference_metrics["grad_norm"])
    out["weight_gap"] = _weight_gap(engine.state_dict(), reference.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        torch.distributed.broadcast_object_list(shared, src=0)
        engine.save_checkpoint(shared[0])
        saved = engine.state_dict()
        engine.train_step(rows, loss=LOSSES.get("ppo_policy"), options={})
        engine.load_checkpoint(shared[0])
        out["restore_gap"] = _weight_gap(engine.state_dict(), saved)
        torch.distributed.barrier()
    return out


def _generation_checks(engine: Any, whole: Any, rows: Batch) -> dict[str, Any]:
    """Greedy tokens against the unsharded model's (``whole``), and a sampled rollout (peers must draw alike, or
    their collectives would part)."""
    prompts = rows.select(["prompts", "prompt_mask"])
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True))
    reference = whole.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True))
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    return {"greedy_equal": bool(torch.equal(greedy["responses"], reference["responses"])),
            "sampled": sampled["responses"]}
