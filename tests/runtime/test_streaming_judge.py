"""A streamed step with an LLM judge: the judge's chain (``judge_prompts`` -> the judge's generate -> ``judge``)
runs chunk by chunk on the judge's group while the policy's next chunk still decodes, and gives the scores an
unstreamed step gives (greedy sampling)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from plans import one_gpu_group

from hybridflow.data import PromptLoader, char_tokenizer, task_examples
from hybridflow.graph import GraphBuilder, RoleKind, load_graph
from hybridflow.models import build_tiny_causal_lm, save_model_dir
from hybridflow.models.tokenizer import WIDE_ALPHABET
from hybridflow.planner import ExecutionMode, Plan
from hybridflow.registry import COMPUTE_FNS
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, default_plan
from hybridflow.runtime.scheduler import combined
from hybridflow.runtime.streaming import streamed_section

TOKENIZER = char_tokenizer()
LOADER = PromptLoader(records=task_examples("reverse", 64), tokenizer=TOKENIZER, batch_size=6)
JUDGE_CHAIN = ("judge_prompts", "judge_generate", "judge")


def test_the_judges_chain_follows_the_policys_generate_chunk_by_chunk() -> None:
    generate, followers = streamed_section(load_graph("grpo_judge"))  # type: ignore[misc]
    assert generate.name == "actor_generate"
    assert [node.name for node in followers] == [*JUDGE_CHAIN, "reference_ref_logprob", "actor_logprob"]


def test_a_generate_that_samples_from_computed_prompts_is_no_follower() -> None:
    """The rule is the graph's shape, not a role's name: a second generate on a trainable policy (it samples
    more than one answer per row, or learns) leaves nothing to stream."""
    g = GraphBuilder("policy_refines")
    actor = g.role("actor", RoleKind.POLICY)
    g.generate(actor, n=2, loss_mask=True)
    g.compute("again", fn="judge_prompts", inputs=("prompts", "responses", "response_mask", "ground_truth"),
              outputs=("again", "again_mask"), template="pointwise", policy="actor", judge="actor")
    g.generate(actor, name="refine", inputs=("again",), outputs=("refined", "refined_mask"), greedy=True)
    g.compute("score", fn="judge_scores", inputs=("refined", "refined_mask"), outputs=("scores", "verdicts"),
              template="pointwise", policy="actor", judge="actor")
    g.logprob(actor)
    g.compute("advantages", fn="grpo_advantages", inputs=("scores", "loss_mask", "uid"), outputs=("advantages",))
    g.update(actor, loss="ppo_policy", inputs=("prompts", "responses", "response_mask", "loss_mask", "old_logprobs",
                                               "advantages"))
    graph = g.build()
    assert graph.stream_generate is None and graph.streamed_followers == ()


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wide = char_tokenizer(WIDE_ALPHABET)
    return save_model_dir(build_tiny_causal_lm("tiny-qwen2", vocab_size=len(wide), seed=3), wide,
                          tmp_path_factory.mktemp("judge"))


def _counted(monkeypatch: pytest.MonkeyPatch, name: str, calls: list[tuple[str, int]]) -> None:
    fn = COMPUTE_FNS.get(name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append((name, len(args[0])))
        return fn(*args, **kwargs)

    for attribute in ("make_state", "reads_role_models"):
        if hasattr(fn, attribute):
            setattr(counting, attribute, getattr(fn, attribute))
    monkeypatch.setitem(COMPUTE_FNS._items, name, counting)


def _judge_apart(plan: Plan) -> Plan:
    """``plan``'s one group less the judge, and the judge on a GPU of its own."""
    (group,) = plan.groups
    rest = replace(group, roles=tuple(role for role in group.roles if role != "judge"),
                   layouts=tuple(layout for layout in group.layouts if layout.role != "judge"))
    return replace(plan, groups=(rest, one_gpu_group(1, "judge")))


@pytest.mark.parametrize("apart", [False, True], ids=["judge-with-the-actor", "judge-on-its-own-group"])
def test_a_streamed_judge_scores_what_an_unstreamed_one_does(warm_model_dir: Path, judge_dir: Path, apart: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    graph = load_graph("grpo_judge", n=2, max_new_tokens=8, top_k=1, judge_max_new_tokens=6)
    models = {"actor": warm_model_dir, "reference": warm_model_dir, "judge": judge_dir}
    specs = {name: RoleSpec(name=name, kind=graph.role(name).kind, model=str(model),
                            optim=OptimSpec(lr=1e-30) if name == "actor" else None)  # weights stay put
             for name, model in models.items()}
    plan = _judge_apart(default_plan(graph)) if apart else default_plan(graph)
    calls: list[tuple[str, int]] = []
    for name in ("judge_prompts", "judge_scores"):
        _counted(monkeypatch, name, calls)

    def run(chunks: int) -> list[Any]:
        with Controller(graph, plan, specs=specs, mode=ExecutionMode(stream_chunks=chunks)) as controller:
            return [controller.step(LOADER.batch(0), step=0)]

    (whole,) = run(1)
    assert sorted(calls) == [("judge_prompts", 12), ("judge_scores", 12)]
    calls.clear()
    (streamed,) = run(3)
    assert sorted(calls) == [("judge_prompts", 4)] * 3 + [("judge_scores", 4)] * 3  # each chunk's 2 prompts x 2

    def same(ids: str, mask: str) -> bool:  # the tokens each mask keeps (padding positions hold anything)
        return torch.equal(whole.batch[ids][whole.batch[mask].bool()],
                           streamed.batch[ids][streamed.batch[mask].bool()])

    assert same("responses", "response_mask")
    assert same("judge_prompts", "judge_prompts_mask") and same("verdict_ids", "verdict_mask")
    assert whole.batch["judge_prompts"].shape == streamed.batch["judge_prompts"].shape
    assert bool(streamed.batch["judge_prompts_mask"][:, -1].all())  # joined left-padded: each row ends at the end
    assert torch.equal(whole.batch["scores"], streamed.batch["scores"])
    assert list(whole.batch.non_tensors["verdicts"]) == list(streamed.batch.non_tensors["verdicts"])
    for name in ("judge/unparsed", "judge/unparsed_frac", "judge_prompts/truncated"):  # the step's, not a chunk's
        assert streamed.metrics[name] == pytest.approx(whole.metrics[name]), name
    assert whole.metrics["judge/unparsed"] == 12 * whole.metrics["judge/unparsed_frac"]
    mask = whole.batch["response_mask"].bool()
    assert torch.allclose(whole.batch["advantages"][mask], streamed.batch["advantages"][mask], atol=1e-5)


def test_a_nodes_reports_over_a_step_add_up_its_counts_and_weigh_its_means_by_rows() -> None:
    reports = [(4, {"unparsed": 1.0, "unparsed_frac": 0.25}), (2, {"unparsed": 2.0, "unparsed_frac": 1.0})]
    assert combined(reports, {"unparsed"}) == {"unparsed": 3.0, "unparsed_frac": pytest.approx(0.5)}
    assert combined(reports[:1], {"unparsed"}) == reports[0][1]
    assert combined([(0, {"a": 1.0}), (0, {"a": 3.0, "b": 1.0})], ()) == {"a": 2.0, "b": 1.0}
