"""Where should an LLM judge go? The planner's choice against measured runs. CPU, Ray, three logical GPUs.

``grpo_judge`` on ``tiny-qwen2`` (the judge a frozen copy of the policy's starting weights,
``configs/grpo_judge.yaml``'s default; the pointwise template), 16 prompts x 4 samples, 24 new tokens, an
8-token verdict budget, in three hand mappings of three logical GPUs that share the machine's cores
(``placement.host_cores``):

- **with the actor**: the actor (its rollout colocated) and the judge on GPU 0, the reference on GPU 1;
- **with the reference**: the actor on GPU 0, the reference and the judge on GPU 1;
- **its own**: the actor on GPU 0, the reference on GPU 1, the judge on GPU 2,

each as a sync step and streamed in 2 chunks (``pipeline.stream_chunks``; the judge's chain then runs chunk by chunk
on its group while the next chunk decodes, ``docs/judges.md``). Each run's measured step (the median of its kept
steps over the repeats, interleaved across configurations) is compared with the planner's prediction for the same
mapping (``evaluate_mapping``, as ``hybridflow train`` costs a manual mapping, re-costed through
``cli.calibrate.case_from_run_dir``), calibrated as ``benchmarks/planner_self.py`` calibrates: constants fitted on
its workload A (GRPO with a rule reward, 4 runs on two logical GPUs). The questions: is the planner's choice among
the three mappings the measured fastest, and does its order match the measured one? ``placement: auto`` on the same
inputs is printed beside them, unstreamed and allowed 2 chunks (the search then costs each step streamed and not
and keeps the faster), and the unstreamed one trained and measured as a fourth configuration (with the calibration
fitted on A). The judge's prompts are priced with the template's tokens as the run's tokenizer counts them.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python benchmarks/planner_judge.py [--steps 6] [--repeats 2] [--out DIR]

Sized for a 2-core machine: 4 calibration runs and 7 x ``--repeats`` judge runs of ~30 s each (Ray and model start
included). A finished run directory is reused. Results: ``docs/benchmarks.md``, "Where a judge goes".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_ranking import FITTED, kendall_tau, kept_steps, prompt_tokens, train_at_driver_priority
from planner_self import RUNS
from planner_self import config as calibration_config
from planner_self import median_case as calibration_case

from hybridflow.cli.calibrate import case_from_run_dir
from hybridflow.planner import plan_placement
from hybridflow.planner.calibration import Calibration
from hybridflow.planner.fit import describe, fit_calibration
from hybridflow.planner.plan import Plan
from hybridflow.planner.published import MeasuredCase
from hybridflow.planner.request import PlanRequest
from hybridflow.train.config import load_config
from hybridflow.train.setup import layout_support

SKIP_STEPS = 2
HOST_CORES = 2
MAPPINGS: dict[str, dict[str, list[int]]] = {
    "with the actor": {"actor": [0], "reference": [1], "judge": [0]},
    "with the reference": {"actor": [0], "reference": [1], "judge": [1]},
    "its own": {"actor": [0], "reference": [1], "judge": [2]},
}
CHUNKS = (1, 2)
AUTO = "placement auto"
TIE = 1.01  # predicted steps within 1% of the fastest: a tie, the choice between them the order of MAPPINGS
OPTIONS = {"n": 4, "kl_coef": 0.04, "max_new_tokens": 24, "judge_template": "pointwise", "judge_max_new_tokens": 8}


def config(meshes: dict[str, list[int]] | None, chunks: int, steps: int, out: Path,
           calibration: Path | None = None) -> dict[str, Any]:
    """A judge run on hand ``meshes``, or (None) the plan ``placement: auto`` makes with ``calibration``."""
    placement: dict[str, Any] = ({"mode": "manual", "meshes": meshes} if meshes is not None
                                 else {"mode": "auto", "calibration": str(calibration)})
    return {"algorithm": {"name": "grpo_judge", "options": OPTIONS}, "seed": 0, "steps": steps,
            "executor": {"name": "ray"}, "placement": {"num_gpus": 3, "host_cores": HOST_CORES, **placement},
            "pipeline": {"stream_chunks": chunks}, "model": {"name": "tiny-qwen2", "sft_steps": 0},
            "data": {"task": "reverse", "num_examples": 2000, "batch_size": 16},
            "optim": {"actor": {"lr": 5e-4, "grad_clip": 1.0, "micro_batch_size": 64}}, "output_dir": str(out),
            "logging": {"trackers": [], "plot": False, "progress": False}}


def slug(name: str, chunks: int) -> str:
    return f"{name.replace(' ', '-')}-c{chunks}"


def calibrated(out: Path, steps: int) -> Calibration:
    """planner_self's workload A runs (with this machine's cores shared as the judge runs share them), fitted."""
    folders = {}
    for name, (meshes, padding, budget) in RUNS["A"].items():
        print(f"A {name}; load average {os.getloadavg()[0]:.1f}", flush=True)
        run = (out / f"A-{name.replace(' ', '-')}").resolve()
        settings = calibration_config("A", meshes, padding, budget, steps, run)
        settings["placement.host_cores"] = HOST_CORES
        folders[name] = [train_at_driver_priority(settings, run)]
    prompt = prompt_tokens(next(out.glob("A-*.json")))
    train = [(case.predict, case.measured) for case in (calibration_case(paths, prompt) for paths in folders.values())]
    fitted = fit_calibration(train, names=FITTED, source="benchmarks/planner_judge.py (planner_self's workload A)")
    print(f"fitted on workload A: {describe(fitted.default, FITTED)}")
    return fitted


def judge_case(folders: list[Path], prompt: int) -> MeasuredCase:
    """The first repeat's case, its measured step the median of every repeat's kept steps."""
    case = case_from_run_dir(folders[0], SKIP_STEPS, prompt)
    nodes = [case_from_run_dir(folder, SKIP_STEPS, prompt).measured for folder in folders]
    measured = {key: statistics.median(node[key] for node in nodes) for key in set.intersection(*map(set, nodes))}
    measured["step"] = statistics.median(step for folder in folders for step in kept_steps(folder))
    return replace(case, measured=measured)


def judge_place(groups: Any) -> str:
    for group in groups:
        if "judge" in group.roles:
            return ("with the actor" if "actor" in group.roles else "with the reference" if "reference" in group.roles
                    else "its own") + f" (GPUs {list(group.gpus)})"
    return "nowhere"


def report(cases: dict[tuple[str, int], MeasuredCase], fitted: Calibration) -> None:
    print("| mapping | chunks | measured step, median (s) | predicted, priors (s) | predicted, calibrated (s) "
          "| ratio |")
    print("|---|---|---|---|---|---|")
    for (name, chunks), case in cases.items():
        step, after = case.measured["step"], case.predict(fitted)["step"]
        print(f"| {name} | {chunks} | {step:.2f} | {case.predict(Calibration())['step']:.2f} | {after:.2f} | "
              f"{after / step:.2f}x |")
    for (name, chunks), case in cases.items():
        after = case.predict(fitted)
        parts = ", ".join(f"{key} {sec:.2f}/{after.get(key, 0.0):.2f}" for key, sec in sorted(case.measured.items())
                          if key != "step" and sec > 0.005)
        print(f"  {name}, {chunks} chunk(s), measured/predicted node seconds: {parts}")
    for chunks in CHUNKS:
        names = [name for name, c in cases if c == chunks]
        if len(names) < 2:
            continue
        measured = [cases[name, chunks].measured["step"] for name in names]
        predicted = [cases[name, chunks].predict(fitted)["step"] for name in names]
        by_measured = sorted(names, key=lambda n: cases[n, chunks].measured["step"])
        by_predicted = sorted(names, key=lambda n: cases[n, chunks].predict(fitted)["step"])
        tied = [name for name in by_predicted[1:] if cases[name, chunks].predict(fitted)["step"]
                <= TIE * cases[by_predicted[0], chunks].predict(fitted)["step"]]
        print(f"{chunks} chunk(s): measured order {by_measured}; predicted order {by_predicted}"
              f"{f' (the first tied with {tied}: the planner cannot tell them apart)' if tied else ''}; planner's "
              f"choice {by_predicted[0]!r} is {'' if by_predicted[0] == by_measured[0] else 'NOT '}the measured "
              f"fastest ({cases[by_predicted[0], chunks].measured['step'] / min(measured):.2f}x its step); Kendall "
              f"tau-a {kendall_tau(predicted, measured):.2f}")
    case = next(iter(cases.values()))
    run = load_config(Path(case.id) / "config.json")  # what the trainer's backends run, as `placement: auto` sees
    request = PlanRequest(case.graph, case.models, case.workload, case.cluster, settings=case.settings,
                          calibration=fitted, support=layout_support(run, case.graph))
    auto = plan_placement(request)
    groups = "; ".join(f"{list(g.roles)} on GPUs {list(g.gpus)} ("
                       + ", ".join(f"{lay.role} dp={lay.dp} tp={lay.tp}" for lay in g.layouts) + ")"
                       for g in auto.groups)
    print(f"placement: auto (calibrated, unstreamed): the judge {judge_place(auto.groups)}; {groups}; predicted "
          f"{auto.step_time_s:.2f} s; load average {os.getloadavg()[0]:.1f}")
    streamed = plan_placement(replace(request, stream_chunks=max(CHUNKS)))
    print(f"placement: auto allowed {max(CHUNKS)} chunks: the judge {judge_place(streamed.groups)}; predicted "
          f"{streamed.step_time_s:.2f} s; {dict(streamed.extra)['stream_choice']}")
    print(f"judge prompt: {case.workload.prompt_len} prompt + {case.workload.response_len} response + "
          f"{case.workload.template_tokens} template tokens (the run's tokenizer)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, interleaved")
    parser.add_argument("--out", type=Path, default=Path("runs/planner_judge"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    fitted = calibrated(args.out, args.steps)
    calibration = (args.out / "calibration.json").resolve()
    fitted.save(calibration)
    folders: dict[tuple[str, int], list[Path]] = {}
    runs: list[tuple[str, dict[str, list[int]] | None, int]] = [
        (name, meshes, chunks) for chunks in CHUNKS for name, meshes in MAPPINGS.items()]
    for repeat in range(args.repeats):  # interleaved: every configuration once before any twice
        for name, meshes, chunks in [*runs, (AUTO, None, 1)]:
            print(f"{name}, {chunks} chunk(s) (repeat {repeat}); load average {os.getloadavg()[0]:.1f}", flush=True)
            out = (args.out / f"J-{slug(name, chunks)}-r{repeat}").resolve()
            folders.setdefault((name, chunks), []).append(
                train_at_driver_priority(config(meshes, chunks, args.steps, out, calibration), out))
    prompt = prompt_tokens(next(args.out.glob("J-*.json")))
    cases = {key: judge_case(paths, prompt) for key, paths in folders.items()}
    auto = cases.pop((AUTO, 1))
    report(cases, fitted)
    plan = Plan.from_json((Path(auto.id) / "plan.json").read_text())
    print(f"{AUTO} as trained: the judge {judge_place(plan.groups)}; measured {auto.measured['step']:.2f} s, "
          f"predicted {auto.predict(fitted)['step']:.2f} s (its own plan said {plan.step_time_s:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
