"""A multi-turn ``generate`` on a worker: the rows' trajectories (``hybridflow.agents``) as response rows.

The rank's rollout engine samples turns in a :meth:`~hybridflow.runtime.protocols.TurnGenerator.turn_session`,
behind a :func:`~hybridflow.agents.server.turn_server` (batching for fixed-batch engines, direct calls for
engines that batch continuously); each row's environment is built from the node's
``environment`` and ``env_options`` and reset from the row's ``ground_truth``. The trajectory becomes one
response: ``responses`` / ``response_mask`` hold every token after the prompt (sampled turns and templated
observations), ``loss_mask`` only the sampled ones, ``rollout_logprobs`` their behaviour log-probs (0
elsewhere), beside ``env_rewards``, ``turns``, ``tool_calls`` and a JSON ``agent_trace`` per row.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hybridflow.agents.chat import ChatRenderer
from hybridflow.agents.loop import AgentSettings, Trajectory, run_trajectories
from hybridflow.agents.protocols import Environment, EnvRecord
from hybridflow.agents.records import env_record, environment_for
from hybridflow.agents.server import turn_server
from hybridflow.graph import Node
from hybridflow.graph.node import DEFAULT_MAX_TURNS
from hybridflow.registry import ENVIRONMENTS
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import SamplingParams

ROW_SEED_STRIDE = 104_729  # row i of a rank samples with the rank's seed x 100,003 + i x this


def agent_settings(node: Node) -> AgentSettings:
    """A multi-turn node's bounds: its ``max_turns``, ``max_turn_tokens`` (default: the whole budget), the whole
    trajectory's ``max_new_tokens`` and its ``agent_schedule``."""
    total = node.max_new_tokens
    return AgentSettings(max_turns=int(node.option("max_turns", DEFAULT_MAX_TURNS) or DEFAULT_MAX_TURNS),
                         max_turn_tokens=min(int(node.option("max_turn_tokens", total) or total), total),
                         max_tokens=total, schedule=str(node.option("agent_schedule", "trajectory")))


def environment_factory(node: Node) -> Any:
    """``make_env(record)`` for the node's environment (its registry entry, called with ``env_options``), or
    the registered environment a row names (verl's ``interaction_kwargs["name"]``, TRL's ``environment``
    column)."""
    name, options = node.environment, node.env_options
    assert name is not None
    ENVIRONMENTS.get(name)  # an unknown name fails here, before any row is rolled out

    def make_env(record: EnvRecord) -> Environment:
        try:
            return environment_for(record, name, options)
        except TypeError as err:
            raise TypeError(f"generate node {node.name!r}: environment {name!r} does not take env_options "
                            f"{sorted(options)}: {err}") from err

    return make_env


@functools.lru_cache(maxsize=8)
def role_tokenizer(model: str) -> Any:
    """The tokenizer of a role's model: saved beside it, or the character tokenizer of a built-in tiny model."""
    from hybridflow.data.tokenizer import char_tokenizer, load_tokenizer

    if Path(model).is_dir():
        return load_tokenizer(model)
    return char_tokenizer()


def agent_generate(engine: Any, node: Node, inputs: Batch, sampling: SamplingParams, *, tokenizer: Any,
                   eos_token_id: int, pad_token_id: int, rank: int, max_batch: int = 0) -> Batch:
    """Roll out this rank's rows of a multi-turn generate node (ports in, ports out)."""
    prompts, prompt_mask = inputs["prompts"], inputs["prompt_mask"]
    prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(prompts, prompt_mask, strict=True)]
    truths = list(inputs["ground_truth"])
    # A row without a prompt column (a plain-text ground truth) shows its environment the decoded prompt tokens.
    records = [env_record(index, truth, None if getattr(truth, "prompt", None) else tokenizer.decode(ids))
               for index, (truth, ids) in enumerate(zip(truths, prompt_ids, strict=True))]
    base = sampling.rank_seed(rank) * 100_003
    renderer = ChatRenderer(tokenizer, turn_end_id=eos_token_id)
    with engine.turn_session(sampling) as generate_batch, turn_server(generate_batch, max_batch=max_batch) as server:
        trajectories = run_trajectories(records, prompt_ids, server=server, renderer=renderer,
                                        make_env=environment_factory(node), environment=str(node.environment),
                                        settings=agent_settings(node),
                                        seeds=[base + index * ROW_SEED_STRIDE for index in range(len(records))])
    return trajectory_batch(trajectories, pad=pad_token_id, prompts=prompt_ids)


def trajectory_batch(trajectories: Sequence[Trajectory], *, pad: int,
                     prompts: Sequence[Sequence[int]] | None = None) -> Batch:
    """Trajectories as right-padded response rows (the generate ports, with the agent outputs).

    ``prompts``: the rows' prompt tokens (the node's ``prompts`` port). The trainer scores each response after
    those, so a trajectory whose environment started it from another prompt (``reset`` returned messages or a
    :class:`~hybridflow.agents.protocols.Prompt`) must extend them: the extra prompt tokens lead its response,
    without loss. One that does not extend them is refused, as its log-probs would be scored on a wrong prefix.
    """
    if prompts is not None:
        trajectories = [_after_row_prompt(t, list(p)) for t, p in zip(trajectories, prompts, strict=True)]
    width = max([len(t.tokens) for t in trajectories] + [1])
    rows = len(trajectories)
    responses = torch.full((rows, width), pad, dtype=torch.long)
    response_mask = torch.zeros((rows, width), dtype=torch.long)
    loss_mask = torch.zeros((rows, width), dtype=torch.long)
    logprobs = torch.zeros((rows, width), dtype=torch.float32)
    for row, trajectory in enumerate(trajectories):
        length = len(trajectory.tokens)
        responses[row, :length] = torch.tensor(trajectory.tokens, dtype=torch.long)
        response_mask[row, :length] = 1
        loss_mask[row, :length] = torch.tensor(trajectory.sampled, dtype=torch.long)
        logprobs[row, :length] = torch.tensor(trajectory.logprobs, dtype=torch.float32)
    return Batch({"responses": responses, "response_mask": response_mask, "loss_mask": loss_mask,
                  "rollout_logprobs": logprobs,
                  "env_rewards": torch.tensor([t.env_reward for t in trajectories], dtype=torch.float32),
                  "turns": torch.tensor([t.turns for t in trajectories], dtype=torch.long),
                  "tool_calls": torch.tensor([len(t.tool_results) for t in trajectories], dtype=torch.long)},
                 {"agent_trace": [t.trace() for t in trajectories]})


def _after_row_prompt(trajectory: Trajectory, prompt: list[int]) -> Trajectory:
    started = trajectory.prompt_ids
    if started == prompt:
        return trajectory
    if started[:len(prompt)] != prompt:
        raise ValueError(f"row {trajectory.index}: environment {trajectory.environment!r} started the trajectory from "
                         f"a prompt ({len(started)} tokens) that does not extend the row's prompt ({len(prompt)} "
                         "tokens); a generate node's prompts port is not rewritten, so the trainer would score this "
                         "response after the wrong prompt. Give the rows the prompt the environment uses (same "
                         "messages, tools and chat template)")
    lead = Trajectory(index=trajectory.index, environment=trajectory.environment, prompt_ids=prompt)
    lead.extend(started[len(prompt):], sampled=False)
    return dataclasses.replace(trajectory, prompt_ids=prompt, tokens=lead.tokens + trajectory.tokens,
                               sampled=lead.sampled + trajectory.sampled, logprobs=lead.logprobs + trajectory.logprobs,
                               versions=lead.versions + trajectory.versions)
