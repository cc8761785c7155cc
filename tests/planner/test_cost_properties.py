"""Hypothesis properties of the step-cost model: more GPUs never slower (exact regime), a longer tail never
faster, offload never uses more GPU memory."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hybridflow.graph import NodeLoad, Op, Workload, load_graph
from hybridflow.planner import DEVICES, Cluster, InfeasibleError, ModelSpec, RoleLayout, plan_placement
from hybridflow.planner.costs import Shape
from hybridflow.planner.groups import GroupEvaluator
from hybridflow.planner.lengths import LengthDistribution
from hybridflow.planner.problem import build_problem
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.rollout import generate_cost
from hybridflow.planner.settings import Offload, RunSettings
from hybridflow.testing.strategies import clusters

FAST = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
SLACK = 1 + 1e-9
MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama3.2-3b", "qwen2.5-7b", "qwen3-30b-a3b")


@st.composite
def run_settings(draw: st.DrawFn, mean: int) -> RunSettings:
    cap = draw(st.sampled_from([mean, 2 * mean, 8 * mean]))
    parts = draw(st.sampled_from([Offload(), Offload(params=True), Offload(params=True, grads=True, optimizer=True)]))
    return RunSettings(lengths=LengthDistribution.lognormal(mean=mean, max=cap),
                       mini_batch_size=draw(st.sampled_from([None, 16, 64])), epochs=draw(st.integers(1, 2)),
                       train_tokens_per_gpu=draw(st.sampled_from([None, 4096, 16384])),
                       offload={"actor": parts}, rollout_sleep=draw(st.booleans()),
                       gpu_memory_utilization=draw(st.sampled_from([None, 0.5])))


@FAST
@given(st.data(), st.sampled_from(["grpo", "ppo"]), st.sampled_from(MODELS[:3]), st.sampled_from([1, 2, 4]))
def test_more_gpus_never_slower_in_the_exact_regime(data, algorithm, model, extra):
    graph = load_graph(algorithm)
    cluster = data.draw(clusters(max_gpus=8))
    workload = Workload(batch_size=64, prompt_len=128, response_len=256)
    run = data.draw(run_settings(256))
    models = {role.name: ModelSpec.preset(model) for role in graph.roles if role.kind.needs_gpu}
    try:
        plan = plan_placement(PlanRequest(graph, models, workload, cluster, settings=run))
    except InfeasibleError:
        assume(False)
        raise
    parts = [(m.host, m.device, m.gpus) for m in cluster.machines]
    device = data.draw(st.sampled_from(list(cluster.device_names)))
    bigger = Cluster.of([*parts, (len(parts), device, extra)])
    assert bigger.num_gpus <= 16
    larger = plan_placement(PlanRequest(graph, models, workload, bigger, settings=run))
    assert larger.step_time_s <= plan.step_time_s * SLACK


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from(MODELS), st.sampled_from(["H100-80G", "H20", "A100-80G"]), st.sampled_from([1, 2, 4]),
       st.integers(64, 2048), st.floats(1.0, 6.0), st.floats(1.05, 4.0), st.sampled_from([8, 64, 512]),
       st.sampled_from([None, 0.6]))
def test_a_longer_tail_is_never_faster(model, device, rtp, mean, ratio, stretch, rows, util):
    spec = ModelSpec.preset(model)
    assume(spec.heads % rtp == 0)
    load = NodeLoad("g", Op.GENERATE, rows, rows * 128, rows * mean)
    layout = RoleLayout(role="actor", dp=8 // rtp, tp=rtp, rollout_tp=rtp)
    short = LengthDistribution.lognormal(mean=mean, max=mean * ratio)
    long = LengthDistribution.lognormal(mean=mean, max=mean * ratio * stretch)

    def seconds(lengths: LengthDistribution) -> float:
        shape = Shape(DEVICES[device], (8,), run=RunSettings(lengths=lengths, gpu_memory_utilization=util))
        return generate_cost(spec, load, 128, layout, shape).seconds

    assert seconds(long) >= seconds(short) / SLACK
    # The same responses with the longest one made longer: never faster either.
    lengths = sorted({float(x) for x in (mean / 2, mean, 2 * mean)})
    body = LengthDistribution.from_lengths(lengths)
    stretched = LengthDistribution.from_lengths([*lengths[:-1], lengths[-1] * stretch])
    assert seconds(stretched) >= seconds(body) / SLACK


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.sampled_from(MODELS), st.sampled_from(["grpo", "ppo"]), st.booleans(), st.booleans(), st.booleans(),
       st.sampled_from(["H100-80G", "A100-80G"]))
def test_offload_never_uses_more_gpu_memory(model, algorithm, params, grads, optimizer, device):
    graph = load_graph(algorithm)
    models = {role.name: ModelSpec.preset(model) for role in graph.roles if role.kind.needs_gpu}
    workload = Workload(batch_size=64, prompt_len=128, response_len=512)
    cluster = Cluster.parse(f"8x{device}")
    roles = tuple(sorted(models))
    offload = {role: Offload(params=params, grads=grads, optimizer=optimizer) for role in roles}

    def memory(run: RunSettings) -> int:
        evaluator = GroupEvaluator(build_problem(graph, models, workload, cluster, settings=run))
        layouts = tuple(RoleLayout(role=role, dp=8, micro_batch_size=4, rollout_tp=2) for role in roles)
        return evaluator.describe(layouts, evaluator.shape(device, [8])).memory_bytes

    assert memory(RunSettings(offload=offload)) <= memory(RunSettings())


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-8b", "qwen2.5-math-7b"])
def test_new_presets_plan_on_new_devices(preset):
    graph = load_graph("grpo", reward_kind="reward_function")
    models = {role.name: ModelSpec.preset(preset) for role in graph.roles if role.kind.needs_gpu}
    workload = Workload(batch_size=64, prompt_len=256, response_len=1024)
    cluster = Cluster.parse("8xB200")
    run = RunSettings(offload={"actor": Offload(params=True, grads=True, optimizer=True),
                               "reference": Offload(params=True)})
    plan = plan_placement(PlanRequest(graph, models, workload, cluster, settings=run))
    assert plan.feasible and plan.step_time_s > 0
