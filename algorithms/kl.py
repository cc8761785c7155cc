"""KL between policy and reference: per-token estimators and the controllers of the KL coefficient.

Estimators follow Schulman's "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html) as
verl's ``kl_penalty`` does; the controllers are verl's ``AdaptiveKLController`` and ``FixedKLController``
(Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).
"""

from __future__ import annotations

from typing import Protocol

import torch
from hybridflow.algorithms.modes import KLType


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLType = "k1") -> torch.Tensor:
    """Per-token KL estimate between policy and reference. (B, T), (B, T) -> (B, T).

    ``k1``/``kl``: log-ratio; ``abs``: its magnitude; ``k2``/``mse``: half its square;
    ``k3``/``low_var_kl``: Schulman's unbiased low-variance estimator, clamped to [-10, 10].
    A trailing ``+`` (``k1+``, ``k3+``...) is verl's straight-through variant: the value of the named
    estimator with the gradient of ``k2``, whose expected gradient is that of the true KL (k1's and k3's
    are not, though their expected values are).
    """
    value = _estimate(logprobs, ref_logprobs, kind.removesuffix("+"), kind)
    if not kind.endswith("+"):
        return value
    k2 = 0.5 * (logprobs - ref_logprobs).square()
    return k2 - k2.detach() + value.detach()


def _estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, base: str, kind: str) -> torch.Tensor:
    if base in ("k1", "kl"):
        return logprobs - ref_logprobs
    if base == "abs":
        return (logprobs - ref_logprobs).abs()
    if base in ("k2", "mse"):
        return 0.5 * (logprobs - ref_logprobs).square()
    if base in ("k3", "low_var_kl"):
        log_ratio = torch.clamp(ref_logprobs - logprobs, min=-20, max=20)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
    raise ValueError(f"unknown kl_type {kind!r}; use one of k1, abs, k2 (mse), k3 (low_var_kl), "
                     "each optionally with a trailing + (k2's gradient)")


class KLController(Protocol):
    """The KL coefficient of PPO's KL-in-reward, updated once per step from the KL measured in it."""

    @property
    def value(self) -> float: ...

    def update(self, current_kl: float, n_steps: int) -> float: ...


class FixedKLController:
    """A KL coefficient that never changes."""

    def __init__(self, *, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"FixedKLController.kl_coef={kl_coef} must be >= 0")
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> float:
        """Ignore the measurement; return the coefficient."""
        return self.value


class AdaptiveKLController:
    """Steers the KL coefficient so the policy's KL to the reference tracks ``target_kl``.

    Each update multiplies ``value`` by ``1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps /
    horizon``, as verl's and Ziegler et al.'s; ``n_steps`` is the number of samples the KL was measured on
    (verl passes the batch size), so ``horizon`` is in samples too.
    """

    def __init__(self, *, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        for name, number in (("init_kl_coef", init_kl_coef), ("target_kl", target_kl), ("horizon", horizon)):
            if not number > 0:
                raise ValueError(f"AdaptiveKLController.{name}={number} must be > 0")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move the coefficient towards the target after a step; returns the new coefficient."""
        self.last_kl = current_kl
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon
        return self.value

    # A runtime node state (``hybridflow.runtime.protocols.NodeState``): logged each step, kept in checkpoints.
    def metrics(self) -> dict[str, float]:
        return {"kl_coef": self.value, "kl": getattr(self, "last_kl", 0.0), "kl_target": self.target}

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])

