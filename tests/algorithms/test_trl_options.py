"""TRL's scale_rewards and mask_truncated_completions, as pure functions and as GRPO graph options."""

from __future__ import annotations

import pytest
import torch
from hybridflow.algorithms import core, graphs

SCORES = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])  # two groups of four
MASK = torch.ones(8, 3)


def test_scale_rewards_group_batch_none_as_trl_defines_them() -> None:
    grouped = SCORES.view(2, 4)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    group_std = grouped.std(dim=1, keepdim=True).expand(2, 4).reshape(-1)
    expected = {"group": centred / (group_std + 1e-6), "batch": centred / (SCORES.std() + 1e-6), "none": centred}
    for scale, want in expected.items():
        got = core.grpo_advantages(SCORES, MASK, group_size=4, scale=scale)
        torch.testing.assert_close(got, want[:, None].expand(8, 3))
    torch.testing.assert_close(core.grpo_advantages(SCORES, MASK, group_size=4, norm_by_std=False),
                               expected["none"][:, None].expand(8, 3))
    with pytest.raises(ValueError, match="scale_rewards"):
        core.grpo_advantages(SCORES, MASK, group_size=4, scale="global")  # type: ignore[arg-type]


def test_truncated_responses_lose_their_loss_tokens() -> None:
    response = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    loss = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    assert core.truncation_mask(loss, response, max_new_tokens=4).tolist() == [[0, 0, 0, 0], [1, 1, 0, 0],
                                                                                [0, 0, 0, 0]]
    assert core.truncation_mask(loss, response, max_new_tokens=5).tolist() == loss.tolist()


def test_grpo_graph_options() -> None:
    plain = graphs.grpo()
    assert "mask_truncated" not in plain.order and plain == graphs.grpo(scale_rewards="group")
    masked = graphs.grpo(mask_truncated=True, scale_rewards="batch", max_new_tokens=16)
    assert masked.node("mask_truncated").options_dict == {"max_new_tokens": 16}
    assert masked.node("advantages").options_dict["scale_rewards"] == "batch"
    assert "sampled_loss_mask" in masked.node("actor_generate").outputs
    assert "mask_truncated" in graphs.dapo(mask_truncated=True, rollout_correction="tis").order
    dr = graphs.grpo(loss_agg="seq-mean-token-sum-norm", loss_scale_factor=16)
    assert dr.node("actor_update").options_dict["loss_scale_factor"] == 16
    with pytest.raises(ValueError, match="norm_by_std=False and scale_rewards='batch' conflict"):
        graphs.grpo(norm_by_std=False, scale_rewards="batch")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        graphs.grpo(loss_scale_factor=16)  # token-mean has no constant to divide by
