"""The numeric core on small examples worked by hand, its invariants, and its handling of padding."""

from __future__ import annotations

import math

import pytest
import torch
from hybridflow.algorithms import core


def t(rows: list[list[float]] | list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


MASK = t([[1, 1, 1], [1, 1, 0]])


def assert_rows(actual: torch.Tensor, rows: list[list[float]]) -> None:
    torch.testing.assert_close(actual, t(rows), atol=1e-9, rtol=0)


def test_grpo_by_hand():
    # Group (1, 0): mean 0.5, sample std sqrt(0.5). Group (2, 2): no spread, so no signal.
    adv = core.grpo_advantages(t([1.0, 0.0, 2.0, 2.0]), torch.ones(4, 2, dtype=torch.float64), group_size=2)
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv[:, 0].tolist() == pytest.approx([expected, -expected, 0.0, 0.0])
    plain = core.grpo_advantages(t([1.0, 0.0, 2.0, 2.0]), torch.ones(4, 2), group_size=2, norm_by_std=False)
    assert plain[:, 1].tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_grpo_advantages_have_zero_mean_and_unit_std_within_each_group():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(24, generator=gen, dtype=torch.float64)
    adv = core.grpo_advantages(scores, torch.ones(24, 5, dtype=torch.float64), group_size=6)[:, 0].reshape(4, 6)
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(4, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(adv.std(dim=1), torch.ones(4, dtype=torch.float64), atol=1e-5, rtol=0)


def test_groups_must_divide_the_batch():
    with pytest.raises(ValueError, match="does not split into groups of 4"):
        core.grpo_advantages(t([1.0, 2.0, 3.0]), torch.ones(3, 1), group_size=4)


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_values():
    rewards, values = t([[0, 0, 1], [0, 2, 0]]), t([[0.5, 0.2, 0.9], [0.1, 0.3, 7.0]])
    adv, ret = core.gae_advantages(rewards, values, MASK, gamma=1.0, lam=1.0, whiten=False)
    assert_rows(ret, [[1, 1, 1], [2, 2, 0]])
    # The 7.0 on padding is not a bootstrap value: the episode ends at EOS.
    assert_rows(adv, [[0.5, 0.8, 0.1], [1.9, 1.7, 0]])


def test_gae_with_lambda_zero_is_the_one_step_td_error():
    rewards, values = t([[0, 0, 1]]), t([[0.5, 0.2, 0.9]])
    adv, _ = core.gae_advantages(rewards, values, MASK[:1], gamma=0.5, lam=0.0, whiten=False)
    assert_rows(adv, [[0 + 0.5 * 0.2 - 0.5, 0 + 0.5 * 0.9 - 0.2, 1 - 0.9]])


def test_gae_whitening_leaves_returns_alone():
    rewards, values = t([[0, 0, 1], [0, 2, 0]]), t([[0.5, 0.2, 0.9], [0.1, 0.3, 7.0]])
    adv, ret = core.gae_advantages(rewards, values, MASK, gamma=1.0, lam=1.0, whiten=True)
    assert_rows(ret, [[1, 1, 1], [2, 2, 0]])
    on = MASK.bool()
    assert adv[on].mean().item() == pytest.approx(0, abs=1e-7)
    assert adv[on].std().item() == pytest.approx(1, abs=1e-6)


def test_rloo_by_hand():
    adv = core.rloo_advantages(t([[1, 0], [2, 0], [3, 0]]), torch.ones(3, 2, dtype=torch.float64), group_size=3)
    # Each sample minus the mean of the other two.
    assert adv[:, 0].tolist() == pytest.approx([1 - 2.5, 2 - 2.0, 3 - 1.5])
    alone = core.rloo_advantages(t([[1, 0], [2, 0]]), torch.ones(2, 2, dtype=torch.float64), group_size=1)
    assert alone[:, 0].tolist() == pytest.approx([1, 2])


def test_remax_by_hand():
    adv, ret = core.remax_advantages(t([[0, 0, 2], [0, 1, 0]]), t([0.5, 3.0]), MASK)
    assert_rows(ret, [[2, 2, 2], [1, 1, 0]])
    assert_rows(adv, [[1.5, 1.5, 1.5], [-2, -2, 0]])


def test_reinforce_pp_by_hand():
    _, ret = core.reinforce_pp_advantages(t([[1, 0, 2]]), MASK[:1], gamma=0.5)
    assert_rows(ret, [[1 + 0.5 * (0 + 0.5 * 2), 0 + 0.5 * 2, 2]])
    adv, ret = core.reinforce_pp_advantages(t([[1, 0, 2], [0, 3, 0]]), MASK, gamma=1.0)
    assert ret[1, :2].tolist() == pytest.approx([3, 3])
    on = MASK.bool()
    assert adv[on].mean().item() == pytest.approx(0, abs=1e-7) and adv[on].std().item() == pytest.approx(1, abs=1e-6)
    assert adv[1, 2].item() == 0


def test_reinforce_pp_baseline_by_hand():
    adv = core.reinforce_pp_baseline_advantages(t([[1, 0], [3, 0], [5, 0], [5, 0]]),
                                                torch.ones(4, 2, dtype=torch.float64), group_size=2)
    # Centred per group: (-1, 1, 0, 0); whitened over all 8 tokens: std = sqrt(4 / 7).
    assert adv[:, 0].tolist() == pytest.approx([-1 / math.sqrt(4 / 7), 1 / math.sqrt(4 / 7), 0, 0], abs=1e-6)


def test_ppo_clip_and_dual_clip_by_hand():
    old = t([[0.0, 0.0, 0.0, 0.0]])
    logp = torch.log(t([[1.5, 1.5, 4.0, 0.5]]))
    adv = t([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4, dtype=torch.float64)
    loss, stats = core.ppo_policy_loss(logp, old, adv, mask, clip_ratio=0.2)
    # Per token: -min(1.5, 1.2), max(1.5, 1.2), max(4, 1.2), -min(0.5, 0.8).
    assert loss.item() == pytest.approx((-1.2 + 1.5 + 4.0 - 0.5) / 4)
    assert stats["clipfrac"].item() == pytest.approx(1 / 4)
    assert stats["approx_kl"].item() == pytest.approx(-(2 * math.log(1.5) + math.log(4) + math.log(0.5)) / 4)
    dual, stats = core.ppo_policy_loss(logp, old, adv, mask, clip_ratio=0.2, dual_clip=3.0)
    assert dual.item() == pytest.approx((-1.2 + 1.5 + 3.0 - 0.5) / 4)  # -A * ratio capped at -A * 3
    assert stats["clipfrac_lower"].item() == pytest.approx(1 / 4)
    asym, _ = core.ppo_policy_loss(logp, old, adv, mask, clip_ratio=0.2, clip_ratio_high=0.28)
    assert asym.item() == pytest.approx((-1.28 + 1.5 + 4.0 - 0.5) / 4)
    with pytest.raises(ValueError, match=r"dual_clip=1\.0 must be > 1\.0"):
        core.ppo_policy_loss(logp, old, adv, mask, dual_clip=1.0)


def test_ppo_gradient_vanishes_on_clipped_tokens():
    logp = torch.log(t([[1.5, 1.1]])).requires_grad_()
    loss, _ = core.ppo_policy_loss(logp, torch.zeros(1, 2, dtype=torch.float64), t([[1.0, 1.0]]),
                                   torch.ones(1, 2, dtype=torch.float64), clip_ratio=0.2)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0, 0].item() == 0  # ratio 1.5 is past 1 + 0.2
    assert logp.grad[0, 1].item() == pytest.approx(-1.1 / 2)  # d(-ratio)/dlogp over 2 tokens


def test_the_three_aggregations_by_hand():
    loss = t([[1, 2, 99], [3, 99, 99]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    assert core.aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(6 / 3)
    assert core.aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 3) / 2)
    assert core.aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 3) / 2)
    with pytest.raises(ValueError, match="unknown loss_agg 'mean'"):
        core.aggregate_loss(loss, mask, "mean")  # type: ignore[arg-type]


def test_clipped_value_loss_by_hand():
    loss, stats = core.value_loss(t([[1.0, 0.6]]), t([[0.5, 0.5]]), t([[2.0, 0.0]]), t([[1, 1]]), clip_range=0.2)
    # Token 1: clipped prediction 0.7 is farther from 2 than 1.0 is, so 1.69 counts. Token 2: 0.36 unclipped.
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.36) / 2)
    assert stats["vf_clipfrac"].item() == pytest.approx(1 / 2)


def test_kl_estimators_by_hand():
    logp, ref = torch.log(t([0.5])), torch.log(t([0.25]))
    log2 = math.log(2)
    assert core.kl_penalty(logp, ref, "k1").item() == pytest.approx(log2)
    assert core.kl_penalty(ref, logp, "abs").item() == pytest.approx(log2)
    assert core.kl_penalty(logp, ref, "mse").item() == pytest.approx(0.5 * log2**2)
    assert core.kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(0.5 + log2 - 1)  # r - log r - 1, r = 1/2
    far = core.kl_penalty(t([0.0]), t([-50.0]), "k3")
    assert far.item() == 10  # clamped
    same = core.kl_penalty(logp, logp, "k3")
    assert same.item() == 0
    with pytest.raises(ValueError, match="unknown kl_type 'k4'"):
        core.kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_entropy_from_logits_by_hand():
    uniform = torch.zeros(1, 1, 8, dtype=torch.float64)
    assert core.entropy_from_logits(uniform).item() == pytest.approx(math.log(8))
    peaked = t([[[100.0, 0.0, 0.0]]])
    assert core.entropy_from_logits(peaked).item() == pytest.approx(0, abs=1e-30)


def test_kl_penalised_rewards_by_hand():
    rewards = core.kl_penalized_rewards(t([1.0, 2.0]), t([[0.0, 0.1, 0.2], [0.3, 0.3, 9.0]]),
                                        torch.zeros(2, 3, dtype=torch.float64), MASK, kl_coef=0.5)
    assert_rows(rewards, [[0, -0.05, 1 - 0.1], [-0.15, 2 - 0.15, 0]])
    assert core.scores_to_token_rewards(t([1.0, 2.0]), MASK).tolist() == [[0, 0, 1], [0, 2, 0]]


def test_masked_statistics_by_hand():
    values = t([[1, 2, 3], [4, 5, 100]])
    assert core.masked_sum(values, MASK).item() == 15
    assert core.masked_mean(values, MASK).item() == pytest.approx(3)
    assert core.masked_var(values, MASK).item() == pytest.approx(2.5)  # of 1..5, unbiased
    assert core.masked_var(values, MASK, unbiased=False).item() == pytest.approx(2.0)
    whitened = core.masked_whiten(values, MASK)
    assert whitened[0].tolist() == pytest.approx([-2 / math.sqrt(2.5), -1 / math.sqrt(2.5), 0], abs=1e-6)
    with pytest.raises(ValueError, match="at least two"):
        core.masked_var(values, t([[1, 0, 0], [0, 0, 0]]))


def garbage_on_padding(tensor: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(mask.bool(), tensor, torch.full_like(tensor, fill))


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), -1e30])
def test_padding_never_leaks_into_results(fill):
    """Whatever a backend leaves on padding, results on response tokens are unchanged and padding is 0."""
    gen = torch.Generator().manual_seed(1)
    mask = (torch.arange(6)[None, :] < t([6, 4, 2, 5])[:, None]).double()

    def randn() -> torch.Tensor:
        return torch.randn(4, 6, generator=gen, dtype=torch.float64)

    clean = {"rewards": randn() * mask, "values": randn(), "logp": -randn().abs(), "ref": -randn().abs(),
             "adv": randn()}
    dirty = {k: garbage_on_padding(v, mask, fill) for k, v in clean.items()}
    scores, baselines = t([1.0, -1.0, 0.5, 2.0]), t([0.2, 0.1, 0.0, 1.0])

    def run(x: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [
            *core.gae_advantages(x["rewards"], x["values"], mask, 0.99, 0.95),
            core.rloo_advantages(x["rewards"], mask, 2),
            *core.remax_advantages(x["rewards"], baselines, mask),
            *core.reinforce_pp_advantages(x["rewards"], mask, 0.9),
            core.reinforce_pp_baseline_advantages(x["rewards"], mask, 2),
            core.kl_penalized_rewards(scores, x["logp"], x["ref"], mask, 0.1, "k3"),
            core.ppo_policy_loss(x["logp"], x["ref"], x["adv"], mask, dual_clip=3.0)[0],
            core.value_loss(x["values"], x["ref"], x["adv"], mask)[0],
            core.kl_loss(x["logp"], x["ref"], mask, "k1", "seq-mean-token-mean"),
        ]

    for got, want in zip(run(dirty), run(clean), strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)
        if got.dim() == 2:
            assert torch.all(got[~mask.bool()] == 0)
