"""A streamed step goes through the step ledger: the whole-batch nodes after the chunks (the update) do not
receive again the fields their ranks got or produced chunk by chunk, and the numbers stay those of an
unstreamed step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plans import split_plan

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import Graph, RoleKind, load_graph
from hybridflow.planner import ExecutionMode, Plan
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, StepResult, default_plan

BACKEND = f"{Path(__file__).with_name('minimal_backend.py')}:BACKEND"
TOKENIZER = char_tokenizer()
LOADER = PromptLoader(records=task_examples("reverse", 64), tokenizer=TOKENIZER, batch_size=6)
SCORER = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)


def _steps(graph: Graph, plan: Plan, specs: dict[str, RoleSpec], chunks: int, steps: int = 2) -> list[StepResult]:
    with Controller(graph, plan, specs=specs, driver_roles={"reward": SCORER},
                    mode=ExecutionMode(stream_chunks=chunks)) as controller:
        return [controller.step(LOADER.batch(s), step=s) for s in range(steps)]


def _shipped(result: StepResult) -> dict[str, float]:
    return {key: value for key, value in result.metrics.items() if key.startswith("transfer/")}


def test_a_streamed_step_ships_what_an_unstreamed_one_does_to_a_split_trainer() -> None:
    """The bigram policy samples every token of its budget, so both steps have rows of one width: the trainer
    group receives the prompts and responses once (for its log-probs), not again for its update."""
    graph = load_graph("grpo_no_ref", n=2, max_new_tokens=4, reward_kind="reward_function")
    specs = {"actor": RoleSpec(name="actor", kind=RoleKind.POLICY, model="unused", backend=BACKEND,
                               optim=OptimSpec(lr=1.0), options={"vocab_size": len(TOKENIZER)})}
    whole, streamed = _steps(graph, split_plan(), specs, 1), _steps(graph, split_plan(), specs, 3)
    for a, b in zip(whole, streamed, strict=True):
        assert _shipped(b) == _shipped(a) and _shipped(a)["transfer/to_group0_bytes"] > 0


@pytest.mark.parametrize("gpus", [1, 2])
def test_ranks_rebuild_the_joined_padded_fields_exactly(warm_model_dir: Path, gpus: int) -> None:
    """Greedy responses of different lengths: chunks are narrower than the batch, so the joined fields are
    right-padded. One data-parallel shard rebuilds them from its chunk copies, exactly the joined rows (nothing
    shipped twice); two shards hold other rows than the joined batch's and receive them. Either way the
    update sees the unstreamed step's rows."""
    graph = load_graph("grpo", n=2, max_new_tokens=10, top_k=1, reward_kind="reward_function")
    specs = {name: RoleSpec(name=name, kind=graph.role(name).kind, model=str(warm_model_dir),
                            optim=OptimSpec(lr=1e-30) if name == "actor" else None)  # weights stay put
             for name in ("actor", "reference")}
    plan = default_plan(graph, num_gpus=gpus)
    (whole,) = _steps(graph, plan, specs, 1, steps=1)
    with Controller(graph, plan, specs=specs, driver_roles={"reward": SCORER},
                    mode=ExecutionMode(stream_chunks=3)) as controller:
        streamed = controller.step(LOADER.batch(0), step=0)
        kept = controller.executor.groups[0].workers[0].store._fields  # type: ignore[attr-defined]
    lengths = {int(row.sum()) for row in whole.batch["response_mask"]}
    assert len(lengths) > 1  # responses of several lengths: the chunks were padded to join
    assert torch.equal(whole.batch["responses"], streamed.batch["responses"])
    assert abs(whole.metrics["actor/loss"] - streamed.metrics["actor/loss"]) < 1e-5
    if gpus == 1:
        assert _shipped(streamed) == _shipped(whole)
        rebuilt = [name for dp, part, name in kept if part is None and dp == 1]
        assert {"responses", "response_mask", "old_logprobs", "ref_logprobs"} <= set(rebuilt)
        for name in rebuilt:
            assert torch.equal(kept[1, None, name], streamed.batch[name]), name
    else:
        assert _shipped(streamed)["transfer/to_group0_bytes"] > _shipped(whole)["transfer/to_group0_bytes"]
