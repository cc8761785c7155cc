"""Per-token log-probabilities and entropies from logits: the one definition the backends' forward
passes and the algorithms' maths share."""

from __future__ import annotations

import torch


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    # Half-precision softmax over a large vocabulary loses the small probabilities; fp64 stays fp64.
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, T, V), (B, T) -> (B, T) log-probability of each label (fp32 at least)."""
    return torch.log_softmax(_at_least_fp32(logits), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(B, T, V) -> (B, T) entropy of each position's next-token distribution (fp32 at least)."""
    logits = _at_least_fp32(logits)
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
