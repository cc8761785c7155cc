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
from hybridflow.agents.protocols import Environment, EnvRecord, TurnRequest, TurnResult
from hybridflow.agents.records import env_record, environment_for
from hybridflow.agents.server import BatchingTurnServer, turn_server
from hybridflow.graph import Node, Op
from hybridflow.graph.node import DEFAULT_MAX_TURNS, freeze_options
from hybridflow.models.tokenizer import char_tokenizer, load_tokenizer
from hybridflow.registry import ENVIRONMENTS
from hybridflow.runtime.batch import Batch, left_padded
from hybridflow.runtime.loss_mask import with_loss_mask
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


def driver_agent_generate(node: Node, inputs: Batch, *, generate_batch: Any, tokenizer: Any, eos_token_id: int,
                          pad_token_id: int, seed: int) -> Batch:
    """A multi-turn generate node's rows rolled out *on the driver*: environments and tools run here and each batch
    of ready turns is one ``generate_batch`` call on the rollout group (the async pipeline's partial rollouts, so
    weights shipped meanwhile land between turns). Graph fields in, the node's graph fields out, with
    ``policy_version`` (a row's oldest sampled token's) and ``token_policy_version`` (each token's; an observation
    token carries the version of the turn it follows)."""
    ports = port_inputs(node, inputs)
    prompts, prompt_mask = ports["prompts"], ports["prompt_mask"]
    prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(prompts, prompt_mask, strict=True)]
    truths = list(ports["ground_truth"])
    records = [env_record(index, truth, None if getattr(truth, "prompt", None) else tokenizer.decode(ids))
               for index, (truth, ids) in enumerate(zip(truths, prompt_ids, strict=True))]
    renderer = ChatRenderer(tokenizer, turn_end_id=eos_token_id)
    with BatchingTurnServer(generate_batch) as server:
        trajectories = run_trajectories(records, prompt_ids, server=server, renderer=renderer,
                                        make_env=environment_factory(node), environment=str(node.environment),
                                        settings=agent_settings(node),
                                        seeds=[seed * 100_003 + i * ROW_SEED_STRIDE for i in range(len(records))])
    result = trajectory_batch(trajectories, pad=pad_token_id, prompts=prompt_ids)
    versions = torch.zeros(result["responses"].shape, dtype=torch.long)
    for row, trajectory in enumerate(trajectories):
        filled = _forward_filled(trajectory.versions)
        versions[row, :len(filled)] = torch.tensor(filled, dtype=torch.long)
    oldest = torch.tensor([min((v for v, s in zip(t.versions, t.sampled, strict=True) if s), default=0)
                           for t in trajectories], dtype=torch.long)
    names = node.port_outputs()
    out = with_loss_mask(node, result).select(names).rename(names)
    return out.union(Batch({"policy_version": oldest, "token_policy_version": versions * result["response_mask"]}))


def _forward_filled(versions: Sequence[int]) -> list[int]:
    """Each token's weights version, an observation's (-1) taking the version of the sampled turn before it (or,
    leading the trajectory, of the first sampled turn)."""
    first = next((v for v in versions if v >= 0), 0)
    filled, last = [], first
    for version in versions:
        last = version if version >= 0 else last
        filled.append(last)
    return filled


def turns_through_generate(node: Node, call: Any, *, eos_token_id: int, pad_token_id: int) -> Any:
    """``generate_batch`` for :func:`driver_agent_generate`: each batch of turns as one single-turn generate call
    ``call(turn_node, inputs) -> (outputs, weights_version)`` (prompts are the trajectories so far, left-padded;
    each request cut at its own budget, finished where it sampled the end token)."""
    sampling = {k: v for k, v in node.options_dict.items() if k in ("temperature", "top_p", "top_k", "greedy")}

    def generate_batch(requests: Sequence[TurnRequest]) -> list[TurnResult]:
        budget = max(request.max_tokens for request in requests)
        turn_node = Node(node.name, Op.GENERATE, node.role, ("prompts",), ("responses", "response_mask",
                                                                         "rollout_logprobs"),
                         options=freeze_options({**sampling, "max_new_tokens": budget, "logprobs": True}, node.name))
        prompts, mask = left_padded([request.token_ids for request in requests], pad_token_id)
        outputs, version = call(turn_node, Batch({"prompts": prompts, "prompt_mask": mask}))
        results = []
        for row, request in enumerate(requests):
            length = min(int(outputs["response_mask"][row].sum()), request.max_tokens)
            results.append(TurnResult.cut(outputs["responses"][row, :length].tolist(),
                                          outputs["rollout_logprobs"][row, :length].tolist(), eos=eos_token_id,
                                          version=version))
        return results

    return generate_batch


def port_inputs(node: Node, inputs: Batch) -> Batch:
    """A multi-turn node's graph-field inputs as its ports (``prompts``, ``prompt_mask``, ``ground_truth``)."""
    ports = node.port_inputs()
    named = inputs.select([*ports.values(), "prompt_mask"], strict=False)
    return named.rename({field: port for port, field in ports.items()})


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
