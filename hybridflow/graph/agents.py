"""Make any algorithm's graph multi-turn: its generate node rolls out in an environment (docs/agents.md).

GRPO, DAPO, PPO... are written with a single-turn ``generate``; :func:`with_environment` rebinds that node to an
environment (reading ``ground_truth``, writing the agent outputs), lets reward nodes score only the tokens the
policy sampled and, unless ``env_reward_weight`` is 0, adds the environment's rewards to the reward node's
``scores``, so the rest of the graph trains on it unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from hybridflow.graph.errors import NodeSpecError
from hybridflow.graph.graph import Graph
from hybridflow.graph.node import AGENT_INPUT_PORTS, AGENT_OUTPUT_PORTS, Node, freeze_options
from hybridflow.graph.roles import Op

ENV_REWARD_FN = "add_env_rewards"  # the compute function (hybridflow.algorithms) scores + weight x env_rewards
OUTCOME_SCORES = "outcome_scores"


def with_environment(graph: Graph, environment: str, *, env_options: Mapping[str, Any] | None = None,
                     max_turns: int | None = None, max_turn_tokens: int | None = None,
                     schedule: str | None = None, env_reward_weight: float = 1.0) -> Graph:
    """``graph`` with its generate node(s) rolling out in ``environment`` (see ``GraphBuilder.generate``).

    ``schedule`` None leaves the choice to the plan (:func:`with_schedule`; ``trajectory`` when unplanned)."""
    # A generate from prompts a node computes (an LLM judge's) answers the rollouts; it stays single-turn.
    generates = [node for node in graph.nodes
                 if node.op is Op.GENERATE and node.port_inputs()["prompts"] not in graph.producers]
    if not generates:
        raise NodeSpecError(f"graph {graph.name!r} has no generate node to run in environment {environment!r}",
                            node=graph.name, field="environment")
    agent: dict[str, Any] = {"environment": environment, "loss_mask": True}
    if schedule is not None:
        agent["agent_schedule"] = schedule
    if env_options:
        agent["env_options"] = json.dumps(dict(env_options), sort_keys=True)
    agent.update({key: value for key, value in (("max_turns", max_turns), ("max_turn_tokens", max_turn_tokens))
                  if value is not None})
    nodes = [_multi_turn(node, agent) if node in generates else node for node in graph.nodes]
    rollouts = {node.port_outputs()["responses"]: node for node in nodes if node.environment}
    rewritten: list[Node] = []
    for node in nodes:
        rollout = rollouts.get(node.port_inputs().get("responses", "")) if node.op is Op.SCORE else None
        rewritten += [node] if rollout is None else _scored_multi_turn(node, rollout, env_reward_weight)
    return dataclasses.replace(graph, nodes=tuple(rewritten))


def _multi_turn(node: Node, agent: Mapping[str, Any]) -> Node:
    if node.environment:
        raise NodeSpecError(f"node {node.name!r} already runs in environment {node.environment!r}", node=node.name,
                            field="environment")
    if node.option("loss_mask") is not True:  # the node writes no loss mask, so its consumers read none either
        raise NodeSpecError(f"node {node.name!r}: a multi-turn rollout needs a graph that trains on loss_mask "
                            "(generate(..., loss_mask=True) and 'loss_mask' in the inputs of its losses and "
                            "advantages); the built-in algorithms do", node=node.name, field="loss_mask")
    # A renamed rollout (ReMax's greedy_responses) names its agent outputs alike (greedy_env_rewards...).
    prefix = node.port_outputs()["responses"].removesuffix("responses")
    options = {**node.options_dict, **agent}
    return dataclasses.replace(node, inputs=(*node.inputs, *AGENT_INPUT_PORTS),
                               outputs=(*node.outputs, *(prefix + port for port in AGENT_OUTPUT_PORTS)),
                               options=freeze_options(options, node.name))


def _scored_multi_turn(scorer: Node, rollout: Node, weight: float) -> list[Node]:
    """A reward node of a multi-turn rollout reads the policy's own tokens: its ``response_mask`` port is bound to
    the rollout's loss mask (every turn, no observation), so a tool's output cannot earn a reward by itself (an
    answer copied from the calculator counts once the policy writes it). With ``weight``, the node writes
    ``outcome_<scores>`` and ``<scores>`` = those + ``weight`` x the rollout's env rewards."""
    outputs = rollout.port_outputs()
    mask = scorer.port_inputs()["response_mask"]
    inputs = tuple(outputs["loss_mask"] if field == mask else field for field in scorer.inputs)
    scores = scorer.port_outputs()["scores"]
    if not weight:
        return [dataclasses.replace(scorer, inputs=inputs)]
    outcome = OUTCOME_SCORES if scores == "scores" else f"outcome_{scores}"
    env_rewards = outputs["env_rewards"]
    total = Node("env_reward_sum" if scores == "scores" else f"{scores}_env_reward_sum", Op.COMPUTE, None,
                 (outcome, env_rewards), (scores,), fn=ENV_REWARD_FN,
                 options=freeze_options({"weight": weight}, "env_reward_sum"))
    renamed = tuple(outcome if field == scores else field for field in scorer.outputs)
    return [dataclasses.replace(scorer, inputs=inputs, outputs=renamed), total]


def env_reward_weight(graph: Graph) -> float:
    """The weight :func:`with_environment` gave the environment's rewards in ``scores`` (0: none added)."""
    node = next((n for n in graph.nodes if n.op is Op.COMPUTE and n.fn == ENV_REWARD_FN), None)
    return float(node.option("weight", 1.0) or 0.0) if node is not None else 0.0


def with_schedule(graph: Graph, schedule: str | None) -> Graph:
    """``graph`` with every multi-turn node that fixes no ``agent_schedule`` running ``schedule`` (a plan's
    ``mode.agent_schedule``; None: ``trajectory``), so the workers run what the plan costed."""
    chosen = schedule or "trajectory"
    nodes = tuple(dataclasses.replace(node, options=freeze_options({**node.options_dict, "agent_schedule": chosen},
                                                                     node.name))
                  if node.environment and node.option("agent_schedule") is None else node for node in graph.nodes)
    return dataclasses.replace(graph, nodes=nodes)
