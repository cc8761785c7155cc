"""Does the planner predict hybridflow's own runs? Calibrate on one workload, predict another's runs. CPU, Ray.

Workload **A** (calibration): GRPO with the task's rule reward on ``tiny-qwen2`` (16 prompts x 4 samples, 24 new
tokens) in 4 runs that span rows per engine and micro batch counts: data parallel on both logical GPUs, packed,
with and without a token budget; the actor and reference on GPUs of their own with a token budget; one GPU,
padded. ``hybridflow calibrate``'s own code path fits the constants on them: each run directory
(``config.json`` + ``plan.json`` + ``metrics.jsonl``) is costed by ``cli.calibrate.case_from_run_dir``.
Workload **B** (predicted): GRPO on ``tiny-qwen2-wide`` (32 prompts x 4 samples, 32 new tokens), in 9 runs that
differ in what the issue names and the runtime runs on CPU: packing on/off, token budgets, data parallel on one
or two GPUs, the actor and reference apart, the actor on the fsdp backend offloaded (``ROLES``). Each B run's
measured step (median of its kept steps) is compared with its prediction (target: every run within 1.3x) and
the runs are ranked (Kendall tau, target >= 0.8: tau-b, scipy's default, which leaves out of its range a pair the
planner costs the same, e.g. a token budget that never binds; tau-a, which scores such a pair 0, is printed
beside it).
Sized for a 2-core machine: ``--steps 8 --repeats 3`` (the recorded run) is 31 runs, ~12 min on a quiet one
(each run ~20 s, most of it Ray and model start). A finished run directory is reused, so a rerun with another
``--fit`` only re-costs (seconds).

The measurement on a shared 2-core machine follows ``benchmarks/planner_ranking.py`` (whose helpers it reuses):
one worker per logical GPU and core, Ray's workers at the driver's priority, runs interleaved across B's
configurations when ``--repeats`` > 1; note the load average it prints.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planner_self.py [--steps 4] [--repeats 1] [--out DIR] [--fit NAMES]

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planner_self.py --only "B dp2 packed"   # one run, a probe

``--only`` naming every A run as well costs the B runs it names (calibrated on A), e.g. the offload row alone:
``--only "A dp2 packed,A apart budget 512,A one GPU padded,A dp2 packed budget 256,B dp2 fsdp offloaded"``.

Results and what the node times say: ``docs/benchmarks.md``, "Predicting hybridflow's own runs".
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
from planner_ranking import FITTED, kendall_tau, kendall_tau_b, kept_steps, prompt_tokens, train_at_driver_priority

from hybridflow.cli.calibrate import case_from_run_dir
from hybridflow.planner.calibration import Calibration
from hybridflow.planner.fit import describe, fit_calibration
from hybridflow.planner.published import MeasuredCase

SKIP_STEPS = 2
BOTH = {"actor": [0, 1], "reference": [0, 1]}
APART = {"actor": [0], "reference": [1]}
ONE = {"actor": [0], "reference": [0]}
WORKLOADS: dict[str, dict[str, Any]] = {
    "A": {"model": "tiny-qwen2", "batch_size": 16, "options": {"n": 4, "kl_coef": 0.04, "max_new_tokens": 24}},
    "B": {"model": "tiny-qwen2-wide", "batch_size": 32, "options": {"n": 4, "kl_coef": 0.04, "max_new_tokens": 32}},
}
# name -> (meshes, padding, token budget per micro batch for every GPU role or None)
RUNS: dict[str, dict[str, tuple[dict[str, list[int]], bool, int | None]]] = {
    "A": {"dp2 packed": (BOTH, False, None), "apart budget 512": (APART, False, 512),
          "one GPU padded": (ONE, True, None), "dp2 packed budget 256": (BOTH, False, 256)},
    "B": {"dp2 packed": (BOTH, False, None), "dp2 padded": (BOTH, True, None),
          "dp2 packed budget 512": (BOTH, False, 512), "dp2 packed budget 2048": (BOTH, False, 2048),
          "apart packed": (APART, False, None), "apart budget 1024": (APART, False, 1024),
          "one GPU packed": (ONE, False, None), "one GPU padded": (ONE, True, None),
          "dp2 fsdp offloaded": (BOTH, False, None)},
}
# Role settings beside the defaults: the actor on the fsdp backend with its parameters, gradients and optimizer
# states offloaded (Framework.trainable_offload "per_unshard", as hybridflow runs it). On a CPU device its tensors
# are in host memory already: the backend applies no CPUOffloadPolicy and the planner prices no host copies.
ROLES: dict[tuple[str, str], dict[str, dict[str, Any]]] = {
    ("B", "dp2 fsdp offloaded"): {"actor": {"backend": "fsdp", "offload": ["params", "grads", "optimizer"]}},
}


def config(workload: str, meshes: dict[str, list[int]], padding: bool, budget: int | None, steps: int,
           out: Path, extra: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    spec = WORKLOADS[workload]
    roles: dict[str, dict[str, Any]] = {role: {"max_tokens_per_micro_batch": budget} for role in meshes if budget}
    for role, options in (extra or {}).items():
        roles[role] = {**roles.get(role, {}), **options}
    return {"roles": roles, "algorithm": "grpo", "seed": 0, "steps": steps, "executor.name": "ray",
            "placement.num_gpus": 2,
            "algorithm.options": {**spec["options"], "reward_kind": "reward_function"}, "pipeline.padding": padding,
            "placement.mode": "manual", "placement.meshes": meshes, "model": {"name": spec["model"], "sft_steps": 0},
            "data": {"task": "reverse", "num_examples": 2000, "batch_size": spec["batch_size"]},
            "optim": {"actor": {"lr": 5e-4, "grad_clip": 1.0, "micro_batch_size": 64}}, "output_dir": str(out),
            "logging.trackers": [], "logging.plot": False, "logging.progress": False}


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
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each workload-B configuration, interleaved")
    parser.add_argument("--out", type=Path, default=Path("runs/planner_self"))
    parser.add_argument("--only", default="", help="comma-separated 'W name' runs to train (a probe), none costed")
    parser.add_argument("--fit", default=",".join(FITTED), help=f"constants fitted on A (default {','.join(FITTED)})")
    args = parser.parse_args(argv)
    names = tuple(name for name in args.fit.split(",") if name)
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    folders: dict[tuple[str, str], list[Path]] = {}
    for workload, repeats in (("A", 1), ("B", args.repeats)):
        for repeat in range(repeats):  # interleaved: every configuration once before any twice
            for name, (meshes, padding, budget) in RUNS[workload].items():
                if only is not None and f"{workload} {name}" not in only:
                    continue
                print(f"{workload} {name} (repeat {repeat}); load average {os.getloadavg()[0]:.1f}", flush=True)
                out = (args.out / f"{workload}-{slug(name)}-r{repeat}").resolve()
                settings = config(workload, meshes, padding, budget, args.steps, out, ROLES.get((workload, name)))
                folders.setdefault((workload, name), []).append(train_at_driver_priority(settings, out))
    if only is not None and not (all(f"A {name}" in only for name in RUNS["A"]) and any(w == "B" for w, _ in folders)):
        return 0  # a probe: without every calibration run there is nothing to fit, without a B run nothing to predict
    prompts = {w: prompt_tokens(next(args.out.glob(f"{w}-*.json"))) for w in WORKLOADS}
    cases = {key: median_case(paths, prompts[key[0]]) for key, paths in folders.items()}
    train = [(c.predict, c.measured) for (w, _), c in cases.items() if w == "A"]
    fitted = fit_calibration(train, names=names, source="benchmarks/planner_self.py (workload A)")
    print(f"fitted on workload A: {describe(fitted.default, names)}")
    runs = [name for w, name in cases if w == "B"]
    measured = [cases[("B", name)].measured["step"] for name in runs]
    priors = [cases[("B", name)].predict(Calibration())["step"] for name in runs]
    predicted = [cases[("B", name)].predict(fitted)["step"] for name in runs]
    print("| run (B) | measured step, median (s) | predicted, priors (s) | predicted, calibrated on A (s) | ratio |")
    print("|---|---|---|---|---|")
    for name, step, prior, after in zip(runs, measured, priors, predicted, strict=True):
        print(f"| {name} | {step:.2f} | {prior:.2f} | {after:.2f} | {after / step:.2f}x |")
    print("per node (B), measured / calibrated prediction:")
    for name in runs:
        case, after = cases[("B", name)], cases[("B", name)].predict(fitted)
        parts = ", ".join(f"{key} {sec:.2f}/{after.get(key, 0.0):.2f}" for key, sec in sorted(case.measured.items())
                          if key != "step" and sec > 0.01)
        print(f"  {name}: {parts}")
    worst = max(math.exp(abs(math.log(p / m))) for p, m in zip(predicted, measured, strict=True))
    if len(runs) < 2:
        print(f"worst ratio {worst:.2f}x (target 1.3x); one run (B): no ranking")
        return 0
    taus = {name: f"{kendall_tau_b(ranked, measured):.2f} (tau-a {kendall_tau(ranked, measured):.2f})"
            for name, ranked in (("calibrated on A", predicted), ("priors", priors))}
    print(f"worst ratio {worst:.2f}x (target 1.3x); Kendall tau-b (target >= 0.8), "
          + "; ".join(f"{name}: {tau}" for name, tau in taus.items()) + f"; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
