"""The execution modes side by side: tokens/s (``throughput``) and reward per sample (``learning``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_modes.py throughput [--repeats 3] [--out DIR]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_modes.py learning [--seeds 5]

``throughput``: on the Ray executor with 3 logical GPUs, GRPO without a reference on a tiny Qwen2 from random
weights (8 prompts x 8 samples per step, temperature 1.2, up to ``--new-tokens`` tokens): a random model
samples EOS now and then, so response lengths are skewed with a long tail up to the cap, and generation
dominates the step. The learning rate is 1e-9, so every mode samples from the same (stationary) length
distribution: with learning on, 14 steps moved the mean length between modes by 2x, which says nothing
about the modes' speed. Modes: sync colocated (actor and its rollout on all 3 GPUs); on the split [0]
trainer + [1, 2] rollout: sync, sync streamed in 4 chunks, one_step_off, async k=1 and k=2 (partial
rollouts, segments of a quarter of the budget); on the split [0, 1] trainer + [2] rollout: the same but
streaming. Tokens/s counts response tokens per second of wall time over the steps after the first two
(Ray start-up and the first, unoverlapped step).

How the measurement is made meaningful on a shared 2-core machine (as ``planner_ranking.py``): every run in
a process of its own, ``--repeats`` runs of each mode interleaved across modes (a load change hits every
mode alike), the median over repeats, and Ray's workers at the driver's priority (Ray starts them 15 nice
levels lower, where any other process of the machine preempts the logical GPUs, and colocated SPMD ranks,
which wait for each other at every call, suffer most: that made sync colocated look 1.4x slower before).

The planner's prediction of each mode is the plan the trainer makes for that run (``placement=manual``:
its mapping and mode), with what a user gives it: the response lengths of an earlier run
(``planner_settings.lengths_from``, here the first sync colocated run), the machine's cores shared by the
logical GPUs (``host_cores: auto``), and a calibration fitted to the two sync runs (``CALIBRATION_MODES``,
every node time and the step, ``hybridflow calibrate``'s code path). The overlapped modes, the streamed step and
the 2+1 split are predictions; the ranking is compared by Kendall tau, calibrated and with the priors.

``learning``: the learning tests' GRPO run (SFT-warmed tiny Qwen2 on string reversal, 50 steps, local
executor) on a split [0] trainer + [1] rollout mapping, per mode and seed: the reward gain (mean of the last
6 steps minus the first 6) and the final reward. Every mode sees the same samples per step, so steps are
samples seen; async modes pass when their gain lies within the spread of sync's seeds. The last mode adds
truncated importance sampling of the rollout-vs-trainer mismatch (``rollout_correction: tis``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hybridflow.planner import Plan
from hybridflow.planner.fit import describe, fit_calibration
from hybridflow.planner.measured import case_from_run
from hybridflow.planner.modes import describe_mode
from hybridflow.train import placement, setup
from hybridflow.train.config import TrainConfig, load_config
from hybridflow.train.loop import train

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "runtime"))
from learning_configs import LEARNING_RUNS, WINDOW, reward_rise
from planner_ranking import kendall_tau, prompt_tokens, train_at_driver_priority

SKIP_STEPS = 2  # Ray start-up and the first, unoverlapped step
PROMPTS, SAMPLES = 8, 8
SPLIT = ["placement.mode=manual", "placement.meshes={actor: [0], 'actor:rollout': [1, 2]}"]  # trainer 1 GPU, rollout 2
SPLIT_21 = ["placement.mode=manual",
            "placement.meshes={actor: [0, 1], 'actor:rollout': [2]}"]  # trainer 2 GPUs, rollout 1
THROUGHPUT_MODES = {
    "sync, colocated on 3 GPUs": ["placement.mode=manual", "placement.meshes={actor: [0, 1, 2]}"],
    "sync, split 1+2": SPLIT,
    "sync, split 1+2, streamed in 4 chunks": [*SPLIT, "pipeline.stream_chunks=4"],
    "one_step_off, split 1+2": [*SPLIT, "pipeline.mode=one_step_off"],
    "async k=1, split 1+2": [*SPLIT, "pipeline.mode=async", "pipeline.max_staleness=1"],
    "async k=2, split 1+2": [*SPLIT, "pipeline.mode=async", "pipeline.max_staleness=2"],
    "sync, split 2+1": SPLIT_21,
    "one_step_off, split 2+1": [*SPLIT_21, "pipeline.mode=one_step_off"],
    "async k=1, split 2+1": [*SPLIT_21, "pipeline.mode=async", "pipeline.max_staleness=1"],
    "async k=2, split 2+1": [*SPLIT_21, "pipeline.mode=async", "pipeline.max_staleness=2"],
}
# The modes the planner ranks: every one
RANKED = tuple(THROUGHPUT_MODES)
# The planner's CPU constants are fitted to these runs (every node time and the step); every other mode is predicted
CALIBRATION_MODES = ("sync, colocated on 3 GPUs", "sync, split 1+2")
# What the calibration fits: as benchmarks/planner_ranking.py (the CPU's training efficiency and the overheads),
# plus decode_mfu. A CPU core is far from its peak on a tiny model's decode step of 20-60 sequences, so the
# per-sequence work of a step is not negligible beside its fixed overhead; the two sync runs decode 21 and 32
# sequences an engine, which tells the two apart (fit.HELD holds decode_mfu for GPU calibrations, whose
# colocated runs cannot). Held at its prior instead, the pooled ranking's tau is 0.84, not 0.93 (docs/benchmarks.md).
FITTED = ("train_mfu", "eff_half_tokens", "decode_mfu", "decode_step_overhead_s", "phase_overhead_s",
          "micro_batch_overhead_s")
LEARNING_MODES = {
    "sync": ["pipeline.mode=sync"],
    "one_step_off": ["pipeline.mode=one_step_off"],
    "async k=1": ["pipeline.mode=async", "pipeline.max_staleness=1"],
    "async k=2": ["pipeline.mode=async", "pipeline.max_staleness=2"],
    "async k=2, TIS": ["pipeline.mode=async", "pipeline.max_staleness=2", "algorithm.options.rollout_correction=tis"],
}


def throughput_config(overrides: list[str], steps: int, new_tokens: int, out: Path) -> dict[str, Any]:
    """One throughput run's config as a mapping (written as JSON, which is YAML, for ``hybridflow train``)."""
    config = load_config(None, [
        "algorithm=grpo_no_ref", f"algorithm.options={{n: {SAMPLES}, max_new_tokens: {new_tokens}, temperature: 1.2}}",
        f"steps={steps}", "model.sft_steps=0", f"data.batch_size={PROMPTS}", "optim.actor.lr=1e-9", "executor.name=ray",
        "placement.cluster=3xCPU", f"output_dir={out}", "logging.progress=false", "logging.plot=false",
        "logging.trackers=[jsonl]", *overrides])
    return asdict(config)


def run(name: str, overrides: list[str], repeat: int, steps: int, new_tokens: int, root: Path) -> Path:
    """One measured run in a process of its own (reused when finished), Ray workers at the driver's priority."""
    out = root / f"{slug(name)}-r{repeat}"
    return train_at_driver_priority(throughput_config(overrides, steps, new_tokens, out), out)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def kept(folder: Path) -> list[dict[str, float]]:
    """The run's step records after the first ``SKIP_STEPS`` (Ray start-up, the first unoverlapped step)."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if "time/step" in row][SKIP_STEPS:]


def measured(folders: list[Path]) -> dict[str, float]:
    """A mode's medians over its repeats: tokens/s and step time per repeat, then the median."""
    repeats = [kept(folder) for folder in folders]
    rates = [sum(r["response_length/mean"] * PROMPTS * SAMPLES for r in rows) / sum(r["time/step"] for r in rows)
             for rows in repeats]
    every = [r for rows in repeats for r in rows]
    return {"tokens_per_s": statistics.median(rates), "tokens_per_s_low": min(rates), "tokens_per_s_high": max(rates),
            "step_s": statistics.median(r["time/step"] for r in every),
            "mean_len": statistics.mean(r["response_length/mean"] for r in every),
            "max_len": max(r["response_length/max"] for r in every),
            "staleness": max(r.get("pipeline/staleness_max", 0.0) for r in every),
            "rollout_idle": statistics.mean(r.get("pipeline/rollout_idle_fraction", float("nan")) for r in every)}


def saved_config(folder: Path) -> Path:
    """The config file ``train_at_driver_priority`` wrote beside the run in ``folder``."""
    return folder.parent / f"{folder.name}.json"


def planner_config(folder: Path, lengths_from: Path, calibration: Path | None = None, *overrides: str) -> TrainConfig:
    """The config of the run in ``folder`` as the planner sees it: the response lengths of the run at
    ``lengths_from`` (``planner_settings.lengths_from``: an earlier run's metrics, as a user gives them), the
    machine's cores shared by the logical GPUs (``host_cores: auto``), and ``calibration`` when given."""
    extra = [f"placement.calibration={calibration}"] if calibration is not None else []
    return load_config(saved_config(folder),
                       [f"placement.planner={{lengths_from: '{lengths_from}'}}", "placement.host_cores=auto", *extra,
                        *overrides])


def predicted(folder: Path, lengths_from: Path, calibration: Path | None, *overrides: str) -> Plan:
    """The plan the trainer makes for the run in ``folder`` (its mapping and mode; ``planner_config``)."""
    config = planner_config(folder, lengths_from, calibration, *overrides)
    return setup.build_plan(config, setup.build_graph(config), prompt_tokens(saved_config(folder)),
                            str(folder / "init_model"))


def calibrate(folders: list[Path], lengths_from: Path, out: Path) -> Path:
    """Fit the CPU constants to the sync runs in ``folders`` (every node's time and the step, each repeat a case:
    ``hybridflow calibrate``'s code path) and save them; the overlapped modes are then predicted, not fitted."""
    cases = []
    for folder in folders:
        config = planner_config(folder, lengths_from)
        graph = setup.build_graph(config)
        settings = placement.run_settings(config, graph)
        models = placement.role_models(config, graph, str(folder / "init_model"))
        work = placement.workload(config, graph, prompt_tokens(saved_config(folder)), settings)
        case = case_from_run(folder, graph=graph, models=models, workload=work, settings=settings,
                             cluster=placement.planner_cluster(config), skip_steps=SKIP_STEPS)
        cases.append((case.predict, case.measured))
    fitted = fit_calibration(cases, names=FITTED, source="benchmarks/pipeline_modes.py (the sync runs)")
    print(f"fitted on the sync runs: {describe(fitted.default, FITTED)}", file=sys.stderr)
    path = out / "calibration.json"
    fitted.save(path)
    return path


def throughput(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    folders: dict[str, list[Path]] = {}
    for repeat in range(args.repeats):  # interleaved: every mode once before any mode twice
        for name, overrides in THROUGHPUT_MODES.items():
            print(f"{name} (repeat {repeat}); load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
            folders.setdefault(name, []).append(run(name, overrides, repeat, args.steps, args.new_tokens, args.out))
    rows = {name: measured(paths) for name, paths in folders.items()}
    lengths = folders[next(iter(THROUGHPUT_MODES))][0] / "metrics.jsonl"
    fitted = calibrate([path for name in CALIBRATION_MODES for path in folders[name]], lengths, args.out)
    plans = {name: predicted(paths[0], lengths, fitted) for name, paths in folders.items()}
    priors = {name: predicted(paths[0], lengths, None) for name, paths in folders.items()}
    base = rows[next(iter(rows))]["tokens_per_s"]
    print("| mode | tokens/s (median; min-max) | x sync colocated | s per step | planner's s per step (priors) | "
          "rank measured | rank predicted | response length mean / max | rollout idle | max staleness |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ranked = [name for name in rows if name in RANKED]
    measured_rank = _rank([-rows[name]["tokens_per_s"] for name in ranked])
    predicted_rank = _rank([plans[name].step_time_s for name in ranked])
    ranks = {name: (m, p) for name, m, p in zip(ranked, measured_rank, predicted_rank, strict=True)}
    for name, row in rows.items():
        m, p = ranks.get(name, ("-", "-"))
        print(f"| {name} | {row['tokens_per_s']:.0f} ({row['tokens_per_s_low']:.0f}-{row['tokens_per_s_high']:.0f}) "
              f"| {row['tokens_per_s'] / base:.2f} | {row['step_s']:.2f} | {plans[name].step_time_s:.3g} "
              f"({priors[name].step_time_s:.3g}) | {m} | {p} | "
              f"{row['mean_len']:.0f} / {row['max_len']:.0f} | {row['rollout_idle']:.2f} | {row['staleness']:.0f} |")
    speed = [-rows[name]["tokens_per_s"] for name in ranked]
    tau = kendall_tau(speed, [plans[name].step_time_s for name in ranked])
    prior_tau = kendall_tau(speed, [priors[name].step_time_s for name in ranked])
    print(f"\nKendall tau of the planner's ranking of the {len(ranked)} modes against the measured one: {tau:.2f} "
          f"calibrated on the sync runs, {prior_tau:.2f} with the priors; load average {os.getloadavg()[0]:.1f}")
    for name in ranked:
        print(f"- {name}: {describe_mode(plans[name])}")
    auto = predicted(folders[ranked[0]][0], lengths, fitted, "placement.mode=auto", "pipeline.mode=auto",
                     "placement.meshes={}",
                     "placement.separate_rollout=true")
    print(f"\n`placement: auto` with `pipeline: auto` on the same 3 logical GPUs, calibrated: "
          f"{dict(auto.extra).get('pipeline_choice')}")


def learning(overrides: list[str], seed: int, out: Path) -> tuple[float, float]:
    config_file, base = LEARNING_RUNS["grpo"]
    configs = Path(__file__).parents[1] / "configs"
    config = load_config(configs / config_file, [
        *base, f"seed={seed}", "placement.mode=manual", "placement.cluster=2xCPU",
        "placement.meshes={actor: [0], reference: [0], 'actor:rollout': [1]}", f"output_dir={out}",
        "logging.progress=false", "logging.plot=false", "logging.trackers=[jsonl]", *overrides])
    history = train(config).history
    first, last = reward_rise(history, WINDOW)
    return last - first, last


def _rank(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for position, index in enumerate(order):
        ranks[index] = position + 1
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("throughput", "learning"))
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3, help="throughput: runs of each mode, interleaved")
    parser.add_argument("--out", type=Path, default=Path("runs/pipeline_modes"),
                        help="throughput: where the runs go (finished runs are reused)")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    if args.part == "throughput":
        throughput(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        print("| mode | reward gain per seed | gain mean +- std | final reward mean |")
        print("|---|---|---|---|")
        for i, (name, overrides) in enumerate(LEARNING_MODES.items()):
            runs = [learning(overrides, seed, Path(tmp) / f"{i}-{seed}") for seed in range(args.seeds)]
            gains = [gain for gain, _ in runs]
            spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
            print(f"| {name} | {', '.join(f'{g:+.3f}' for g in gains)} | {statistics.mean(gains):+.3f} +- "
                  f"{spread:.3f} | {statistics.mean(last for _, last in runs):.3f} |", flush=True)


if __name__ == "__main__":
    main()
