"""run_tool_calls: concurrency, timeouts that do not wait, and every tool failure turned into a result."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridflow.agents.protocols import Tool, ToolCall
from hybridflow.agents.tools import calculator_tool, run_tool_calls

SCHEMA = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(8)
    yield pool
    pool.shutdown(wait=False, cancel_futures=True)


def _sleep(seconds: float) -> str:
    time.sleep(seconds)
    return f"slept {seconds}"


def _tool(name: str, fn: object, *, timeout_s: float = 5.0) -> Tool:
    return Tool(name=name, description=name, parameters=SCHEMA, fn=fn, timeout_s=timeout_s)  # type: ignore[arg-type]


def _call(name: str, **arguments: object) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def test_calls_of_a_turn_run_concurrently_and_keep_their_order(executor: ThreadPoolExecutor) -> None:
    tools = {"sleep": _tool("sleep", _sleep)}
    start = time.monotonic()
    results = run_tool_calls([_call("sleep", seconds=0.5), _call("sleep", seconds=0.3)], tools, executor=executor)
    elapsed = time.monotonic() - start
    assert elapsed < 0.9, f"two calls took {elapsed:.2f} s: they ran one after the other"
    assert [r.content for r in results] == ["slept 0.5", "slept 0.3"]
    assert all(not r.error for r in results)
    assert results[0].seconds == pytest.approx(0.5, abs=0.2) and results[1].seconds == pytest.approx(0.3, abs=0.2)


def test_a_call_past_its_timeout_returns_at_the_timeout(executor: ThreadPoolExecutor) -> None:
    released = threading.Event()
    tools = {"hang": _tool("hang", lambda seconds: str(released.wait(seconds)), timeout_s=0.3),
             "calculator": calculator_tool()}
    start = time.monotonic()
    calls = [_call("hang", seconds=30), ToolCall(name="calculator", arguments={"expression": "1+1"})]
    hang, calc = run_tool_calls(calls, tools, executor=executor)
    elapsed = time.monotonic() - start
    released.set()
    assert 0.25 < elapsed < 0.8, elapsed
    assert hang.timed_out and hang.error and hang.content == "error: tool 'hang' timed out after 0.3 s"
    assert hang.seconds == pytest.approx(0.3, abs=0.2)
    assert calc.content == "2" and not calc.error


def test_unknown_tool_names_the_valid_tools(executor: ThreadPoolExecutor) -> None:
    (result,) = run_tool_calls([_call("search", q="x")], {"calculator": calculator_tool()}, executor=executor)
    assert result.error and "unknown tool 'search'" in result.content and "['calculator']" in result.content


@pytest.mark.parametrize("arguments", [{}, {"expr": "1"}, {"expression": "1", "extra": 2}])
def test_arguments_that_do_not_fit_quote_the_schema(executor: ThreadPoolExecutor, arguments: dict) -> None:
    (result,) = run_tool_calls([ToolCall(name="calculator", arguments=arguments)], {"calculator": calculator_tool()},
                               executor=executor)
    assert result.error and result.content.startswith("error: bad arguments for tool 'calculator'")
    assert "required ['expression']" in result.content


def test_a_raising_tool_becomes_an_error_result(executor: ThreadPoolExecutor) -> None:
    def broken(seconds: float) -> str:
        raise RuntimeError(f"cannot sleep {seconds}")

    def exits(seconds: float) -> str:
        raise SystemExit(3)

    tools = {"broken": _tool("broken", broken), "exits": _tool("exits", exits)}
    broke, exited = run_tool_calls([_call("broken", seconds=1), _call("exits", seconds=1)], tools, executor=executor)
    assert broke.error and broke.content == "error: RuntimeError: cannot sleep 1"
    assert exited.error and exited.content.startswith("error: SystemExit")


def test_error_text_from_a_tool_marks_the_result(executor: ThreadPoolExecutor) -> None:
    (result,) = run_tool_calls([ToolCall(name="calculator", arguments={"expression": "1/0"})],
                               {"calculator": calculator_tool()}, executor=executor)
    assert result.error and result.content == "error: division by zero"


def test_long_and_non_text_outputs(executor: ThreadPoolExecutor) -> None:
    tools = {"long": _tool("long", lambda seconds: "x" * 10_000), "number": _tool("number", lambda seconds: 42)}
    long, number = run_tool_calls([_call("long", seconds=0), _call("number", seconds=0)], tools, executor=executor,
                                  max_output_chars=100)
    assert long.content.startswith("x" * 100) and not long.content.startswith("x" * 101)
    assert "9900 characters dropped" in long.content
    assert number.content == "42" and not number.error
