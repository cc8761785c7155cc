"""The skyrl-gym and TRL environment_factory adapters, on a real skyrl-gym env and small user environments."""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from hybridflow.agents import Environment, EnvRecord, Message, ParsedTurn, ToolCall, ToolResult
from hybridflow.agents.external_envs import TRLEnvironment
from hybridflow.agents.records import env_record
from hybridflow.data.records import GroundTruth
from hybridflow.registry import ENVIRONMENTS

CHAT = [{"role": "user", "content": "What is 6 * 7?"}]


class LineFormat:
    """A stand-in for the hermes format: one ``CALL name {json arguments}`` per line."""

    def parse(self, text: str) -> ParsedTurn:
        calls, errors = [], []
        for line in text.splitlines():
            if line.startswith("CALL "):
                name, _, arguments = line[5:].partition(" ")
                try:
                    calls.append(ToolCall(name=name, arguments=json.loads(arguments or "{}"), text=line))
                except json.JSONDecodeError as err:
                    errors.append(f"bad arguments for {name}: {err}")
        return ParsedTurn(calls=tuple(calls), errors=tuple(errors))

    def result_messages(self, results: Sequence[ToolResult]) -> list[Message]:
        return [{"role": "tool", "name": r.call.name, "content": r.content} for r in results]


class Counter:
    """A TRL-style environment: public methods are tools, ``get_reward`` scores the rollout."""

    def __init__(self) -> None:
        self.total = 0
        self.reset_kwargs: dict[str, object] = {}

    def reset(self, **kwargs: object) -> str:
        self.reset_kwargs = kwargs
        self.total = int(str(kwargs["start"]))
        return f"The counter starts at {self.total}."

    def add(self, amount: int) -> int:
        """Add to the counter.

        Args:
            amount: How much to add.
        """
        self.total += amount
        return self.total

    def explode(self) -> str:
        """Always fails."""
        raise RuntimeError("boom")

    def stall(self) -> str:
        """Takes too long."""
        time.sleep(2)
        return "late"

    def get_reward(self) -> float:
        return 1.0 if self.total == 10 else 0.0

    def _private(self) -> None:
        raise AssertionError("never a tool")


def counter_record() -> EnvRecord:
    columns = {"start": 3, "extra_info": {"level": 1}, "environment": "trl"}
    return env_record(0, GroundTruth("10", extra_info={"level": 1}, columns=columns, prompt=CHAT))


def test_trl_reset_gets_the_row_and_its_observation_reaches_the_model() -> None:
    env = ENVIRONMENTS.get("trl")(factory=Counter, format=LineFormat())
    assert isinstance(env, Environment) and isinstance(env, TRLEnvironment)
    assert env.reset(counter_record()) == [{"role": "user", "content": "The counter starts at 3."}]
    assert env.instance.reset_kwargs == {"start": 3, "extra_info": {"level": 1}, "prompt": CHAT, "ground_truth": "10"}


def test_trl_calls_the_method_with_the_parsed_arguments_and_get_reward_scores_the_end() -> None:
    env = TRLEnvironment(Counter, format=LineFormat())
    env.reset(counter_record())
    step = env.step('Let me add.\nCALL add {"amount": 7}')
    assert step.observation == [{"role": "tool", "name": "add", "content": "10"}] and not step.done
    assert env.instance.total == 10 and not step.tool_results[0].error
    end = env.step("The counter is 10.")
    assert end.done and end.reward == 1.0 and end.observation == []


def test_trl_failures_become_error_observations_not_exceptions() -> None:
    env = TRLEnvironment(Counter, format=LineFormat(), timeout_s=0.2)
    env.reset(counter_record())
    step = env.step("CALL explode\nCALL add {\"amount\": \"x\"}\nCALL reset\nCALL _private\nCALL add {oops")
    contents = [message["content"] for message in step.observation]
    assert contents[0].startswith("{'error': 'bad arguments for add")  # parse errors come first
    assert contents[1] == "{'error': 'boom'}"
    assert "can only concatenate" in contents[2] or "unsupported operand" in contents[2]
    assert "Tool reset not found" in contents[3] and "['add', 'explode', 'stall']" in contents[3]
    assert "Tool _private not found" in contents[4]
    assert all(result.error for result in step.tool_results) and not step.done
    assert step.info == {"tool_calls": 4, "tool_errors": 5}

    start = time.monotonic()
    late = env.step("CALL stall")
    assert late.tool_results[0].timed_out and "timed out after 0.2 s" in late.observation[0]["content"]
    assert time.monotonic() - start < 1.5


def test_trl_reset_without_kwargs_gets_only_what_it_names_and_an_async_reward_is_awaited(tmp_path: Path) -> None:
    module = tmp_path / "trl_env.py"
    module.write_text(textwrap.dedent("""
        class Quiet:
            def reset(self, ground_truth):
                self.truth = ground_truth

            def answer(self, text: str) -> str:
                \"\"\"Submit.

                Args:
                    text: The answer.
                \"\"\"
                return "right" if text == self.truth else "wrong"

            async def get_reward(self):
                return 0.5
    """))
    env = TRLEnvironment(f"{module}:Quiet", format=LineFormat())
    assert env.reset(counter_record()) == []
    assert env.instance.truth == "10"
    assert env.step('CALL answer {"text": "10"}').observation[0]["content"] == "right"
    assert env.step("no more calls").reward == 0.5  # an async get_reward, awaited


def test_trl_tools_have_schemas_from_type_hints_and_docstrings() -> None:
    pytest.importorskip("transformers")
    tools = {tool.name: tool for tool in TRLEnvironment(Counter, format=LineFormat()).tools()}
    assert sorted(tools) == ["add", "explode", "stall"]
    assert tools["add"].description == "Add to the counter."
    assert tools["add"].parameters["properties"]["amount"]["type"] == "integer"
    assert tools["add"].parameters["required"] == ["amount"]
    assert tools["add"].fn(amount=2) == "2"  # tools return text


class Bare:
    def reset(self) -> None:
        return None


def test_trl_without_get_reward_ends_at_zero_and_a_class_without_reset_is_refused() -> None:
    env = TRLEnvironment(Bare, format=LineFormat())
    assert env.reset(counter_record()) == [] and env.methods == {}
    end = env.step("an answer, no calls")
    assert end.done and end.reward == 0.0  # the run's reward functions score it
    with pytest.raises(TypeError, match="has no callable reset"):
        TRLEnvironment(object, format=LineFormat())


def gsm8k_record(truth: str = "42") -> EnvRecord:
    return env_record(0, GroundTruth(truth, extra_info={"split": "test"}, columns={"data_source": "gsm8k"},
                                     prompt=CHAT))


def test_skyrl_builtin_gsm8k_rewards_the_right_answer() -> None:
    pytest.importorskip("skyrl_gym")
    env = ENVIRONMENTS.get("skyrl")(env="gsm8k")
    assert env.reset(gsm8k_record()) == []
    step = env.step("6 * 7 = 42\n#### 42")
    assert step.done and step.reward == 1.0 and step.observation == []
    env.reset(gsm8k_record())
    assert env.step("#### 41").reward == 0.0


def test_skyrl_builtin_multi_turn_gsm8k_asks_again_after_a_wrong_answer() -> None:
    pytest.importorskip("skyrl_gym")
    env = ENVIRONMENTS.get("skyrl")(env="gsm8k_multi_turn", max_turns=3)
    env.reset(gsm8k_record())
    wrong = env.step("#### 41")
    assert not wrong.done and wrong.observation[0]["role"] == "user" and "####" in wrong.observation[0]["content"]
    right = env.step("#### 42")
    assert right.done and right.reward == 1.0


TWO_TURN_ENV = '''
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class TwoTurnEnv(BaseTextEnv):
    """Say the greeting from env_config first, then the ground truth."""

    def __init__(self, env_config, extras):
        super().__init__()
        self.greeting = env_config.greeting
        self.truth = extras["reward_spec"]["ground_truth"]
        self.bonus = extras["extra_info"]["bonus"]
        self.max_turns = extras["max_turns"]

    def init(self, prompt):
        return prompt + [{"role": "user", "content": f"First say {self.greeting}."}], {}

    def step(self, action):
        self.turns += 1
        if self.turns == 1:
            if self.greeting not in action:
                return BaseTextEnvStepOutput(observations=[], reward=0.0, done=True, metadata={"why": "rude"})
            return BaseTextEnvStepOutput(observations=[{"role": "user", "content": "Now the answer."}],
                                         reward=0.0, done=False, metadata={})
        reward = self.bonus if self.truth in action else 0.0
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={"turns": self.turns},
                                     postprocessed_action=action.strip())


class RewritingEnv(TwoTurnEnv):
    def init(self, prompt):
        return [{"role": "system", "content": "You are a REPL."}], {}
'''


def test_skyrl_user_env_needs_two_turns(tmp_path: Path) -> None:
    pytest.importorskip("skyrl_gym")
    module = tmp_path / "two_turn.py"
    module.write_text(TWO_TURN_ENV)
    env = ENVIRONMENTS.get("skyrl")(env=f"{module}:TwoTurnEnv", max_turns=2, greeting="hello")
    record = env_record(0, GroundTruth("42", extra_info={"bonus": 2.0}, prompt=CHAT))
    assert env.reset(record) == [{"role": "user", "content": "First say hello."}]
    first = env.step("hello there")
    assert not first.done and first.observation == [{"role": "user", "content": "Now the answer."}]
    second = env.step(" 42 ")
    assert second.done and second.reward == 2.0
    assert second.info == {"turns": 2, "postprocessed_action": "42"}

    env.reset(record)
    rude = env.step("42")
    assert rude.done and rude.reward == 0.0 and rude.info == {"why": "rude"}
    env.close()


def test_skyrl_refuses_a_rewritten_prompt_and_unknown_ids(tmp_path: Path) -> None:
    pytest.importorskip("skyrl_gym")
    module = tmp_path / "rewriting.py"
    module.write_text(TWO_TURN_ENV)
    env = ENVIRONMENTS.get("skyrl")(env=f"{module}:RewritingEnv", max_turns=2, greeting="hi")
    with pytest.raises(ValueError, match="rewrote the prompt in init"):
        env.reset(env_record(0, GroundTruth("42", extra_info={"bonus": 1.0}, prompt=CHAT)))
    with pytest.raises(KeyError, match=r"unknown skyrl-gym env 'gsm9k'.*'gsm8k'"):
        ENVIRONMENTS.get("skyrl")(env="gsm9k").reset(gsm8k_record())
