"""Agents: multi-turn rollouts with tools and environments (docs/agents.md).

The contract is :mod:`hybridflow.agents.protocols`; built-in tools, tool-call formats and environments register
in ``hybridflow.registry`` (``TOOLS``, ``TOOL_FORMATS``, ``ENVIRONMENTS``) through entry points.
"""

from hybridflow.agents.protocols import (
    Environment,
    EnvRecord,
    EnvStep,
    Message,
    ParsedTurn,
    Prompt,
    Tool,
    ToolCall,
    ToolCallFormat,
    ToolResult,
    TurnObserver,
    TurnRequest,
    TurnResult,
    TurnServer,
)

__all__ = ["EnvRecord", "EnvStep", "Environment", "Message", "ParsedTurn", "Prompt", "Tool", "ToolCall",
           "ToolCallFormat", "ToolResult", "TurnObserver", "TurnRequest", "TurnResult", "TurnServer"]
