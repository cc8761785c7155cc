"""Nodes of the dataflow graph and the fixed ports of each op."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.graph.errors import NodeSpecError
from hybridflow.graph.roles import Op

_SEQ_INPUTS = ("prompts", "responses", "response_mask")

# Ports of the ops that run on a role, in order. A node binds each port to a field name, by
# position, so one op can read or write renamed fields (ReMax scores ``greedy_responses``).
OP_PORTS: dict[Op, tuple[tuple[str, ...], tuple[str, ...]]] = {
    Op.GENERATE: (("prompts",), ("responses", "response_mask")),
    Op.LOGPROB: (_SEQ_INPUTS, ("old_logprobs",)),
    Op.REF_LOGPROB: (_SEQ_INPUTS, ("ref_logprobs",)),
    Op.VALUES: (_SEQ_INPUTS, ("values",)),
    Op.SCORE: ((*_SEQ_INPUTS, "ground_truth"), ("scores",)),
}

DEFAULT_MAX_NEW_TOKENS = 32
DEFAULT_TEMPERATURE = 1.0  # sampling temperature of a generate node, and of the log-probs that must match it
# A filter's extra rounds per step: the training loop reserves this many prompt batches per step for them
# (hybridflow/train/loop.py EXTRA_ROUNDS_PER_STEP), so more would reuse the next step's prompts.
MAX_FILTER_ROUNDS = 16
"""A generate node's response cap when it sets none: the one default the planner, runtime and checks read."""

# Output ports an op adds when a node sets the option True: ``generate(logprobs=True)`` also writes each
# sampled token's behaviour log-prob, which the off-policy corrections of the policy loss read;
# ``generate(loss_mask=True)`` writes the tokens that carry loss (a multi-turn rollout masks tool outputs
# inside a response; the worker copies ``response_mask`` when the engine writes none).
OPTIONAL_OUTPUT_PORTS: dict[Op, tuple[tuple[str, str], ...]] = {
    Op.GENERATE: (("logprobs", "rollout_logprobs"), ("loss_mask", "loss_mask")),
}


# A multi-turn generate (``environment=`` set) also reads each row's ground truth (its environment is reset from
# the row) and writes what its trajectories did: env rewards, turns, tool calls, and a JSON trace per row.
AGENT_INPUT_PORTS = ("ground_truth",)
AGENT_OUTPUT_PORTS = ("env_rewards", "turns", "tool_calls", "agent_trace")
AGENT_SCHEDULES = ("trajectory", "turn")
DEFAULT_MAX_TURNS = 4


def op_ports(op: Op, options: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The input and output ports of a role op for a node with these options (see ``OPTIONAL_OUTPUT_PORTS``)."""
    in_ports, out_ports = OP_PORTS[op]
    extra = tuple(port for option, port in OPTIONAL_OUTPUT_PORTS.get(op, ()) if options.get(option) is True)
    if op is Op.GENERATE and options.get("environment"):
        return in_ports + AGENT_INPUT_PORTS, out_ports + extra + AGENT_OUTPUT_PORTS
    return in_ports, out_ports + extra


TIMEOUT_OPTION = "timeout_s"
"""A node's own deadline in seconds (any op): past it the step fails naming the node, its role and
:data:`TIMEOUT_KEY_OPTION`, the setting to raise (an LLM judge's algorithm option ``judge_timeout_s``)."""
TIMEOUT_KEY_OPTION = "timeout_key"
SAMPLE_IMAGES_OPTION = "sample_images"
"""A role op whose rows are the sampled rows but whose prompts a compute node wrote (an LLM judge's, holding the
samples' image placeholders) sets it true to read the dataset prompts' images with them, as every node reading
``prompts`` does (``hybridflow.runtime.worker.companion_fields``)."""

DRIVER_OPS = frozenset({Op.COMPUTE, Op.FILTER})
"""Ops the controller runs itself (registry functions on the driver), not a role's workers."""

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
Scalar = str | int | float | bool | None


def freeze_options(options: Mapping[str, Any], node: str = "?") -> tuple[tuple[str, Scalar], ...]:
    """Options as a sorted tuple of pairs, so nodes stay hashable; values must be JSON scalars."""
    for key, value in options.items():
        if not isinstance(value, str | int | float | bool | type(None)):
            raise NodeSpecError(
                f"node {node!r}: option {key}={value!r} must be a str, int, float, bool or None "
                "so the graph stays serialisable",
                node=node,
                field=key,
            )
    return tuple(sorted(options.items()))


def field_names(names: Iterable[str], *, node: str, kind: str) -> tuple[str, ...]:
    """``names`` as a tuple of field names; a bare string is refused, not split into letters."""
    if isinstance(names, str):
        raise NodeSpecError(
            f"node {node!r}: {kind}={names!r} must be a sequence of field names, e.g. ({names!r},)",
            node=node,
            field=kind,
        )
    fields = tuple(names)
    for name in fields:
        if not isinstance(name, str) or not name:
            raise NodeSpecError(f"node {node!r}: {kind} {list(fields)} must all be non-empty strings",
                                node=node, field=kind)
    return fields


@dataclass(frozen=True, slots=True)
class Node:
    """One step of an algorithm: an op on a role (or on the driver, for ``compute``).

    ``fn`` names the driver function of a ``compute`` node and ``loss`` the loss of an ``update``;
    both are registry names (``"gae"``) or import paths (``"pkg.mod:func"``) resolved by the runtime.
    """

    name: str
    op: Op
    role: str | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fn: str | None = None
    loss: str | None = None
    options: tuple[tuple[str, Scalar], ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", Op(self.op))
        if not _NAME.match(self.name):
            raise NodeSpecError(f"node name {self.name!r} must be an identifier", node=self.name, field="name")
        if isinstance(self.options, Mapping):  # accept a plain dict from hand-written code
            object.__setattr__(self, "options", freeze_options(self.options, self.name))
        for kind in ("inputs", "outputs"):
            object.__setattr__(self, kind, field_names(getattr(self, kind), node=self.name, kind=kind))
        self._check_shape()

    def _check_shape(self) -> None:
        where = f"node {self.name!r} ({self.op})"
        timeout = self.option(TIMEOUT_OPTION)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                    or not 0 < timeout < float("inf")):
            raise NodeSpecError(f"{where}: {TIMEOUT_OPTION}={timeout!r} must be a positive number of seconds",
                                node=self.name, field=TIMEOUT_OPTION)
        if self.fn is not None and self.op not in DRIVER_OPS:
            raise NodeSpecError(f"{where}: only a compute or filter node takes fn=", node=self.name, field="fn")
        if self.loss is not None and self.op is not Op.UPDATE:
            raise NodeSpecError(f"{where}: only an update node takes loss=", node=self.name, field="loss")
        if self.op is Op.FILTER:
            self._check_filter(where)
            return
        if self.op is Op.COMPUTE:
            if self.role is not None:
                raise NodeSpecError(f"{where} runs on the driver and takes no role", node=self.name, field="role")
            if not self.fn:
                raise NodeSpecError(f"{where} needs fn= (a registry name or 'module:function')", node=self.name,
                                    field="fn")
            if not self.outputs:
                raise NodeSpecError(f"{where} must declare at least one field in outputs", node=self.name,
                                    field="outputs")
            return
        if self.role is None:
            raise NodeSpecError(f"{where} needs a role", node=self.name, field="role")
        if self.op is Op.UPDATE:
            if not self.loss:
                raise NodeSpecError(f"{where} needs loss= (a registry name or 'module:function')", node=self.name,
                                    field="loss")
            if self.outputs:
                raise NodeSpecError(f"{where} is a sink and produces no fields, but has outputs {list(self.outputs)}",
                                    node=self.name, field="outputs")
            return
        if self.op is Op.GENERATE:
            n = self.option("n", 1)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise NodeSpecError(f"{where}: n={n!r} must be a positive integer", node=self.name, field="n")
            if self.option("environment") is not None:
                self._check_agent(where)
        for option, _ in OPTIONAL_OUTPUT_PORTS.get(self.op, ()):
            if not isinstance(self.option(option, False), bool):
                raise NodeSpecError(f"{where}: {option}={self.option(option)!r} must be True or False",
                                    node=self.name, field=option)
        in_ports, out_ports = op_ports(self.op, self.options_dict)
        for kind, ports, bound in (("inputs", in_ports, self.inputs), ("outputs", out_ports, self.outputs)):
            if len(bound) != len(ports):
                raise NodeSpecError(
                    f"{where} binds {len(bound)} {kind} {list(bound)} but the op has ports {list(ports)}",
                    node=self.name,
                    field=kind,
                )
        every = [*self.inputs, *self.outputs]
        twice = next((name for name in every if every.count(name) > 1), None)
        if twice is not None:
            raise NodeSpecError(f"{where} binds field {twice!r} to two ports", node=self.name, field=twice)

    @property
    def options_dict(self) -> dict[str, Scalar]:
        return dict(self.options)

    def option(self, key: str, default: Scalar = None) -> Scalar:
        return dict(self.options).get(key, default)

    def port_inputs(self) -> dict[str, str]:
        """Port name -> field name for an op with fixed ports (identity for compute/update)."""
        ports = op_ports(self.op, self.options_dict)[0] if self.op in OP_PORTS else self.inputs
        return dict(zip(ports, self.inputs, strict=True))

    def port_outputs(self) -> dict[str, str]:
        ports = op_ports(self.op, self.options_dict)[1] if self.op in OP_PORTS else self.outputs
        return dict(zip(ports, self.outputs, strict=True))

    def _check_agent(self, where: str) -> None:
        environment = self.option("environment")
        if not isinstance(environment, str) or not environment:
            raise NodeSpecError(f"{where}: environment={environment!r} must name an environment (a registry name "
                                "such as 'calculator', or 'path/file.py:factory')", node=self.name, field="environment")
        if self.option("loss_mask") is not True:
            raise NodeSpecError(f"{where}: a multi-turn generate (environment={environment!r}) must set "
                                "loss_mask=True: its responses hold tool outputs the policy did not sample, which "
                                "losses must leave out", node=self.name, field="loss_mask")
        for key in ("max_turns", "max_turn_tokens"):
            value = self.option(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise NodeSpecError(f"{where}: {key}={value!r} must be a positive integer", node=self.name, field=key)
        schedule = self.option("agent_schedule", "trajectory")
        if schedule not in AGENT_SCHEDULES:
            raise NodeSpecError(f"{where}: agent_schedule={schedule!r} must be one of {list(AGENT_SCHEDULES)} "
                                "(trajectory: each trajectory advances alone; turn: batch-synchronous turns)",
                                node=self.name, field="agent_schedule")
        options = self.option("env_options")
        if options is not None:
            try:
                parsed = json.loads(str(options))
            except json.JSONDecodeError as err:
                raise NodeSpecError(f"{where}: env_options must be a JSON object string ({err})", node=self.name,
                                    field="env_options") from err
            if not isinstance(parsed, dict):
                raise NodeSpecError(f"{where}: env_options={options!r} must be a JSON object", node=self.name,
                                    field="env_options")

    @property
    def environment(self) -> str | None:
        """The environment a multi-turn generate node runs its rows in (None: a single-turn generate)."""
        value = self.option("environment") if self.op is Op.GENERATE else None
        return str(value) if value else None

    @property
    def env_options(self) -> dict[str, Any]:
        """The environment factory's options of a multi-turn generate node (``{}`` when none)."""
        options = self.option("env_options")
        return dict(json.loads(str(options))) if options else {}

    def _check_filter(self, where: str) -> None:
        if self.role is not None:
            raise NodeSpecError(f"{where} runs on the driver and takes no role", node=self.name, field="role")
        if not self.fn:
            raise NodeSpecError(f"{where} needs fn= (a function returning the rows to keep)", node=self.name,
                                field="fn")
        if self.outputs:
            raise NodeSpecError(f"{where} keeps or drops rows and produces no fields, but has outputs "
                                f"{list(self.outputs)}", node=self.name, field="outputs")
        rounds = self.option("max_rounds", 0)
        if not isinstance(rounds, int) or isinstance(rounds, bool) or not 0 <= rounds <= MAX_FILTER_ROUNDS:
            raise NodeSpecError(f"{where}: max_rounds={rounds!r} must be an integer in [0, {MAX_FILTER_ROUNDS}] "
                                "(extra rollouts allowed to refill the batch; each is a whole generation's work)",
                                node=self.name, field="max_rounds")

    @property
    def deadline_s(self) -> float | None:
        """The node's own deadline (:data:`TIMEOUT_OPTION`), None when it sets none."""
        timeout = self.option(TIMEOUT_OPTION)
        return float(timeout) if timeout is not None else None

    @property
    def deadline_key(self) -> str:
        """The setting that gave the node its deadline, for the error of a late call."""
        return str(self.option(TIMEOUT_KEY_OPTION) or f"option {TIMEOUT_OPTION} of node {self.name!r}")

    @property
    def max_new_tokens(self) -> int:
        """The response cap of a generate node: its option, else :data:`DEFAULT_MAX_NEW_TOKENS`."""
        return int(self.option("max_new_tokens", DEFAULT_MAX_NEW_TOKENS) or DEFAULT_MAX_NEW_TOKENS)

    @property
    def samples_per_prompt(self) -> int:
        """``n`` of a generate node (1 for every other op)."""
        n = self.option("n", 1) if self.op is Op.GENERATE else 1
        assert isinstance(n, int)
        return n
