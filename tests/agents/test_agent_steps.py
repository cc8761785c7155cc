"""Multi-turn generate nodes through the runtime on a tiny model: on-policy log-probs equal the rollout's,
observations carry no loss, and a GRPO step trains on the sampled tokens only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.data import PromptLoader, char_tokenizer, task_examples
from hybridflow.graph import Graph, load_graph
from hybridflow.graph.agents import with_environment
from hybridflow.registry import LOSSES
from hybridflow.runtime import Batch, Controller, OptimSpec, RoleSpec, default_plan

FEEDBACK = f"{Path(__file__).with_name('agent_envs.py')}:Feedback"
LOADER = PromptLoader(records=task_examples("reverse", 64), tokenizer=char_tokenizer(), batch_size=4)


def varied_scores(batch: Batch) -> Batch:
    return Batch({"scores": (torch.arange(len(batch)) % 3).float()})


def likely_eos(controller: Controller) -> None:
    """Make the random tiny policy end its turns often (+4 on the EOS logit), trainer and rollout alike."""
    engine = controller.executor.groups[0].workers[0].engines["actor"]  # type: ignore[attr-defined]
    eos = engine.model.config.eos_token_id

    def boost(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        output[..., eos] += 4.0
        return output

    engine.model.lm_head.register_forward_hook(boost)


def agent_graph(schedule: str = "trajectory") -> Graph:
    graph = load_graph("grpo_no_ref", reward_kind="reward_function", max_new_tokens=40, rollout_correction="tis")
    return with_environment(graph, FEEDBACK, env_options={"turns": 3}, max_turns=3, max_turn_tokens=8,
                            schedule=schedule)


def agent_step(model: Path, graph: Graph) -> Any:
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model),
                              optim=OptimSpec(lr=1e-3) if r.kind.trainable else None)
             for r in graph.roles if r.kind.needs_gpu}
    with Controller(graph, default_plan(graph), specs=specs, driver_roles={"reward": varied_scores}) as controller:
        likely_eos(controller)
        return controller.step(LOADER.batch(0), step=0)


@pytest.mark.parametrize("schedule", ["trajectory", "turn"])
def test_a_multi_turn_step_is_on_policy_and_leaves_observations_out_of_the_loss(random_model_dir: Path,
                                                                                schedule: str) -> None:
    result = agent_step(random_model_dir, agent_graph(schedule))
    batch = result.batch
    mask, loss_mask = batch["response_mask"], batch["loss_mask"]
    observed = (mask != 0) & (loss_mask == 0)
    assert bool(observed.any()), "no trajectory got an observation: nothing multi-turn was tested"
    assert int(batch["turns"].max()) >= 2 and bool((batch["turns"] <= 3).all())
    sampled = loss_mask != 0
    # On-policy: the trainer's log-probs of the sampled tokens are the rollout's, token for token.
    gap = (batch["old_logprobs"] - batch["rollout_logprobs"]).abs()[sampled]
    assert float(gap.max()) < 1e-5
    assert bool((batch["rollout_logprobs"][observed] == 0).all())
    assert bool((batch["advantages"][observed] == 0).all())
    # The update's loss gives every observation token exactly zero gradient.
    logprobs = batch["old_logprobs"].clone().requires_grad_(True)
    loss, _ = LOSSES.get("ppo_policy")(outputs={"logprobs": logprobs},
                                       batch={**batch.tensors, "response_mask": loss_mask})
    loss.backward()
    assert logprobs.grad is not None
    assert bool((logprobs.grad[observed] == 0).all()) and bool((logprobs.grad[sampled] != 0).any())
    assert result.metrics["actor/rollout_logprob_gap_max"] < 1e-4
    assert len(batch["agent_trace"]) == len(batch) and '"turns"' in batch["agent_trace"][0]


def test_the_observations_are_the_templated_feedback(random_model_dir: Path) -> None:
    result = agent_step(random_model_dir, agent_graph())
    batch = result.batch
    tokenizer = char_tokenizer()
    row = int(torch.argmax(batch["turns"]))
    observed = ((batch["response_mask"][row] != 0) & (batch["loss_mask"][row] == 0)).nonzero().flatten()
    text = tokenizer.decode(batch["responses"][row, observed])
    assert "try again" in text


def test_every_built_in_algorithm_becomes_multi_turn() -> None:
    from hybridflow.graph.loading import takes_option
    from hybridflow.registry import ALGORITHMS

    for name in ALGORITHMS.names():
        takes = takes_option(name, "reward_kind")  # an LLM judge's graph has no reward role
        graph = load_graph(name, **({"reward_kind": "reward_function"} if takes else {}))
        if not any(node.option("loss_mask") is True for node in graph.nodes):
            continue
        agent = with_environment(graph, FEEDBACK)
        generates = [node for node in agent.nodes if node.environment]
        assert generates and all(any(f.endswith("env_rewards") for f in node.outputs) for node in generates), name
        if name == "remax":  # the greedy baseline scores its own trajectory, with its own env rewards
            assert agent.node("greedy_score").inputs[2] == "greedy_loss_mask"
            assert agent.node("greedy_scores_env_reward_sum").inputs == ("outcome_greedy_scores", "greedy_env_rewards")


def test_a_ppo_step_trains_the_critic_on_a_multi_turn_rollout(random_model_dir: Path) -> None:
    graph = with_environment(load_graph("ppo", reward_kind="reward_function", max_new_tokens=40), FEEDBACK,
                             env_options={"turns": 2}, max_turns=2, max_turn_tokens=8)
    batch = agent_step(random_model_dir, graph).batch
    observed = (batch["response_mask"] != 0) & (batch["loss_mask"] == 0)
    assert bool(observed.any())
    assert bool((batch["advantages"][observed] == 0).all()) and bool((batch["returns"][observed] == 0).all())
