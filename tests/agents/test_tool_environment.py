"""ToolEnvironment through the registry: turns with calls get tool messages, a turn without calls ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.agents.protocols import Environment, EnvRecord
from hybridflow.agents.tool_env import PARSE_ERROR_NAME, ToolEnvironment, shared_executor
from hybridflow.registry import ENVIRONMENTS


def _hermes(expression: str) -> str:
    return f'<tool_call>{json.dumps({"name": "calculator", "arguments": {"expression": expression}})}</tool_call>'


def test_calculator_environment_from_the_registry() -> None:
    env = ENVIRONMENTS.get("calculator")()
    assert isinstance(env, Environment)
    assert env.reset(EnvRecord(index=0, prompt="What is 12*34?")) == []
    step = env.step(f"I will compute. {_hermes('12*34')} {_hermes('1/0')}")
    assert not step.done and step.info == {"parse_errors": 0}
    assert [(m["role"], m["name"], m["content"]) for m in step.observation] == [
        ("tool", "calculator", "408"), ("tool", "calculator", "error: division by zero")]
    assert [r.error for r in step.tool_results] == [False, True]
    final = env.step("The answer is 408.")
    assert final.done and final.observation == [] and final.tool_results == ()
    env.close()


def test_parse_errors_are_shown_and_do_not_end_the_trajectory() -> None:
    env = ENVIRONMENTS.get("tools")(tools=["calculator"])
    step = env.step("<tool_call>{oops</tool_call>")
    assert not step.done and step.tool_results == () and step.info == {"parse_errors": 1}
    (message,) = step.observation
    assert message["role"] == "tool" and message["name"] == PARSE_ERROR_NAME
    assert message["content"].startswith("error: tool call 1: invalid JSON")


def test_compact_format_with_two_tools(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "the moon is made of rock"}\n{"id": "b", "text": "cheese is food"}\n')
    env = ToolEnvironment(tools=("calculator", "retrieval"), format="compact",
                          tool_options={"retrieval": {"corpus": str(corpus), "top_k": 1}})
    step = env.step("@calculator(6*7) @retrieval(what is the moon made of)")
    assert [m["content"] for m in step.observation] == ["42", "[1] a: the moon is made of rock"]


def test_record_create_kwargs_rebuild_the_tool_for_that_row(tmp_path: Path) -> None:
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text('{"id": "f", "text": "alpha facts"}\n')
    second.write_text('{"id": "s", "text": "alpha lore"}\n')
    env = ToolEnvironment(tools="retrieval", format="compact", tool_options={"retrieval": {"corpus": str(first)}})
    assert env.step("@retrieval(alpha)").observation[0]["content"].startswith("[1] f:")
    env.reset(EnvRecord(index=1, prompt="q", tools_kwargs={"retrieval": {"create_kwargs": {"corpus": str(second)}}}))
    assert env.step("@retrieval(alpha)").observation[0]["content"].startswith("[1] s:")
    env.reset(EnvRecord(index=2, prompt="q"))  # the next row without kwargs gets the configured tool back
    assert env.step("@retrieval(alpha)").observation[0]["content"].startswith("[1] f:")


def test_configuration_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"tool_options has options for \['python'\]"):
        ToolEnvironment(tools=("calculator",), tool_options={"python": {"timeout_s": 1}})
    with pytest.raises(KeyError, match="unknown tool 'nope'"):
        ToolEnvironment(tools=("nope",))
    with pytest.raises(KeyError, match="unknown tool-call format 'xml'"):
        ToolEnvironment(format="xml")
    with pytest.raises(TypeError, match="tool 'calculator': options \\['digits'\\]"):
        ToolEnvironment(tool_options={"calculator": {"digits": 3}})
    env = ToolEnvironment()
    with pytest.raises(ValueError, match=r"record\.tools_kwargs names tool 'python'"):
        env.reset(EnvRecord(index=0, prompt="q", tools_kwargs={"python": {"create_kwargs": {}}}))


def test_the_default_executor_is_shared_and_a_hung_tool_does_not_hold_the_exit() -> None:
    import subprocess
    import sys
    import time

    assert shared_executor() is shared_executor()
    code = ("import time\nfrom hybridflow.agents import Tool, ToolCall\n"
            "from hybridflow.agents.tool_env import shared_executor\n"
            "from hybridflow.agents.tools import run_tool_calls\n"
            "hang = Tool(name='hang', description='never returns', parameters={'type': 'object', 'properties': {}},"
            " fn=lambda: time.sleep(10**6), timeout_s=0.2)\n"
            "[result] = run_tool_calls([ToolCall(name='hang', arguments={})], {'hang': hang}, "
            "executor=shared_executor())\nprint(result.timed_out)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    assert time.monotonic() - started < 30  # the interpreter exits although the call still sleeps
