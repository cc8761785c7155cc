"""What a graph says about itself: roles and their ops, concurrent stages, and per-step work."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridflow.graph import Graph, Op, RoleKind, Workload, edge_bytes, field_bytes, load_graph, node_loads

WORKLOAD = Workload(batch_size=8, prompt_len=16, response_len=32)


def test_ppo_roles_and_their_ops():
    graph = load_graph("ppo")
    assert graph.ops_by_role() == {
        "actor": {Op.GENERATE, Op.LOGPROB, Op.UPDATE},
        "critic": {Op.VALUES, Op.UPDATE},
        "reference": {Op.REF_LOGPROB},
        "reward": {Op.SCORE},
    }
    assert [n.op for n in graph.nodes_of("critic")] == [Op.VALUES, Op.UPDATE]
    trainable = {r.name for r in graph.roles if r.kind.trainable}
    assert trainable == {"actor", "critic"}


def test_a_reward_function_needs_no_gpu_and_kinds_can_be_swapped():
    graph = load_graph("grpo").with_role_kind("reward", "reward_function")
    assert graph.role("reward").kind is RoleKind.REWARD_FUNCTION
    assert [r.name for r in graph.roles if not r.kind.needs_gpu] == ["reward"]
    assert load_graph("grpo").role("reward").kind is RoleKind.REWARD_MODEL  # the original is unchanged


def test_ppo_stages_run_the_four_model_passes_together():
    stages = [set(s) for s in load_graph("ppo").stages()]
    assert stages == [
        {"actor_generate"},
        {"reward_score", "reference_ref_logprob", "critic_values", "actor_logprob"},
        {"kl_rewards"},
        {"gae"},
        {"critic_update", "actor_update"},
    ]


def test_grpo_has_no_critic_and_puts_kl_in_the_loss():
    graph = load_graph("grpo", n=8)
    assert "critic" not in graph.role_names and graph.samples_per_prompt == 8
    update = graph.node("actor_update")
    assert "ref_logprobs" in update.inputs and update.option("kl_coef") == 0.04


def test_node_token_counts_for_a_grouped_rollout():
    graph = load_graph("grpo", n=4)
    rows = 8 * 4
    loads = node_loads(graph, WORKLOAD)
    generate = loads["actor_generate"]
    # The n samples of a prompt share one prefill; each decodes its own response.
    assert (generate.sequences, generate.prompt_tokens, generate.response_tokens) == (rows, 8 * 16, rows * 32)
    for name in ("reward_score", "reference_ref_logprob", "actor_logprob", "actor_update"):
        assert (loads[name].prompt_tokens, loads[name].response_tokens) == (rows * 16, rows * 32)
        assert loads[name].tokens == rows * 48
    assert loads["advantages"].tokens == 0


def test_workload_n_samples_overrides_the_graph():
    graph = load_graph("grpo", n=4)
    two = Workload(batch_size=8, prompt_len=16, response_len=32, n_samples=2)
    assert two.sequences(graph) == 16 and WORKLOAD.sequences(graph) == 32
    assert node_loads(graph, two)["actor_logprob"].response_tokens == 16 * 32


def test_edge_bytes_follow_field_shapes_and_dtypes():
    graph = load_graph("grpo", n=4)
    rows, resp = 32, 32
    sizes = edge_bytes(graph, WORKLOAD)
    assert set(sizes) == {(e.src, e.dst) for e in graph.edges}
    assert sizes[("actor_generate", "reward_score")] == rows * resp * (8 + 1)  # int64 ids + bool mask
    assert sizes[("reward_score", "advantages")] == rows * 4  # one float per sequence
    assert sizes[("actor_logprob", "actor_update")] == rows * resp * 4
    assert sizes[("advantages", "actor_update")] == rows * resp * 4


def test_field_bytes_of_inputs_and_unknown_fields():
    graph = load_graph("grpo", n=4)
    assert field_bytes(graph, "prompts", WORKLOAD) == 8 * 16 * 8  # once per prompt, not per sample
    assert field_bytes(graph, "ground_truth", WORKLOAD) == 8 * 64
    assert field_bytes(graph, "my_stat", WORKLOAD) == 32 * 32 * 4  # default: float32 per response token


@pytest.mark.parametrize("name", ["ppo", "grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline"])
def test_bytes_and_tokens_scale_linearly_with_the_batch(name):
    graph = load_graph(name)
    double = Workload(batch_size=16, prompt_len=16, response_len=32)
    assert edge_bytes(graph, double) == {k: 2 * v for k, v in edge_bytes(graph, WORKLOAD).items()}
    small, big = node_loads(graph, WORKLOAD), node_loads(graph, double)
    assert all(big[n].tokens == 2 * small[n].tokens for n in small)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"batch_size": 0}, "batch_size"), ({"prompt_len": True}, "prompt_len"), ({"response_len": 1.5}, "response_len"),
     ({"n_samples": 0}, "n_samples"), ({"n_samples": True}, "n_samples"), ({"token_bytes": -1}, "token_bytes")],
)
def test_workload_rejects_bad_sizes_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"Workload.{field}="):
        Workload(**{"batch_size": 8, "prompt_len": 16, "response_len": 32, **kwargs})


def test_a_field_read_twice_moves_once():
    graph = load_graph("grpo")
    nodes = tuple(replace(n, inputs=(*n.inputs, "scores")) if n.name == "advantages" else n for n in graph.nodes)
    doubled = Graph(graph.name, graph.roles, nodes)
    edge = next(e for e in doubled.edges if (e.src, e.dst) == ("reward_score", "advantages"))
    assert edge.fields == ("scores",)
    assert edge_bytes(doubled, WORKLOAD) == edge_bytes(graph, WORKLOAD)
