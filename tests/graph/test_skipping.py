"""Passes whose results are known are taken out of the graph (hybridflow/graph/skipping.py): a forward pass
nothing reads (the reference at ``kl_coef: 0``) and the old log-probs of a single on-policy update. Shown by
``hybridflow graph``, kept through JSON, and not costed by the planner."""

from __future__ import annotations

import pytest

from hybridflow.cli import main
from hybridflow.graph import DETACHED_LOGPROBS, Workload, from_json, load_graph, to_json, with_detached_logprobs
from hybridflow.planner import Cluster, ModelSpec, plan_placement
from hybridflow.planner.request import PlanRequest

KL_ALGORITHMS = ("grpo", "ppo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "dr_grpo", "gspo")


@pytest.mark.parametrize("algorithm", KL_ALGORITHMS)
def test_kl_coef_zero_drops_the_reference_role(algorithm: str) -> None:
    graph = load_graph(algorithm, kl_coef=0.0)
    assert "reference" not in graph.role_names
    assert not any("ref_logprobs" in node.inputs for node in graph.nodes)
    (skipped,) = graph.skipped
    assert skipped.node == "reference_ref_logprob" and skipped.role == "reference" and "kl_coef=0" in skipped.reason
    assert "reference" in load_graph(algorithm, kl_coef=0.1).role_names


def test_an_adaptive_kl_keeps_the_reference_from_a_zero_start() -> None:
    assert "reference" in load_graph("ppo", kl_coef=0.0, kl_target=0.1).role_names


def test_single_pass_updates_take_their_own_old_logprobs() -> None:
    graph = with_detached_logprobs(load_graph("grpo"), {"actor"})
    assert "actor_logprob" not in graph.order and "old_logprobs" not in graph.node("actor_update").inputs
    assert graph.node("actor_update").option(DETACHED_LOGPROBS) == "old_logprobs"
    assert [s.node for s in graph.skipped] == ["actor_logprob"]
    assert with_detached_logprobs(load_graph("grpo"), set()) == load_graph("grpo")  # no role: unchanged
    # PPO's KL-in-reward reads the old log-probs before the update: the pass stays unless kl_coef is 0.
    assert "actor_logprob" in with_detached_logprobs(load_graph("ppo"), {"actor"}).order
    assert "actor_logprob" not in with_detached_logprobs(load_graph("ppo", kl_coef=0.0), {"actor"}).order


def test_skipped_passes_survive_json_and_show_in_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    graph = with_detached_logprobs(load_graph("grpo", kl_coef=0.0), {"actor"})
    assert from_json(to_json(graph)) == graph
    assert "skipped" not in to_json(load_graph("grpo"))  # nothing skipped: the JSON is as it was
    assert main(["graph", "grpo", "-o", "kl_coef=0", "--single-pass"]) == 0
    out = capsys.readouterr().out
    assert "skipped (results known in advance):" in out
    assert "reference_ref_logprob: nothing reads ref_logprobs (kl_coef=0); role 'reference' is not placed" in out
    assert "actor_logprob: a single on-policy pass" in out
    assert main(["graph", "grpo"]) == 0 and "skipped" not in capsys.readouterr().out


def test_the_planner_costs_only_the_passes_left() -> None:
    models = {role: ModelSpec.preset("qwen2.5-1.5b") for role in ("actor", "reference")}
    workload = Workload(batch_size=256, prompt_len=256, response_len=512)
    cluster = Cluster.parse("4xH100")
    full = plan_placement(PlanRequest(load_graph("grpo", reward_kind="reward_function"), models, workload, cluster))
    lean_graph = with_detached_logprobs(load_graph("grpo", reward_kind="reward_function", kl_coef=0.0), {"actor"})
    lean = plan_placement(PlanRequest(lean_graph, {"actor": models["actor"]}, workload, cluster))
    assert "reference" in full.roles and "reference" not in lean.roles and lean.step_time_s < full.step_time_s
