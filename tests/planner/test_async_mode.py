"""The ``async`` execution mode in the planner: a detached pool streaming generation, at most k updates ahead."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.cli import main
from hybridflow.graph import Graph, Workload, load_graph, node_loads
from hybridflow.planner import (
    Cluster,
    InfeasibleError,
    LengthDistribution,
    ModelSpec,
    Plan,
    RunSettings,
    plan_placement,
    rollout_role,
)
from hybridflow.planner.calibration import DEFAULT_CONSTANTS
from hybridflow.planner.costs import COLLECTIVE_LATENCY_S, Shape
from hybridflow.planner.devices import get_device
from hybridflow.planner.manual import evaluate_mapping, parse_mapping
from hybridflow.planner.modes import streamed_generate_seconds
from hybridflow.planner.problem import build_problem
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.rollout import Engine, decode_seconds
from hybridflow.planner.weight_moves import WEIGHT_TENSOR_S
from hybridflow.testing import brute_force_step_time, check_plan

ROLLOUT = rollout_role("actor")
SPLIT = parse_mapping(f"actor=0-1,reference=0-1,{ROLLOUT}=2-3")
SMALL = "qwen2.5-0.5b"


@pytest.fixture(scope="module")
def grpo() -> Graph:
    return load_graph("grpo", reward_kind="reward_function")


def small_models(graph: Graph) -> dict[str, ModelSpec]:
    return {role.name: ModelSpec.preset(SMALL) for role in graph.roles if role.kind.needs_gpu}


def four_gpus(*, instant_driver: bool = False) -> Cluster:
    parsed = Cluster.parse("4xA100-80G")
    # A driver link this fast makes every transfer through the controller ~1e-12 s: the hand sum needs none.
    return dataclasses.replace(parsed, driver_bandwidth=1e21) if instant_driver else parsed


def long_tail(mean: int, cap: int) -> RunSettings:
    return RunSettings(lengths=LengthDistribution.lognormal(mean=mean, max=cap))


def seconds(plan: Plan, node: str) -> float:
    return next(n.seconds for n in plan.nodes if n.node == node)


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_async_step_by_hand(grpo: Graph, max_staleness: int) -> None:
    models, hardware, recipe = small_models(grpo), four_gpus(instant_driver=True), long_tail(256, 8192)
    workload = Workload(batch_size=64, prompt_len=256, response_len=256)
    sync = evaluate_mapping(PlanRequest(grpo, models, workload, hardware, settings=recipe), SPLIT)
    plan = evaluate_mapping(PlanRequest(grpo, models, workload, hardware, settings=recipe, pipeline="async",
                                        max_staleness=max_staleness), SPLIT)
    assert (plan.pipeline, plan.max_staleness) == ("async", max_staleness)
    layout = plan.layout(ROLLOUT)
    assert layout == sync.layout(ROLLOUT)  # engines are chosen as in sync: by a batch's generation time
    # The pool's steady state: every token of an engine's share decoded at full concurrency, at the mean
    # in-flight context, instead of the bulk plus the last cohort draining to the longest response.
    shape = Shape(get_device("A100-80G"), (2,), hardware.inter_node_bandwidth, run=recipe,
                  constants=DEFAULT_CONSTANTS)
    engine = Engine(models["actor"], shape, layout.rollout_tp, 2)
    rows = workload.sequences(grpo)
    per_engine = math.ceil(rows / (2 // layout.rollout_tp))
    lengths = recipe.response_lengths(256)
    in_flight = min(per_engine, layout.rollout_batch_size or per_engine, recipe.max_num_seqs)
    steady = per_engine * lengths.mean / in_flight * engine.step_seconds(in_flight, 256 + lengths.mean_age())
    tail_bound = decode_seconds(engine, per_engine, in_flight, 256, lengths, rows)
    latency = seconds(sync, "actor_generate")  # the synchronous generation time of one batch on the pool
    streamed = latency - (tail_bound - steady)
    assert steady < tail_bound / 2  # this long tail is most of a synchronous rollout
    load = (models["actor"].params * 2 / hardware.inter_node_bandwidth + COLLECTIVE_LATENCY_S
            + models["actor"].weight_tensors * WEIGHT_TENSOR_S)  # the tensor-by-tensor loop
    assert seconds(plan, "actor_generate") == pytest.approx(streamed + load, rel=1e-9)
    assert dict(plan.extra)["batch_latency_s"] == pytest.approx(latency, rel=1e-9)
    trainer = (seconds(sync, "reference_ref_logprob") + seconds(sync, "actor_logprob")
               + seconds(sync, "actor_update"))
    step = max(streamed + load, trainer, (latency + trainer) / (max_staleness + 1))
    assert plan.step_time_s == pytest.approx(step, rel=1e-9)
    # Here the long tail, spread over k + 1 trainer steps, is what paces: k buys exactly that.
    assert (latency + trainer) / (max_staleness + 1) > max(streamed + load, trainer)
    check_plan(plan, graph=grpo, cluster=hardware)


SPLITS = st.sampled_from(["actor=0-5,reference=0-5,actor:rollout=6-7", "actor=0-3,reference=0-3,actor:rollout=4-7",
                          "actor=0-6,reference=0-6,actor:rollout=7", "actor=0-1,reference=2-3,actor:rollout=4-7"])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(SPLITS, st.sampled_from([8, 32, 128]), st.sampled_from([64, 256, 1024]), st.sampled_from([1, 4, 16]))
def test_async_is_never_slower_than_one_step_off_and_a_larger_k_never_slower(
        text: str, batch: int, mean: int, spread: int) -> None:
    graph = load_graph("grpo", reward_kind="reward_function")
    models, hardware = small_models(graph), Cluster.parse("8xA100-80G")
    workload, recipe = Workload(batch_size=batch, prompt_len=128, response_len=mean), long_tail(mean, mean * spread)
    mapping = parse_mapping(text)

    def step(pipeline: str, k: int | None = None) -> float:
        return evaluate_mapping(PlanRequest(graph, models, workload, hardware, settings=recipe, pipeline=pipeline,
                                            max_staleness=k), mapping).step_time_s

    one_step_off, by_k = step("one_step_off"), [step("async", k) for k in (1, 2, 3)]
    assert by_k[0] <= one_step_off * (1 + 1e-9)
    assert by_k[2] <= by_k[1] * (1 + 1e-9) and by_k[1] <= by_k[0] * (1 + 1e-9)
    assert step("async", 0) >= by_k[0] * (1 - 1e-9)  # k = 0: a batch's generation and training in turn


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.sampled_from([SMALL, "qwen2.5-7b"]), st.sampled_from([128, 512, 2048]), st.sampled_from([2, 4, 8]),
       st.sampled_from([1, 2]))
def test_streamed_pool_time_follows_the_mean_length_not_the_max(name: str, mean: int, spread: int,
                                                                 rollout_tp: int) -> None:
    graph = load_graph("grpo", reward_kind="reward_function")
    model = ModelSpec.preset(name)
    workload = Workload(batch_size=256, prompt_len=128, response_len=mean)
    models = {role: model for role in small_models(graph)}
    layout = evaluate_mapping(PlanRequest(graph, models, workload, Cluster.parse("4xA100-80G")), SPLIT,
                              rollout_tp={ROLLOUT: rollout_tp}).layout(ROLLOUT)
    load = node_loads(graph, workload)["actor_generate"]

    def pool(lengths: LengthDistribution) -> tuple[float, float]:
        shape = Shape(get_device("A100-80G"), (2,), run=RunSettings(lengths=lengths))
        return streamed_generate_seconds(model, load, 128, layout, shape)

    narrow = pool(LengthDistribution.point(mean))
    wide = pool(LengthDistribution.lognormal(mean=mean, max=mean * spread))
    assert wide[0] <= wide[1] and narrow[0] <= narrow[1] * (1 + 1e-9)
    # A cap `spread` times the mean stretches a synchronous batch by its tail; the streamed pool only by the
    # longer contexts of the sequences in flight (their length-biased mean age grows with the spread).
    assert wide[0] / narrow[0] < 1.5
    assert wide[1] / narrow[1] > wide[0] / narrow[0]
    if spread >= 4:
        assert wide[1] / narrow[1] > 1.25
    doubled = pool(LengthDistribution.lognormal(mean=2 * mean, max=2 * mean * spread))
    assert doubled[0] > 1.5 * wide[0]  # twice the tokens: nearly twice the time, or more (longer contexts)


def test_auto_picks_async_when_generation_dominates_with_a_long_tail(grpo: Graph) -> None:
    models, hardware, recipe = small_models(grpo), four_gpus(), long_tail(1024, 8192)
    workload = Workload(batch_size=64, prompt_len=256, response_len=1024)
    auto = plan_placement(PlanRequest(grpo, models, workload, hardware, settings=recipe, pipeline="auto"))
    one_step_off = plan_placement(PlanRequest(grpo, models, workload, hardware, settings=recipe,
                                              pipeline="one_step_off"))
    sync = plan_placement(PlanRequest(grpo, models, workload, hardware, settings=recipe))
    assert auto.pipeline == "async" and auto.detached_rollouts == {"actor": ROLLOUT}
    assert auto.step_time_s < 0.8 * one_step_off.step_time_s < 0.8 * sync.step_time_s
    why = dict(auto.extra)["pipeline_choice"]
    assert why.startswith(f"async k={auto.max_staleness} on ") and "streamed generation" in why
    assert "sync colocated" in why and "one_step_off split" in why
    fixed = plan_placement(PlanRequest(grpo, models, workload, hardware, settings=recipe, pipeline="async",
                                       max_staleness=1))
    assert (fixed.pipeline, fixed.max_staleness) == ("async", 1) and fixed.step_time_s >= auto.step_time_s
    assert Plan.from_json(auto.to_json()) == auto
    check_plan(auto, graph=grpo, cluster=hardware)


@pytest.mark.parametrize("spec", ["4xA100-80G", "2xA100-80G+3xL40S", "8xA100-80G"])
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_async_search_equals_brute_force(grpo: Graph, spec: str, max_staleness: int) -> None:
    models, recipe = small_models(grpo), long_tail(512, 8192)
    workload, hardware = Workload(batch_size=32, prompt_len=256, response_len=512), Cluster.parse(spec)
    problem = build_problem(grpo, models, workload, hardware, detach=("actor",), settings=recipe, pipeline="async",
                            max_staleness=max_staleness)
    plan = plan_placement(PlanRequest(grpo, models, workload, hardware, settings=recipe, pipeline="async",
                                      max_staleness=max_staleness))
    # The search's bounds use the makespan, which the batch-latency term can only raise: still exact.
    assert plan.step_time_s == pytest.approx(brute_force_step_time(problem), rel=1e-9)


def test_auto_keeps_sync_colocated_on_a_tiny_workload(grpo: Graph) -> None:
    models, hardware = small_models(grpo), four_gpus()
    tiny = Workload(batch_size=16, prompt_len=64, response_len=16)
    auto = plan_placement(PlanRequest(grpo, models, tiny, hardware, pipeline="auto"))
    assert (auto.pipeline, auto.max_staleness, auto.detached_rollouts) == ("sync", 0, {})
    assert auto.step_time_s == plan_placement(PlanRequest(grpo, models, tiny, hardware)).step_time_s
    assert "async k=1 split" in dict(auto.extra)["pipeline_choice"]


def test_bad_async_inputs_name_the_field(grpo: Graph) -> None:
    models, workload = small_models(grpo), Workload(batch_size=8, prompt_len=8, response_len=8)
    with pytest.raises(ValueError, match=r"PlanRequest.max_staleness=-1 must be an integer >= 0"):
        PlanRequest(grpo, models, workload, four_gpus(), pipeline="async", max_staleness=-1)
    with pytest.raises(ValueError, match=r"PlanRequest.max_staleness=2 with pipeline='one_step_off'"):
        PlanRequest(grpo, models, workload, four_gpus(), pipeline="one_step_off", max_staleness=2)
    with pytest.raises(ValueError, match=r"pipeline='async' needs the rollout of 'actor' on GPUs of its own"):
        evaluate_mapping(PlanRequest(grpo, models, workload, four_gpus(), pipeline="async"),
                         parse_mapping("actor=0-3,reference=0-3"))
    with pytest.raises(InfeasibleError, match=r"PlanRequest.pipeline='async' needs .* at least 2 GPUs"):
        plan_placement(PlanRequest(grpo, models, workload, Cluster.parse("1xA100-80G"), pipeline="async"))
    dapo = load_graph("dapo")  # its filter regenerates within the step
    with pytest.raises(ValueError, match=r"PlanRequest.pipeline='async': the dapo graph .* filter"):
        plan_placement(PlanRequest(dapo, small_models(dapo), workload, four_gpus(), pipeline="async"))


def test_cli_plan_pipeline_async_with_a_staleness(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--algorithm", "grpo", "--reward-kind", "reward_function", "--cluster", "4xA100-80G",
            "--model", SMALL, "--batch-size", "64", "--prompt-len", "256", "--response-len", "1024",
            "--max-response-len", "8192"]
    assert main([*args, "--pipeline", "async", "--max-staleness", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["pipeline"], data["max_staleness"]) == ("async", 2)
    assert data["extra"]["pipeline_choice"].startswith("async k=2 on ")
    assert main([*args, "--pipeline", "auto"]) == 0
    assert "execution mode: async k=" in capsys.readouterr().out
    assert main([*args, "--pipeline", "async", "--max-staleness", "-1"]) == 2
    assert "--max-staleness=-1 must be at least 0" in capsys.readouterr().err
