"""``report.md`` of ``benchmarks/gpu_check.py``: one row per part, then each GRPO part's phases."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GIB = 2**30


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def part_row(row: Mapping[str, Any]) -> str:
    result = row.get("result") or {}
    step = (result.get("phases") or {}).get("step", {})
    memory = result.get("memory") or {}
    status = row["status"] + (f": {row['reason']}" if row.get("reason") else "")
    return (f"| {row['name']} | {status.replace('|', '/')} | {row['seconds']:.1f} | {_num(step.get('measured_s'))} | "
            f"{_num(step.get('predicted_s'))} | {_ratio(step.get('ratio'))} | {_gib(memory.get('measured_bytes'))} | "
            f"{_gib(memory.get('predicted_bytes'))} | {_ratio(memory.get('ratio'))} |")


def phase_table(row: Mapping[str, Any]) -> list[str]:
    result = row["result"]
    layout = result["layouts"]["actor"]
    fits = "fits it" if result["feasible"] else "says it does not fit: " + "; ".join(result["planner_problems"])
    lines = [f"### {row['name']}: {row['summary']}", "",
             f"Cluster {result['cluster']}; actor layout: {layout['sharding']}, {layout['dtype']}, "
             f"{'padded' if layout['padding'] else 'packed'}, micro batch {layout['micro_batch_size']}, gradient "
             f"checkpointing {'on' if layout['gradient_checkpointing'] else 'off'}, offload "
             f"{layout['offload'] or 'none'}; attention {sorted(set(result['attention'].values()))}; "
             f"{result['steps']} steps, the first {result['skip_steps']} not measured; the planner "
             f"{fits}.",
             "", "| phase | measured (s) | predicted (s) | predicted / measured |", "|---|---|---|---|"]
    for phase, value in result["phases"].items():
        lines.append(f"| {phase} | {_num(value['measured_s'])} | {_num(value['predicted_s'])} | "
                     f"{_ratio(value['ratio'])} |")
    return [*lines, ""]


def markdown(report: Mapping[str, Any]) -> str:
    environment = ", ".join(f"{key} {value}" for key, value in report["environment"].items())
    lines = [f"# GPU check ({report['mode']} mode): {'passed' if report['passed'] else 'FAILED'} in "
             f"{report['seconds']:.0f} s (budget {report['budget_s']:.0f} s)", "", environment, "",
             "Ratios are predicted / measured; measured phases are means over the steps after the first; peak memory "
             "is `torch.cuda.max_memory_allocated` over the steps (none on a CPU) against the plan's bytes per GPU.",
             "", "| part | status | seconds | step measured (s) | step predicted (s) | ratio | peak GiB measured | "
             "peak GiB predicted | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [part_row(row) for row in report["parts"]]
    lines.append("")
    for row in report["parts"]:
        result = row.get("result") or {}
        if "mean_gap" in result:
            lines += [f"### {row['name']}: {row['summary']}", "",
                      f"Attention {result['attention_implementation']}, SDPA kernel {result['sdpa_kernel']}; "
                      f"|packed - padded| log-probs over {result['tokens']} tokens: mean {result['mean_gap']:.4f}, "
                      f"max {result['max_gap']:.4f}.", ""]
        elif result.get("phases"):
            lines += phase_table(row)
    return "\n".join(lines) + "\n"
