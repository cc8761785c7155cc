"""Losses a trainable role minimises, as pure tensor maths: PPO and GSPO surrogates, value, KL, entropy.

Every loss takes ``agg`` (a :data:`~hybridflow.algorithms.modes.LossAgg` mode) and keyword ``norm``:
without a norm it is the loss of the micro batch alone; with the mini batch's
:class:`~hybridflow.algorithms.aggregation.LossNorm` it is the micro batch's additive share of the mini
batch's loss (see :func:`~hybridflow.algorithms.aggregation.aggregate_loss`). Statistics (``clipfrac``,
``approx_kl``...) stay means over the micro batch's masked tokens either way.

The mask argument is the *loss mask* (the ``loss_mask`` field; ``response_mask`` when a rollout writes none):
tokens outside it (padding, a tool's output inside a multi-turn response) add nothing to a loss, a statistic
or a gradient, whatever their log-probs, advantages or values: the constant inputs (old log-probs, advantages,
returns...) are zeroed there before any arithmetic, so even an inf on a masked token cannot turn the exact 0
gradient of the masked loss into ``0 * inf`` = NaN.
"""

from __future__ import annotations

import torch
from hybridflow.algorithms.aggregation import LossNorm, aggregate_loss
from hybridflow.algorithms.kl import kl_penalty
from hybridflow.algorithms.masked import masked_mean, masked_sum, on_mask
from hybridflow.algorithms.modes import KLType, LossAgg


def _on_mask(mask: torch.Tensor, *constants: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each (B, T) constant with 0 outside ``mask``: what sits on a masked token cannot reach a gradient."""
    return tuple(on_mask(constant, mask) for constant in constants)


def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
                    dual_clip: float | None = None, agg: LossAgg = "token-mean", *,
                    norm: LossNorm | None = None,
                    token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate objective, with optional dual clip (``dual_clip`` > 1) for negative advantages.

    All inputs (B, T). ``token_weights`` (B, T) scale each token's loss (off-policy corrections,
    :mod:`hybridflow.algorithms.offpolicy`). Returns the scalar loss and ``clipfrac``, ``clipfrac_lower``,
    ``approx_kl``.
    Deviation from verl: verl always dual-clips (``clip_ratio_c=3.0``); here ``dual_clip=None`` is the
    plain PPO objective of the paper, TRL and OpenRLHF. Pass ``dual_clip=3.0`` for verl's numbers.
    """
    old_logprobs, advantages = _on_mask(response_mask, old_logprobs, advantages)
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio, 1 + high)
    clipped = torch.maximum(losses1, losses2)
    stats = {
        "clipfrac": masked_mean(torch.gt(losses2, losses1).float(), response_mask),
        "approx_kl": masked_mean(-log_ratio, response_mask),
        "clipfrac_lower": logprobs.new_zeros(()),
    }
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip={dual_clip} must be > 1.0 (verl uses 3.0)")
        losses3 = -advantages * dual_clip
        lower = torch.minimum(losses3, clipped)
        stats["clipfrac_lower"] = masked_mean(
            torch.gt(clipped, losses3).float() * (advantages < 0).float(), response_mask
        )
        clipped = torch.where(advantages < 0, lower, clipped)
    if token_weights is not None:
        clipped = clipped * on_mask(token_weights, response_mask)
    return aggregate_loss(clipped, response_mask, agg, norm), stats


def gspo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                     response_mask: torch.Tensor, clip_ratio: float = 3e-4, clip_ratio_high: float | None = 4e-4,
                     agg: LossAgg = "seq-mean-token-mean", *,
                     norm: LossNorm | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (https://arxiv.org/abs/2507.18071): PPO's clipped surrogate on a sequence-level ratio.

    All inputs (B, T). A sequence's ratio is the geometric mean of its token ratios,
    ``s_i = exp(mean_t log(pi / pi_old))``, and each token carries ``sg[s_i] * pi_t / sg[pi_t]``: the value
    ``s_i``, the gradient ``s_i * grad log pi_t``; the clip (defaults: the paper's 3e-4 / 4e-4) acts on
    ``s_i``. As verl's ``compute_policy_loss_gspo``, including its clamp of the log-ratio at 10. Deviation:
    verl always aggregates ``seq-mean-token-mean`` and ignores its ``loss_agg_mode``; here ``agg``
    defaults to that and is honoured when changed. Statistics as :func:`ppo_policy_loss`'s.
    """
    old_logprobs, advantages = _on_mask(response_mask, old_logprobs, advantages)
    log_ratio = logprobs - old_logprobs
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / lengths  # (B,)
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio, 1 + high)
    stats = {
        "clipfrac": masked_mean(torch.gt(losses2, losses1).float(), response_mask),
        "approx_kl": masked_mean(-log_ratio, response_mask),
        "clipfrac_lower": logprobs.new_zeros(()),
    }
    return aggregate_loss(torch.maximum(losses1, losses2), response_mask, agg, norm), stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               response_mask: torch.Tensor, clip_range: float | None = 0.2,
               agg: LossAgg = "token-mean", *,
               norm: LossNorm | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss, ``0.5 * max((v - R)^2, (clip(v) - R)^2)``. All inputs (B, T)."""
    old_values, returns = _on_mask(response_mask, old_values, returns)
    losses1 = (values - returns).square()
    if clip_range is None:
        return 0.5 * aggregate_loss(losses1, response_mask, agg, norm), {"vf_clipfrac": values.new_zeros(())}
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    losses2 = (clipped_values - returns).square()
    loss = 0.5 * aggregate_loss(torch.maximum(losses1, losses2), response_mask, agg, norm)
    return loss, {"vf_clipfrac": masked_mean(torch.gt(losses2, losses1).float(), response_mask)}


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor,
            kind: KLType = "low_var_kl", agg: LossAgg = "token-mean", *,
            norm: LossNorm | None = None) -> torch.Tensor:
    """KL to the reference as a loss term (GRPO style). (B, T) x 3 -> scalar."""
    (ref_logprobs,) = _on_mask(response_mask, ref_logprobs)
    return aggregate_loss(kl_penalty(logprobs, ref_logprobs, kind), response_mask, agg, norm)


def entropy_bonus(entropy: torch.Tensor, response_mask: torch.Tensor, agg: LossAgg = "token-mean", *,
                  norm: LossNorm | None = None) -> torch.Tensor:
    """Mean entropy, to subtract from the loss times an entropy coefficient. (B, T) -> scalar."""
    return aggregate_loss(entropy, response_mask, agg, norm)

