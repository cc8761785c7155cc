"""Dr.GRPO, GSPO and GRPO without a reference as graphs, and the actor-loss options of the built-ins."""

from __future__ import annotations

import pytest

from hybridflow.graph import Op, Workload, load_graph
from hybridflow.planner import Cluster, ModelSpec, plan_placement
from hybridflow.planner.request import PlanRequest
from hybridflow.testing import check_plan

NO_REFERENCE = ["grpo_no_ref", "dr_grpo", "gspo"]
ACTOR_OPTIONS = {"clip_ratio_high": 0.28, "loss_agg": "seq-mean-token-mean", "entropy_coef": 0.01}


def actor_update(name: str, **options):
    graph = load_graph(name, **options)
    return graph, next(n for n in graph.nodes if n.op is Op.UPDATE and n.role == "actor")


@pytest.mark.parametrize("name", NO_REFERENCE)
def test_graphs_without_kl_have_no_reference_and_the_planner_places_none(name):
    graph, update = actor_update(name, reward_kind="reward_function")
    assert "reference" not in graph.ops_by_role()
    assert "ref_logprobs" not in update.inputs and not update.option("kl_coef")
    tiny = ModelSpec.preset("tiny")
    cluster = Cluster.parse("1xCPU")
    plan = plan_placement(PlanRequest(graph, {"actor": tiny}, Workload(batch_size=4, prompt_len=8, response_len=8),
                                      cluster))
    check_plan(plan, graph=graph, cluster=cluster)
    assert set(plan.roles) == {"actor", "reward"}


@pytest.mark.parametrize("name", ["dr_grpo", "gspo"])
def test_a_kl_coefficient_brings_the_reference_back(name):
    graph, update = actor_update(name, kl_coef=0.01)
    assert "reference" in graph.ops_by_role()
    assert "ref_logprobs" in update.inputs and update.option("kl_coef") == 0.01


def test_dr_grpo_and_gspo_set_their_maths():
    graph, update = actor_update("dr_grpo", max_new_tokens=64)
    advantages = graph.node("advantages")
    assert advantages.option("norm_by_std") is False
    assert update.option("loss_agg") == "seq-mean-token-sum-norm" and update.option("loss_scale_factor") == 64
    _, update = actor_update("gspo")
    assert update.loss == "gspo_policy"
    assert (update.option("clip_ratio"), update.option("clip_ratio_high")) == (3e-4, 4e-4)
    assert update.option("loss_agg") == "seq-mean-token-mean"


@pytest.mark.parametrize("name", ["ppo", "grpo", "grpo_no_ref", "rloo", "remax", "reinforce_pp",
                                  "reinforce_pp_baseline", "dr_grpo"])
def test_actor_loss_options_reach_the_update_and_stay_out_by_default(name):
    _, plain = actor_update(name)
    assert "clip_ratio_high" not in plain.options_dict and "entropy_coef" not in plain.options_dict
    assert name == "dr_grpo" or "loss_agg" not in plain.options_dict
    options = {k: v for k, v in ACTOR_OPTIONS.items() if not (name == "dr_grpo" and k == "loss_agg")}
    _, update = actor_update(name, **options)
    for key, value in options.items():
        assert update.option(key) == value


def test_a_misspelt_loss_agg_fails_when_the_graph_is_built():
    with pytest.raises(ValueError, match="unknown loss_agg 'token_mean'"):
        load_graph("grpo", loss_agg="token_mean")
