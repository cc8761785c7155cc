"""Where should an LLM judge go? The planner's predicted order against measured runs. CPU, Ray, four logical GPUs.

``grpo_judge`` on ``tiny-qwen2-wide`` (the judge a frozen copy of the policy's starting weights,
``configs/grpo_judge.yaml``'s default; the pointwise template), 16 prompts x 4 samples, 48 new tokens, an 8-token
verdict budget, on four logical GPUs that share the machine's cores (``placement.host_cores``). The actor (its
rollout colocated) is data parallel on GPUs 0-1 and the reference on GPU 2, and the judge goes

- **with the actor**: on GPUs 0-1, data parallel beside the rollout (dp=2);
- **with the reference**: on GPU 2, after the reference's log-probs;
- **its own**: on GPU 3 (dp=1), beside the reference's pass,

each as a sync step and streamed in 2 chunks (``pipeline.stream_chunks``; the judge's chain then runs chunk by chunk
on its group while the next chunk decodes, ``docs/judges.md``).

The workload was chosen before any measurement, from the planner's predictions alone (``--predict``: no training,
a fraction of a second per mapping): with three one-GPU groups (the layout of the 2026-12-07 runs) the model puts the
judge with the actor and on its own group at the same step unstreamed (the actor's GPU idles while the judge answers
in either place), and every neighbour within 2-10% in both modes; the group sizes above, the wider policy (the
judge's prompt, ~235 tokens, and the reference's pass over 58 tokens both grow with it) and the longer responses
spread the three to >= 12% between neighbours in both modes (``docs/benchmarks.md``, "Where a judge goes").

``--predict`` prints, and writes to ``OUT/predicted.json``, those a-priori steps (``placement.planned`` on each
run's config, as ``hybridflow train`` costs a manual mapping) with the calibration it is given. A measurement then
trains every configuration once per round, rounds repeated (placements alternated, so a slow spell of the shared
machine falls on all of them), and compares each configuration's median kept step (and its per-round medians'
range) with the same a-priori prediction and with the prediction re-costed on the run's own response lengths
(``cli.calibrate.case_from_run_dir``). The calibration: ``--calibration FILE`` (a saved fit), else planner_self's
workload A trained and fitted here (4 GRPO runs on two logical GPUs, ``benchmarks/planner_self.py``).
``placement: auto`` on the same inputs is printed beside them; ``--auto`` also trains its unstreamed plan.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planner_judge.py --predict [--calibration FILE] [--out DIR]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planner_judge.py [--calibration FILE] [--steps 6] [--rounds 3]

Sized for a 2-core machine: 6 x ``--rounds`` judge runs of ~30-40 s each (Ray and model start included). A
finished run directory is reused. Results: ``docs/benchmarks.md``, "Where a judge goes".
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
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
from hybridflow.train import placement, setup
from hybridflow.train.config import config_from_dotted, load_config
from hybridflow.train.setup import layout_support
from hybridflow.train.template_tokens import template_tokens

SKIP_STEPS = 2
HOST_CORES = 2
NUM_GPUS = 4
MODEL = "tiny-qwen2-wide"
BATCH = 16
MAPPINGS: dict[str, dict[str, list[int]]] = {
    "with the actor": {"actor": [0, 1], "reference": [2], "judge": [0, 1]},
    "with the reference": {"actor": [0, 1], "reference": [2], "judge": [2]},
    "its own": {"actor": [0, 1], "reference": [2], "judge": [3]},
}
CHUNKS = (1, 2)
AUTO = "placement auto"
TIE = 1.01  # predicted steps within 1% of the fastest: a tie, the choice between them the order of MAPPINGS
OPTIONS = {"n": 4, "kl_coef": 0.04, "max_new_tokens": 48, "judge_template": "pointwise", "judge_max_new_tokens": 8}
Key = tuple[str, int]


def config(meshes: dict[str, list[int]] | None, chunks: int, steps: int, out: Path,
           calibration: Path | None = None) -> dict[str, Any]:
    """A judge run on hand ``meshes``, or (None) the plan ``placement: auto`` makes with ``calibration``."""
    placement_: dict[str, Any] = ({"mode": "manual", "meshes": meshes} if meshes is not None else {"mode": "auto"})
    if calibration is not None:
        placement_["calibration"] = str(calibration)
    return {"algorithm": {"name": "grpo_judge", "options": OPTIONS}, "seed": 0, "steps": steps,
            "executor": {"name": "ray"}, "placement": {"num_gpus": NUM_GPUS, "host_cores": HOST_CORES, **placement_},
            "pipeline": {"stream_chunks": chunks}, "model": {"name": MODEL, "sft_steps": 0},
            "data": {"task": "reverse", "num_examples": 2000, "batch_size": BATCH},
            "optim": {"actor": {"lr": 5e-4, "grad_clip": 1.0, "micro_batch_size": 64}}, "output_dir": str(out),
            "logging": {"trackers": [], "plot": False, "progress": False}}


def slug(name: str, chunks: int) -> str:
    return f"{name.replace(' ', '-')}-c{chunks}"


def predicted(settings: dict[str, Any]) -> float:
    """The step ``hybridflow train`` would plan for ``settings`` before training it (no run): the longest prompt,
    the template's tokens in the run's tokenizer, responses at their budget."""
    run = config_from_dotted(settings)
    graph = setup.build_graph(run)
    tokenizer = setup.policy_tokenizer(run)
    train, _ = setup.prepare_data(run, setup.data_splits(run), tokenizer)
    extra = template_tokens(run, graph, tokenizer, setup.records(run))
    return placement.planned(run, graph, int(train.longest_prompt_tokens), support=layout_support(run, graph),
                             vocab_size=len(tokenizer), template_tokens=extra).step_time_s


def gaps(steps: dict[str, float]) -> str:
    """The names fastest first, each with how much slower it is than the one before it."""
    order = sorted(steps, key=steps.__getitem__)
    return " < ".join(
        f"{name} ({steps[name]:.2f} s{'' if i == 0 else f', +{steps[name] / steps[order[i - 1]] - 1:.0%}'})"
        for i, name in enumerate(order))


def predict_all(calibration: Path, steps: int, out: Path) -> dict[Key, float]:
    """Every hand configuration's a-priori step, printed and written to ``out/predicted.json``."""
    before = {(name, chunks): predicted(config(meshes, chunks, steps, out / "unused", calibration))
              for chunks in CHUNKS for name, meshes in MAPPINGS.items()}
    for chunks in CHUNKS:
        print(f"predicted a priori, {chunks} chunk(s): {gaps({n: s for (n, c), s in before.items() if c == chunks})}")
    (out / "predicted.json").write_text(json.dumps(
        {"written": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "calibration": str(calibration),
         "steps": [{"mapping": n, "chunks": c, "step_s": s} for (n, c), s in before.items()]}, indent=1))
    return before


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
    """The first round's case, its measured step the median of every round's kept steps."""
    case = case_from_run_dir(folders[0], SKIP_STEPS, prompt)
    nodes = [case_from_run_dir(folder, SKIP_STEPS, prompt).measured for folder in folders]
    measured = {key: statistics.median(node[key] for node in nodes) for key in set.intersection(*map(set, nodes))}
    measured["step"] = statistics.median(step for folder in folders for step in kept_steps(folder))
    return replace(case, measured=measured)


def measured_timeline(folders: list[Path]) -> dict[str, tuple[float, float]]:
    """Each node's span in the step (``timeline/<node>/start_s``, ``end_s``), the median over every round's kept
    steps (runs written before the runtime recorded spans have none)."""
    steps = [json.loads(line) for folder in folders
             for line in (folder / "metrics.jsonl").read_text().splitlines()[SKIP_STEPS:] if line.strip()]
    nodes = {key.split("/")[1] for step in steps for key in step if key.startswith("timeline/")}
    return {node: (statistics.median(step[f"timeline/{node}/start_s"] for step in steps
                                     if f"timeline/{node}/start_s" in step),
                   statistics.median(step[f"timeline/{node}/end_s"] for step in steps
                                     if f"timeline/{node}/end_s" in step)) for node in sorted(nodes)}


def timeline_lines(case: MeasuredCase, fitted: Calibration, measured: dict[str, tuple[float, float]]) -> str:
    """Each node's measured span beside the planner's (start-end, seconds into the step), in the planner's order."""
    plan = case.plan(fitted)
    return ", ".join(f"{node.node} {measured[node.node][0]:.2f}-{measured[node.node][1]:.2f}/"
                     f"{node.start_s:.2f}-{node.end_s:.2f}" for node in sorted(plan.nodes, key=lambda n: n.start_s)
                     if node.node in measured)


def judge_place(groups: Any) -> str:
    for group in groups:
        if "judge" in group.roles:
            return ("with the actor" if "actor" in group.roles else "with the reference" if "reference" in group.roles
                    else "its own") + f" (GPUs {list(group.gpus)})"
    return "nowhere"


def spread_verdict(rounds: int, apart: bool) -> str:
    if rounds < 2:
        return "one round: no spread"
    return "apart (the gap exceeds the spread)" if apart else "OVERLAP (the gap is within the spread)"


def paired(fast: list[float], slow: list[float]) -> str:
    """The rounds compared pairwise (a round runs every configuration back to back, so a round's pair shares the
    machine's state): in how many the slower configuration was slower, and the sign test's two-sided p-value."""
    wins, rounds = sum(b > a for a, b in zip(fast, slow, strict=True)), len(fast)
    tail = sum(math.comb(rounds, k) for k in range(max(wins, rounds - wins), rounds + 1)) / 2 ** rounds
    return f"slower in {wins} of {rounds} rounds (sign test p = {min(1.0, 2 * tail):.2f})"


def order_verdict(chunks: int, names: list[str], before: dict[Key, float], cases: dict[Key, MeasuredCase],
                  rounds: dict[Key, list[float]], fitted: Calibration) -> None:
    """Predicted against measured order for one mode, and whether each measured gap clears the rounds' spread."""
    measured = {name: cases[name, chunks].measured["step"] for name in names}
    prior = {name: before[name, chunks] for name in names}
    by_measured, by_predicted = sorted(names, key=measured.__getitem__), sorted(names, key=prior.__getitem__)
    tied = [name for name in by_predicted[1:] if prior[name] <= TIE * prior[by_predicted[0]]]
    print(f"{chunks} chunk(s): predicted order {by_predicted}{f' (the first tied with {tied})' if tied else ''}; "
          f"measured order {by_measured}: {'the SAME' if by_predicted == by_measured else 'DIFFERENT'}; the "
          f"planner's choice {by_predicted[0]!r} is {'' if by_predicted[0] == by_measured[0] else 'NOT '}the measured "
          f"fastest; Kendall tau-a {kendall_tau([prior[n] for n in names], [measured[n] for n in names]):.2f}")
    recosted = sorted(names, key=lambda name: cases[name, chunks].predict(fitted)["step"])
    print(f"  re-costed on the runs' response lengths: order {recosted} "
          f"({'the same' if recosted == by_predicted else 'NOT the same'} as a priori)")
    for fast, slow in itertools.pairwise(by_measured):
        low, high = max(rounds[fast, chunks]), min(rounds[slow, chunks])
        print(f"  {slow!r} measured +{measured[slow] / measured[fast] - 1:.0%} over {fast!r} (predicted "
              f"{prior[slow] / prior[fast] - 1:+.0%}); per-round medians {fast} "
              f"{min(rounds[fast, chunks]):.2f}-{low:.2f} s, {slow} {high:.2f}-{max(rounds[slow, chunks]):.2f} s: "
              f"{spread_verdict(len(rounds[fast, chunks]), low < high)}; "
              f"{paired(rounds[fast, chunks], rounds[slow, chunks])}")


def report(cases: dict[Key, MeasuredCase], fitted: Calibration, before: dict[Key, float],
           rounds: dict[Key, list[float]], timelines: dict[Key, dict[str, tuple[float, float]]]) -> None:
    print("| judge | chunks | predicted a priori (s) | predicted on the run's lengths (s) | measured step, median (s) "
          "| per-round medians (s) | predicted / measured |")
    print("|---|---|---|---|---|---|---|")
    for (name, chunks), case in cases.items():
        step = case.measured["step"]
        print(f"| {name} | {chunks} | {before[name, chunks]:.2f} | {case.predict(fitted)['step']:.2f} | {step:.2f} | "
              f"{' / '.join(f'{s:.2f}' for s in rounds[name, chunks])} | {before[name, chunks] / step:.2f}x |")
    for (name, chunks), case in cases.items():
        after = case.predict(fitted)
        parts = ", ".join(f"{key} {sec:.2f}/{after.get(key, 0.0):.2f}" for key, sec in sorted(case.measured.items())
                          if key != "step" and sec > 0.005)
        print(f"  {name}, {chunks} chunk(s), measured/predicted node seconds: {parts}")
        if timelines.get((name, chunks)):
            print(f"    measured/predicted spans (s into the step): "
                  f"{timeline_lines(case, fitted, timelines[name, chunks])}")
    for chunks in CHUNKS:
        names = [name for name, c in cases if c == chunks]
        if len(names) > 1:
            order_verdict(chunks, names, before, cases, rounds, fitted)
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
    parser.add_argument("--rounds", type=int, default=3, help="runs of each configuration, one per round, interleaved")
    parser.add_argument("--out", type=Path, default=Path("runs/planner_judge"))
    parser.add_argument("--calibration", type=Path, help="a saved fit (else workload A is trained and fitted here)")
    parser.add_argument("--predict", action="store_true", help="print the a-priori predictions and train nothing")
    parser.add_argument("--auto", action="store_true", help="also train placement: auto's unstreamed plan each round")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    calibration = (args.out / "calibration.json").resolve()
    fitted = Calibration.load(args.calibration) if args.calibration else calibrated(args.out, args.steps)
    fitted.save(calibration)
    before = predict_all(calibration, args.steps, args.out)
    if args.predict:
        return 0
    folders: dict[Key, list[Path]] = {}
    runs: list[tuple[str, dict[str, list[int]] | None, int]] = [
        (name, meshes, chunks) for chunks in CHUNKS for name, meshes in MAPPINGS.items()]
    for repeat in range(args.rounds):  # interleaved: every configuration once before any twice
        for name, meshes, chunks in [*runs, *([(AUTO, None, 1)] if args.auto else [])]:
            started = time.time()
            out = (args.out / f"J-{slug(name, chunks)}-r{repeat}").resolve()
            folders.setdefault((name, chunks), []).append(
                train_at_driver_priority(config(meshes, chunks, args.steps, out, calibration), out))
            print(f"{name}, {chunks} chunk(s), round {repeat}: {time.time() - started:.0f} s; load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    prompt = prompt_tokens(next(args.out.glob("J-*.json")))
    rounds = {key: [statistics.median(kept_steps(folder)) for folder in paths] for key, paths in folders.items()}
    cases = {key: judge_case(paths, prompt) for key, paths in folders.items()}
    auto = cases.pop((AUTO, 1), None)
    report(cases, fitted, before, rounds, {key: measured_timeline(paths) for key, paths in folders.items()})
    if auto is not None:
        plan = Plan.from_json((Path(auto.id) / "plan.json").read_text())
        print(f"{AUTO} as trained: the judge {judge_place(plan.groups)}; measured {auto.measured['step']:.2f} s, "
              f"predicted {auto.predict(fitted)['step']:.2f} s (its own plan said {plan.step_time_s:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
