"""A compute node that turns finite rows into NaN or inf fails the step naming the node, its function, the rows
and their inputs, before any loss is computed from them (hybridflow/runtime/controller.py)."""

from __future__ import annotations

import hybridflow.algorithms  # noqa: F401  (registers the compute functions)
import pytest
import torch

from hybridflow.graph import Node, Op
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.controller import _run_compute
from hybridflow.runtime.errors import RuntimeStepError

NEAR_LIMIT = 3.0e38  # a finite float32 reward; two of them overflow a group's sum


def test_rewards_near_float32s_limit_fail_at_the_advantage_node_naming_the_rows() -> None:
    node = Node("advantages", Op.COMPUTE, None, ("scores", "response_mask"), ("advantages",), fn="grpo_advantages",
                options=(("group_size", 2),))
    scores = torch.tensor([1.0, 0.0, NEAR_LIMIT, NEAR_LIMIT])
    state = Batch({"scores": scores, "response_mask": torch.ones(4, 3)})
    with pytest.raises(RuntimeStepError, match=r"compute node 'advantages' \(fn 'grpo_advantages'\) made non-finite "
                                               r"'advantages' at rows \[2, 3\] from finite inputs \(row 2: "
                                               r"\{'scores': \[3\.0\d*e\+38\]") as caught:
        _run_compute(node, state)
    assert caught.value.node == "advantages"


def test_an_environment_reward_that_overflows_the_sum_is_named_by_row() -> None:
    node = Node("env_reward_sum", Op.COMPUTE, None, ("outcome", "env_rewards"), ("scores",), fn="add_env_rewards",
                options=(("weight", 10.0),))
    state = Batch({"outcome": torch.tensor([1.0, 1.0]), "env_rewards": torch.tensor([0.5, NEAR_LIMIT])})
    with pytest.raises(RuntimeStepError, match=r"'scores' at rows \[1\] from finite inputs"):
        _run_compute(node, state)


def test_rows_that_were_not_finite_already_pass() -> None:
    node = Node("env_reward_sum", Op.COMPUTE, None, ("outcome", "env_rewards"), ("scores",), fn="add_env_rewards")
    state = Batch({"outcome": torch.tensor([1.0, float("-inf")]), "env_rewards": torch.tensor([0.5, 0.0])})
    outputs, _ = _run_compute(node, state)
    assert outputs["scores"].tolist() == [1.5, float("-inf")]
