"""Execution modes on the published pairs: colocated sync vs split asynchronous runs of one experiment.

Three records of ../shared/calibration/published_runs.json have a ``companion_split_run``: the same
experiment on split pools, run asynchronously, and faster than colocated. Each pair is entered twice:

- **as run**: the colocated arm costed ``sync`` on all GPUs (exactly as ``benchmarks/published_runs.py``
  enters it), and the split arm costed on its published split in its published mode (``PAIRS``), with the
  colocated arm's layouts, lengths, offload and token budgets (the split arms' own scripts are not in the
  records); the trainer pool keeps the colocated arm's training parallelism, the engines its rollout TP;
- **as the planner would choose**: ``plan_placement(..., PlannerOptions(pipeline="auto"))`` on the same
  cluster and recipe, what ``hybridflow plan --pipeline auto`` prints: sync colocated, sync split,
  one_step_off split and async split with k = 1 and 2 compared, pool sizes and layouts its own.

Both with the shipped ``verl-published`` calibration (fitted on colocated runs only; nothing is fitted on
the split arms) or the priors. Nobody on this project measured these runs: the timings are the sources'.

    .venv/bin/python benchmarks/published_pairs.py [--runs PATH] [--calibration verl-published|priors|FILE]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.planner import Plan, PlannerOptions, plan_placement
from hybridflow.planner.calibration import Calibration
from hybridflow.planner.manual import evaluate_mapping
from hybridflow.planner.modes import OVERLAPPED, describe_mode
from hybridflow.planner.plan import rollout_role
from hybridflow.planner.published import MeasuredCase, case_from_record

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_runs import RUNS, records_with_assumptions  # the colocated arms' assumptions


@dataclass(frozen=True)
class SplitArm:
    """A companion split run as published: pool sizes, the engines' TP and the execution mode."""

    rollout_gpus: int
    trainer_gpus: int
    engine_tp: int
    pipeline: str
    max_staleness: int | None = None


# "4 rollout GPUs + 12 training GPUs" (verl one-step-off doc); verl's fully-async "32:32" and "96:32" are
# rollout:trainer. verl's fully_async with partial rollouts and staleness_threshold <= 1 lets the rollout
# run at most one parameter sync ahead of the trainer: k = 1. Engine TP as assumed for the colocated arms.
PAIRS: dict[str, SplitArm] = {
    "verl_doc_onestepoff_colocate_fsdp2_16xH20": SplitArm(4, 12, 2, "one_step_off"),
    "verl_doc_fullyasync_colocate_64xH20": SplitArm(32, 32, 4, "async", 1),
    "verl_doc_fullyasync_colocate_qwen3_30b_a3b_128xH20": SplitArm(96, 32, 4, "async", 1),
}


def split_arm(case: MeasuredCase, record: dict[str, Any], arm: SplitArm, calibration: Calibration | None, *,
              pipeline: str | None = None, max_staleness: int | None = None) -> Plan:
    """The split run costed on its published split (in its own mode unless ``pipeline`` is given)."""
    trainer = tuple(range(arm.trainer_gpus))
    rollout = tuple(range(arm.trainer_gpus, arm.trainer_gpus + arm.rollout_gpus))
    mapping = {**dict.fromkeys(case.mapping, trainer), rollout_role("actor"): rollout}
    tp = int(record["gpus"]["count"]) // int(case.layout["data_parallel_size"])  # training tensor parallelism
    layout = {**case.layout, "data_parallel_size": dict.fromkeys(case.mapping, arm.trainer_gpus // tp),
              "rollout_tp": {rollout_role("actor"): arm.engine_tp}}
    mode = pipeline or arm.pipeline
    bound = max_staleness if pipeline else arm.max_staleness
    return evaluate_mapping(case.graph, case.models, case.workload, case.cluster, mapping, settings=case.settings,
                            calibration=calibration, pipeline=mode, max_staleness=bound, **layout)


def pair_rows(path: Path = RUNS, calibration: Calibration | None = None) -> list[dict[str, Any]]:
    """Per pair: both arms as run, the published split in every mode, and the planner's own choice."""
    rows = []
    for record in records_with_assumptions(path):
        arm = PAIRS.get(record["id"])
        if arm is None or "companion_split_run" not in record:
            continue
        case = case_from_record(record)
        split = split_arm(case, record, arm, calibration)
        modes = {label: split_arm(case, record, arm, calibration, pipeline=mode, max_staleness=k).step_time_s
                 for label, mode, k in (("sync", "sync", None), ("one_step_off", "one_step_off", None),
                                        ("async k=1", "async", 1), ("async k=2", "async", 2))}
        auto = plan_placement(case.graph, case.models, case.workload, case.cluster, settings=case.settings,
                              calibration=calibration, options=PlannerOptions(pipeline="auto"))
        rows.append({
            "run": record["id"], "arm": arm, "published_colocated_s": float(record["timings_s"]["step"]),
            "colocated_s": case.plan(calibration).step_time_s,
            "published_split_s": float(record["companion_split_run"]["timings_s"]["step"]),
            "split_s": split.step_time_s, "split_feasible": split.feasible, "split_mode": describe_mode(split),
            "modes": modes, "auto": auto,
            "auto_is_split_async": auto.pipeline in OVERLAPPED and bool(auto.detached_rollouts),
        })
    return rows


def _mode(arm: SplitArm) -> str:
    return f"async k={arm.max_staleness}" if arm.pipeline == "async" else arm.pipeline


def _auto(plan: Plan) -> str:
    if plan.pipeline not in OVERLAPPED:
        return f"{plan.pipeline} {'split' if plan.detached_rollouts else 'colocated'}"
    rollout = sum(plan.groups[i].size for i in {plan.group_index(r) for r in plan.detached_rollouts.values()}
                  if i is not None)
    mode = f"async k={plan.max_staleness}" if plan.pipeline == "async" else plan.pipeline
    return f"{mode} {rollout}+{plan.num_gpus - rollout}"


def print_rows(rows: list[dict[str, Any]], name: str) -> None:
    print(f"\n{name}: seconds per step, predicted (ratio to published)\n")
    print("| run | published colocated | colocated sync | published split | split as run | split, mode | "
          "`plan --pipeline auto` | auto step | picks split async |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        arm: SplitArm = row["arm"]
        fits = "" if row["split_feasible"] else ", OOM risk"
        print(f"| {row['run']} | {row['published_colocated_s']:.0f} | {row['colocated_s']:.0f} "
              f"({row['colocated_s'] / row['published_colocated_s']:.2f}x) | {row['published_split_s']:.0f} | "
              f"{row['split_s']:.0f} ({row['split_s'] / row['published_split_s']:.2f}x{fits}) | "
              f"{arm.rollout_gpus}+{arm.trainer_gpus} {_mode(arm)} | {_auto(row['auto'])} | "
              f"{row['auto'].step_time_s:.0f} | {'yes' if row['auto_is_split_async'] else 'no'} |")
    print("\nThe published split in each mode (seconds per step):\n")
    print("| run | " + " | ".join(rows[0]["modes"]) + " |" if rows else "")
    print("|---|" + "---|" * len(rows[0]["modes"]) if rows else "")
    for row in rows:
        print(f"| {row['run']} | " + " | ".join(f"{s:.0f}" for s in row["modes"].values()) + " |")
    print("\nPools of the split as run, and the planner's reason:\n")
    for row in rows:
        print(f"- {row['run']}: as run, {row['split_mode']}")
        print(f"  auto: {dict(row['auto'].extra)['pipeline_choice']}")
    picked = sum(row["auto_is_split_async"] for row in rows)
    print(f"\n{name}: the planner picks a split asynchronous placement for {picked} of {len(rows)} pairs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=RUNS)
    parser.add_argument("--calibration", default="verl-published",
                        help="a shipped calibration name, a calibration file, or 'priors' (none)")
    args = parser.parse_args(argv)
    calibration = None if args.calibration == "priors" else Calibration.load(args.calibration)
    print_rows(pair_rows(args.runs, calibration), args.calibration)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
