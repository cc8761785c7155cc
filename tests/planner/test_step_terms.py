"""The terms that replaced the fitted per-step constant, vLLM's KV sizing with preemption, verl's overlay and the
record fields published runs now read: each against a hand computation (torch-free, fast)."""

from __future__ import annotations

import pytest

from hybridflow.graph import NodeLoad, Op, Workload, load_graph
from hybridflow.planner import ModelSpec, RoleLayout
from hybridflow.planner.calibration import Calibration, Constants
from hybridflow.planner.cluster import Cluster
from hybridflow.planner.costs import USABLE_MEMORY, Shape, shard_ranks
from hybridflow.planner.devices import GB, GIB, TFLOPS, DeviceSpec
from hybridflow.planner.lengths import LengthDistribution
from hybridflow.planner.manual import evaluate_mapping
from hybridflow.planner.overlays import ControllerOverlay
from hybridflow.planner.problem import build_problem
from hybridflow.planner.published import _eager, _vllm_v0, case_from_record
from hybridflow.planner.request import PlanRequest
from hybridflow.planner.rollout import (
    HOST_ZERO_BYTES_S,
    KV_BLOCK_TOKENS,
    V0_SERIAL_STEP_CPU_S,
    V0_SWAP_SPACE_BYTES,
    Engine,
    cache_rebuild_seconds,
    concurrency,
    decode_seconds,
    generate_cost,
    kv_blocks,
    preempted_seconds,
)
from hybridflow.planner.schedule import compile_schedule
from hybridflow.planner.settings import Framework, RunSettings
from hybridflow.planner.step_terms import (
    CHECKPOINT_BYTES_PER_PARAM,
    CHECKPOINT_WRITE_BYTES_S,
    DETOKENIZE_TOKEN_S,
    RULE_SCORE_S,
    reward_seconds,
)

ROUND = DeviceSpec(name="ROUND", memory_bytes=100 * GIB, hbm_bandwidth=1000 * GB, flops=(("bf16", 100 * TFLOPS),),
                   link="NVLink", link_bandwidth=100 * GB, host_bandwidth=10 * GB)
PLAIN = Constants(train_mfu=0.5, eff_half_tokens=1000, hbm_efficiency=0.5, decode_mfu=0.5, prefill_mfu=0.5,
                  host_efficiency=0.5, decode_step_overhead_s=0.0, phase_overhead_s=0.0)
MODEL = ModelSpec(name="round", params=1_000_000_000, layers=10, hidden=1000, heads=10, kv_heads=10, vocab=1000)
KV_TOKEN = 2 * MODEL.layers * MODEL.kv_heads * MODEL.head_dim * 2  # K and V, every layer, bf16
PROMPT = 100


def engine(run: RunSettings) -> Engine:
    return Engine(MODEL, Shape(ROUND, (1,), 25e9, run=run, constants=PLAIN), 1, 2)


def test_a_rule_reward_detokenises_and_scores_every_sample_in_its_workers():
    assert reward_seconds(1000, 500, 1) == pytest.approx(1000 * (RULE_SCORE_S + 500 * DETOKENIZE_TOKEN_S))
    assert reward_seconds(1000, 500, 4) == pytest.approx(reward_seconds(1000, 500, 1) / 4)


def test_the_reward_node_on_the_driver_is_costed_per_sample():
    graph, cluster = load_graph("grpo_no_ref", reward_kind="reward_function"), Cluster.parse("1x8xA100-80G")
    workload = Workload(batch_size=64, prompt_len=PROMPT, response_len=400, n_samples=4)
    problem = build_problem(graph, {"actor": ModelSpec.preset("qwen2.5-7b")}, workload, cluster,
                            settings=RunSettings(reward_workers=2))
    schedule = compile_schedule(problem, {"actor": 0})
    seconds = dict(zip(schedule.nodes, schedule.driver_seconds, strict=True))
    assert seconds["reward_score"] == pytest.approx(256 * (RULE_SCORE_S + 500 * DETOKENIZE_TOKEN_S) / 2)
    assert seconds["advantages"] == pytest.approx(256 * 1e-6)  # a vector op over the rows


def test_vllm_sizes_its_cache_from_its_own_share_in_blocks():
    run = RunSettings(gpu_memory_utilization=0.3, max_num_seqs=100_000)
    blocks = int((0.3 * 100 * GIB - 2 * MODEL.params) // (KV_BLOCK_TOKENS * KV_TOKEN))
    assert kv_blocks(engine(run)) == blocks
    lengths = LengthDistribution.point(900)
    fits = int(blocks * KV_BLOCK_TOKENS / (PROMPT + 450))  # admitted at the mean context in flight, not at 1,000
    assert concurrency(engine(run), 100_000, 100_000, PROMPT, lengths) == fits
    # Trainer shards resident on the GPU do not shrink vLLM's share (vLLM refuses to start instead)...
    assert concurrency(engine(run), 100_000, 100_000, PROMPT, lengths, resident=20 * GIB) == fits
    # ...the generate phase's memory does: resident + share <= the whole device passes the usable-memory check.
    load = NodeLoad("g", Op.GENERATE, 64, 64 * PROMPT, 64 * 900)
    cost = generate_cost(MODEL, load, PROMPT, RoleLayout(role="actor", dp=1), engine(run).shape, 20 * GIB)
    assert cost.transient_bytes == int(0.3 * 100 * GIB - (1 - USABLE_MEMORY) * 100 * GIB)


def test_a_drain_that_outgrows_the_cache_preempts_and_recomputes():
    lengths = LengthDistribution.point(900)
    roomy = engine(RunSettings(gpu_memory_utilization=0.9))
    # A share that holds ~40 sequences at the drain's mid context (550 tokens): 64 in flight overflow it.
    tight_util = (2 * MODEL.params + 40 * 550 * KV_TOKEN) / (100 * GIB)
    tight = engine(RunSettings(gpu_memory_utilization=tight_util))
    cache = kv_blocks(tight) * KV_BLOCK_TOKENS
    fits = cache / 550
    assert 39 < fits < 41
    by_hand = 900 * 64 / fits * tight.step_seconds(fits, 550) + preempted_seconds(tight, (64 - fits) * PROMPT)
    assert decode_seconds(tight, 64, 64, PROMPT, lengths, 64) == pytest.approx(by_hand, rel=1e-9)
    assert decode_seconds(roomy, 64, 64, PROMPT, lengths, 64) == pytest.approx(900 * roomy.step_seconds(64, 550))
    layer_weights = MODEL.params - 2 * MODEL.vocab * MODEL.hidden  # a prefill: no embedding matmul, no head
    assert preempted_seconds(tight, 1000) == pytest.approx(2 * layer_weights * 1000 / (100e12 * 0.5))


def test_validation_and_checkpoints_are_amortised_over_the_steps_that_hold_them():
    graph, cluster = load_graph("grpo_no_ref", reward_kind="reward_function"), Cluster.parse("2x8xA100-80G")
    models = {"actor": ModelSpec.preset("qwen2.5-7b")}
    workload = Workload(batch_size=64, prompt_len=PROMPT, response_len=400, n_samples=4)
    mapping = {"actor": tuple(range(16))}
    plain = RunSettings(rollout_sleep=True)
    base = evaluate_mapping(PlanRequest(graph, models, workload, cluster, settings=plain), mapping)
    checked = RunSettings(rollout_sleep=True, validations_per_step=0.1, validation_prompts=30, validation_samples=2)
    validated = evaluate_mapping(PlanRequest(graph, models, workload, cluster, settings=checked), mapping)
    saving = evaluate_mapping(PlanRequest(graph, models, workload, cluster,
                                          settings=RunSettings(rollout_sleep=True, checkpoints_per_step=0.05)), mapping)
    written = models["actor"].params * CHECKPOINT_BYTES_PER_PARAM / (2 * CHECKPOINT_WRITE_BYTES_S)  # two machines
    assert saving.step_time_s - base.step_time_s == pytest.approx(0.05 * written, rel=1e-9)
    assert dict(saving.extra)["step_terms_s"] == pytest.approx(0.05 * written, rel=1e-9)
    extra = validated.step_time_s - base.step_time_s
    generate = next(node.seconds for node in base.nodes if node.node == "actor_generate")
    # One validation holds a rollout of 60 rows (woken, refreshed; shorter than the step's 256) and their rewards.
    assert 0.1 * reward_seconds(60, PROMPT + 400, 1) < extra < 0.1 * generate + 0.1 * reward_seconds(60, 500, 1)


def test_verls_overlay_runs_its_reward_between_the_calls_not_beside_them():
    graph, cluster = load_graph("grpo_no_ref", reward_kind="reward_function"), Cluster.parse("1x8xA100-80G")
    models = {"actor": ModelSpec.preset("qwen2.5-7b")}
    workload = Workload(batch_size=512, prompt_len=PROMPT, response_len=2000, n_samples=8)
    mapping = {"actor": tuple(range(8))}
    hybridflow = evaluate_mapping(PlanRequest(graph, models, workload, cluster), mapping)
    overlay = ControllerOverlay(serial_driver=True)
    verl = evaluate_mapping(PlanRequest(graph, models, workload, cluster, overlay=overlay), mapping)
    starts = {"hf": {node.node: node for node in hybridflow.nodes}, "verl": {node.node: node for node in verl.nodes}}
    reward = starts["hf"]["reward_score"].seconds
    assert reward > 1.0  # 4,096 samples of 2,100 tokens
    assert starts["hf"]["actor_logprob"].start_s < starts["hf"]["reward_score"].end_s - 0.9 * reward  # overlapped
    assert starts["verl"]["actor_logprob"].start_s == pytest.approx(starts["verl"]["reward_score"].end_s)
    assert verl.step_time_s > hybridflow.step_time_s + 0.9 * reward


RECORD = {"id": "r", "framework": "verl", "framework_version": "0.4.1", "model": "Qwen2.5-7B", "params_b": 7,
          "gpus": {"type": "NVIDIA H100", "count": 16, "nodes": 2, "gpus_per_node": 8}, "batch_prompts": 64, "n": 4,
          "response_len_max": 1024, "response_len_mean": 400, "train_backend": "Megatron",
          "train_parallelism": {"tp": 2, "pp": 4}, "timings_s": {"step": 100.0}}


def test_a_record_s_pipeline_stages_split_the_data_parallel_ranks_and_its_padding_is_read():
    case = case_from_record(RECORD)
    assert case.layout["data_parallel_size"] == 8 and case.layout["pipeline_parallel"] == 4  # GPUs / tp, pp splits
    layout = RoleLayout(role="actor", dp=8, tp=2, pp=4)
    assert shard_ranks(layout, Shape(ROUND, (8, 8))) == 2  # a stage's weights shard over 16 / (tp x pp) ranks
    assert not case.settings.padding
    assert case_from_record({**RECORD, "use_remove_padding": False}).settings.padding
    assert case_from_record({**RECORD, "micro_batch": {"use_remove_padding": False}}).settings.padding
    with pytest.raises(ValueError, match=r"16 GPUs do not split into tp=2 x pp=3"):
        case_from_record({**RECORD, "train_parallelism": {"tp": 2, "pp": 3}})
    with pytest.raises(ValueError, match=r"use_remove_padding='no' must be true or false"):
        case_from_record({**RECORD, "use_remove_padding": "no"})


def test_verl_records_carry_the_overlay_and_verls_eager_default_by_version():
    case = case_from_record(RECORD)
    assert case.overlay == ControllerOverlay()
    assert case_from_record({**RECORD, "framework": "OpenRLHF"}).overlay is None
    assert _eager(RECORD) and not _eager({**RECORD, "framework_version": "0.6.0"})
    assert not _eager({**RECORD, "rollout_engine": "vLLM (enforce_eager False)"})
    assert _eager({**RECORD, "framework_version": "0.7", "rollout_engine": "vLLM (enforce_eager=True)"})
    assert case.settings.enforce_eager
    plan = case.plan(Calibration.load("verl-published"))
    assert plan.step_time_s > 0


def test_verls_vendored_v0_engine_steps_serially_when_eager_and_rebuilds_its_cache_each_rollout():
    """vLLM's V0 engine under enforce_eager has no async output processing: its per-step CPU work adds to every
    decode step. Freed after each rollout, its cache engine zeroes the CPU swap space and the KV cache again. A
    record says which engine through its vLLM release (verl vendors those before 0.7)."""
    v0 = RunSettings(framework=Framework(vllm_v0_engine=True), enforce_eager=True, gpu_memory_utilization=0.5)
    eager = RunSettings(enforce_eager=True, gpu_memory_utilization=0.5)
    assert engine(v0).step_seconds(8, 500) - engine(eager).step_seconds(8, 500) == pytest.approx(V0_SERIAL_STEP_CPU_S)
    # CUDA graphs: async output hides it
    graphs = RunSettings(framework=Framework(vllm_v0_engine=True), gpu_memory_utilization=0.5)
    assert engine(graphs).step_seconds(8, 500) == engine(RunSettings()).step_seconds(8, 500)
    asleep = RunSettings(framework=Framework(vllm_v0_engine=True), rollout_sleep=True, gpu_memory_utilization=0.5)
    kv_bytes = kv_blocks(engine(asleep)) * KV_BLOCK_TOKENS * KV_TOKEN
    assert cache_rebuild_seconds(engine(asleep)) == pytest.approx(
        V0_SWAP_SPACE_BYTES / HOST_ZERO_BYTES_S + kv_bytes / (1000e9 * 0.5))
    assert cache_rebuild_seconds(engine(RunSettings(rollout_sleep=True, gpu_memory_utilization=0.5))) == 0.0
    old = {**RECORD, "framework_version": "v0.3.0.post0", "rollout_engine": "vLLM (0.6.3-era)"}
    assert _vllm_v0(old) and case_from_record(old).settings.framework.vllm_v0_engine
    assert not _vllm_v0({**old, "rollout_engine": "vLLM 0.8.5"})  # vLLM's own engine and sleep mode
    assert not _vllm_v0({**old, "framework": "OpenRLHF"})
    # A memory fraction is no release: the DeepSeek-V3 record's note gives 0.6 as gpu_memory_utilization.
    assert not _vllm_v0({**old, "rollout_engine": "vLLM (enforce_eager=True, gpu_memory_utilization 0.6)"})


def test_run_settings_refuse_rates_outside_a_step():
    with pytest.raises(ValueError, match=r"validations_per_step=2 must be a rate in \[0, 1\]"):
        RunSettings(validations_per_step=2)
    with pytest.raises(ValueError, match=r"reward_workers=0 must be a positive integer"):
        RunSettings(reward_workers=0)


def test_budget_micro_batches_follow_the_runtimes_greedy_cut():
    import random

    from hybridflow.graph import NodeLoad as Load
    from hybridflow.planner.costs import budget_micro_batches
    from hybridflow.runtime.balancing import token_micro_batches

    lengths = LengthDistribution.lognormal(mean=300, max=2000)
    draw = random.Random(0)
    sizes, weights = zip(*lengths.points, strict=True)
    rows = [PROMPT + round(size) for size in draw.choices(sizes, weights, k=4096)]
    load = Load("n", Op.LOGPROB, 4096, 4096 * PROMPT, 4096 * 300)
    shape = Shape(ROUND, (1,), run=RunSettings(lengths=lengths), constants=PLAIN)
    for budget in (1024, 2048, 8192):
        runtime = len(token_micro_batches(rows, budget))
        planned = budget_micro_batches(load, shape, len(rows), sum(rows), budget)
        assert abs(planned - runtime) <= 0.1 * runtime, (budget, planned, runtime)
        assert planned > sum(rows) / budget  # the greedy cut never fills every budget
    padded = Shape(ROUND, (1,), run=RunSettings(lengths=lengths, padding=True), constants=PLAIN)
    assert budget_micro_batches(load, padded, 4096, 4096 * 2100, 8192) == -(-4096 // 3)  # 3 rows of 2,100 a batch
    assert len(token_micro_batches([PROMPT + 2000] * 4096, 8192)) == budget_micro_batches(load, padded, 4096, 0, 8192)


def test_cpu_attention_is_per_sequence_when_packed_and_the_whole_masked_square_when_padded():
    from hybridflow.planner.costs import attention_tokens, packed_sequence_tokens

    lengths = LengthDistribution.from_lengths([100, 300, 800])
    load = NodeLoad("n", Op.LOGPROB, 64, 64 * PROMPT, 64 * 400)
    cpu = DeviceSpec(name="C", memory_bytes=16 * GIB, hbm_bandwidth=35 * GB, flops=(("fp32", TFLOPS),), link="host",
                     link_bandwidth=GB, varlen_attention=False)
    run, padded = RunSettings(lengths=lengths), RunSettings(lengths=lengths, padding=True)
    assert attention_tokens(load, Shape(ROUND, (1,), run=run)) == packed_sequence_tokens(load, Shape(ROUND, (1,),
                                                                                                      run=run))
    # backends/common/varlen.py: causal sdpa per packed sequence, as flash-attention varlen on a GPU
    assert attention_tokens(load, Shape(cpu, (1,), run=run)) == packed_sequence_tokens(load, Shape(cpu, (1,), run=run))
    assert attention_tokens(load, Shape(cpu, (1,), run=padded)) == 2 * (PROMPT + 800)
