"""The names of the loss-aggregation modes, KL estimators and off-policy corrections, torch-free so graphs can check
options early."""

from __future__ import annotations

from typing import Literal, get_args

LossAgg = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
LOSS_AGGS: tuple[str, ...] = get_args(LossAgg)

KLType = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl",
                 "k1+", "kl+", "abs+", "k2+", "mse+", "k3+", "low_var_kl+"]
KL_TYPES: tuple[str, ...] = get_args(KLType)

ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = get_args(ScaleRewards)
"""How group-relative advantages are scaled (TRL's ``scale_rewards``): by the std of the prompt's group, of the
whole batch, or not at all (Dr.GRPO)."""

RolloutCorrection = Literal["tis", "decoupled"]
ROLLOUT_CORRECTIONS: tuple[str, ...] = get_args(RolloutCorrection)


def check_choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise a ValueError naming ``option`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"unknown {option} {value!r}; use one of {', '.join(choices)}")

DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust"]
DPO_LOSS_TYPES: tuple[str, ...] = get_args(DPOLossType)
"""DPO's losses, TRL's ``loss_type`` names (:mod:`hybridflow.algorithms.preference`)."""


def check_dpo_options(*, beta: float, loss_type: str, label_smoothing: float, sft_coef: float = 0.0) -> None:
    """Raise a ValueError naming the option when ``beta``, ``loss_type``, ``label_smoothing`` or ``sft_coef`` is out
    of range."""
    check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
    if not sft_coef >= 0:
        raise ValueError(f"algorithm option sft_coef={sft_coef} must be >= 0 (0: no NLL term on the chosen responses)")
    if not beta > 0:
        raise ValueError(f"algorithm option beta={beta} must be > 0 (the strength of the pull to the reference)")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"algorithm option label_smoothing={label_smoothing} must be in [0, 0.5) (the probability "
                         "that a preference label is flipped)")
    if label_smoothing and loss_type not in ("sigmoid", "robust"):
        raise ValueError(f"algorithm option label_smoothing={label_smoothing} applies to loss_type 'sigmoid' or "
                         f"'robust', not {loss_type!r}")
