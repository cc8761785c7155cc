"""Token-budget micro batches and the padding switch, from a run's config to the plan's layouts and the engines
(issue 22)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hybridflow.graph import load_graph
from hybridflow.planner import LayoutSupport, RoleLayout
from hybridflow.runtime import default_plan
from hybridflow.train import setup
from hybridflow.train.config import load_config
from hybridflow.train.placement import run_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))


def test_config_budgets_and_padding_reach_every_layout_and_the_planner(tmp_path: Path) -> None:
    graph = load_graph("grpo", reward_kind="reward_function")
    config = load_config(None, ["pipeline.padding=true", "roles={actor: {max_tokens_per_micro_batch: 512}}"])
    plan = setup.build_plan(config, graph)
    assert plan.layout("actor").max_tokens_per_micro_batch == 512
    assert plan.layout("actor").forward_max_tokens_per_micro_batch == 512
    assert plan.layout("reference").max_tokens_per_micro_batch == 0
    assert all(plan.layout(role).padding for role in ("actor", "reference"))
    same = load_config(None, ["placement.mode=auto", "roles={actor: {max_tokens_per_micro_batch: 256}, "
                                                "reference: {max_tokens_per_micro_batch: 256}}"])
    settings = run_settings(same, graph)
    assert (settings.train_tokens_per_gpu, settings.forward_tokens_per_gpu, settings.padding) == (256, 256, False)
    assert run_settings(config, graph).train_tokens_per_gpu is None  # one role's budget: a PlanRequest input
    budget = "roles={actor: {max_tokens_per_micro_batch: 512}}"
    for keys in (["placement.mode=auto"], ["placement.mode=manual", "placement.meshes={actor: [0], reference: [0]}"]):
        # the planner plans with the budget (a request input); nothing writes it into the finished plan
        planned = setup.build_plan(load_config(None, [*keys, budget]), graph)
        mode = keys[0]
        assert planned.layout("actor").max_tokens_per_micro_batch == 512, mode
        assert planned.layout("actor").forward_max_tokens_per_micro_batch == 512, mode
    path = tmp_path / "plan.json"
    path.write_text(default_plan(graph).to_json())
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch'=512 disagrees with the plan file"):
        setup.build_plan(load_config(None, [f"placement.plan_file={path}",
                                            "roles={actor: {max_tokens_per_micro_batch: 512}}"]),
                         graph)


def test_a_backend_without_token_budgets_refuses_them() -> None:
    layout = RoleLayout(role="actor", dp=1, max_tokens_per_micro_batch=64, forward_max_tokens_per_micro_batch=32)
    problems = LayoutSupport(backend="mine").problems(layout)
    assert [p.split("=")[0] for p in problems] == ["max_tokens_per_micro_batch", "forward_max_tokens_per_micro_batch"]
    assert LayoutSupport(backend="mine", token_budgets=True).problems(layout) == []
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=-1 must be >= 0"):
        RoleLayout(role="actor", dp=1, max_tokens_per_micro_batch=-1)


@pytest.mark.parametrize("padding", [False, True])
def test_forward_ops_under_a_token_budget_equal_row_micro_batches(padding: bool) -> None:
    from harness import context, layout, role_spec
    from hybridflow.backends.common.micro_batches import row_tokens
    from hybridflow.backends.torch import TorchRoleEngine
    from packing_ranks import ragged_batch

    from hybridflow.graph import RoleKind
    from hybridflow.planner import Sharding

    batch = ragged_batch()
    spec = role_spec(kind=RoleKind.FROZEN_POLICY)
    rows = TorchRoleEngine(spec, layout(dp=1, sharding=Sharding.NO_SHARD, micro_batch_size=8, padding=padding),
                           context())
    budgeted = TorchRoleEngine(spec, layout(dp=1, sharding=Sharding.NO_SHARD, padding=padding,
                                            forward_max_tokens_per_micro_batch=14), context())
    micros = budgeted.forward_micro_batches(batch)
    assert len(micros) > 1 and sum(len(micro) for micro in micros) == len(batch)
    assert all(len(micro) == 1 or sum(row_tokens(micro, padding=padding)) <= 14 for micro in micros)
    expected, got = rows.log_probs(batch, with_entropy=True), budgeted.log_probs(batch, with_entropy=True)
    for name in ("logprobs", "entropy"):
        assert torch.allclose(got[name], expected[name], atol=1e-5), name
    assert budgeted.executed_layout()["forward_max_tokens_per_micro_batch"] == 14
