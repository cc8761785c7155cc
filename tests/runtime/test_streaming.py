"""Streaming within a step: generation hands its rows on in chunks, row-wise nodes start on finished chunks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from plans import split_plan

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import RoleKind, load_graph
from hybridflow.planner import ExecutionMode
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, default_plan
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.streaming import streamed_section
from hybridflow.train.metrics import step_metrics

BACKEND = f"{Path(__file__).with_name('minimal_backend.py')}:BACKEND"
TOKENIZER = char_tokenizer()
LOADER = PromptLoader(records=task_examples("reverse", 64), tokenizer=TOKENIZER, batch_size=6)
SCORER = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)


def test_the_streamed_section_is_the_row_wise_nodes_after_generate() -> None:
    generate, followers = streamed_section(load_graph("ppo"))  # type: ignore[misc]
    assert generate.name == "actor_generate"
    assert {node.op.value for node in followers} == {"score", "ref_logprob", "logprob", "values"}
    assert streamed_section(load_graph("dapo")) is None  # a filter regenerates: nothing to stream
    assert streamed_section(load_graph("remax")) is None  # two generate nodes


def test_streamed_greedy_steps_equal_unstreamed_ones(warm_model_dir: Path) -> None:
    graph = load_graph("grpo", n=2, max_new_tokens=10, top_k=1, reward_kind="reward_function")
    specs = {name: RoleSpec(name=name, kind=graph.role(name).kind, model=str(warm_model_dir),
                            optim=OptimSpec(lr=1e-30) if name == "actor" else None)  # weights stay put
             for name in ("actor", "reference")}

    def run(chunks: int) -> list:  # type: ignore[type-arg]
        with Controller(graph, default_plan(graph), specs=specs, driver_roles={"reward": SCORER},
                        mode=ExecutionMode(stream_chunks=chunks)) as controller:
            return [controller.step(LOADER.batch(s), step=s) for s in range(2)]

    whole, streamed = run(1), run(3)
    for a, b in zip(whole, streamed, strict=True):
        assert torch.equal(a.batch["responses"], b.batch["responses"])
        assert torch.equal(a.batch["response_mask"], b.batch["response_mask"])
        mask = a.batch["response_mask"].bool()
        for name in ("old_logprobs", "ref_logprobs", "advantages"):  # padding positions hold anything
            assert torch.allclose(a.batch[name][mask], b.batch[name][mask], atol=1e-5), name
        assert torch.equal(a.batch["scores"], b.batch["scores"])
        assert abs(a.metrics["actor/loss"] - b.metrics["actor/loss"]) < 1e-5
        assert set(a.node_seconds) == set(b.node_seconds)


def test_scoring_starts_while_later_chunks_still_generate() -> None:
    """A slow rollout (0.3 s per generate call) in 2 chunks: the reward function scores the first chunk
    before the second has been generated, instead of after the whole batch."""
    graph = load_graph("grpo_no_ref", n=2, max_new_tokens=4, reward_kind="reward_function")
    calls: list[float] = []

    class Timed:
        def __call__(self, batch: Batch) -> Batch:
            calls.append(time.perf_counter())
            return SCORER(batch)

    plan = split_plan()
    specs = {"actor": RoleSpec(name="actor", kind=RoleKind.POLICY, model="unused", backend=BACKEND,
                               optim=OptimSpec(lr=1.0), options={"vocab_size": len(TOKENIZER),
                                                                 "generate_delay_s": 0.3})}
    with Controller(graph, plan, specs=specs, driver_roles={"reward": Timed()},
                    mode=ExecutionMode(stream_chunks=2)) as controller:
        result = controller.step(LOADER.batch(0), step=0)
        ended = time.perf_counter()
    assert len(calls) == 2 and len(result.batch) == 12
    assert ended - calls[0] > 0.25  # the first chunk was scored while the second still generated
    # The step's timeline says the same: the scorer's span opens inside the generation's, and the generation
    # runs its two calls back to back while the scorer's two calls leave a chunk's decode between them.
    generate, score = result.node_spans["actor_generate"], result.node_spans["reward_score"]
    assert 0 <= generate[0] < score[0] < generate[1] - 0.2 < score[1]
    assert result.node_seconds["actor_generate"] > 0.9 * (generate[1] - generate[0])
    assert result.node_seconds["reward_score"] < 0.5 * (score[1] - score[0])
    metrics = step_metrics(result, ended - calls[0])
    assert metrics["timeline/reward_score/start_s"] == score[0] and metrics["timeline/actor_update/end_s"] > score[1]


def test_streaming_is_refused_where_it_cannot_apply() -> None:
    specs = {"actor": RoleSpec(name="actor", kind=RoleKind.POLICY, model="unused", backend=BACKEND,
                               options={"vocab_size": len(TOKENIZER)})}
    graph = load_graph("grpo_no_ref", n=2, max_new_tokens=4, reward_kind="reward_function")
    with pytest.raises(ValueError, match="stream_chunks=0 must be >= 1"):
        Controller(graph, default_plan(graph), specs=specs, driver_roles={"reward": SCORER},
                   mode=ExecutionMode(stream_chunks=0))
    split = split_plan()
    with pytest.raises(ValueError, match="streams within a sync step"):
        Controller(graph, split, specs=specs, driver_roles={"reward": SCORER},
                   mode=ExecutionMode(stream_chunks=2, pipeline="one_step_off"))

