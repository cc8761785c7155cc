"""The agent cost model: distributions, the two schedules, the plan's recorded choice and the CLI's inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.graph import Graph, GraphBuilder, RoleKind, Workload, load_graph
from hybridflow.planner import AgentWorkload, Cluster, ModelSpec, Plan, plan_placement, predict_agent_schedules
from hybridflow.planner.distributions import Empirical, Fixed, Lognormal, parse_distribution
from hybridflow.planner.request import PlanRequest

LONG_TAIL = "lognormal:median=0.1,sigma=1.0"


def agentic_graph(**options: object) -> Graph:
    g = GraphBuilder("agentic")
    actor, reward = g.role("actor", RoleKind.POLICY), g.role("reward", RoleKind.REWARD_FUNCTION)
    g.generate(actor, n=4, environment="calculator", max_turns=3, max_new_tokens=512, loss_mask=True, **options)
    g.score(reward)
    g.logprob(actor)
    g.compute("advantages", fn="grpo_advantages", inputs=("scores", "loss_mask", "uid"), outputs=("advantages",),
              norm_by_std=True)
    g.update(actor, loss="ppo_policy", inputs=("prompts", "responses", "loss_mask", "old_logprobs", "advantages"))
    return g.build()


def predict(turns: int, latency: str, *, caching: bool = True, model: str = "tiny-qwen2") -> dict[str, float]:
    workload = AgentWorkload(turns=f"fixed:{turns}", tool_latency=latency, observation_tokens=16,
                             prefix_caching=caching)
    return predict_agent_schedules(model=ModelSpec.preset(model), workload=workload, batch=32, prompt_len=128,
                                   max_turns=3, max_new_tokens=512, max_turn_tokens=128)


def test_distributions_parse_from_text() -> None:
    assert parse_distribution("fixed:2", field="turns") == Fixed(2.0)
    assert parse_distribution(LONG_TAIL, field="x") == Lognormal(median=0.1, sigma=1.0)
    assert parse_distribution("empirical:0.1,0.3,2.0", field="x").mean == pytest.approx(0.8)
    assert parse_distribution(3, field="x") == Fixed(3.0)


@pytest.mark.parametrize(("text", "match"), [
    ("weibull:2", r"tool_latency='weibull:2': unknown kind 'weibull'.*lognormal:median=0.1,sigma=1.0"),
    ("lognormal:median=0.1", r"tool_latency=.*lognormal takes median= and sigma="),
    ("lognormal:median=-1,sigma=1", r"tool_latency=.*median > 0"),
    ("empirical:", r"tool_latency=.*empirical has no values"),
    ("fixed:abc", r"tool_latency='fixed:abc'.*e.g.|tool_latency='fixed:abc'.*write"),
])
def test_a_bad_distribution_names_the_field_and_an_example(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_distribution(text, field="tool_latency")


@pytest.mark.parametrize("dist", [Lognormal(median=0.1, sigma=1.0), Empirical.of([0.1, 0.3, 2.0]), Fixed(0.5),
                                  Lognormal(median=1.0, sigma=0.3).sum_of(3)])
def test_expected_max_is_the_mean_at_one_draw_and_grows_with_draws(dist) -> None:
    assert dist.expected_max(1) == pytest.approx(dist.mean)
    maxima = [dist.expected_max(n) for n in (1, 2, 8, 64, 512)]
    assert maxima == sorted(maxima)
    if dist.variance > 0:
        assert maxima[-1] > 1.5 * maxima[0]


def test_the_numeric_order_statistic_matches_closed_forms() -> None:
    # Two draws of a lognormal: E[max] = 2·mean·Φ(σ/√2) (the max of two is the mean plus half the mean |X-Y|).
    dist = Lognormal(median=0.1, sigma=1.0)
    closed = 2 * dist.mean * 0.5 * (1 + math.erf(1.0 / 2))
    assert dist.expected_max(2) == pytest.approx(closed, rel=1e-3)
    # The x-space integral of the base class agrees with the z-space one.
    generic = super(Lognormal, dist).expected_max(64)
    assert generic == pytest.approx(dist.expected_max(64), rel=2e-2)
    # Empirical: exact; the slowest of 3 draws of {0.1, 0.3, 2.0}.
    assert Empirical.of([0.1, 0.3, 2.0]).expected_max(3) == pytest.approx(2 * 19 / 27 + 0.3 * 7 / 27 + 0.1 / 27)


def test_without_tools_one_turn_costs_the_same_under_both_schedules() -> None:
    seconds = predict(1, "fixed:0")
    assert seconds["trajectory"] == pytest.approx(seconds["turn"], rel=1e-6)


def test_with_a_long_tail_trajectories_win_and_the_gap_grows_with_turns() -> None:
    gaps = []
    for turns in (2, 3):
        seconds = predict(turns, LONG_TAIL)
        assert seconds["trajectory"] < seconds["turn"]
        gaps.append(seconds["turn"] / seconds["trajectory"])
    assert gaps == sorted(gaps) and gaps[0] > 1.2


def test_one_turn_has_nothing_to_overlap_even_with_a_long_tail() -> None:
    # Every first turn is sent at once and sampled as one batch; its tools then wait side by side under both
    # schedules (benchmarks/agent_throughput.py measured 0.99x). The trajectory's own turn at the sustained
    # concurrency would make it look faster.
    for tokens in (32, 128):
        seconds = predict_agent_schedules(
            model=ModelSpec.preset("tiny-qwen2"), batch=32, prompt_len=32, max_turns=1, max_new_tokens=tokens,
            workload=AgentWorkload(turns="fixed:1", tool_latency=LONG_TAIL, turn_tokens=tokens, prefix_caching=False))
        assert seconds["trajectory"] == pytest.approx(seconds["turn"], rel=2e-3)


def test_prefix_caching_lowers_the_re_sent_context_prefill() -> None:
    cached, recomputed = predict(3, "fixed:0", caching=True), predict(3, "fixed:0", caching=False)
    assert cached["turn"] < recomputed["turn"] and cached["trajectory"] < recomputed["trajectory"]
    assert predict(1, "fixed:0", caching=True) == predict(1, "fixed:0", caching=False)  # one turn re-sends nothing


def test_metrics_give_turns_calls_and_a_lognormal_latency(tmp_path: Path) -> None:
    rows = [{"agent/turns_mean": 2.5, "agent/turns_max": 3, "agent/tool_calls_per_trajectory": 2.5,
             "agent/tool_latency_p50_s": 0.1, "agent/tool_latency_p95_s": 0.5}] * 3
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    workload = AgentWorkload.from_metrics(path)
    assert isinstance(workload.tool_latency, Lognormal)
    assert workload.tool_latency.sigma == pytest.approx(math.log(5) / 1.645)
    assert workload.turns is not None and workload.turns.mean == pytest.approx(2.5)
    assert workload.turns.expected_max(1000) == pytest.approx(3)
    assert workload.calls_per_turn == pytest.approx(1.0)
    (tmp_path / "empty.jsonl").write_text('{"loss": 1}\n')
    with pytest.raises(ValueError, match="agent/turns_mean"):
        AgentWorkload.from_metrics(tmp_path / "empty.jsonl")


def test_a_plan_records_the_faster_schedule_and_round_trips_it() -> None:
    graph, models = agentic_graph(), {"actor": ModelSpec.preset("qwen2.5-1.5b")}
    workload = Workload(batch_size=64, prompt_len=256, response_len=256)
    agent = AgentWorkload(turns="fixed:3", tool_latency=LONG_TAIL, observation_tokens=32)
    plan = plan_placement(PlanRequest(graph, models, workload, Cluster.parse("4xH100"), agent=agent))
    assert plan.mode.agent_schedule == "trajectory"
    why = dict(plan.extra)["agent_schedule"]
    assert "trajectory" in why and "vs turn" in why
    loaded = Plan.from_json(plan.to_json())
    assert loaded.mode == plan.mode and loaded.mode.agent_schedule == "trajectory"


def test_a_node_that_fixes_its_schedule_is_costed_and_recorded_so() -> None:
    graph, models = agentic_graph(agent_schedule="turn"), {"actor": ModelSpec.preset("qwen2.5-1.5b")}
    workload = Workload(batch_size=64, prompt_len=256, response_len=256)
    agent = AgentWorkload(turns="fixed:3", tool_latency=LONG_TAIL)
    fixed = plan_placement(PlanRequest(graph, models, workload, Cluster.parse("4xH100"), agent=agent))
    free = plan_placement(PlanRequest(agentic_graph(), models, workload, Cluster.parse("4xH100"), agent=agent))
    assert fixed.mode.agent_schedule == "turn" and fixed.step_time_s > free.step_time_s


def test_without_agent_inputs_the_plan_says_what_it_assumed() -> None:
    plan = plan_placement(PlanRequest(agentic_graph(), {"actor": ModelSpec.preset("qwen2.5-1.5b")},
                                      Workload(batch_size=64, prompt_len=256, response_len=256),
                                      Cluster.parse("4xH100")))
    assert "no agent inputs given" in dict(plan.extra)["agent_schedule"]


def test_graphs_without_agents_are_unchanged_and_refuse_agent_inputs() -> None:
    graph = load_graph("grpo", reward_kind="reward_function")
    models = {role.name: ModelSpec.preset("qwen2.5-0.5b") for role in graph.roles if role.kind.needs_gpu}
    workload = Workload(batch_size=64, prompt_len=256, response_len=256)
    plan = plan_placement(PlanRequest(graph, models, workload, Cluster.parse("2xH100")))
    assert plan.mode.agent_schedule is None and "agent_schedule" not in plan.to_dict()
    with pytest.raises(ValueError, match="no multi-turn generate node"):
        plan_placement(PlanRequest(graph, models, workload, Cluster.parse("2xH100"),
                                   agent=AgentWorkload(turns="fixed:2")))


def test_execution_mode_refuses_an_unknown_schedule() -> None:
    from hybridflow.planner import ExecutionMode

    with pytest.raises(ValueError, match=r"ExecutionMode.agent_schedule='async' must be one of \['trajectory'"):
        ExecutionMode(agent_schedule="async")


def test_the_cli_takes_agent_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "agentic.py"
    source.write_text(
        "from hybridflow.graph import GraphBuilder, RoleKind\n\n"
        "def build(**_):\n"
        "    g = GraphBuilder('agentic')\n"
        "    a, r = g.role('actor', RoleKind.POLICY), g.role('reward', RoleKind.REWARD_FUNCTION)\n"
        "    g.generate(a, n=4, environment='calculator', max_turns=3, max_new_tokens=512, loss_mask=True)\n"
        "    g.score(r)\n    g.logprob(a)\n"
        "    g.compute('advantages', fn='grpo_advantages', inputs=('scores', 'loss_mask', 'uid'),\n"
        "              outputs=('advantages',), norm_by_std=True)\n"
        "    g.update(a, loss='ppo_policy', inputs=('prompts', 'responses', 'loss_mask', 'old_logprobs',\n"
        "             'advantages'))\n"
        "    return g.build()\n")
    assert main(["plan", "--algorithm", f"{source}:build", "--cluster", "4xH100", "--model", "qwen2.5-1.5b",
                 "--batch-size", "64", "--reward-kind", "reward_function", "--agent-turns", "fixed:3",
                 "--tool-latency", LONG_TAIL, "--observation-tokens", "32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["agent_schedule"] == "trajectory" and "vs turn" in data["extra"]["agent_schedule"]
    assert main(["plan", "--algorithm", f"{source}:build", "--cluster", "4xH100", "--model", "qwen2.5-1.5b",
                 "--reward-kind", "reward_function", "--agent-turns", "bogus"]) == 2
    assert "turns='bogus'" in capsys.readouterr().err
