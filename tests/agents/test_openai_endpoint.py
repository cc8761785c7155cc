"""Agents written with the real ``openai`` SDK, trained through the rollout's OpenAI-compatible endpoint: the loop
keeps the sampled tokens, the SDK sees parsed tool calls, rewritten histories and dead trajectories fail fast."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
from chat_templates import chat_tokenizer
from openai_agents import HermesLike
from test_agent_steps import LOADER, likely_eos, varied_scores

from hybridflow.agents.chat import ChatRenderer
from hybridflow.agents.loop import AgentSettings, EnvironmentFailure, Trajectory, run_trajectories
from hybridflow.agents.openai_agent import OpenAIAgentEnvironment
from hybridflow.agents.openai_endpoint import openai_endpoint
from hybridflow.agents.protocols import EnvRecord, TurnRequest, TurnResult
from hybridflow.agents.server import BatchingTurnServer
from hybridflow.graph import load_graph
from hybridflow.graph.agents import with_environment
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, default_plan
from hybridflow.runtime.agent_rollout import trajectory_batch

pytestmark = pytest.mark.timeout(60)

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
QUESTION = "What is 12*34?"
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
HELPERS = Path(__file__).with_name("openai_agents.py")


class ScriptedModel:
    """Answers a trajectory's turn t with ``turns[t]``, t counted from the assistant generation prompts in the
    request (the prompt is the agent's, so its length is not known in advance); optionally slow."""

    def __init__(self, renderer: ChatRenderer, turns: Sequence[str], *, delay_s: float = 0.0) -> None:
        self.renderer, self.turns, self.delay_s = renderer, list(turns), delay_s
        self.opening = renderer.encode("<|im_start|>assistant")

    def __call__(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        time.sleep(self.delay_s)
        results = []
        for request in requests:
            ids, width = list(request.token_ids), len(self.opening)
            turn = sum(ids[i:i + width] == self.opening for i in range(len(ids))) - 1
            out = [*self.renderer.encode(self.turns[min(turn, len(self.turns) - 1)]), self.renderer.turn_end_id]
            out = out[:request.max_tokens]
            results.append(TurnResult(token_ids=tuple(out), logprobs=tuple(-0.25 for _ in out),
                                      finished=out[-1] == self.renderer.turn_end_id))
        return results


def roll(agent: Callable[..., Any], turns: Sequence[str], *, rows: int = 1, delay_s: float = 0.0,
         request_timeout_s: float = 30.0, **settings: Any
         ) -> tuple[list[Trajectory], list[OpenAIAgentEnvironment], ChatRenderer]:
    tokenizer, end = chat_tokenizer("qwen2")
    renderer = ChatRenderer(tokenizer, turn_end_id=end)
    envs: list[OpenAIAgentEnvironment] = []

    def make_env(record: EnvRecord) -> OpenAIAgentEnvironment:
        envs.append(OpenAIAgentEnvironment(agent, tool_format=HermesLike(), request_timeout_s=request_timeout_s))
        return envs[-1]

    records = [EnvRecord(index=i, prompt=QUESTION) for i in range(rows)]
    with BatchingTurnServer(ScriptedModel(renderer, turns, delay_s=delay_s)) as server:
        out = run_trajectories(records, [[0]] * rows, server=server, renderer=renderer, make_env=make_env,
                               environment="openai_agent", seeds=list(range(rows)),
                               settings=AgentSettings(**{"max_tokens": 600, "max_turn_tokens": 120, **settings}))
    return out, envs, renderer


def test_an_sdk_agent_calls_a_tool_then_answers_and_trains_on_the_sampled_tokens() -> None:
    seen: list[Any] = []

    def agent(client: openai.OpenAI, record: EnvRecord) -> float:
        seen.append(client.models.list().data[0].id)
        messages: list[Any] = [{"role": "user", "content": record.prompt}]
        first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        seen.append(first)
        messages.append(first.choices[0].message)  # the SDK's own object, serialised back by the SDK
        for call in first.choices[0].message.tool_calls or []:
            expression = json.loads(call.function.arguments)["expression"]
            left, right = expression.split("*")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(int(left) * int(right))})
        second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        seen.append(second)
        return 1.0 if "408" in (second.choices[0].message.content or "") else 0.0

    (trajectory,), (env,), renderer = roll(agent, ["Let me compute. " + CALL, "The answer is 408."])
    prompt = renderer.prompt_ids([{"role": "user", "content": QUESTION}], tools=TOOLS)
    first = [*renderer.encode("Let me compute. " + CALL), renderer.turn_end_id]
    observation = renderer.observation_ids([{"role": "tool", "content": "408"}])
    second = [*renderer.encode("The answer is 408."), renderer.turn_end_id]
    assert trajectory.prompt_ids == prompt  # the agent's first request is the prompt, tools listed
    assert trajectory.tokens == first + observation + second  # byte for byte: the turns as sampled
    assert trajectory.sampled == [True] * len(first) + [False] * len(observation) + [True] * len(second)
    assert (trajectory.turns, trajectory.env_reward, trajectory.finished) == (2, 1.0, True)
    # The SDK parsed the first turn's tool call.
    model_id, reply, answer = seen
    assert model_id == "hybridflow-policy"
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute."
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == \
        ("function", "calculator", {"expression": "12*34"})
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(first)
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content == "The answer is 408."
    # Every request as served: the context it continued and the exact sampled tokens.
    assert [(r.prompt_tokens, list(r.completion_ids)) for r in env.requests] == \
        [(len(prompt), first), (len(prompt) + len(first) + len(observation), second)]
    assert all(lp == -0.25 for r in env.requests for lp in r.completion_logprobs)


def test_concurrent_trajectories_each_get_their_own_conversation() -> None:
    def agent(client: openai.OpenAI, record: EnvRecord) -> float:
        messages: list[Any] = [{"role": "user", "content": f"row {record.index}"}]
        reply = client.chat.completions.create(model="policy", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "and?"}]
        client.chat.completions.create(model="policy", messages=messages)
        return float(record.index)

    out, envs, renderer = roll(agent, ["one", "two"], rows=4)
    assert [t.env_reward for t in out] == [0.0, 1.0, 2.0, 3.0] and all(t.turns == 2 for t in out)
    assert [t.prompt_ids for t in out] == [renderer.prompt_ids([{"role": "user", "content": f"row {i}"}])
                                           for i in range(4)]
    assert len({env.trajectory_id for env in envs}) == 4


def test_an_async_agent_with_the_async_client() -> None:
    async def agent(client: openai.AsyncOpenAI, record: EnvRecord) -> float:
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        return 0.5 if reply.choices[0].message.content == "hello" else 0.0

    (trajectory,), _, _ = roll(agent, ["hello"])
    assert (trajectory.turns, trajectory.env_reward, trajectory.finished) == (1, 0.5, True)


def test_a_rewritten_history_gets_409_and_ends_the_trajectory() -> None:
    errors: list[openai.APIStatusError] = []

    def agent(client: openai.OpenAI, record: EnvRecord) -> float:
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        edited = {"role": "assistant", "content": reply.choices[0].message.content + " (edited)"}
        try:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}, edited,
                                                                     {"role": "user", "content": "go on"}])
        except openai.APIStatusError as err:
            errors.append(err)
        return 1.0

    (trajectory,), (env,), renderer = roll(agent, ["hello", "never sampled"])
    assert [err.status_code for err in errors] == [409]
    assert errors[0].body["code"] == "history_rewritten"  # type: ignore[index]
    assert trajectory.turns == 1 and trajectory.finished and trajectory.env_reward == 0.0
    assert trajectory.tokens == [*renderer.encode("hello"), renderer.turn_end_id]
    assert env._thread is not None and not env._thread.is_alive()


def test_an_agent_that_raises_fails_the_rollout_naming_the_row() -> None:
    def agent(client: openai.OpenAI, record: EnvRecord) -> float:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        if record.index == 1:
            raise ValueError("the agent's own tool broke")
        return 1.0

    with pytest.raises(EnvironmentFailure, match=r"'openai_agent' raised in step on row 1 \(turn 1\).*tool broke"):
        roll(agent, ["hello"], rows=2)


def test_an_agent_that_never_asks_fails_reset() -> None:
    with pytest.raises(EnvironmentFailure, match=r"raised in reset on row 0.*without sending a chat request"):
        roll(lambda client, record: 1.0, ["hello"])


def test_a_rollout_that_does_not_answer_in_time_gets_504_not_a_hang() -> None:
    statuses: list[int] = []

    def agent(client: openai.OpenAI, record: EnvRecord) -> float:
        try:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        except openai.APIStatusError as err:
            statuses.append(err.status_code)
        return 0.0

    start = time.monotonic()
    (trajectory,), _, _ = roll(agent, ["hello"], delay_s=1.5, request_timeout_s=0.5)
    assert statuses == [504] and trajectory.finished and time.monotonic() - start < 20


def test_a_trajectory_cut_by_max_turns_fails_the_agents_pending_call_fast() -> None:
    statuses: list[int] = []

    def agent(client: openai.OpenAI, record: EnvRecord) -> float:
        messages: list[Any] = [{"role": "user", "content": "hi"}]
        try:
            while True:
                reply = client.chat.completions.create(model="policy", messages=messages)
                messages += [reply.choices[0].message, {"role": "user", "content": "more"}]
        except openai.APIStatusError as err:
            statuses.append(err.status_code)
        return 1.0

    (trajectory,), (env,), _ = roll(agent, ["hello"], max_turns=2)
    assert trajectory.turns == 2 and not trajectory.finished
    assert env._thread is not None and not env._thread.is_alive()  # close() ended the agent, not the timeout
    assert statuses == [410]
    later = urllib.request.Request(f"{env.base_url}/models")
    with pytest.raises(urllib.error.HTTPError) as gone:
        urllib.request.urlopen(later, timeout=10)
    assert gone.value.code == 404  # a closed trajectory is no longer routed


def test_unknown_trajectories_and_bad_bodies_get_openai_shaped_errors() -> None:
    endpoint = openai_endpoint()
    assert endpoint is openai_endpoint()  # one per process
    client = openai.OpenAI(base_url=endpoint.base_url("no-such-trajectory"), api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.body["code"] == "trajectory_not_found"  # type: ignore[index]

    env = OpenAIAgentEnvironment(lambda client, record: 0.0, tool_format=HermesLike(), request_timeout_s=5)
    trajectory_id = endpoint.register(env)
    try:
        for body, code in ((b"{not json", "invalid_json"), (b'{"messages": []}', "invalid_messages"),
                           (b'{"messages": [{"content": "x"}]}', "invalid_messages")):
            request = urllib.request.Request(f"{endpoint.base_url(trajectory_id)}/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"}, method="POST")
            with pytest.raises(urllib.error.HTTPError) as bad:
                urllib.request.urlopen(request, timeout=10)
            error = json.loads(bad.value.read())["error"]
            assert bad.value.code == 400 and error["code"] == code and error["type"] == "invalid_request_error"
            assert bad.value.headers["x-should-retry"] == "false"
    finally:
        endpoint.unregister(trajectory_id)


def test_close_unblocks_a_request_waiting_on_the_rollout() -> None:
    env = OpenAIAgentEnvironment(lambda client, record: 0.0, tool_format=HermesLike(), request_timeout_s=30)
    env.trajectory_id = openai_endpoint().register(env)
    outcome: list[BaseException] = []

    def call() -> None:
        client = openai.OpenAI(base_url=env.base_url, api_key="unused", max_retries=0)
        try:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        except openai.APIStatusError as err:
            outcome.append(err)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    time.sleep(0.3)  # the request is waiting in the mailbox
    started = time.monotonic()
    env.close()
    caller.join(timeout=10)
    assert not caller.is_alive() and time.monotonic() - started < 10
    assert [getattr(err, "status_code", None) for err in outcome] == [410]


def test_a_replaced_prompt_must_extend_the_rows_prompt_tokens() -> None:
    """The trainer scores responses after the node's prompts port, so the extra prompt tokens lead the response
    without loss, and a prompt that is not an extension is refused rather than trained off-policy."""
    trajectory = Trajectory(index=3, environment="openai_agent", prompt_ids=[1, 2, 3, 4])
    trajectory.extend([5, 6], sampled=True, logprobs=[-1.0, -2.0], version=0)
    batch = trajectory_batch([trajectory], pad=0, prompts=[[1, 2]])
    assert batch["responses"][0].tolist() == [3, 4, 5, 6]
    assert batch["loss_mask"][0].tolist() == [0, 0, 1, 1]
    assert batch["rollout_logprobs"][0].tolist() == [0.0, 0.0, -1.0, -2.0]
    with pytest.raises(ValueError, match=r"row 3: environment 'openai_agent' .* does not extend the row's prompt"):
        trajectory_batch([trajectory], pad=0, prompts=[[9, 2]])


def test_a_controller_step_with_an_sdk_agent_is_on_policy(random_model_dir: Path) -> None:
    graph = load_graph("grpo_no_ref", reward_kind="reward_function", max_new_tokens=40, rollout_correction="tis")
    graph = with_environment(graph, "openai_agent", max_turns=3, max_turn_tokens=8,
                             env_options={"agent": f"{HELPERS}:chatty", "tool_format": f"{HELPERS}:HermesLike",
                                          "request_timeout_s": 30})
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(random_model_dir),
                              optim=OptimSpec(lr=1e-3) if r.kind.trainable else None)
             for r in graph.roles if r.kind.needs_gpu}
    with Controller(graph, default_plan(graph), specs=specs, driver_roles={"reward": varied_scores}) as controller:
        likely_eos(controller)
        batch = controller.step(LOADER.batch(0), step=0).batch
    mask, loss_mask = batch["response_mask"], batch["loss_mask"]
    observed = (mask != 0) & (loss_mask == 0)
    assert bool(observed.any()), "no trajectory got a follow-up user turn: nothing multi-turn was tested"
    assert int(batch["turns"].max()) >= 2
    sampled = loss_mask != 0
    gap = (batch["old_logprobs"] - batch["rollout_logprobs"]).abs()[sampled]
    assert float(gap.max()) < 1e-5
    assert bool((batch["rollout_logprobs"][observed] == 0).all())
    traces = [json.loads(trace) for trace in batch["agent_trace"]]
    returned = [t["env_reward"] for t in traces if not t["truncated"] and t["turns"] == 3]
    assert returned and all(reward == 0.25 for reward in returned)  # what the agent returned is the env reward
