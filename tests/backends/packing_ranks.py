"""Rank functions of the packing tests: packed sequences against padded rows, same engine, same weights."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from fsdp_ranks import step_with_grads
from harness import context, layout, rank_rows, role_spec, rollout_batch

from hybridflow.graph import RoleKind
from hybridflow.planner import Sharding
from hybridflow.registry import LOSSES
from hybridflow.runtime.batch import Batch

PROMPTS = (6, 3, 1, 4, 6, 2, 5, 6)  # real prompt tokens per row (left padded)
RESPONSES = (5, 1, 3, 0, 2, 4, 5, 1)  # real response tokens per row (right padded; one row fully masked)
PAD = 0  # the char tokenizer's <pad>


def ragged_batch() -> Batch:
    """Left-padded ragged prompts, right-padded ragged responses, one response fully masked; padding holds
    the pad id."""
    batch = rollout_batch(len(PROMPTS), prompt_len=max(PROMPTS), response_len=max(RESPONSES))
    prompt_mask = (torch.arange(max(PROMPTS))[None, :] >= max(PROMPTS) - torch.tensor(PROMPTS)[:, None]).long()
    response_mask = (torch.arange(max(RESPONSES))[None, :] < torch.tensor(RESPONSES)[:, None]).long()
    return Batch({**batch.tensors, "prompt_mask": prompt_mask, "response_mask": response_mask,
                  "prompts": batch["prompts"].masked_fill(prompt_mask == 0, PAD),
                  "responses": batch["responses"].masked_fill(response_mask == 0, PAD)})


def masked_gap(packed: torch.Tensor, padded: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest difference where ``mask`` is 1."""
    return float(((packed - padded).abs() * mask).max())


def grad_gap(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest gradient difference relative to the largest reference gradient."""
    scale = max(float(g.abs().max()) for g in reference.values())
    return max(float((grads[n] - reference[n]).abs().max()) for n in reference) / scale


def recorded_gradients(engine: Any, batch: Batch, loss: str, full: Callable[[torch.Tensor], torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
    """One update's whole gradients, read just before the optimizer applies them.

    Dropout is switched off: HF's token-classification head (the critic's) drops 10% in training, and a packed
    row draws other masks than padded rows.
    """
    for module in engine.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return step_with_grads(engine, batch, full, loss)[1]


def forward_gaps(build: Callable[[RoleKind, bool], Any], batch: Batch) -> dict[str, float]:
    """Packed vs padded log-probs, entropy, values and scores of ``batch`` (engines from ``build(kind, padding)``)."""
    mask = batch["response_mask"]
    gaps: dict[str, float] = {}
    packed, padded = (build(RoleKind.FROZEN_POLICY, padding).log_probs(batch, with_entropy=True)
                      for padding in (False, True))
    for name in ("logprobs", "entropy"):
        gaps[name] = masked_gap(packed[name], padded[name], mask)
        gaps[f"{name}_outside_mask"] = float((packed[name] * (1 - mask)).abs().max())
    packed, padded = (build(RoleKind.VALUE, padding).values(batch) for padding in (False, True))
    gaps["values"] = masked_gap(packed["values"], padded["values"], mask)
    packed, padded = (build(RoleKind.REWARD_MODEL, padding).score(batch) for padding in (False, True))
    gaps["scores"] = float((packed["scores"] - padded["scores"]).abs().max())
    gaps["scores_scale"] = float(padded["scores"].abs().max())
    return gaps


def torch_gaps(model: str) -> dict[str, float]:
    """The torch engine, one rank: forward outputs and policy / critic gradients, micro batches of 3 rows."""
    from hybridflow.backends.torch import TorchRoleEngine

    batch = ragged_batch()

    def build(kind: RoleKind, padding: bool) -> Any:
        spec = dataclasses.replace(role_spec(kind=kind), model=model)
        return TorchRoleEngine(spec, layout(dp=1, sharding=Sharding.NO_SHARD, micro_batch_size=3, padding=padding),
                               context())

    gaps = forward_gaps(build, batch)
    for kind, loss in ((RoleKind.POLICY, "ppo_policy"), (RoleKind.VALUE, "value")):
        packed, padded = (recorded_gradients(build(kind, padding), batch, loss, lambda g: g)
                          for padding in (False, True))
        gaps[f"{loss}_grads"] = grad_gap(packed, padded)
    return gaps


def sharded_gaps(rank: int, world_size: int, backend: str) -> dict[str, float]:
    """FSDP (FULL_SHARD) or DeepSpeed (ZeRO-3 / ZeRO-2 for training) on ``world_size`` ranks: each rank's share of
    the ragged batch, packed against padded; gradients against the torch engine's padded update of the whole
    batch (DeepSpeed: the global gradient norm)."""
    from hybridflow.backends.torch import TorchRoleEngine

    batch = ragged_batch()
    rows = rank_rows(batch, rank, world_size)

    def build(kind: RoleKind, padding: bool, sharding: Sharding | None = None) -> Any:
        if backend == "fsdp":
            from hybridflow.backends.fsdp import FsdpRoleEngine

            return FsdpRoleEngine(role_spec(kind=kind), layout(sharding=sharding or Sharding.FULL_SHARD,
                                                               micro_batch_size=2, padding=padding),
                                  context(rank, world_size))
        from hybridflow.backends.deepspeed import DeepSpeedRoleEngine

        return DeepSpeedRoleEngine(role_spec(kind=kind), layout(sharding=sharding or Sharding.ZERO3,
                                                                micro_batch_size=2, padding=padding),
                                   context(rank, world_size))

    gaps = forward_gaps(build, rows)
    reference = recorded_gradients(
        TorchRoleEngine(role_spec(), layout(dp=1, sharding=Sharding.NO_SHARD, micro_batch_size=len(batch),
                                            padding=True), context()), batch, "ppo_policy", lambda g: g)
    if backend == "fsdp":
        from hybridflow.backends.fsdp.engine import full_value

        grads = recorded_gradients(build(RoleKind.POLICY, False), rows, "ppo_policy", full_value)
        gaps["ppo_policy_grads"] = grad_gap(grads, reference)
    else:
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in reference.values())))
        engine = build(RoleKind.POLICY, False, Sharding.ZERO2)
        metrics = engine.train_step(rows, loss=LOSSES.get("ppo_policy"), options={})
        gaps["ppo_policy_grad_norm"] = abs(metrics["grad_norm"] - norm) / norm
        engine.close()
    return gaps
