"""Direct preference optimisation (https://arxiv.org/abs/2305.18290) as pure tensor maths, and its loss.

A preference batch holds each pair as two rows, the chosen response and the rejected one, told apart by the
``chosen`` field (1 / 0) and tied by the ``pair`` field (an id both rows share). :func:`pair_rows` finds the two
rows of every pair in a micro batch; :func:`dpo_loss` is TRL 1.16's ``DPOTrainer._compute_loss`` on the summed
log-probs of each response (``trl/trainer/dpo_trainer.py``, the ``loss_type`` branches ``sigmoid``, ``ipo``,
``hinge`` and ``robust``), with the same metrics (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
``rewards/margins``, ``logps/chosen``, ``logps/rejected``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from hybridflow.algorithms.masked import masked_sum
from hybridflow.algorithms.modes import DPO_LOSS_TYPES, DPOLossType, check_dpo_options

from hybridflow.registry import LOSSES


def pair_rows(pair: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row indices of each pair's chosen and rejected response, in pair-id order. (B,), (B,) -> (P,), (P,).

    Every pair id must appear on exactly two rows, one chosen and one rejected: a pair cut in two (by a micro batch
    or a data-parallel shard holding an odd number of rows) raises, naming the pair."""
    ids, counts = torch.unique(pair, return_counts=True)
    if bool((counts != 2).any()):
        lone = int(ids[counts != 2][0])
        raise ValueError(f"preference pair {lone} has {int(counts[counts != 2][0])} row(s) in this micro batch, not 2 "
                         "(chosen and rejected): pairs must not be cut, so use an even micro batch size and split "
                         "batches into an even number of rows")
    order = torch.argsort(pair * 2 + (1 - chosen.long()), stable=True)  # per pair: chosen, then rejected
    first, second = order[0::2], order[1::2]
    if not bool((chosen[first] == 1).all() and (chosen[second] == 0).all()):
        raise ValueError("every preference pair needs one chosen row (chosen=1) and one rejected row (chosen=0)")
    return first, second


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, *, beta: float = 0.1, loss_type: DPOLossType = "sigmoid",
             label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DPO loss, a mean over pairs, and TRL's metrics. Inputs: summed log-probs per response (P,); for ``ipo``
    also each response's token count ``chosen_tokens`` / ``rejected_tokens`` (P,).

    ``sigmoid``: ``-log σ(β Δ)`` with ``Δ = (log π_c - log π_ref,c) - (log π_r - log π_ref,r)``; with
    ``label_smoothing`` ε it is conservative DPO, ``-(1-ε) log σ(βΔ) - ε log σ(-βΔ)`` (TRL before 1.0 named this
    ``sigmoid``; TRL 1.16's ``sigmoid`` ignores ε). ``ipo``: ``(Δ̄ - 1/(2β))²`` with each log-ratio divided by its
    response's token count, as TRL. ``hinge``: ``relu(1 - βΔ)``. ``robust``: TRL's robust DPO with ε."""
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)
    elif loss_type == "robust":
        losses = (-(1 - label_smoothing) * F.logsigmoid(beta * delta)
                  + label_smoothing * F.logsigmoid(-beta * delta)) / (1 - 2 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo_loss: loss_type='ipo' needs chosen_tokens and rejected_tokens")
        average = (chosen_logratios / chosen_tokens.clamp(min=1.0)
                   - rejected_logratios / rejected_tokens.clamp(min=1.0))
        losses = (average - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo_loss: loss_type={loss_type!r} must be one of {list(DPO_LOSS_TYPES)}")
    chosen_rewards, rejected_rewards = beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    metrics = {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
               "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
               "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
               "logps/chosen": chosen_logps.detach().mean(), "logps/rejected": rejected_logps.detach().mean()}
    return losses.mean(), metrics


@LOSSES.register("dpo")
def dpo(*, outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor], beta: float = 0.1,
        loss_type: DPOLossType = "sigmoid", label_smoothing: float = 0.0,
        sft_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO on a micro batch of whole pairs: the policy's ``outputs["logprobs"]`` and ``batch["ref_logprobs"]`` (B, T)
    summed over ``loss_mask`` per row, paired by ``pair`` / ``chosen`` (B,) (:func:`pair_rows`, :func:`dpo_loss`).

    ``sft_coef`` > 0 adds that times the negative log-likelihood of the chosen responses, a mean over their tokens
    (RPO, https://arxiv.org/abs/2404.19733; TRL's ``loss_type=[..., "sft"]`` with ``loss_weights=[1, sft_coef]``).
    Takes no ``norm``: the loss is a mean over pairs, and the update loop weighs micro batches by their rows, which
    are two per pair, so the mini batch's loss is still the mean over its pairs (the NLL's token mean is the micro
    batch's own)."""
    check_dpo_options(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, sft_coef=sft_coef)
    mask = batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]
    chosen, rejected = pair_rows(batch["pair"], batch["chosen"])
    logps = masked_sum(outputs["logprobs"], mask, dim=-1)  # (B,)
    ref = masked_sum(batch["ref_logprobs"].to(logps.dtype), mask, dim=-1)
    tokens = mask.sum(dim=-1).to(logps.dtype)
    loss, metrics = dpo_loss(logps[chosen], logps[rejected], ref[chosen], ref[rejected], beta=beta,
                             loss_type=loss_type, label_smoothing=label_smoothing, chosen_tokens=tokens[chosen],
                             rejected_tokens=tokens[rejected])
    metrics = {"dpo_loss": loss.detach(), **metrics}
    if sft_coef:
        nll = -logps[chosen].sum() / tokens[chosen].sum().clamp(min=1.0)
        loss = loss + sft_coef * nll
        metrics["sft_loss"] = nll.detach()
    return loss, metrics
