"""Reducing a per-token loss (B, T) to the scalar a backend differentiates, per micro batch or globally.

The modes are verl's ``agg_loss`` modes (``verl/trainer/ppo/core_algos.py``, 2026-08). Without a
:class:`LossNorm` a micro batch is its own mini batch. With one, :func:`aggregate_loss` returns the
micro batch's additive *share* of the mini batch's loss: summed over every micro batch of the mini batch
(on every data-parallel rank), the shares and their gradients equal the loss of the whole mini batch
computed in one pass, whatever the micro batch size or rank count.
"""

from __future__ import annotations

import torch
from hybridflow.algorithms.masked import masked_mean, masked_sum
from hybridflow.algorithms.modes import LOSS_AGGS, LossAgg, check_choice

from hybridflow.loss_norm import LossNorm, loss_norm, sum_loss_norms

__all__ = ["LossNorm", "aggregate_loss", "loss_norm", "sum_loss_norms"]


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: LossAgg = "token-mean",
                   norm: LossNorm | None = None) -> torch.Tensor:
    """Reduce a per-token loss (B, T) with ``mask`` (B, T) to a scalar.

    ``token-mean``: over all tokens. ``token-sum``: the plain sum. ``seq-mean-token-sum``: each sequence's
    token sum, averaged over sequences. ``seq-mean-token-sum-norm`` (Dr.GRPO): the same over the horizon.
    ``seq-mean-token-mean``: each sequence's token mean, averaged over sequences. The seq-mean modes
    average over non-empty sequences only (verl too); a fully masked row adds nothing.

    With ``norm``, the result is this micro batch's share of the mini batch's aggregate (see the module
    docstring). Backends whose all-reduce *averages* gradients over ranks (DDP, FSDP) must multiply the
    share by the number of ranks; verl folds that ``dp_size`` into ``agg_loss``, we keep it out of the maths.
    """
    check_choice("loss_agg", mode, LOSS_AGGS)
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    if mode == "token-mean":
        if norm is None:
            return masked_mean(loss_mat, mask)
        return masked_sum(loss_mat, mask) / _positive(norm.tokens)
    lengths = mask.sum(dim=-1)
    seq_losses = masked_sum(loss_mat, mask, dim=-1)  # (B,), 0 on fully masked rows
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (lengths + 1e-8)
    if norm is None:
        # A batch of empty rows only has nothing to average: its loss is 0, not 0 / 0.
        share = seq_losses.sum() / (lengths > 0).sum().clamp(min=1)
        horizon = float(mask.shape[-1])
    else:
        share, horizon = seq_losses.sum() / _positive(norm.seqs), norm.horizon
    return share / horizon if mode == "seq-mean-token-sum-norm" else share


def _positive(count: float) -> float:
    """A count to divide by: a mini batch without tokens has zero numerators, so any divisor does."""
    return count if count > 0 else 1.0
