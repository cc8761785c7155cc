"""The loss mask: tokens inside a response with ``loss_mask`` 0 (a multi-turn rollout's tool outputs) carry no loss,
no gradient, no advantage, no KL and no entropy term, whatever their log-probs, advantages or values hold; with
``loss_mask == response_mask`` every number is the one the response mask gives."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hybridflow.algorithms import core, functions

from hybridflow.registry import LOSSES

ROWS, STEPS = 6, 8
MODES = core.LOSS_AGGS


def masks() -> tuple[torch.Tensor, torch.Tensor]:
    """``response_mask`` (right-padded, one empty row) and a ``loss_mask`` inside it with holes in the middle of
    responses, one at a response's end and one row whose every response token is masked. (B, T) each."""
    lengths = torch.tensor([8, 5, 7, 0, 3, 6])
    response = (torch.arange(STEPS)[None, :] < lengths[:, None]).double()
    loss = response.clone()
    loss[0, 2:5] = 0  # a tool's output between two turns
    loss[1, 4] = 0  # the last response token (a template token after EOS)
    loss[2, 1] = 0
    loss[2, 5] = 0
    loss[4, :] = 0  # a row of observations only
    return response, loss


def randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def off(loss_mask: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Response tokens outside the loss mask."""
    return (response_mask != 0) & (loss_mask == 0)


def perturbed(tensor: torch.Tensor, where: torch.Tensor, seed: int, *, inf: bool = True) -> torch.Tensor:
    """``tensor`` with large random values at ``where``, and one inf unless ``inf`` is False (a model's outputs are
    finite, and an inf a gradient flows through gives ``0 * inf``)."""
    noisy = torch.where(where, 50 * randn(seed, *tensor.shape), tensor)
    if inf:
        first = where.nonzero()[0]
        noisy[first[0], first[1]] = float("inf")
    return noisy


def policy_inputs(seed: int) -> dict[str, torch.Tensor]:
    response, loss = masks()
    return {"response_mask": response, "loss_mask": loss, "old_logprobs": -1.0 + 0.2 * randn(seed, ROWS, STEPS),
            "rollout_logprobs": torch.where(loss != 0, -1.0 + 0.2 * randn(seed + 7, ROWS, STEPS), 0.0),
            "ref_logprobs": -1.0 + 0.2 * randn(seed + 1, ROWS, STEPS), "advantages": randn(seed + 2, ROWS, STEPS),
            "values": randn(seed + 3, ROWS, STEPS), "returns": randn(seed + 4, ROWS, STEPS)}


def loss_and_grads(loss_name: str, batch: dict[str, torch.Tensor], live: dict[str, torch.Tensor],
                   options: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    outputs = {name: value.clone().requires_grad_(True) for name, value in live.items()}
    loss, metrics = LOSSES.get(loss_name)(outputs=outputs, batch=batch, **options)
    loss.backward()
    return loss.detach(), {name: value.grad for name, value in outputs.items()}, metrics  # type: ignore[misc]


POLICY_CASES = [("ppo_policy", {"loss_agg": mode, "kl_coef": 0.1, "entropy_coef": 0.01}) for mode in MODES] + [
    ("ppo_policy", {"loss_agg": "seq-mean-token-sum-norm", "loss_scale_factor": 16}),
    ("ppo_policy", {"dual_clip": 3.0, "clip_ratio_high": 0.28}),
    ("ppo_policy", {"rollout_correction": "tis", "rollout_is_cap": 2.0, "kl_coef": 0.1}),
    ("ppo_policy", {"rollout_correction": "decoupled", "rollout_is_cap": 1.5}),
    ("gspo_policy", {"kl_coef": 0.1, "entropy_coef": 0.01}),
    ("gspo_policy", {"loss_agg": "token-mean"}),
]


@pytest.mark.parametrize(("loss_name", "options"), POLICY_CASES)
@pytest.mark.parametrize("global_norm", [False, True])
def test_masked_tokens_change_neither_the_policy_loss_nor_its_gradient(loss_name: str, options: dict,
                                                                       global_norm: bool) -> None:
    batch = policy_inputs(0)
    where = off(batch["loss_mask"], batch["response_mask"])
    live = {"logprobs": batch["old_logprobs"] + 0.3 * randn(5, ROWS, STEPS), "entropy": randn(6, ROWS, STEPS).abs()}
    if global_norm:
        options = {**options, "norm": core.loss_norm(batch["loss_mask"])}
    loss, grads, metrics = loss_and_grads(loss_name, batch, live, options)
    noisy_batch = {**batch, **{name: perturbed(batch[name], where, i)
                               for i, name in enumerate(("old_logprobs", "ref_logprobs", "advantages",
                                                         "rollout_logprobs"))}}
    noisy_live = {name: perturbed(value, where, 10 + i, inf=False) for i, (name, value) in enumerate(live.items())}
    noisy_loss, noisy_grads, noisy_metrics = loss_and_grads(loss_name, noisy_batch, noisy_live, options)
    assert torch.isfinite(loss) and noisy_loss == loss
    for name, grad in noisy_grads.items():
        assert torch.equal(grad[where], torch.zeros_like(grad[where])), name  # exactly 0 on masked tokens
        assert torch.equal(grad, grads[name]), name
    assert bool(grads["logprobs"][batch["loss_mask"] != 0].abs().sum() > 0), "no gradient on trained tokens"
    assert noisy_metrics.keys() == metrics.keys()
    for key, value in metrics.items():
        assert torch.equal(noisy_metrics[key], value), key


@pytest.mark.parametrize("mode", MODES)
def test_masked_tokens_change_neither_the_value_loss_nor_its_gradient(mode: str) -> None:
    batch = policy_inputs(1)
    where = off(batch["loss_mask"], batch["response_mask"])
    live = {"values": batch["values"] + 0.5 * randn(8, ROWS, STEPS)}
    loss, grads, _ = loss_and_grads("value", batch, live, {"loss_agg": mode, "clip_range": 0.2})
    noisy_batch = {**batch, "values": perturbed(batch["values"], where, 1),
                   "returns": perturbed(batch["returns"], where, 2)}
    noisy_live = {"values": perturbed(live["values"], where, 3, inf=False)}
    noisy_loss, noisy_grads, _ = loss_and_grads("value", noisy_batch, noisy_live, {"loss_agg": mode, "clip_range": 0.2})
    assert torch.isfinite(loss) and noisy_loss == loss
    assert torch.equal(noisy_grads["values"][where], torch.zeros(int(where.sum()), dtype=torch.float64))
    assert torch.equal(noisy_grads["values"], grads["values"])


@pytest.mark.parametrize(("loss_name", "options", "live"), [
    ("ppo_policy", {"kl_coef": 0.1, "entropy_coef": 0.01, "loss_agg": "seq-mean-token-mean"}, ("logprobs", "entropy")),
    ("ppo_policy", {"rollout_correction": "tis"}, ("logprobs", "entropy")),
    ("gspo_policy", {}, ("logprobs", "entropy")),
    ("value", {"loss_agg": "seq-mean-token-sum"}, ("values",)),
])
def test_a_loss_mask_equal_to_the_response_mask_changes_no_number(loss_name: str, options: dict,
                                                                  live: tuple[str, ...]) -> None:
    batch = policy_inputs(2)
    batch["loss_mask"] = batch["response_mask"].clone()
    batch["rollout_logprobs"] = torch.where(batch["response_mask"] != 0, batch["old_logprobs"] - 0.05, 0.0)
    outputs = {"logprobs": batch["old_logprobs"] + 0.1, "entropy": randn(3, ROWS, STEPS).abs(),
               "values": batch["values"] + 0.1}
    outputs = {name: outputs[name] for name in live}
    with_mask = loss_and_grads(loss_name, batch, outputs, options)
    without = loss_and_grads(loss_name, {k: v for k, v in batch.items() if k != "loss_mask"}, outputs, options)
    assert torch.equal(with_mask[0], without[0])
    for name in live:
        assert torch.equal(with_mask[1][name], without[1][name])
    assert {k: float(v) for k, v in with_mask[2].items()} == {k: float(v) for k, v in without[2].items()}


def test_the_loss_mask_does_change_the_loss() -> None:
    """The check above can fail: the same inputs aggregated over the response mask give another loss."""
    batch = policy_inputs(3)
    outputs = {"logprobs": batch["old_logprobs"] + 0.1}
    masked = loss_and_grads("ppo_policy", batch, outputs, {})[0]
    unmasked = loss_and_grads("ppo_policy", {**batch, "loss_mask": batch["response_mask"]}, outputs, {})[0]
    assert abs(float(masked - unmasked)) > 1e-3


def test_statistics_are_over_trained_tokens_only() -> None:
    batch = policy_inputs(4)
    loss_mask = batch["loss_mask"]
    logprobs = batch["old_logprobs"] + 0.5 * randn(9, ROWS, STEPS)
    _, stats = core.ppo_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], loss_mask)
    log_ratio = (logprobs - batch["old_logprobs"])[loss_mask != 0]
    assert float(stats["approx_kl"]) == pytest.approx(float(-log_ratio.mean()), rel=1e-9)
    _, metrics = LOSSES.get("ppo_policy")(outputs={"logprobs": logprobs, "entropy": batch["values"].abs()},
                                          batch=batch, rollout_correction="tis")
    gap = (batch["old_logprobs"] - batch["rollout_logprobs"]).abs()[loss_mask != 0].max()
    assert float(metrics["rollout_logprob_gap_max"]) == pytest.approx(float(gap))  # not |old - 0| off the mask
    assert float(metrics["rollout_is_kept_fraction"]) == 1.0
    assert float(metrics["entropy"]) == pytest.approx(float(batch["values"].abs()[loss_mask != 0].mean()))


AdvantageFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ADVANTAGES: dict[str, AdvantageFn] = {
    "gae": lambda rewards, values, mask, _: torch.cat(core.gae_advantages(rewards, values, mask, 0.9, 0.8)),
    "gae_unwhitened": lambda rewards, values, mask, _: torch.cat(core.gae_advantages(rewards, values, mask, 0.9, 0.8,
                                                                                     whiten=False)),
    "reinforce_pp": lambda rewards, values, mask, _: torch.cat(core.reinforce_pp_advantages(rewards, mask, 0.9)),
    "reinforce_pp_baseline": lambda rewards, values, mask, scores: core.reinforce_pp_baseline_advantages(
        rewards, mask, 2),
    "rloo": lambda rewards, values, mask, scores: core.rloo_advantages(rewards, mask, 2),
    "grpo": lambda rewards, values, mask, scores: core.grpo_advantages(scores, mask, 2),
    "dr_grpo": lambda rewards, values, mask, scores: core.grpo_advantages(scores, mask, 2, norm_by_std=False),
    "remax": lambda rewards, values, mask, scores: torch.cat(core.remax_advantages(rewards, scores, mask)),
}


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_advantages_are_zero_off_the_loss_mask_and_ignore_what_sits_there(name: str) -> None:
    response, loss_mask = masks()
    where = off(loss_mask, response)
    scores = randn(20, ROWS)
    rewards = core.kl_penalized_rewards(scores, randn(21, ROWS, STEPS), randn(22, ROWS, STEPS), loss_mask, 0.1)
    values = randn(23, ROWS, STEPS)
    out = ADVANTAGES[name](rewards, values, loss_mask, scores)
    noisy = ADVANTAGES[name](perturbed(rewards, where, 1), perturbed(values, where, 2), loss_mask, scores)
    assert torch.equal(out, noisy)
    mask = torch.cat([loss_mask] * (out.shape[0] // ROWS))
    assert bool((out[mask == 0] == 0).all())
    assert bool((out[mask != 0] != 0).any())


def test_gae_flows_across_a_masked_tool_output_undiscounted() -> None:
    """A reward after a tool's output reaches the agent's tokens before it as if the gap were not there."""
    loss_mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    joined = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 9.0, 9.0, 9.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 7.0, 7.0, 7.0, 0.3, 0.1, 0.0]])
    advantages, returns = core.gae_advantages(rewards, values, loss_mask, gamma=0.9, lam=0.8, whiten=False)
    kept = loss_mask[0] != 0
    expected_adv, expected_ret = core.gae_advantages(rewards[:, kept], values[:, kept], joined, gamma=0.9, lam=0.8,
                                                     whiten=False)
    assert torch.allclose(advantages[:, kept], expected_adv) and torch.allclose(returns[:, kept], expected_ret)
    assert bool((advantages[:, ~kept] == 0).all()) and bool((returns[:, ~kept] == 0).all())


def test_a_score_lands_on_the_last_trained_token() -> None:
    response, loss_mask = masks()
    scores = torch.arange(1.0, ROWS + 1, dtype=torch.float64)
    rewards = core.scores_to_token_rewards(scores, loss_mask)
    assert rewards[1, 3] == 2.0 and rewards[1, 4] == 0.0  # row 1's last response token is masked
    assert rewards[0, 7] == 1.0 and rewards[2, 6] == 3.0
    assert float(rewards[3].abs().sum()) == 0.0 and float(rewards[4].abs().sum()) == 0.0  # nothing to train on
    assert torch.equal(core.scores_to_token_rewards(scores, response).sum(dim=1), scores * (response.sum(dim=1) > 0))


def test_kl_penalised_rewards_ignore_log_probs_off_the_loss_mask() -> None:
    response, loss_mask = masks()
    where = off(loss_mask, response)
    logprobs, ref = randn(30, ROWS, STEPS), randn(31, ROWS, STEPS)
    state = functions._kl_state(kl_coef=0.1, kl_target=0.05)
    noisy_state = functions._kl_state(kl_coef=0.1, kl_target=0.05)
    rewards = functions.kl_penalized_rewards(randn(32, ROWS), logprobs, ref, loss_mask, kl_coef=0.1, state=state)
    noisy = functions.kl_penalized_rewards(randn(32, ROWS), perturbed(logprobs, where, 1), ref, loss_mask,
                                           kl_coef=0.1, state=noisy_state)
    assert torch.equal(rewards, noisy) and bool((rewards[loss_mask == 0] == 0).all())
    assert state is not None and noisy_state is not None and state.value == noisy_state.value
