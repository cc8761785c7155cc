"""Does the planner predict hybridflow's own runs? Calibrate on one workload, predict another's runs. CPU, Ray.

Workload **A** (calibration): GRPO with the task's rule reward on ``tiny-qwen2`` (32 prompts x 4 samples, 32 new
tokens) in 3 runs: data parallel on both logical GPUs packed and padded, and the actor and reference on GPUs of
their own with a token budget. ``hybridflow calibrate``'s own code path fits the constants on them: each run
directory (``config.json`` + ``plan.json`` + ``metrics.jsonl``) is costed by ``cli.calibrate.case_from_run_dir``.
Workload **B** (predicted): GRPO on ``tiny-qwen2-wide`` (64 prompts x 4 samples, 48 new tokens), in runs that
differ in what the issue names and the runtime runs now: packing on/off, token budgets, data parallel on one or
two GPUs, placements. Each B run's measured step (median of its kept steps) is compared with its prediction
(target: every run within 1.3x) and the runs are ranked (Kendall tau, target >= 0.8).

The measurement on a shared 2-core machine follows ``benchmarks/planner_ranking.py`` (whose helpers it reuses):
one worker per logical GPU and core, Ray's workers at the driver's priority, runs interleaved across B's
configurations when ``--repeats`` > 1; note the load average it prints.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planner_self.py [--steps 6] [--repeats 1] [--out DIR]

Not yet run to the end (issue 22): one B run (``dp2 packed budget 512``, 3 steps) took 5 minutes on the shared
2-core machine at load average ~14 (29 s a step), so the 13 runs did not fit the session; ``docs/benchmarks.md``
records that probe, not a result.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_ranking import FITTED, kendall_tau, kept_steps, prompt_tokens, train_at_driver_priority

from hybridflow.cli.calibrate import case_from_run_dir
from hybridflow.planner.calibration import Calibration
from hybridflow.planner.fit import describe, fit_calibration
from hybridflow.planner.published import MeasuredCase

SKIP_STEPS = 2
BOTH = {"actor": [0, 1], "reference": [0, 1]}
APART = {"actor": [0], "reference": [1]}
ONE = {"actor": [0], "reference": [0]}
WORKLOADS: dict[str, dict[str, Any]] = {
    "A": {"model": "tiny-qwen2", "batch_size": 32, "options": {"n": 4, "kl_coef": 0.04, "max_new_tokens": 32}},
    "B": {"model": "tiny-qwen2-wide", "batch_size": 64, "options": {"n": 4, "kl_coef": 0.04, "max_new_tokens": 48}},
}
# name -> (meshes, padding, token budget per micro batch for every GPU role or None)
RUNS: dict[str, dict[str, tuple[dict[str, list[int]], bool, int | None]]] = {
    "A": {"dp2 packed": (BOTH, False, None), "dp2 padded": (BOTH, True, None), "apart budget 512": (APART, False, 512)},
    "B": {"dp2 packed": (BOTH, False, None), "dp2 padded": (BOTH, True, None),
          "dp2 packed budget 512": (BOTH, False, 512), "dp2 packed budget 2048": (BOTH, False, 2048),
          "dp2 padded budget 1024": (BOTH, True, 1024), "apart packed": (APART, False, None),
          "apart padded": (APART, True, None), "apart budget 1024": (APART, False, 1024),
          "one GPU packed": (ONE, False, None), "one GPU padded": (ONE, True, None)},
}


def config(workload: str, meshes: dict[str, list[int]], padding: bool, budget: int | None, steps: int,
           out: Path) -> dict[str, Any]:
    spec = WORKLOADS[workload]
    roles = {role: {"max_tokens_per_micro_batch": budget} for role in meshes} if budget else {}
    return {"roles": roles, "algorithm": "grpo", "seed": 0, "steps": steps, "executor": "ray", "num_gpus": 2,
            "algorithm_options": {**spec["options"], "reward_kind": "reward_function"}, "padding": padding,
            "placement": "manual", "meshes": meshes, "model": {"name": spec["model"], "sft_steps": 0},
            "data": {"task": "reverse", "num_examples": 2000, "batch_size": spec["batch_size"]},
            "actor": {"lr": 5e-4, "grad_clip": 1.0, "micro_batch_size": 64}, "output_dir": str(out),
            "trackers": [], "tensorboard": False, "plot": False, "progress": False}


def slug(name: str) -> str:
    return name.replace(" ", "-")


def median_case(folders: list[Path], prompt: int) -> MeasuredCase:
    cases = [case_from_run_dir(folder, SKIP_STEPS, prompt) for folder in folders]
    keys = set.intersection(*(set(c.measured) for c in cases))
    measured = {key: statistics.median(c.measured[key] for c in cases) for key in keys}
    measured["step"] = statistics.median(step for folder in folders for step in kept_steps(folder))
    return replace(cases[0], measured=measured)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each workload-B configuration, interleaved")
    parser.add_argument("--out", type=Path, default=Path("runs/planner_self"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    folders: dict[tuple[str, str], list[Path]] = {}
    for workload, repeats in (("A", 1), ("B", args.repeats)):
        for repeat in range(repeats):  # interleaved: every configuration once before any twice
            for name, (meshes, padding, budget) in RUNS[workload].items():
                print(f"{workload} {name} (repeat {repeat}); load average {os.getloadavg()[0]:.1f}", flush=True)
                out = (args.out / f"{workload}-{slug(name)}-r{repeat}").resolve()
                settings = config(workload, meshes, padding, budget, args.steps, out)
                folders.setdefault((workload, name), []).append(train_at_driver_priority(settings, out))
    prompts = {w: prompt_tokens(next(args.out.glob(f"{w}-*.json"))) for w in WORKLOADS}
    cases = {key: median_case(paths, prompts[key[0]]) for key, paths in folders.items()}
    train = [(c.predict, c.measured) for (w, _), c in cases.items() if w == "A"]
    fitted = fit_calibration(train, names=FITTED, source="benchmarks/planner_self.py (workload A)")
    print(f"fitted on workload A: {describe(fitted.default, FITTED)}")
    names = [name for w, name in cases if w == "B"]
    measured = [cases[("B", name)].measured["step"] for name in names]
    priors = [cases[("B", name)].predict(Calibration())["step"] for name in names]
    predicted = [cases[("B", name)].predict(fitted)["step"] for name in names]
    print("| run (B) | measured step, median (s) | predicted, priors (s) | predicted, calibrated on A (s) | ratio |")
    print("|---|---|---|---|---|")
    for name, step, prior, after in zip(names, measured, priors, predicted, strict=True):
        print(f"| {name} | {step:.2f} | {prior:.2f} | {after:.2f} | {after / step:.2f}x |")
    worst = max(math.exp(abs(math.log(p / m))) for p, m in zip(predicted, measured, strict=True))
    tau = kendall_tau(predicted, measured)
    print(f"worst ratio {worst:.2f}x (target 1.3x); Kendall tau, calibrated on A: {tau:.2f}; "
          f"priors: {kendall_tau(priors, measured):.2f} (target >= 0.8); load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
