"""What the planner charges for an LLM judge: a judge prompt is prompt + response + the template's own tokens (counted
with the run's tokenizer, or estimated from the template's text for a dry run), the driver's rendering and parsing
are priced, and the search costs a streamable step streamed and not and keeps the faster (docs/planner.md,
"Judges and teachers")."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hybridflow.algorithms.judge_templates import CHARS_PER_TOKEN, load_template

from hybridflow.cli import main
from hybridflow.graph import Workload, load_graph
from hybridflow.graph.workload import node_loads
from hybridflow.models.tokenizer import PLAIN_CHAT_TEMPLATE, WIDE_ALPHABET, char_tokenizer
from hybridflow.planner import Cluster, ModelSpec, plan_placement
from hybridflow.planner.manual import evaluate_mapping
from hybridflow.planner.plan import Plan, colocated_plan
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.step_terms import DETOKENIZE_TOKEN_S, TEMPLATE_RENDER_S, TOKENIZE_TOKEN_S
from hybridflow.train.config import load_config
from hybridflow.train.template_tokens import template_tokens

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = Workload(batch_size=64, prompt_len=256, response_len=512)
MODELS = {"actor": ModelSpec.preset("qwen2.5-7b"), "reference": ModelSpec.preset("qwen2.5-7b"),
          "judge": ModelSpec.preset("qwen2.5-0.5b")}
APART = {"actor": range(8), "reference": range(8), "judge": (8, 9)}
LONG = "You are a careful grader. " * 80 + "Task: {{ prompt }} Response: {{ response }} Score: <0-10>"


def _request(workload: Workload = WORKLOAD, **options: object) -> PlanRequest:
    return PlanRequest(load_graph("grpo_judge", **options), MODELS, workload, Cluster.parse("8xA100-80G+2xT4"))


def _seconds(plan: Plan) -> dict[str, float]:
    return {node.node: node.seconds for node in plan.nodes}


def test_a_dry_run_estimates_the_template_from_its_text_and_a_given_count_replaces_it() -> None:
    graph = load_graph("grpo_judge")
    text = load_template("pointwise").render(prompt="", response="")
    assert graph.node("judge_prompts").option("template_tokens") == -(-len(text) // CHARS_PER_TOKEN)
    rows = 64 * graph.samples_per_prompt
    assert node_loads(graph, replace(WORKLOAD, template_tokens=300))["judge_generate"].prompt_tokens == (
        rows * (256 + 512 + 300))
    with pytest.raises(ValueError, match=r"Workload\.template_tokens=-1 must be an integer >= 0"):
        replace(WORKLOAD, template_tokens=-1)


def test_the_run_counts_the_template_in_the_judges_tokenizer_with_its_ground_truths() -> None:
    config = load_config(ROOT / "configs" / "grpo_judge.yaml", ["algorithm.options.judge_template=pointwise"])
    plain = char_tokenizer()  # one token a character, no chat template
    pointwise = load_template("pointwise").render(prompt="", response="")
    assert template_tokens(config, load_graph("grpo_judge"), plain, []) == len(pointwise)
    chat = char_tokenizer(WIDE_ALPHABET, chat_template=PLAIN_CHAT_TEMPLATE)  # the judge's chat markup counts too
    assert template_tokens(config, load_graph("grpo_judge"), chat, []) > len(pointwise)
    reference = load_template("reference").render(prompt="", response="")
    rows = [{"prompt": "p", "ground_truth": "abc"}, {"prompt": "p", "ground_truth": "abcdefg"}]
    graph = load_graph("grpo_judge", judge_template="reference")
    assert template_tokens(config, graph, plain, rows) == len(reference) + 5  # the mean ground truth, 3 and 7
    assert template_tokens(config, load_graph("grpo", reward_kind="reward_function"), plain, rows) is None


def test_a_longer_template_costs_the_judge_and_the_driver_more() -> None:
    short, long = (evaluate_mapping(_request(judge_template=text), APART)
                   for text in ("{{ prompt }} {{ response }} Score:", LONG))
    for node in ("judge_generate", "judge_prompts"):
        assert _seconds(long)[node] > _seconds(short)[node], node
    together = {"actor": range(8), "reference": range(8), "judge": range(8)}  # the judge on the step's critical path
    assert (evaluate_mapping(_request(judge_template=LONG), together).step_time_s
            > evaluate_mapping(_request(judge_template="{{ prompt }} {{ response }} Score:"), together).step_time_s)
    measured = evaluate_mapping(_request(replace(WORKLOAD, template_tokens=4000), judge_template=LONG), APART)
    assert _seconds(measured)["judge_generate"] > _seconds(long)["judge_generate"]  # a run's count replaces it


def test_the_judges_driver_nodes_are_priced_from_their_tokens() -> None:
    plan = evaluate_mapping(_request(replace(WORKLOAD, template_tokens=100), judge_max_new_tokens=16), APART)
    rows = 64 * 4
    expected = rows * (TEMPLATE_RENDER_S + (256 + 512) * DETOKENIZE_TOKEN_S + (256 + 512 + 100) * TOKENIZE_TOKEN_S)
    assert _seconds(plan)["judge_prompts"] == pytest.approx(expected)
    assert _seconds(plan)["judge"] > rows * 16 * DETOKENIZE_TOKEN_S  # each verdict decoded, then parsed


def test_the_search_streams_where_streaming_is_cheaper_and_says_so() -> None:
    """A small judge beside 4 A100s and 2 T4s: unstreamed, the search keeps everything on the A100s (the judge
    would only wait for the whole batch on the T4s); streamed, the judge moves to the T4s, where it scores each
    chunk while the next one decodes. Eight chunks pay eight decode tails: the unstreamed plan stays."""
    models = {"actor": ModelSpec.preset("qwen2.5-1.5b"), "reference": ModelSpec.preset("qwen2.5-1.5b"),
              "judge": ModelSpec.preset("qwen2.5-0.5b")}
    workload = Workload(batch_size=1024, prompt_len=256, response_len=512, template_tokens=300)
    request = PlanRequest(load_graph("grpo_judge"), models, workload, Cluster.parse("4xA100-80G+2xT4"))
    unstreamed = plan_placement(request)
    assert "stream_choice" not in dict(unstreamed.extra)  # nothing asked to stream: nothing costed streamed
    assert [group.roles for group in unstreamed.groups] == [("actor", "reference", "judge")]
    two, eight = plan_placement(replace(request, stream_chunks=2)), plan_placement(replace(request, stream_chunks=8))
    assert two.mode.stream_chunks == 2 and two.step_time_s < 0.98 * unstreamed.step_time_s
    assert {group.roles: group.device for group in two.groups} == {("actor", "reference"): "A100-80G",
                                                                    ("judge",): "T4"}
    assert dict(two.extra)["stream_choice"].startswith("streamed in 2 chunks")
    assert eight.mode.stream_chunks == 1 and eight.step_time_s == pytest.approx(unstreamed.step_time_s)
    assert dict(eight.extra)["stream_choice"].startswith("unstreamed")
    streamed_eight = evaluate_mapping(replace(request, stream_chunks=8), {"actor": range(4), "reference": range(4),
                                                                          "judge": [4, 5]})
    assert streamed_eight.step_time_s > eight.step_time_s


def test_the_search_refuses_to_stream_a_graph_with_nothing_to_stream() -> None:
    dapo = load_graph("dapo", reward_kind="reward_function")
    request = PlanRequest(dapo, {"actor": MODELS["actor"]}, WORKLOAD, Cluster.parse("8xA100-80G"), stream_chunks=2)
    with pytest.raises(ValueError, match=r"stream_chunks=2: the dapo graph .* nothing to stream"):
        plan_placement(request)


def test_a_run_with_placement_auto_streams_as_its_plan_chose() -> None:
    config = load_config(ROOT / "configs" / "grpo_judge.yaml", ["placement.mode=auto", "pipeline.stream_chunks=2"])
    plan = colocated_plan("grpo_judge", ["actor", "reference", "judge"])
    assert config.execution_mode(plan).stream_chunks == 2  # a plan that chose nothing: the config's
    chose = replace(plan, extra=(("stream_choice", "unstreamed: ..."),))
    assert config.execution_mode(chose).stream_chunks == 1


def test_plan_cli_takes_a_template_count(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--algorithm", "grpo_judge", "--cluster", "8xA100-80G+2xT4", "--model", "qwen2.5-7b",
            "--model", "judge=qwen2.5-0.5b", "--batch-size", "64", "--json", "--manual",
            "actor=0-7,reference=0-7,judge=8-9"]
    judged = []
    for count in ("0", "3000"):
        assert main([*args, "--template-tokens", count]) == 0
        manual = json.loads(capsys.readouterr().out)["manual"]
        judged.append(next(node["seconds"] for node in manual["nodes"] if node["node"] == "judge_generate"))
    assert judged[1] > judged[0]
    assert main([*args, "--template-tokens", "-1"]) == 2
    assert "--template-tokens" in capsys.readouterr().err


def test_a_self_judging_actor_with_a_detached_rollout_judges_on_the_rollouts_gpus() -> None:
    graph = load_graph("grpo_judge", self_judge=True)
    request = PlanRequest(graph, {"actor": MODELS["actor"], "reference": MODELS["reference"]}, WORKLOAD,
                          Cluster.parse("16xA100-80G"))
    mapping = {"actor": range(8), "actor:rollout": range(8, 16), "reference": range(8, 16)}
    plan = evaluate_mapping(request, mapping)
    placed = {node.node: node.role for node in plan.nodes}
    assert plan.feasible and placed["actor_generate"] == placed["judge_generate"] == "actor:rollout"
    with pytest.raises(ValueError, match=r"2 generate node\(s\); one_step_off overlaps exactly one"):
        evaluate_mapping(replace(request, pipeline="one_step_off"), mapping)


def test_a_runs_plan_counts_the_template_and_ground_truths_with_its_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.train import setup
    from hybridflow.train.prepare import prepare_run

    seen: dict[str, object] = {}
    build = setup.build_plan
    monkeypatch.setattr(setup, "build_plan", lambda *args, **kwargs: seen.update(kwargs) or build(*args, **kwargs))
    config = load_config(ROOT / "configs" / "grpo_judge.yaml",  # the reference template, which shows the ground truth
                         ["data.num_examples=32", "placement.mode=auto", "placement.num_gpus=2"])
    run = prepare_run(config)
    run.scorer.close()
    truths = [len(str(record["ground_truth"])) for record in run.train_data.records]
    expected = len(load_template("reference").render(prompt="", response="")) + round(sum(truths) / len(truths))
    assert seen["template_tokens"] == expected  # the tiny policy's character tokenizer: one token a character
