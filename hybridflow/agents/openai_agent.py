"""Agents written against the ``openai`` SDK as environments: ``environment="openai_agent"``.

A user writes ``def agent(client: openai.OpenAI, record: EnvRecord) -> float`` (or ``async def`` taking an
``openai.AsyncOpenAI``): it chats through ``client.chat.completions.create(model=..., messages=..., tools=...)``,
runs its own tools and returns the trajectory's reward. Control is inverted so that the agent loop keeps owning
the tokens: the agent runs on a thread of its own, and each of its requests is a turn of the loop.

- ``reset``: the agent starts; its first request's ``messages`` and ``tools`` become the trajectory's prompt.
- ``step(turn)``: the pending request is answered with the sampled turn (tool calls parsed by ``tool_format``);
  the agent's next request must repeat the conversation so far plus that answer, and the messages it adds are the
  observation (templated as a token suffix, never re-rendered). The agent returning ends the trajectory with its
  reward; raising fails the rollout (an ``EnvironmentFailure`` naming the row); a request that rewrites the
  history gets HTTP 409 and ends the trajectory (``info["history_rewritten"]``).

One conversation per trajectory: requests are answered in order, and sampling parameters in the request
(``temperature``, ``max_tokens``...) are ignored, since the rollout's own settings decide how turns are sampled.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from hybridflow.agents.openai_endpoint import EndpointError, openai_endpoint
from hybridflow.agents.protocols import EnvRecord, EnvStep, Message, Prompt, ToolCallFormat, TurnResult
from hybridflow.registry import ENVIRONMENTS, TOOL_FORMATS, load_object

JOIN_TIMEOUT_S = 5.0  # how long close() waits for the agent's thread (a daemon: it cannot keep the process alive)


@dataclass(frozen=True, kw_only=True)
class RequestRecord:
    """One chat-completion request as the rollout served it: the length of the context it continued, and the
    sampled completion's token ids and log-probs (the same tokens the trajectory trains on)."""

    prompt_tokens: int
    completion_ids: tuple[int, ...]
    completion_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class _Exchange:
    """A request waiting on the rollout: its body and the answer the HTTP thread blocks on."""

    body: dict[str, Any]
    answer: Future[dict[str, Any]]


@dataclass(frozen=True)
class _Returned:
    """The agent's function came back: its value, or what it raised."""

    value: Any = None
    error: BaseException | None = None


class _Mailbox:
    """What the agent sends the rollout (requests, then its return), in order; closing fails what is pending."""

    def __init__(self) -> None:
        self._items: deque[_Exchange | _Returned] = deque()
        self._ready = threading.Condition()
        self.closed = False

    def put(self, item: _Exchange | _Returned) -> bool:
        with self._ready:
            if self.closed:
                return False
            self._items.append(item)
            self._ready.notify()
            return True

    def get(self, timeout_s: float) -> _Exchange | _Returned | None:
        with self._ready:
            self._ready.wait_for(lambda: self._items or self.closed, timeout=timeout_s)
            return self._items.popleft() if self._items and not self.closed else None

    def close(self) -> list[_Exchange | _Returned]:
        with self._ready:
            self.closed = True
            items, self._items = list(self._items), deque()
            self._ready.notify_all()
            return items


@ENVIRONMENTS.register("openai_agent")
class OpenAIAgentEnvironment:
    """Runs ``agent`` (``path/file.py:fn`` or ``module:fn``) against this process's OpenAI endpoint.

    ``tool_format``: how tool calls are parsed from a turn into the completion's ``tool_calls`` (a
    ``TOOL_FORMATS`` name or ``path/file.py:Class``). ``request_timeout_s`` bounds every wait: a request the
    rollout does not answer in time gets 504; an agent that neither calls again nor returns in time ends the
    trajectory (``info["agent_timed_out"]``), and one that never sends its first request fails ``reset``.
    ``model`` is the name ``GET /models`` lists (requests may name any model).
    """

    def __init__(self, agent: str | Callable[..., Any], tool_format: str | ToolCallFormat = "hermes",
                 request_timeout_s: float = 300.0, model: str = "hybridflow-policy") -> None:
        if request_timeout_s <= 0:
            raise ValueError(f"openai_agent: request_timeout_s={request_timeout_s} must be > 0")
        self.agent = load_object(agent) if isinstance(agent, str) else agent
        if not callable(self.agent):
            raise TypeError(f"openai_agent: agent={agent!r} is a {type(self.agent).__name__}, not a function "
                            "agent(client, record) -> float")
        self.format: ToolCallFormat = TOOL_FORMATS.get(tool_format)() if isinstance(tool_format, str) else tool_format
        self.request_timeout_s, self.model = request_timeout_s, model
        self.requests: list[RequestRecord] = []
        self.trajectory_id = ""
        self._mailbox = _Mailbox()
        self._thread: threading.Thread | None = None
        self._pending: _Exchange | None = None
        self._history: list[Message] = []  # the conversation the next request must start with
        self._tools: Any = None

    @property
    def base_url(self) -> str:
        return openai_endpoint().base_url(self.trajectory_id)

    def reset(self, record: EnvRecord) -> Prompt:
        """Start the agent and wait for its first request: that request's messages and tools are the prompt."""
        self.trajectory_id = openai_endpoint().register(self)
        self._thread = threading.Thread(target=self._run_agent, args=(record,), daemon=True,
                                        name=f"openai-agent-{record.index}")
        self._thread.start()
        item = self._mailbox.get(self.request_timeout_s)
        if item is None:
            raise TimeoutError(f"the agent sent no request within request_timeout_s={self.request_timeout_s}")
        if isinstance(item, _Returned):
            if item.error is not None:
                raise RuntimeError(f"the agent raised before its first request: {item.error!r}") from item.error
            raise RuntimeError(f"the agent returned {item.value!r} without sending a chat request")
        self._pending, self._history, self._tools = item, list(item.body["messages"]), item.body.get("tools")
        return Prompt(messages=[_for_template(m) for m in self._history], tools=self._tools)

    def observe_turn(self, *, prompt_tokens: int, result: TurnResult) -> None:
        self.requests.append(RequestRecord(prompt_tokens=prompt_tokens, completion_ids=tuple(result.token_ids),
                                           completion_logprobs=tuple(result.logprobs)))

    def step(self, turn: str) -> EnvStep:
        """Answer the pending request with ``turn``; then the agent's next request is the observation, or its
        return the reward."""
        if self._pending is None:
            raise RuntimeError("openai_agent: step() with no request waiting (before reset, or after the end)")
        parsed = self.format.parse(turn)
        message = _assistant_message(turn, parsed.calls)
        self._pending.answer.set_result(self._completion(message))
        self._pending, self._history = None, [*self._history, message]
        item = self._mailbox.get(self.request_timeout_s)
        info: dict[str, Any] = {"parse_errors": len(parsed.errors)}
        if item is None:
            return EnvStep(done=True, info={**info, "agent_timed_out": 1})
        if isinstance(item, _Returned):
            if item.error is not None:
                raise RuntimeError(f"the agent raised: {type(item.error).__name__}: {item.error}") from item.error
            return EnvStep(done=True, reward=_reward(item.value), info=info)
        messages = item.body["messages"]
        seen = len(self._history)
        if (item.body.get("tools") != self._tools or len(messages) < seen
                or [_canonical(m) for m in messages[:seen]] != [_canonical(m) for m in self._history]):
            item.answer.set_exception(EndpointError(
                HTTPStatus.CONFLICT, "this conversation does not extend the previous request plus the assistant "
                "message returned to it (same messages, same tools); a trajectory is one growing conversation, so "
                "this one has ended", code="history_rewritten"))
            return EnvStep(done=True, info={**info, "history_rewritten": 1})
        self._pending, self._history = item, list(messages)
        return EnvStep(observation=[_for_template(m) for m in messages[seen:]], info=info)

    def close(self) -> None:
        """Stop waiting: pending and later requests fail at once, and the agent's thread is given a moment."""
        if self.trajectory_id:
            openai_endpoint().unregister(self.trajectory_id)
        for item in [*self._mailbox.close(), *([self._pending] if self._pending else [])]:
            if isinstance(item, _Exchange) and not item.answer.done():
                item.answer.set_exception(_ended())
        self._pending = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=JOIN_TIMEOUT_S)

    def chat_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """The endpoint's side (a request thread): queue the request, block until the rollout answers it."""
        _validate(body)
        exchange = _Exchange(body=body, answer=Future())
        if not self._mailbox.put(exchange):
            raise _ended()
        try:
            return exchange.answer.result(timeout=self.request_timeout_s)
        except FutureTimeout as err:
            raise EndpointError(HTTPStatus.GATEWAY_TIMEOUT, f"the rollout did not answer within request_timeout_s="
                                f"{self.request_timeout_s}", code="rollout_timeout", type="server_error") from err

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                            "owned_by": "hybridflow"}]}

    def _completion(self, message: Message) -> dict[str, Any]:
        served = self.requests[-1] if self.requests else None
        prompt_tokens = served.prompt_tokens if served else 0
        completion_tokens = len(served.completion_ids) if served else 0
        assert self._pending is not None
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": str(self._pending.body.get("model") or self.model),
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def _run_agent(self, record: EnvRecord) -> None:
        try:
            value = self._call_agent(record)
        except BaseException as err:  # the rollout reports it (raised from step/reset), so it must see it
            self._mailbox.put(_Returned(error=err))
        else:
            self._mailbox.put(_Returned(value=value))

    def _call_agent(self, record: EnvRecord) -> Any:
        try:
            import openai
        except ImportError as err:
            raise ImportError("environment 'openai_agent' needs the openai SDK: pip install openai") from err
        # No SDK retries: a retried request would ask for a turn the trajectory already holds.
        options: dict[str, Any] = {"base_url": self.base_url, "api_key": "unused", "max_retries": 0,
                   "timeout": self.request_timeout_s + 5.0}
        if inspect.iscoroutinefunction(self.agent):
            async def run_async() -> Any:
                async with openai.AsyncOpenAI(**options) as client:
                    return await self.agent(client, record)

            return asyncio.run(run_async())
        with openai.OpenAI(**options) as client:
            return self.agent(client, record)


def _ended() -> EndpointError:
    return EndpointError(HTTPStatus.GONE, "the trajectory ended (done, turn or token budget) before this request "
                         "was answered", code="trajectory_ended")


def _validate(body: Mapping[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EndpointError(HTTPStatus.BAD_REQUEST, "'messages' must be a non-empty list", code="invalid_messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise EndpointError(HTTPStatus.BAD_REQUEST, f"messages[{i}] must be an object with a 'role'",
                                code="invalid_messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise EndpointError(HTTPStatus.BAD_REQUEST, "'tools' must be a list", code="invalid_tools")
    if body.get("n", 1) not in (1, None):
        raise EndpointError(HTTPStatus.BAD_REQUEST, "n > 1 is not supported: one trajectory samples one turn at a "
                            "time", code="unsupported_n")
    if body.get("stream"):
        raise EndpointError(HTTPStatus.BAD_REQUEST, "stream=True is not supported", code="unsupported_stream")


def _assistant_message(turn: str, calls: Sequence[Any]) -> Message:
    """The completion's message: the text outside the tool calls, and the calls in OpenAI's shape."""
    if not calls:
        return {"role": "assistant", "content": turn}
    content = turn
    for call in calls:
        if call.text:
            content = content.replace(call.text, "", 1)
    return {"role": "assistant", "content": content.strip() or None,
            "tool_calls": [{"id": call.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": call.name, "arguments": json.dumps(dict(call.arguments))}}
                           for call in calls]}


def _text(content: Any) -> str:
    """A message's content as text (``None``, a string, or a list of ``{"type": "text", "text"}`` parts)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _canonical(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What two renderings of one message share, whatever the SDK serialised (``None`` fields, content parts,
    JSON spacing of arguments): role, text, tool calls (name and parsed arguments), tool_call_id and name."""
    calls = tuple((str(call.get("function", {}).get("name")), json.dumps(_arguments(call.get("function", {})
                                                                                  .get("arguments")), sort_keys=True))
                  for call in message.get("tool_calls") or ())
    return (message.get("role"), _text(message.get("content")), calls, message.get("tool_call_id") or None,
            message.get("name") or None)


def _for_template(message: Mapping[str, Any]) -> Message:
    """A request message as HF chat templates take it: text content, tool-call arguments as objects, no nulls."""
    rendered: Message = {key: value for key, value in message.items() if value is not None}
    rendered["content"] = _text(message.get("content"))
    if message.get("tool_calls"):
        rendered["tool_calls"] = [{**call, "function": {**call.get("function", {}),
                                                        "arguments": _arguments(call.get("function", {})
                                                                                .get("arguments"))}}
                                  for call in message["tool_calls"]]
    return rendered


def _reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"the agent returned {value!r}; it must return the trajectory's reward as a float")
    return float(value)
