"""What a step's trajectories did, as scalar metrics (``agent/*`` in metrics.jsonl, the report and the planner).

The keys are a contract: ``hybridflow plan --agent-from metrics.jsonl`` reads ``agent/turns_mean``,
``agent/turns_max``, ``agent/tool_calls_per_trajectory`` and the tool-latency percentiles back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def agent_metrics(traces: Sequence[str]) -> dict[str, float]:
    """Turns, tool calls, tool errors and timeouts, tool latency p50/p95, truncations and env rewards over the
    JSON traces (``Trajectory.trace``) of a step's rows."""
    rows = [json.loads(trace) for trace in traces]
    if not rows:
        return {}
    turns = [float(row["turns"]) for row in rows]
    calls: list[dict[str, Any]] = [call for row in rows for call in row["tools"]]
    latencies = sorted(float(call["seconds"]) for call in calls)
    out = {"agent/turns_mean": sum(turns) / len(turns), "agent/turns_max": max(turns),
           "agent/tool_calls_per_trajectory": len(calls) / len(rows),
           "agent/tool_call_rate": sum(1 for row in rows if row["tools"]) / len(rows),
           "agent/tool_errors": float(sum(1 for call in calls if call["error"] and not call["timed_out"])),
           "agent/tool_timeouts": float(sum(1 for call in calls if call["timed_out"])),
           "agent/parse_errors": float(sum(int(row.get("parse_errors", 0)) for row in rows)),
           "agent/truncated_fraction": sum(1 for row in rows if row["truncated"]) / len(rows),
           "agent/env_reward_mean": sum(float(row["env_reward"]) for row in rows) / len(rows)}
    if latencies:
        out["agent/tool_latency_p50_s"] = percentile(latencies, 0.50)
        out["agent/tool_latency_p95_s"] = percentile(latencies, 0.95)
    return out


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linearly interpolated (numpy's default)."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
