"""The ``calculator`` tool and :func:`run_tool_calls`, which runs one turn's calls concurrently.

Tools report a model-readable failure by returning text that starts with ``error:`` (or by raising: the
runner turns any exception into such a text). Either way the :class:`ToolResult` has ``error=True``.
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

from hybridflow.agents.protocols import Tool, ToolCall, ToolResult
from hybridflow.registry import TOOLS

MAX_EXPONENT = 100
MAX_DIGITS = 1000
_MAX_BITS = int(MAX_DIGITS * math.log2(10)) + 1
_BINARY_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, ``+ - * / // % **``, unary ``-``/``+``, parentheses.

    Raises ``ValueError`` for anything else (names, calls, attributes, strings), for an exponent beyond
    ``MAX_EXPONENT`` in size, a result over ``MAX_DIGITS`` digits, division by zero or a non-finite result.
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r} ({exc.msg})") from exc
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, str or complex
        value: int | float = node.value  # type: ignore[assignment]
        return _checked(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _checked(_UNARY_OPS[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _checked(_BINARY_OPS[type(node.op)](left, right))
        except ZeroDivisionError as exc:
            raise ValueError("division by zero") from exc
        except OverflowError as exc:
            raise ValueError("result too large") from exc
    raise ValueError(f"unsupported syntax {type(node).__name__!r}: only numbers, + - * / // % ** and "
                     "parentheses are allowed")


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} too large (at most {MAX_EXPONENT} in size)")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 \
            and (abs(base).bit_length() - 1) * exponent > _MAX_BITS:
        raise ValueError(f"result has more than {MAX_DIGITS} digits")
    if isinstance(exponent, float) and not exponent.is_integer() and base < 0:
        raise ValueError("a negative number to a fractional power is not a real number")


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise ValueError(f"result has more than {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not a finite number")
    if isinstance(value, complex):
        raise ValueError("result is not a real number")
    return value


def format_number(value: int | float) -> str:
    """``7`` for ints and integral floats, else 12 significant digits (``0.3`` for ``0.1 + 0.2``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def calculate(expression: str) -> str:
    """The calculator tool's function: the value as text, or ``error: why``."""
    try:
        return format_number(evaluate_arithmetic(expression))
    except ValueError as exc:
        return f"error: {exc}"


def calculator_tool(*, timeout_s: float = 2.0) -> Tool:
    """The ``calculator`` tool: safe arithmetic on one ``expression`` argument."""
    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
        parameters={"type": "object",
                    "properties": {"expression": {"type": "string", "description": "e.g. (12 + 3) * 4"}},
                    "required": ["expression"]},
        fn=calculate,
        timeout_s=timeout_s,
    )


def truncate_output(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters, with a note saying how many were dropped."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n... [output truncated: {len(text) - max_chars} characters dropped]"


class DaemonThreads(Executor):
    """Runs each call on a daemon thread of its own: a tool that never returns holds neither a pool's worker nor
    the interpreter's exit (a pool's threads are joined at exit, so one hung call would hang the run's end)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # the caller's future carries it; the thread ends here
                future.set_exception(err)

        threading.Thread(target=run, name="hybridflow-tool", daemon=True).start()
        return future


def run_tool_calls(calls: Sequence[ToolCall], tools: Mapping[str, Tool], *, executor: Executor,
                   max_output_chars: int = 4000) -> list[ToolResult]:
    """Run one turn's calls concurrently on ``executor``; one result per call, in the calls' order.

    Each call is bounded by its tool's ``timeout_s``: past it the result says so (``timed_out=True``) and the
    runner returns without waiting (the call's thread finishes in the background; a tool that must be stopped,
    like ``python``, enforces its own limit). Unknown tools, bad arguments, exceptions and non-text outputs
    become error results; nothing a tool does makes this raise.
    """
    started: list[tuple[float, Future[tuple[str, float, bool]] | ToolResult]] = []
    for call in calls:
        refused = _refusal(call, tools)
        if refused is not None:
            started.append((time.monotonic(), refused))
        else:
            started.append((time.monotonic(), executor.submit(_call_tool, tools[call.name], call.arguments)))
    results: list[ToolResult] = []
    for call, (start, pending) in zip(calls, started, strict=True):
        if isinstance(pending, ToolResult):
            results.append(pending)
            continue
        timeout_s = tools[call.name].timeout_s
        try:
            content, seconds, failed = pending.result(timeout=max(0.0, start + timeout_s - time.monotonic()))
        except FutureTimeoutError:
            pending.cancel()  # only stops a call still queued behind a busy executor
            results.append(ToolResult(call=call, content=f"error: tool {call.name!r} timed out after "
                                      f"{float(timeout_s)} s", seconds=time.monotonic() - start,
                                      error=True, timed_out=True))
            continue
        results.append(ToolResult(call=call, content=truncate_output(content, max_output_chars),
                                  seconds=seconds, error=failed or content.startswith("error:")))
    return results


def _refusal(call: ToolCall, tools: Mapping[str, Tool]) -> ToolResult | None:
    """An error result for a call that cannot start (unknown tool, arguments that do not fit), else None."""
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(call=call, error=True,
                          content=f"error: unknown tool {call.name!r}; valid tools: {sorted(tools)}")
    try:
        inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as exc:
        required = list(tool.parameters.get("required") or ())
        properties = list((tool.parameters.get("properties") or {}).keys())
        return ToolResult(call=call, error=True,
                          content=f"error: bad arguments for tool {call.name!r} ({exc}); it takes "
                                  f"required {required} of properties {properties}")
    except ValueError:  # a callable without an inspectable signature: let the call itself decide
        return None
    return None


def _call_tool(tool: Tool, arguments: Mapping[str, Any]) -> tuple[str, float, bool]:
    """``(content, seconds, raised)`` of one call; runs on the executor."""
    start = time.monotonic()
    try:
        output: Any = tool.fn(**arguments)
    except (Exception, SystemExit) as exc:  # a tool's failure is an observation, never the runner's
        return f"error: {type(exc).__name__}: {exc}", time.monotonic() - start, True
    content = output if isinstance(output, str) else str(output)
    return content, time.monotonic() - start, False


TOOLS.add("calculator", calculator_tool)
