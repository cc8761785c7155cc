"""``ToolEnvironment``: an environment whose only world is a set of tools (registered ``"tools"``, ``"calculator"``).

Each model turn is parsed with the tool-call format; its calls run concurrently and their results (plus one
message per call that could not be parsed) are the observation. A turn without calls ends the trajectory;
the reward is left to the reward function, which sees the whole trajectory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

from hybridflow.agents.protocols import EnvRecord, EnvStep, Message, Tool, ToolCall, ToolCallFormat, ToolResult
from hybridflow.agents.tools import DaemonThreads, run_tool_calls
from hybridflow.registry import ENVIRONMENTS, TOOL_FORMATS, TOOLS

PARSE_ERROR_NAME = "invalid_tool_call"
"""The ``name`` of the tool message that tells the model a call could not be parsed."""

def shared_executor() -> DaemonThreads:
    """The process-wide executor tool calls run on by default: a daemon thread per call (a hung tool neither
    exhausts a pool nor holds the process's exit)."""
    return _SHARED_EXECUTOR


_SHARED_EXECUTOR = DaemonThreads()


class ToolEnvironment:
    """Tools from ``TOOLS`` (options per tool in ``tool_options``), calls parsed by the ``format`` from
    ``TOOL_FORMATS``; implements :class:`hybridflow.agents.protocols.Environment`.

    ``reset`` applies a record's verl-style ``tools_kwargs`` (``{"tool": {"create_kwargs": {...}}}``) by rebuilding
    that tool with those options over ``tool_options``; other keys of an entry (verl's ``execute_kwargs``, ...)
    are not used.
    """

    def __init__(self, tools: Sequence[str] | str = ("calculator",), format: str = "hermes",
                 max_output_chars: int = 4000, tool_options: Mapping[str, Mapping[str, Any]] | None = None,
                 executor: Executor | None = None) -> None:
        self.tool_names = (tools,) if isinstance(tools, str) else tuple(tools)
        if not self.tool_names:
            raise ValueError("ToolEnvironment: tools=() is empty; name at least one tool, e.g. tools=['calculator']")
        if len(set(self.tool_names)) != len(self.tool_names):
            raise ValueError(f"ToolEnvironment: tools={list(self.tool_names)} names a tool twice")
        self.tool_options = {name: dict(options) for name, options in (tool_options or {}).items()}
        unknown = sorted(set(self.tool_options) - set(self.tool_names))
        if unknown:
            raise ValueError(f"ToolEnvironment: tool_options has options for {unknown}, which are not in "
                             f"tools={list(self.tool_names)}")
        if max_output_chars < 1:
            raise ValueError(f"ToolEnvironment: max_output_chars={max_output_chars} must be >= 1")
        self.format_name, self.max_output_chars = format, max_output_chars
        self.executor = executor
        self._base_tools = self._build_tools({})
        self.tools = self._base_tools
        self.format = self._build_format(self.tools)

    def _build_tools(self, create_kwargs: Mapping[str, Mapping[str, Any]]) -> dict[str, Tool]:
        """The tools by the name the model calls them, each built with its options and ``create_kwargs``."""
        tools: dict[str, Tool] = {}
        for name in self.tool_names:
            options = {**self.tool_options.get(name, {}), **create_kwargs.get(name, {})}
            try:
                tool = TOOLS.get(name)(**options)
            except TypeError as exc:
                raise TypeError(f"tool {name!r}: options {sorted(options)} (from tool_options and the record's "
                                f"tools_kwargs create_kwargs) do not fit its factory: {exc}") from exc
            if not isinstance(tool, Tool):
                raise TypeError(f"TOOLS[{name!r}](**options) returned {type(tool).__name__}, not a Tool")
            if tool.name in tools:
                raise ValueError(f"ToolEnvironment: two tools in tools={list(self.tool_names)} are called "
                                 f"{tool.name!r}")
            tools[tool.name] = tool
        return tools

    def _build_format(self, tools: Mapping[str, Tool]) -> ToolCallFormat:
        call_format = TOOL_FORMATS.get(self.format_name)(tools=tools)
        if not isinstance(call_format, ToolCallFormat):
            raise TypeError(f"TOOL_FORMATS[{self.format_name!r}] built a {type(call_format).__name__}, which has "
                            "no parse / result_messages")
        return call_format

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' OpenAI function schemas (rendered into chat prompts)."""
        return [tool.schema() for tool in self._base_tools.values()]

    def reset(self, record: EnvRecord) -> list[Message]:
        create_kwargs = _create_kwargs(record.tools_kwargs, self.tool_names)
        if create_kwargs:
            self.tools = self._build_tools(create_kwargs)
            self.format = self._build_format(self.tools)
        elif self.tools is not self._base_tools:
            self.tools = self._base_tools
            self.format = self._build_format(self.tools)
        return []

    def step(self, turn: str) -> EnvStep:
        parsed = self.format.parse(turn)
        if not parsed.calls and not parsed.errors:
            return EnvStep(done=True)
        results = run_tool_calls(parsed.calls, self.tools, executor=self.executor or shared_executor(),
                                 max_output_chars=self.max_output_chars)
        parse_errors = [ToolResult(call=ToolCall(name=PARSE_ERROR_NAME, arguments={}), content=f"error: {error}",
                                   error=True) for error in parsed.errors]
        return EnvStep(observation=self.format.result_messages([*results, *parse_errors]), done=False,
                       tool_results=tuple(results), info={"parse_errors": len(parsed.errors)})

    def close(self) -> None:
        """Nothing to release: the executor is shared (or the caller's)."""


def _create_kwargs(tools_kwargs: Mapping[str, Any], tool_names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{tool: create_kwargs}`` from a record's ``tools_kwargs``, checked against the environment's tools."""
    found: dict[str, dict[str, Any]] = {}
    for name, entry in tools_kwargs.items():
        if name not in tool_names:
            raise ValueError(f"record.tools_kwargs names tool {name!r}, which this environment does not have; "
                             f"its tools: {list(tool_names)}")
        if not isinstance(entry, Mapping):
            raise TypeError(f"record.tools_kwargs[{name!r}] must be a mapping like {{'create_kwargs': {{...}}}}, "
                            f"got {type(entry).__name__}")
        options = entry.get("create_kwargs") or {}
        if not isinstance(options, Mapping):
            raise TypeError(f"record.tools_kwargs[{name!r}]['create_kwargs'] must be a mapping of tool options")
        if options:
            found[name] = dict(options)
    return found


def calculator_environment(format: str = "hermes", max_output_chars: int = 4000,
                           tool_options: Mapping[str, Mapping[str, Any]] | None = None,
                           executor: Executor | None = None) -> ToolEnvironment:
    """A :class:`ToolEnvironment` with the calculator alone."""
    return ToolEnvironment(tools=("calculator",), format=format, max_output_chars=max_output_chars,
                           tool_options=tool_options, executor=executor)


ENVIRONMENTS.add("tools", ToolEnvironment)
ENVIRONMENTS.add("calculator", calculator_environment)
