"""Masked statistics over padded (B, T) tensors: the building blocks of every other module here.

Masks are 1 on response tokens and 0 on padding (or on observation tokens inside a multi-turn
response). Whatever sits at a masked position, even NaN or inf, never reaches a result.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` weighted by ``mask``. ``values``, ``mask``: (B, T).

    Masked positions are selected away rather than multiplied by zero, so NaN or inf on padding
    (``0 * inf`` is NaN) cannot poison the sum, as in current verl.
    """
    weighted = on_mask(values * mask, mask)
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def on_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is non-zero, 0 elsewhere (NaN-safe, unlike ``values * mask``)."""
    return torch.where(mask != 0, values, torch.zeros_like(values))


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1. (B, T) -> scalar, or reduced along ``dim``."""
    return masked_sum(values, mask, dim) / (masked_sum(torch.ones_like(values), mask, dim) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over masked positions, with Bessel's correction when ``unbiased``. (B, T) -> scalar."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count <= 1:
            raise ValueError("masked_var needs at least two unmasked values for an unbiased estimate")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise to zero mean and unit variance over masked positions. (B, T) -> (B, T)."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


