"""Execution modes on the published pairs: colocated sync vs split asynchronous runs of one experiment.

Three records of benchmarks/data/published_runs.json have a ``companion_split_run``: the same
experiment on split pools, run asynchronously, and faster than colocated. Each pair is entered twice:

- **as run**: the colocated arm costed ``sync`` on all GPUs (exactly as ``benchmarks/published_runs.py``
  enters it), and the split arm costed on its published split in its published mode with its own script's
  settings (``PAIRS``: offload, token budgets, engine memory and eager mode, and whether the update takes the
  rollout's log-probs instead of an old_log_prob pass); everything its script does not change (model, data,
  lengths, parallelism) is the colocated arm's. Each split arm's published phases are shown beside the plan's;
- **as the planner would choose**: ``plan_placement(PlanRequest(..., pipeline="auto"))`` on the colocated
  arm's graph and recipe, what ``hybridflow plan --pipeline auto`` prints: sync colocated, sync split,
  one_step_off split and async split with k = 1 and 2 compared, pool sizes and layouts its own.

Both with the shipped ``verl-published`` calibration (fitted on colocated runs only, ``decode_mfu`` held at
its prior; nothing is fitted on the split arms) or the priors. ``--hold NAMES`` refits the shared calibration
on the colocated runs with exactly the named constants held at their priors (``--hold ''``: none held;
``published_runs.py``'s cases and targets) and costs the pairs with it. Nobody on this project measured these
runs: the timings are the sources'.

    .venv/bin/python benchmarks/published_pairs.py [--runs PATH] [--calibration verl-published|priors|FILE]
        [--hold NAME,...]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.planner import Plan, plan_placement
from hybridflow.planner.calibration import Calibration
from hybridflow.planner.fit import FITTED, fit_calibration
from hybridflow.planner.manual import evaluate_mapping
from hybridflow.planner.modes import OVERLAPPED, describe_mode, pool_seconds
from hybridflow.planner.plan import rollout_role
from hybridflow.planner.published import case_from_record
from hybridflow.planner.request import PlanRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_runs import RUNS, load_cases, records_with_assumptions, table, verdict  # the colocated arms


@dataclass(frozen=True)
class SplitArm:
    """A companion split run as published and as its own script sets it up.

    ``record`` replaces fields of the colocated arm's record (offload, micro batches, the engine note), and
    ``hybridflow`` its planner-only assumptions (``published_runs.ASSUMPTIONS``): what the split arm's script
    sets differently from its colocated arm. Everything else (model, data, lengths, parallelism) is the
    colocated arm's, as the sources describe one experiment run two ways.
    """

    rollout_gpus: int
    trainer_gpus: int
    engine_tp: int
    pipeline: str
    max_staleness: int | None = None
    record: dict[str, Any] = field(default_factory=dict)
    hybridflow: dict[str, Any] = field(default_factory=dict)


NO_ACTOR_OFFLOAD = {"actor_param": False, "actor_grad": False, "actor_optimizer": False}
# "4 rollout GPUs + 12 training GPUs" (verl one-step-off doc); verl's fully-async "32:32" and "96:32" are
# rollout:trainer. verl's fully_async with partial rollouts and staleness_threshold 0.5 lets the rollout run at
# most half a batch ahead of the trainer's parameter version; the planner's bound is an integer, so k = 1.
# Each arm's own script, and what it sets differently from its colocated arm:
# - one-step-off 4+12: recipe/one_step_off_policy/dapo_7b_math_fsdp2_4_12.sh (the PR #2231 script): actor_offload
#   False (the colocated script offloads params and optimizer: the trainer pool no longer hosts an engine),
#   gen_tp 2, sp 4, fsdp_size 2, the same token budgets, gpu_memory_utilization 0.8; old_log_prob recomputed
#   (the doc's table has the phase, 108 s).
# - fully async 32:32, the doc table's settings (require_batches 4, trigger_parameter_sync_step 4, staleness 0.5,
#   partial rollout) as in recipe/fully_async_policy/shell/dapo_7b_math_fsdp2_64_64.sh: actor_offload False,
#   gen_tp 4, sp 4, gpu_memory_utilization 0.8, actor budget 2 x (2048 + 28672); async_training.use_rollout_log_probs
#   defaults to True ("we default to old_log_prob being calculated by rollout", recipe README), so there is no
#   old_log_prob pass (the doc's table shows none).
# - fully async 96:32, recipe/fully_async_policy/shell/grpo_30b_a3b_base_math_megatron_96_32.sh: the trainer keeps
#   params, grads and optimizer offloaded (as the colocated arm is assumed to), rollout gpu_memory_utilization 0.7
#   and enforce_eager=True, actor and log-prob budgets 2048 + 8192 tokens (the colocated assumption is twice that),
#   use_rollout_log_probs=True: no old_log_prob pass; the reference's log-probs stay (KL loss).
PAIRS: dict[str, SplitArm] = {
    "verl_doc_onestepoff_colocate_fsdp2_16xH20": SplitArm(
        4, 12, 2, "one_step_off", record={"offload": {**NO_ACTOR_OFFLOAD, "ref_param": True}}),
    "verl_doc_fullyasync_colocate_64xH20": SplitArm(
        32, 32, 4, "async", 1, record={"offload": {**NO_ACTOR_OFFLOAD, "ref_param": True}},
        hybridflow={"rollout_logprobs": True}),
    "verl_doc_fullyasync_colocate_qwen3_30b_a3b_128xH20": SplitArm(
        96, 32, 4, "async", 1,
        record={"rollout_engine": "vLLM (enforce_eager=True)",
                "micro_batch": {"ppo_mini_batch_prompts": 128, "use_dynamic_bsz": True,
                                "actor_ppo_max_token_len_per_gpu": 2048 + 8192,
                                "log_prob_max_token_len_per_gpu": 2048 + 8192}},
        hybridflow={"rollout_logprobs": True, "gpu_memory_utilization": 0.7}),
}


def split_record(record: dict[str, Any], arm: SplitArm) -> dict[str, Any]:
    """The colocated arm's record with the split arm's own settings (``SplitArm.record``/``hybridflow``)."""
    return {**record, **arm.record, "id": f"{record['id']} (split)",
            "hybridflow": {**(record.get("hybridflow") or {}), **arm.hybridflow}}


def split_arm(record: dict[str, Any], arm: SplitArm, calibration: Calibration | None, *,
              pipeline: str | None = None, max_staleness: int | None = None) -> Plan:
    """The split run costed on its published split with its own settings (in its own mode unless ``pipeline``)."""
    case = case_from_record(split_record(record, arm))
    trainer = tuple(range(arm.trainer_gpus))
    rollout = tuple(range(arm.trainer_gpus, arm.trainer_gpus + arm.rollout_gpus))
    mapping = {**dict.fromkeys(case.mapping, trainer), rollout_role("actor"): rollout}
    tp = int(record["gpus"]["count"]) // int(case.layout["data_parallel_size"])  # training tensor parallelism
    layout = {**case.layout, "data_parallel_size": dict.fromkeys(case.mapping, arm.trainer_gpus // tp),
              "rollout_tp": {rollout_role("actor"): arm.engine_tp}}
    mode = pipeline or arm.pipeline
    bound = max_staleness if pipeline else arm.max_staleness
    return evaluate_mapping(PlanRequest(case.graph, case.models, case.workload, case.cluster, settings=case.settings,
                                        calibration=calibration, pipeline=mode, max_staleness=bound,
                                        micro_batch_sizes=case.micro_batch_sizes), mapping, **layout)


# The split arms' published phases and the plan's counterparts. The trainer's wait (one-step-off's
# ``wait_prev_gen``, fully-async's ``gen``: the trainer fetching samples) is the predicted step less the
# per-step overhead and the trainer pool's busy time. verl's fully-async ``step`` timer (each phase summed over
# the trigger_parameter_sync_step local steps of one parameter version, recipe detach_utils.MetricsAggregator)
# leaves out the parameter sync; the plan charges it to the trainer's update (the shipment) and the pool.
SPLIT_PHASES = {"generate_sequences": "actor_generate", "old_log_prob": "actor_logprob",
                "ref": "reference_ref_logprob", "update_actor": "actor_update"}
TRAINER_WAIT = ("wait_prev_gen", "gen")


def split_phases(plan: Plan, published: dict[str, float], calibration: Calibration | None) -> dict[str, float]:
    """Predicted seconds for each published phase of a split arm (``SPLIT_PHASES``, ``TRAINER_WAIT``, ``step``)."""
    seconds = {node.node: node.seconds for node in plan.nodes}
    overhead = float(dict(plan.extra).get("step_terms_s", 0.0))  # amortised validation and checkpoints
    predicted = {}
    for key in published:
        if key == "step":
            predicted[key] = plan.step_time_s
        elif key in TRAINER_WAIT:
            predicted[key] = max(0.0, plan.step_time_s - overhead - pool_seconds(plan)[1])
        elif SPLIT_PHASES.get(key) in seconds:
            predicted[key] = seconds[SPLIT_PHASES[key]]
    return predicted


def pair_rows(path: Path = RUNS, calibration: Calibration | None = None) -> list[dict[str, Any]]:
    """Per pair: both arms as run, the published split in every mode, and the planner's own choice."""
    rows = []
    for record in records_with_assumptions(path):
        arm = PAIRS.get(record["id"])
        if arm is None or "companion_split_run" not in record:
            continue
        case = case_from_record(record)
        split = split_arm(record, arm, calibration)
        modes = {label: split_arm(record, arm, calibration, pipeline=mode, max_staleness=k).step_time_s
                 for label, mode, k in (("sync", "sync", None), ("one_step_off", "one_step_off", None),
                                        ("async k=1", "async", 1), ("async k=2", "async", 2))}
        auto = plan_placement(PlanRequest(case.graph, case.models, case.workload, case.cluster, settings=case.settings,
                                          calibration=calibration, pipeline="auto"))
        rows.append({
            "run": record["id"], "arm": arm, "published_colocated_s": float(record["timings_s"]["step"]),
            "colocated_s": case.plan(calibration).step_time_s,
            "published_split_s": float(record["companion_split_run"]["timings_s"]["step"]),
            "split_s": split.step_time_s, "split_feasible": split.feasible, "split_mode": describe_mode(split),
            "modes": modes, "auto": auto,
            "phases": split_phases(split, record["companion_split_run"]["timings_s"], calibration),
            "published_phases": record["companion_split_run"]["timings_s"],
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
    print("\nThe split arms' phases as run, predicted vs published (seconds; the trainer's wait is the step less "
          "the overhead and the trainer pool's busy time):\n")
    print("| run | phase | published | predicted (ratio) |")
    print("|---|---|---|---|")
    for row in rows:
        for key, published in row["published_phases"].items():
            if key in row["phases"]:
                value = row["phases"][key]
                print(f"| {row['run']} | {key} | {published:.0f} | {value:.0f} ({value / published:.2f}x) |")
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
    parser.add_argument("--hold", default=None,
                        help="refit the shared calibration on the colocated runs with exactly these constants at "
                             "their priors ('' holds none)")
    args = parser.parse_args(argv)
    calibration = None if args.calibration == "priors" else Calibration.load(args.calibration)
    name = args.calibration
    if args.hold is not None:
        held = [item.strip() for item in args.hold.split(",") if item.strip()]
        unknown = sorted(set(held) - set(FITTED))
        if unknown:
            parser.error(f"--hold {','.join(unknown)}: not fitted constants; choose from {', '.join(FITTED)}")
        cases = load_cases(args.runs)
        calibration = fit_calibration([(case.predict, case.measured) for case in cases],
                                      names=FITTED, held=held,
                                      source=f"benchmarks/published_pairs.py --hold {args.hold}")
        name = f"refit, {args.hold or 'nothing'} held at the prior"
        rows = table(cases, {name: calibration})
        constants = calibration.to_dict()["default"]
        print(f"{name}: " + json.dumps({key: round(value, 4) for key, value in constants.items()}))
        print(verdict(rows, name))
    print_rows(pair_rows(args.runs, calibration), name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
