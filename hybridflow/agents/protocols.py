"""The agent contract: environments, tools, tool-call formats and the token-level turn server.

A multi-turn ``generate`` node (``generate(..., environment="calculator")``) runs one *trajectory* per row:
the policy samples a turn, the row's :class:`Environment` answers it (tool results, feedback), and the
rollout continues from the tokens it already holds. Nothing here imports torch: environments and tools are
plain Python, and the runtime turns finished :class:`Trajectory` records into batch rows.

- :class:`Tool`: a function with an OpenAI-function JSON schema (``parameters``) and a per-call timeout.
- :class:`ToolCallFormat`: how tool calls look in the model's text (hermes ``<tool_call>`` JSON by default)
  and how their results go back to it as chat messages.
- :class:`Environment`: ``reset`` from a data record, ``step`` on the model's turn, ``close``.
- :class:`TurnServer`: token ids in, sampled token ids (and their log-probs) out, one request per turn;
  implementations batch the requests of trajectories that are ready at the same time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]
"""A chat message as the ``openai`` SDK and HF chat templates take it (``role``, ``content``, ...)."""


@dataclass(frozen=True, kw_only=True)
class Tool:
    """A function the model may call: ``fn(**arguments) -> str``, described by an OpenAI-function schema.

    ``parameters`` is the JSON schema of the arguments (``{"type": "object", "properties": ...}``);
    ``timeout_s`` bounds one call (a call past it becomes an observation saying so).
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., str]
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"Tool.name={self.name!r} must be a non-empty identifier (letters, digits, _ or -)")
        if self.timeout_s <= 0:
            raise ValueError(f"tool {self.name!r}: timeout_s={self.timeout_s} must be > 0")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema with type 'object' "
                             f"(OpenAI function format), got {dict(self.parameters)!r}")

    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools=[...]`` entry (also what HF chat templates render into the system prompt)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One call parsed from a turn: the tool's name, its arguments and the text it was parsed from."""

    name: str
    arguments: Mapping[str, Any]
    text: str = ""
    id: str = ""


@dataclass(frozen=True, kw_only=True)
class ParsedTurn:
    """A turn's tool calls, and the calls that could not be parsed (each with why, shown to the model)."""

    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ToolResult:
    """What a call returned (or why it did not): the text the model sees next, and how it went."""

    call: ToolCall
    content: str
    seconds: float = 0.0
    error: bool = False
    timed_out: bool = False


@runtime_checkable
class ToolCallFormat(Protocol):
    """How tool calls appear in the model's text and how their results return as messages."""

    def parse(self, text: str) -> ParsedTurn:
        """The calls in one assistant turn (none: the turn answers, and the trajectory may end)."""
        ...

    def result_messages(self, results: Sequence[ToolResult]) -> list[Message]:
        """The chat messages that carry ``results`` back to the model (e.g. ``role: tool`` messages)."""
        ...


@dataclass(frozen=True, kw_only=True)
class EnvRecord:
    """What an environment is reset from: the row's prompt, ground truth and verl-style extras."""

    index: int
    prompt: str | list[Message]
    ground_truth: str = ""
    extra_info: Mapping[str, Any] = field(default_factory=dict)
    tools_kwargs: Mapping[str, Any] = field(default_factory=dict)
    interaction_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class EnvStep:
    """An environment's answer to one turn."""

    observation: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    tool_results: tuple[ToolResult, ...] = ()
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """A prompt an environment starts the trajectory from instead of the row's (``reset`` returns it): its
    messages and the OpenAI ``tools=[...]`` the chat template lists (e.g. an OpenAI-SDK agent's first request)."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None


@runtime_checkable
class Environment(Protocol):
    """One trajectory's world. A fresh instance per row: ``reset``, then ``step`` per model turn, ``close``."""

    def reset(self, record: EnvRecord) -> list[Message] | Prompt:
        """Start on ``record``; returns messages to show before the first turn (usually none), or a
        :class:`Prompt` that replaces the row's prompt."""
        ...

    def step(self, turn: str) -> EnvStep:
        """The model's turn (its decoded text, end token stripped) -> observation messages, reward, done."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class ToolUser(Protocol):
    """An environment whose tools the prompt should list (chat templates render them from ``tools=``)."""

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The OpenAI function schemas of the tools (:meth:`Tool.schema`)."""
        ...


@runtime_checkable
class TurnObserver(Protocol):
    """An environment that also wants each turn's tokens (the loop calls it before ``step``, and for a turn cut
    by the token budget, which is never stepped): ``prompt_tokens`` is the length of the context it continued."""

    def observe_turn(self, *, prompt_tokens: int, result: TurnResult) -> None:
        ...


EnvironmentFactory = Callable[..., Environment]
"""``factory(**options) -> Environment``: the ``hybridflow.registry.ENVIRONMENTS`` entries."""


@dataclass(frozen=True, kw_only=True)
class TurnRequest:
    """Sample one turn: continue ``token_ids`` (the whole trajectory so far) by at most ``max_tokens``.

    ``session``: the trajectory's key, the same on each of its turns (a server rollout sends it as the router's
    ``X-Session-ID``, so the turns reach the replica that holds their prefix); empty: none."""

    token_ids: tuple[int, ...]
    max_tokens: int
    seed: int
    session: str = ""


@dataclass(frozen=True, kw_only=True)
class TurnResult:
    """The sampled tokens (ending with EOS unless cut at ``max_tokens``), their log-probs, and the weights
    version that sampled them."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finished: bool
    version: int = 0

    @classmethod
    def cut(cls, token_ids: Sequence[int], logprobs: Sequence[float], *, eos: int, version: int = 0) -> TurnResult:
        """A sampled row (already within its budget) up to and including its first ``eos``: ``finished`` iff it
        sampled one."""
        ids = list(token_ids)
        ends = ids.index(eos) + 1 if eos in ids else len(ids)
        return cls(token_ids=tuple(ids[:ends]), logprobs=tuple(list(logprobs)[:ends]), finished=eos in ids,
                   version=version)


class TurnServer(Protocol):
    """Token-in, token-out sampling for trajectories that advance independently."""

    def submit(self, request: TurnRequest) -> Future[TurnResult]:
        ...

    def submit_many(self, requests: Sequence[TurnRequest]) -> list[Future[TurnResult]]:
        """Submit ``requests`` at once, so they can be sampled as one batch."""
        ...
