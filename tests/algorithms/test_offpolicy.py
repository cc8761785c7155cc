"""Off-policy corrections of the PPO loss (TIS, decoupled PPO) on hand-worked examples: loss and gradient."""

from __future__ import annotations

import math

import pytest
import torch
from hybridflow.algorithms.offpolicy import rollout_correction

from hybridflow.registry import LOSSES

LN = math.log


def _batch(old: list[float], rollout: list[float], advantages: list[float]) -> dict[str, torch.Tensor]:
    return {"old_logprobs": torch.tensor([old]), "rollout_logprobs": torch.tensor([rollout]),
            "advantages": torch.tensor([advantages]), "response_mask": torch.ones(1, len(old))}


def test_tis_truncates_the_trainer_over_rollout_ratio() -> None:
    weights, mask = rollout_correction(torch.tensor([[LN(0.5), LN(0.9), LN(0.2)]]),
                                       torch.tensor([[LN(0.25), LN(0.9), LN(0.4)]]), torch.ones(1, 3), mode="tis",
                                       cap=1.5)
    assert torch.allclose(weights, torch.tensor([[1.5, 1.0, 0.5]]))  # 2.0 truncated to the cap
    assert mask.tolist() == [[1, 1, 1]]


def test_decoupled_ppo_drops_tokens_over_the_cap_from_the_loss() -> None:
    weights, mask = rollout_correction(torch.tensor([[LN(0.5), LN(0.9), LN(0.2)]]),
                                       torch.tensor([[LN(0.25), LN(0.9), LN(0.4)]]), torch.ones(1, 3),
                                       mode="decoupled", cap=1.5)
    assert torch.allclose(weights, torch.tensor([[0.0, 1.0, 0.5]]))
    assert mask.tolist() == [[0, 1, 1]]


@pytest.mark.parametrize(("mode", "expected_loss", "expected_grad"), [
    # Current = old policy (ratio 1, inside the clip). Token losses -A * ratio * w: -(1*1.5), -(2*1.0), -(-1*0.5).
    # token-mean over 3 tokens: (-1.5 - 2 + 0.5) / 3 = -1.0; d/dlogprob of -A*w*exp(lp - old) at lp = old: -A*w/3.
    ("tis", -1.0, [-1.5 / 3, -2.0 / 3, 0.5 / 3]),
    # Decoupled: the first token leaves the mask, the mean runs over the 2 others: (-2 + 0.5) / 2.
    ("decoupled", -0.75, [0.0, -2.0 / 2, 0.5 / 2]),
])
def test_the_corrected_ppo_loss_and_gradient_by_hand(mode: str, expected_loss: float,
                                                     expected_grad: list[float]) -> None:
    batch = _batch([LN(0.5), LN(0.9), LN(0.2)], [LN(0.25), LN(0.9), LN(0.4)], [1.0, 2.0, -1.0])
    logprobs = batch["old_logprobs"].clone().requires_grad_(True)
    loss, _ = LOSSES.get("ppo_policy")(outputs={"logprobs": logprobs}, batch=batch, rollout_correction=mode,
                                       rollout_is_cap=1.5)
    loss.backward()
    assert float(loss) == pytest.approx(expected_loss, abs=1e-6)
    assert logprobs.grad is not None
    assert torch.allclose(logprobs.grad, torch.tensor([expected_grad]), atol=1e-6)


def test_a_correction_without_rollout_logprobs_names_the_field() -> None:
    batch = _batch([0.0], [0.0], [1.0])
    del batch["rollout_logprobs"]
    with pytest.raises(KeyError, match="rollout_logprobs"):
        LOSSES.get("ppo_policy")(outputs={"logprobs": torch.zeros(1, 1)}, batch=batch, rollout_correction="tis")
    with pytest.raises(ValueError, match="rollout_correction='is' must be one of"):
        rollout_correction(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), mode="is", cap=2.0)  # type: ignore[arg-type]
