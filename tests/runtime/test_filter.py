"""A graph's filter step: validation, the bounded "generate more" loop the controller runs, DAPO end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import networkx as nx
import pytest
import torch

from hybridflow.data import char_tokenizer
from hybridflow.graph import GraphBuilder, NodeSpecError, RoleKind, load_graph
from hybridflow.runtime import Batch, Controller, OptimSpec, RoleSpec, default_plan

BACKEND = f"{Path(__file__).with_name('minimal_backend.py')}:BACKEND"
TOKENIZER = char_tokenizer()
N = 4


def _prompts(count: int, start: int) -> Batch:
    """Prompt rows; prompt k's ground truth says whether its group's rewards can differ ("flat" ones cannot)."""
    prompts = torch.randint(4, len(TOKENIZER), (count, 3), generator=torch.Generator().manual_seed(start))
    truths = ["flat" if (start + k) % 2 == 0 else "signal" for k in range(count)]
    return Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)}, {"ground_truth": truths})


def _scorer(batch: Batch) -> Batch:
    """Flat prompts score 0.5 whatever the response; the others score a (nearly always varying) response hash."""
    responses = batch["responses"].float()
    varying = (responses * torch.arange(1, responses.shape[1] + 1)).sum(dim=1) % 7 / 7
    flat = torch.tensor([truth == "flat" for truth in batch["ground_truth"]])
    return Batch({"scores": torch.where(flat, torch.full_like(varying, 0.5), varying)})


def _controller(max_rounds: int) -> Controller:
    graph = load_graph("dapo", n=N, max_new_tokens=4, max_rounds=max_rounds, reward_kind="reward_function")
    specs = {"actor": RoleSpec(name="actor", kind=RoleKind.POLICY, model="unused", backend=BACKEND,
                               optim=OptimSpec(lr=0.1), options={"vocab_size": len(TOKENIZER)})}
    return Controller(graph, default_plan(graph), specs=specs, driver_roles={"reward": _scorer})


def _groups(result: Any) -> dict[int, int]:
    uids, counts = result.batch["uid"].unique(return_counts=True)
    return dict(zip(uids.tolist(), counts.tolist(), strict=True))


def test_extra_rounds_refill_the_batch_with_groups_that_carry_signal() -> None:
    with _controller(max_rounds=3) as controller:
        result = controller.step(_prompts(4, 0), step=0, more=lambda r: _prompts(4, 100 + 10 * r))
    groups = _groups(result)
    assert len(groups) == 4 and set(groups.values()) == {N}  # the batch is full: 4 whole groups, none split
    assert all(truth == "signal" for truth in result.batch["ground_truth"])  # every flat group was dropped
    metrics = result.metrics
    assert metrics["filter/rounds"] >= 2 and metrics["filter/filled_groups"] == 0
    assert metrics["filter/kept_groups"] >= 4 and 0 < metrics["filter/kept_fraction"] < 1
    assert "actor/loss" in metrics and result.node_seconds["dynamic_sampling"] >= 0


def test_when_rounds_run_out_dropped_groups_fill_the_batch() -> None:
    with _controller(max_rounds=0) as controller:
        result = controller.step(_prompts(4, 0), step=0, more=lambda r: _prompts(4, 100))
    groups = _groups(result)
    assert len(groups) == 4 and set(groups.values()) == {N}
    assert result.metrics["filter/rounds"] == 1 and result.metrics["filter/filled_groups"] == 2
    flat = [truth == "flat" for truth in result.batch["ground_truth"]]
    assert sum(flat) == 2 * N  # the two flat groups came back to fill it, after the kept ones
    advantages = result.batch["advantages"][torch.tensor(flat)]
    assert float(advantages.abs().max()) == 0.0  # a flat group has no signal: zero advantage, no gradient


def test_no_sample_is_lost_or_used_twice_across_rounds() -> None:
    with _controller(max_rounds=5) as controller:
        result = controller.step(_prompts(6, 1), step=0, more=lambda r: _prompts(6, 200 + 10 * r))
    rows = result.batch
    pairs = {(int(u), tuple(r.tolist())) for u, r in zip(rows["uid"], rows["responses"], strict=True)}
    assert len(rows) == 6 * N and len(pairs) == len(rows)


def _graph(**kwargs: Any) -> GraphBuilder:
    g = GraphBuilder("f")
    actor, reward = g.role("actor", RoleKind.POLICY), g.role("reward", RoleKind.REWARD_FUNCTION)
    g.generate(actor, n=2)
    g.score(reward)
    g.logprob(actor)
    return g


def test_every_node_outside_the_section_waits_for_the_filter() -> None:
    g = _graph()
    g.filter("keep", fn="groups_with_signal", inputs=("scores", "uid"))
    g.update("actor", loss="ppo_policy", inputs=("prompts", "responses", "response_mask", "old_logprobs"))
    graph = g.build()
    # Neither reads anything the filter writes, yet both run on its kept rows: field-less edges order them.
    assert graph.sampling_section == {"actor_generate", "reward_score"}  # logprob runs once, after the filter
    assert "keep" in graph.predecessors("actor_logprob")
    assert nx.has_path(graph.dag, "keep", "actor_update")


def test_a_filter_must_follow_a_rollout() -> None:
    g = GraphBuilder("f")
    actor = g.role("actor", RoleKind.POLICY)
    g.filter("keep", fn="groups_with_signal", inputs=("prompts", "uid"))
    g.generate(actor)
    g.logprob(actor)
    g.update(actor, loss="ppo_policy", inputs=("prompts", "responses", "response_mask", "old_logprobs"))
    with pytest.raises(NodeSpecError, match="depends on no generate node"):
        g.build()


def test_one_filter_per_graph() -> None:
    g = _graph()
    g.filter("keep", fn="groups_with_signal", inputs=("scores", "uid"))
    g.filter("again", fn="groups_with_signal", inputs=("scores", "uid"))
    g.update("actor", loss="ppo_policy", inputs=("prompts", "responses", "response_mask", "old_logprobs"))
    with pytest.raises(NodeSpecError, match="one filter per graph"):
        g.build()


def test_bad_filter_options_name_the_field() -> None:
    with pytest.raises(NodeSpecError, match=r"max_rounds=-1 must be an integer in \[0, 16\]"):
        _graph().filter("keep", fn="groups_with_signal", inputs=("scores", "uid"), max_rounds=-1)


def test_the_dapo_graph_reruns_rollout_and_scoring_but_not_the_update() -> None:
    graph = load_graph("dapo", overlong_buffer=4)
    assert graph.sampling_section == {"actor_generate", "reward_score", "overlong_shaping"}
    assert "reference" not in graph.role_names  # DAPO has no KL: nothing to place for a reference
    update = graph.node("actor_update").options_dict
    assert update["clip_ratio"] == 0.2 and update["clip_ratio_high"] == 0.28


@pytest.mark.slow
def test_dapo_with_dynamic_sampling_runs_from_hybridflow_train(tmp_path: Path) -> None:
    from hybridflow.train.config import load_config
    from hybridflow.train.loop import train

    config = load_config(None, ["algorithm=dapo", "algorithm.options={n: 4, max_new_tokens: 6, max_rounds: 2}",
                                "steps=3", "model.sft_steps=20", "data.batch_size=4", "data.num_examples=64",
                                f"output_dir={tmp_path}", "logging.progress=false", "logging.plot=false"])
    result = train(config)
    assert len(result.history) == 3
    assert all("filter/rounds" in row and row["filter/kept_groups"] >= 0 for row in result.history)
