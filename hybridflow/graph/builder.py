"""A small builder so an algorithm reads as a few lines of graph code."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.graph import skipping
from hybridflow.graph.graph import DEFAULT_INPUTS, Graph
from hybridflow.graph.node import Node, Scalar, field_names, freeze_options, op_ports
from hybridflow.graph.roles import Op, Role, RoleKind

Fields = Sequence[str] | None


class GraphBuilder:
    """Collects roles and nodes, then :meth:`build` returns a validated, immutable :class:`Graph`.

    Each op method takes the role, optional field renames (``inputs=``/``outputs=``, bound to the
    op's ports by position), an optional node ``name`` (default ``<role>_<op>``) and keyword options.
    """

    def __init__(self, name: str, *, inputs: Sequence[str] = DEFAULT_INPUTS) -> None:
        self.name = name
        self.inputs = tuple(inputs)
        self._roles: list[Role] = []
        self._nodes: list[Node] = []

    def role(self, name: str, kind: RoleKind | str) -> str:
        """Declare a role and return its name, for use in the op methods."""
        self._roles.append(Role(name, RoleKind(kind)))
        return name

    def generate(self, role: str, *, n: int = 1, name: str | None = None, inputs: Fields = None,
                 outputs: Fields = None, env_options: Mapping[str, Any] | None = None, **sampling: Scalar) -> str:
        """Roll out ``n`` responses per prompt; options: temperature, top_p, top_k, max_new_tokens, greedy,
        ``logprobs=True``, which adds the output ``rollout_logprobs`` (each sampled token's behaviour log-prob),
        and ``loss_mask=True``, which adds the output ``loss_mask`` (B, T): the response tokens that carry loss,
        a subset of ``response_mask`` (a multi-turn rollout leaves tool outputs out; an engine that writes
        none gets ``response_mask``). Without it, losses fall back to ``response_mask``. ``sample_images=True``:
        prompts a node rendered from the sampled rows read those rows' images too (an LLM judge's;
        :data:`~hybridflow.graph.node.SAMPLE_IMAGES_OPTION`).

        Multi-turn (docs/agents.md): ``environment="calculator"`` (an ``ENVIRONMENTS`` name or
        ``path/file.py:factory``) with ``env_options`` (its factory's keyword arguments), ``max_turns``,
        ``max_turn_tokens`` (sampled tokens per turn; ``max_new_tokens`` bounds the whole trajectory) and
        ``agent_schedule`` (``trajectory`` or ``turn``); it reads ``ground_truth`` and also writes
        ``env_rewards``, ``turns``, ``tool_calls`` and ``agent_trace``, and needs ``loss_mask=True``."""
        options: dict[str, Any] = {"n": n, **sampling}
        if env_options is not None:
            options["env_options"] = json.dumps(dict(env_options), sort_keys=True)
        return self._role_op(Op.GENERATE, role, name, inputs, outputs, options)

    def logprob(self, role: str, *, name: str | None = None, inputs: Fields = None, outputs: Fields = None,
                **options: Scalar) -> str:
        """Log-probs of the responses under ``role`` (by default into ``old_logprobs``)."""
        return self._role_op(Op.LOGPROB, role, name, inputs, outputs, options)

    def ref_logprob(self, role: str, *, name: str | None = None, inputs: Fields = None, outputs: Fields = None,
                    **options: Scalar) -> str:
        """Log-probs under a frozen reference (into ``ref_logprobs``)."""
        return self._role_op(Op.REF_LOGPROB, role, name, inputs, outputs, options)

    def values(self, role: str, *, name: str | None = None, inputs: Fields = None, outputs: Fields = None,
               **options: Scalar) -> str:
        """Per-token value estimates of a critic (into ``values``)."""
        return self._role_op(Op.VALUES, role, name, inputs, outputs, options)

    def score(self, role: str, *, name: str | None = None, inputs: Fields = None, outputs: Fields = None,
              **options: Scalar) -> str:
        """One scalar reward per response from a reward model or function (into ``scores``)."""
        return self._role_op(Op.SCORE, role, name, inputs, outputs, options)

    def compute(self, name: str, *, fn: str, inputs: Sequence[str], outputs: Sequence[str],
                **options: Scalar) -> str:
        """A driver-side step: ``fn(*input_fields, **options)`` returns the output fields in order."""
        node = Node(name, Op.COMPUTE, None, field_names(inputs, node=name, kind="inputs"),
                    field_names(outputs, node=name, kind="outputs"), fn=fn, options=freeze_options(options, name))
        self._nodes.append(node)
        return name

    def filter(self, name: str, *, fn: str, inputs: Sequence[str], max_rounds: int = 3, **options: Scalar) -> str:
        """Keep the rows ``fn(*input_fields, **options)`` marks True (a bool per row); the nodes this one depends
        on rerun on fresh prompts, at most ``max_rounds`` more times, until the step's batch is full again.
        Every other node runs after it, once, on the kept rows."""
        node = Node(name, Op.FILTER, None, field_names(inputs, node=name, kind="inputs"), (), fn=fn,
                    options=freeze_options({"max_rounds": max_rounds, **options}, name))
        self._nodes.append(node)
        return name

    def update(self, role: str, *, loss: str, inputs: Sequence[str], name: str | None = None,
               **options: Scalar) -> str:
        """A train step on ``role`` minimising ``loss`` over the fields in ``inputs``."""
        node_name = name or f"{role}_update"
        node = Node(node_name, Op.UPDATE, role, field_names(inputs, node=node_name, kind="inputs"), (), loss=loss,
                    options=freeze_options(options, node_name))
        self._nodes.append(node)
        return node_name

    def build(self, *, prune_unread: bool = False, why: str = "") -> Graph:
        """The validated graph. With ``prune_unread``, forward passes nothing reads are skipped instead of refused
        as dead (and roles left without nodes dropped), each recorded with ``why``
        (:func:`~hybridflow.graph.skipping.prune_unread`)."""
        if not prune_unread:
            return Graph(self.name, tuple(self._roles), tuple(self._nodes), self.inputs)
        roles, nodes, skipped = skipping.prune_unread(self._roles, self._nodes, why=why)
        return Graph(self.name, roles, nodes, self.inputs, skipped)

    def _role_op(self, op: Op, role: str, name: str | None, inputs: Fields, outputs: Fields,
                 options: Mapping[str, Scalar]) -> str:
        in_ports, out_ports = op_ports(op, options)
        node_name = name or f"{role}_{op.value}"
        node = Node(node_name, op, role, field_names(inputs or in_ports, node=node_name, kind="inputs"),
                    field_names(outputs or out_ports, node=node_name, kind="outputs"),
                    options=freeze_options(options, node_name))
        self._nodes.append(node)
        return node_name
