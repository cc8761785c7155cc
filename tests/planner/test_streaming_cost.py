"""A sync step streamed in chunks (``stream_chunks``), as the planner costs it."""

from __future__ import annotations

import json

import pytest

from hybridflow.cli import main
from hybridflow.graph import Graph, Workload, load_graph
from hybridflow.planner import Cluster, LengthDistribution, ModelSpec, RunSettings
from hybridflow.planner.manual import evaluate_mapping
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.schedule import DRIVER, Schedule, stream_schedule, timeline


def test_streamed_schedule_by_hand() -> None:
    """gen (group 0) -> score (driver) and logprob (group 1) -> update (group 1), in 2 chunks."""
    plan = Schedule(nodes=("gen", "score", "logprob", "update"), group_of=(0, DRIVER, 1, 1),
                    preds=((), ((0, 0.2),), ((0, 0.2),), ((1, 0.0), (2, 0.0))), driver_seconds=(0.0, 1.0, 0.0, 0.0),
                    cross_group_bytes=0, num_groups=2)
    expanded, origin = stream_schedule(plan, "gen", ("score", "logprob"), 2)
    assert expanded.nodes == ("gen#0", "gen#1", "score#0", "logprob#0", "score#1", "logprob#1", "update")
    assert origin == ((0, 0), (0, 1), (1, 0), (2, 0), (1, 1), (2, 1), (3, -1))
    assert expanded.preds[3] == ((0, 0.1),) and expanded.preds[6] == ((2, 0.0), (4, 0.0), (3, 0.0), (5, 0.0))
    assert expanded.driver_seconds[2] == expanded.driver_seconds[4] == 0.5
    # Chunks of gen 3 s, logprob 1 s; update 2 s: logprob#0 runs while gen#1 decodes.
    spans = timeline(expanded, [3.0, 3.0, 0.0, 1.0, 0.0, 1.0, 2.0])
    assert spans[3] == pytest.approx((3.1, 4.1)) and spans[5] == pytest.approx((6.1, 7.1))
    assert spans[6] == pytest.approx((7.1, 9.1))


@pytest.fixture(scope="module")
def grpo() -> Graph:
    return load_graph("grpo", reward_kind="reward_model")


def test_streaming_overlaps_forward_passes_when_lengths_are_even(grpo: Graph) -> None:
    """Reference and reward model on GPUs of their own, every response as long, and more sequences than the
    engines hold at once (a chunk then costs its share of the batch): chunks pipeline the forward passes behind
    the generation, so the step shortens. (With fewer rows, a memory-bound decode costs a chunk nearly what it
    costs the batch, and streaming loses.)"""
    models = {role: ModelSpec.preset("qwen2.5-7b") for role in ("actor", "reference", "reward")}
    workload = Workload(batch_size=1024, prompt_len=512, response_len=512, n_samples=8)
    cluster = Cluster.parse("8xH100")
    mapping = {"actor": [0, 1, 2, 3], "reference": [4, 5], "reward": [6, 7]}
    whole = evaluate_mapping(PlanRequest(grpo, models, workload, cluster), mapping)
    unstreamed = evaluate_mapping(PlanRequest(grpo, models, workload, cluster, stream_chunks=1), mapping)
    assert (unstreamed.step_time_s, unstreamed.nodes) == (whole.step_time_s, whole.nodes)
    streamed = evaluate_mapping(PlanRequest(grpo, models, workload, cluster, stream_chunks=4), mapping)
    assert streamed.step_time_s < whole.step_time_s
    assert streamed.mode.stream_chunks == 4
    by_node = {node.node: node for node in streamed.nodes}
    assert by_node["reference_ref_logprob"].start_s < by_node["actor_generate"].end_s  # on the first chunk done


def test_a_streamed_nodes_seconds_are_its_chunks_not_the_waits_between_them(grpo: Graph) -> None:
    """The reference and the reward model share a group: each chunk of one waits behind the other's, so a node's
    span (first chunk's start to last chunk's end) holds time it spends queued. Its seconds are its chunks' own, as
    a run's ``time/<node>`` sums its calls: within the span, and the two nodes' seconds fit in their shared span."""
    models = {role: ModelSpec.preset("qwen2.5-7b") for role in ("actor", "reference", "reward")}
    workload = Workload(batch_size=1024, prompt_len=512, response_len=512, n_samples=8)
    mapping = {"actor": [0, 1, 2, 3], "reference": [4, 5, 6, 7], "reward": [4, 5, 6, 7]}
    streamed = evaluate_mapping(PlanRequest(grpo, models, workload, Cluster.parse("8xH100"), stream_chunks=4), mapping)
    nodes = {node.node: node for node in streamed.nodes}
    reference, reward = nodes["reference_ref_logprob"], nodes["reward_score"]
    for node in (reference, reward):
        assert 0 < node.seconds < 0.9 * (node.end_s - node.start_s), node  # 3 waits behind the other's chunks
    shared = max(reference.end_s, reward.end_s) - min(reference.start_s, reward.start_s)
    assert reference.seconds + reward.seconds <= shared + 1e-9


def test_streaming_pays_each_chunks_tail_when_lengths_are_skewed() -> None:
    """The CPU benchmark's case: a tiny model whose decode is mostly per-step overhead and a long tail. Each
    chunk waits for its own longest response, so 4 chunks cost more than one batch."""
    graph = load_graph("grpo_no_ref", reward_kind="reward_function")
    models = {"actor": ModelSpec.preset("tiny-qwen2")}
    workload = Workload(batch_size=8, prompt_len=10, response_len=56, n_samples=8)
    recipe = RunSettings(lengths=LengthDistribution.lognormal(mean=56, max=160))
    split = {"actor": [0], "actor:rollout": [1, 2]}
    cluster = Cluster.parse("3xCPU", host_cores=2)
    whole = evaluate_mapping(PlanRequest(graph, models, workload, cluster, settings=recipe), split)
    streamed = evaluate_mapping(PlanRequest(graph, models, workload, cluster, settings=recipe, stream_chunks=4), split)
    assert streamed.step_time_s > 1.2 * whole.step_time_s


def test_bad_stream_chunks_name_the_field(grpo: Graph) -> None:
    models = {role: ModelSpec.preset("tiny-qwen2") for role in ("actor", "reference", "reward")}
    workload, cluster = Workload(batch_size=8, prompt_len=8, response_len=8), Cluster.parse("4xCPU")
    mapping = {"actor": [0], "actor:rollout": [1], "reference": [2], "reward": [3]}
    with pytest.raises(ValueError, match=r"stream_chunks=0 must be >= 1 \(an integer"):
        evaluate_mapping(PlanRequest(grpo, models, workload, cluster, stream_chunks=0), mapping)
    with pytest.raises(ValueError, match="stream_chunks=2 streams within a sync step; pipeline='async'"):
        evaluate_mapping(PlanRequest(grpo, models, workload, cluster, stream_chunks=2, pipeline="async"), mapping)
    with pytest.raises(ValueError, match="nothing to stream"):
        evaluate_mapping(PlanRequest(load_graph("dapo", reward_kind="reward_function"), {"actor": models["actor"]},
                                     workload, cluster, stream_chunks=2), {"actor": [0]})


def test_cli_plan_stream_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--algorithm", "grpo_no_ref", "--reward-kind", "reward_function", "--model", "tiny-qwen2",
            "--cluster", "3xCPU", "--batch-size", "8", "--prompt-len", "10", "--response-len", "56",
            "--max-response-len", "160", "--n-samples", "8", "--json"]
    assert main([*args, "--manual", "actor=0,actor:rollout=1-2", "--stream-chunks", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["manual"]["stream_chunks"] == 4
    assert main([*args, "--stream-chunks", "4"]) == 0  # the search costs the step streamed and not, keeps the faster
    plan = json.loads(capsys.readouterr().out)
    assert plan["stream_chunks"] in (1, 4) and "streamed" in plan["extra"]["stream_choice"]
