"""The planner costs a filter's extra rollouts: the section before the filter runs 1/keep-rate times."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.graph import Workload, edge_bytes, load_graph, node_loads
from hybridflow.planner import Cluster, ModelSpec, evaluate_mapping
from hybridflow.planner.request import PlanRequest

GRAPH = load_graph("dapo", n=8, max_rounds=3, max_new_tokens=512)


def _work(keep: float) -> Workload:
    return Workload(batch_size=64, prompt_len=256, response_len=512, filter_keep_rate=keep)


def _step_seconds(keep: float) -> float:
    models = {"actor": ModelSpec.preset("llama3-8b"), "reward": ModelSpec.preset("llama3-8b")}
    plan = evaluate_mapping(PlanRequest(GRAPH, models, _work(keep), Cluster.parse("8xA100-80G")),
                            {"actor": list(range(8)), "reward": list(range(8))})
    return plan.step_time_s


def test_rounds_are_the_inverse_keep_rate_capped_by_max_rounds() -> None:
    assert [_work(p).rounds(GRAPH) for p in (1.0, 0.5, 0.25, 0.1)] == [1.0, 2.0, 4.0, 4.0]
    assert Workload(batch_size=1, prompt_len=1, response_len=1, filter_keep_rate=0.1).rounds(load_graph("grpo")) == 1


def test_only_the_section_pays_for_the_extra_rounds() -> None:
    one, two = node_loads(GRAPH, _work(1.0)), node_loads(GRAPH, _work(0.5))
    assert two["actor_generate"].response_tokens == 2 * one["actor_generate"].response_tokens
    assert two["reward_score"].sequences == 2 * one["reward_score"].sequences
    assert two["actor_logprob"] == one["actor_logprob"] and two["actor_update"] == one["actor_update"]
    edges_one, edges_two = edge_bytes(GRAPH, _work(1.0)), edge_bytes(GRAPH, _work(0.5))
    assert edges_two["actor_generate", "reward_score"] == 2 * edges_one["actor_generate", "reward_score"]


@settings(max_examples=15, deadline=None)
@given(st.floats(0.05, 1.0), st.floats(0.05, 1.0))
def test_a_lower_keep_rate_is_never_cheaper(a: float, b: float) -> None:
    low, high = sorted((a, b))
    assert _step_seconds(low) >= _step_seconds(high) - 1e-9


def test_bad_keep_rates_name_the_field() -> None:
    with pytest.raises(ValueError, match="filter_keep_rate=0 must be in"):
        Workload(batch_size=1, prompt_len=1, response_len=1, filter_keep_rate=0)
