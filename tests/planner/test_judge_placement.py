"""An LLM judge in the plan: its generate is costed as a judge's (each sampled row prefilled with its response,
answered within the verdict budget), and the planner places it where the step is fastest, a small judge on a
group of its own (docs/planner.md, "Judges")."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridflow.graph import Workload, load_graph
from hybridflow.graph.workload import node_loads
from hybridflow.planner import Cluster, ModelSpec, plan_placement
from hybridflow.planner.manual import evaluate_mapping
from hybridflow.planner.request import PlanRequest

WORKLOAD = Workload(batch_size=128, prompt_len=256, response_len=512)


def test_a_judges_generate_reads_prompt_response_and_template_and_decodes_its_verdict_budget() -> None:
    graph = load_graph("grpo_judge", n=4, judge_max_new_tokens=24)
    template = graph.node("judge_prompts").option("template_tokens")
    assert isinstance(template, int) and template > 0  # the pointwise template's text, estimated for a dry run
    loads = node_loads(graph, WORKLOAD)
    rows = 128 * 4
    actor, judge = loads["actor_generate"], loads["judge_generate"]
    assert (actor.prompt_tokens, actor.response_tokens) == (128 * 256, rows * 512)  # prompts shared by n samples
    assert (judge.sequences, judge.prompt_tokens, judge.response_tokens) == (
        rows, rows * (256 + 512 + template), rows * 24)


@pytest.fixture(scope="module")
def judge_request() -> PlanRequest:
    models = {"actor": ModelSpec.preset("qwen2.5-7b"), "reference": ModelSpec.preset("qwen2.5-7b"),
              "judge": ModelSpec.preset("qwen2.5-0.5b")}
    return PlanRequest(load_graph("grpo_judge"), models, WORKLOAD, Cluster.parse("8xA100-80G+2xT4"))


def test_a_small_judge_gets_the_t4s_and_the_step_is_faster_than_with_it_colocated(judge_request: PlanRequest) -> None:
    plan = plan_placement(judge_request)
    judge_group = next(group for group in plan.groups if "judge" in group.roles)
    assert plan.feasible and judge_group.device == "T4" and judge_group.roles == ("judge",)
    colocated = evaluate_mapping(judge_request, {"actor": range(8), "reference": range(8), "judge": range(8)})
    with_reference = evaluate_mapping(judge_request, {"actor": range(4), "reference": range(4, 8),
                                                      "judge": range(4, 8)})
    assert colocated.feasible and with_reference.feasible
    assert plan.step_time_s < min(colocated.step_time_s, with_reference.step_time_s)
    # the judge overlaps the reference's pass on its own group instead of queueing behind the actor's passes
    judge = next(node for node in plan.nodes if node.node == "judge_generate")
    reference = next(node for node in plan.nodes if node.node == "reference_ref_logprob")
    assert judge.start_s < reference.end_s


def test_plan_cli_places_the_judge(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridflow.cli import main

    assert main(["plan", "--algorithm", "grpo_judge", "--cluster", "8xA100-80G+2xT4", "--model", "qwen2.5-7b",
                 "--model", "judge=qwen2.5-0.5b"]) == 0
    out = capsys.readouterr().out
    assert "judge" in out and "T4" in out and "judge_generate" in out


def test_a_streamed_step_overlaps_the_judge_with_the_rollout_only_on_a_group_apart(judge_request: PlanRequest) -> None:
    """Streamed, the judge's chain follows the policy's generate chunk by chunk (``Graph.streamed_followers``, the
    runtime's rule): on its own GPUs it starts on the first chunk while the next decodes; beside the rollout its
    generate queues behind every generate chunk (its prompts are rendered on the driver either way)."""
    streamed = replace(judge_request, stream_chunks=4)
    apart = evaluate_mapping(streamed, {"actor": range(8), "reference": range(8), "judge": (8, 9)})
    colocated = evaluate_mapping(streamed, {"actor": range(8), "reference": range(8), "judge": range(8)})
    for plan, overlaps in ((apart, True), (colocated, False)):
        nodes = {node.node: node for node in plan.nodes}
        assert plan.feasible and plan.mode.stream_chunks == 4
        assert nodes["judge_prompts"].start_s < nodes["actor_generate"].end_s
        for name in ("judge_generate", "judge"):
            assert (nodes[name].start_s < nodes["actor_generate"].end_s) is overlaps, name
