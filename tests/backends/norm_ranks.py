"""Rank function of the loss-normalisation tests: gradients of one update, however the mini batch is cut."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from harness import context, layout, rank_rows, role_spec, rollout_batch

from hybridflow.planner import Sharding
from hybridflow.registry import LOSSES
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.collective import ProcessGroupCollective

MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LENGTHS = (5, 1, 3, 0, 2, 4, 5, 1)  # response tokens per row: ragged, one row fully masked
# Token budgets per micro batch (rows cost 6 prompt tokens + their response: 7 to 11 packed, 11 padded): from one
# row per micro batch to the whole share; 16 gives the two ranks' shares 3 and 4 micro batches, which they even out.
BUDGETS = (11, 16, 24, 100)


def ragged_batch(loss_mask: bool = False) -> Batch:
    """Ragged responses; with ``loss_mask`` also a loss mask inside them that leaves tokens out mid-response
    (a tool's output), at a response's end and in a whole row, so its token and sequence counts both differ."""
    batch = rollout_batch(len(LENGTHS))
    mask = (torch.arange(5)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    fields = {**batch.tensors, "response_mask": mask}
    if loss_mask:
        trained = mask.clone()
        trained[0, 1:3] = 0
        trained[2, 2] = 0
        trained[5, 1] = 0
        trained[6, :] = 0
        fields["loss_mask"] = trained
    return Batch(fields)


def legacy_loss(*, outputs: Any, batch: Any, loss_agg: str = "token-mean") -> Any:
    """A loss without the ``norm`` keyword: the loop weights its micro-batch means by rows, as it used to."""
    return LOSSES.get("ppo_policy")(outputs=outputs, batch=batch, loss_agg=loss_agg)


def _update(engine: Any, batch: Batch, mode: str, full: Any,
            loss: Any = None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One update with ``loss_agg=mode``; whole gradients recorded just before the optimizer applies them."""
    grads: dict[str, torch.Tensor] = {}
    optimizer = getattr(engine, "optimizer", None)
    step = optimizer.step if optimizer is not None else None

    def record(*args: Any, **kwargs: Any) -> Any:
        for name, param in engine.model.named_parameters():
            grads[name] = full(param.grad).detach().clone()
        assert step is not None
        return step(*args, **kwargs)

    if optimizer is not None:
        optimizer.step = record
    metrics = engine.train_step(batch, loss=loss or LOSSES.get("ppo_policy"), options={"loss_agg": mode})
    return metrics, grads


def _gap(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest gradient difference relative to the largest reference gradient."""
    scale = max(float(g.abs().max()) for g in reference.values())
    return max(float((grads[n] - reference[n]).abs().max()) for n in reference) / scale


def gradient_gaps(rank: int, world_size: int, backend: str, loss_mask: bool = False) -> dict[str, Any]:
    """Per mode and (backend, dp, micro batch size): the gradient's gap to one pass over the whole mini batch
    (torch, one rank), and for DeepSpeed the global gradient norm's relative gap. With ``loss_mask`` the batch
    holds a loss mask that differs from its response mask."""
    from hybridflow.backends.torch import TorchRoleEngine

    batch = ragged_batch(loss_mask)
    out: dict[str, Any] = {}
    for mode in MODES:
        def torch_engine(micro: int, ranks: int, budget: int = 0, padding: bool = False) -> Any:
            collective = ProcessGroupCollective(rank=rank, world_size=world_size) if ranks > 1 else None
            ctx = context(rank if ranks > 1 else 0, ranks)
            ctx = dataclasses.replace(ctx, collective=collective) if collective is not None else ctx
            return TorchRoleEngine(role_spec(), layout(dp=ranks, micro_batch_size=micro,
                                                       max_tokens_per_micro_batch=budget, padding=padding), ctx)

        reference_metrics, reference = _update(torch_engine(len(batch), 1), batch, mode, lambda g: g)
        gaps: dict[str, float] = {}
        if backend == "torch":
            for micro in (1, 2, 4, 8):
                gaps[f"dp1/micro{micro}"] = _gap(_update(torch_engine(micro, 1), batch, mode, lambda g: g)[1],
                                                 reference)
            for micro in (1, 2, 4):
                rows = rank_rows(batch, rank, world_size)
                gaps[f"dp2/micro{micro}"] = _gap(_update(torch_engine(micro, 2), rows, mode, lambda g: g)[1],
                                                 reference)
            for budget in BUDGETS:
                gaps[f"dp1/tokens{budget}"] = _gap(_update(torch_engine(1, 1, budget), batch, mode, lambda g: g)[1],
                                                   reference)
                rows = rank_rows(batch, rank, world_size)
                gaps[f"dp2/tokens{budget}"] = _gap(_update(torch_engine(1, 2, budget), rows, mode, lambda g: g)[1],
                                                   reference)
            gaps["dp1/tokens16/padded"] = _gap(_update(torch_engine(1, 1, 16, True), batch, mode, lambda g: g)[1],
                                               reference)
            out[f"{mode}/legacy_gap"] = _gap(_update(torch_engine(1, 1), batch, mode, lambda g: g,
                                                     legacy_loss)[1], reference)
            # One pass without a norm aggregates over the loss's own mask: the norm must count that mask's tokens.
            gaps["dp1/one_pass_without_norm"] = _gap(_update(torch_engine(len(batch), 1), batch, mode, lambda g: g,
                                                             legacy_loss)[1], reference)
        elif backend == "fsdp":
            from hybridflow.backends.fsdp import FsdpRoleEngine
            from hybridflow.backends.fsdp.engine import full_value

            for micro in (1, 2, 4):
                engine = FsdpRoleEngine(role_spec(), layout(sharding=Sharding.FULL_SHARD, micro_batch_size=micro),
                                        context(rank, world_size))
                gaps[f"dp2/micro{micro}"] = _gap(_update(engine, rank_rows(batch, rank, world_size), mode,
                                                         full_value)[1], reference)
            for budget in (16, 24):
                engine = FsdpRoleEngine(role_spec(), layout(sharding=Sharding.FULL_SHARD,
                                                            max_tokens_per_micro_batch=budget),
                                        context(rank, world_size))
                gaps[f"dp2/tokens{budget}"] = _gap(_update(engine, rank_rows(batch, rank, world_size), mode,
                                                           full_value)[1], reference)
        else:
            from hybridflow.backends.deepspeed import DeepSpeedRoleEngine

            norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in reference.values())))
            for name, fields in (("micro1", {"micro_batch_size": 1}), ("micro4", {"micro_batch_size": 4}),
                                 ("tokens16", {"max_tokens_per_micro_batch": 16})):
                engine = DeepSpeedRoleEngine(role_spec(), layout(sharding=Sharding.ZERO2, **fields),
                                             context(rank, world_size))
                metrics, _ = _update(engine, rank_rows(batch, rank, world_size), mode, lambda g: g)
                gaps[f"dp2/{name}"] = abs(metrics["grad_norm"] - norm) / norm
                engine.close()
        out[mode] = {"gaps": gaps, "reference_loss": reference_metrics["loss"]}
    return out
