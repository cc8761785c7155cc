"""The execution modes side by side: tokens/s (``throughput``) and reward per sample (``learning``).

    .venv/bin/python benchmarks/pipeline_modes.py throughput [--steps 14] [--new-tokens 160]
    .venv/bin/python benchmarks/pipeline_modes.py learning [--seeds 3]

``throughput``: on the Ray executor with 3 logical GPUs, GRPO without a reference on a tiny Qwen2 from random
weights (8 prompts x 8 samples per step, temperature 1.2, up to ``--new-tokens`` tokens): a random model
samples EOS now and then, so response lengths are skewed with a long tail up to the cap, and generation
dominates the step. The learning rate is 1e-9, so every mode samples from the same (stationary) length
distribution: with learning on, 14 steps moved the mean length between modes by 2x, which says nothing
about the modes' speed. Modes: sync colocated (actor and its rollout on all 3 GPUs), and on the split
[0] trainer + [1, 2] rollout: sync, sync streamed in 4 chunks, one_step_off, async k=1 and k=2 (partial
rollouts, segments of a quarter of the budget). Every run is placed with ``placement=manual``, so its
plan.json holds the planner's predicted step time for that mapping and mode, printed beside the measured
one. Tokens/s counts response tokens per second of wall time over the steps after the first two (Ray
start-up and the first, unoverlapped step).

``learning``: the learning tests' GRPO run (SFT-warmed tiny Qwen2 on string reversal, 50 steps, local
executor) on a split [0] trainer + [1] rollout mapping, per mode and seed: the reward gain (mean of the last
6 steps minus the first 6) and the final reward. Every mode sees the same samples per step, so steps are
samples seen; async modes pass when their gain lies within the spread of sync's seeds. The last mode adds
truncated importance sampling of the rollout-vs-trainer mismatch (``rollout_correction: tis``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from hybridflow.train.config import load_config
from hybridflow.train.loop import train

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "runtime"))
from learning_configs import LEARNING_RUNS, WINDOW, reward_rise

SPLIT = ["placement=manual", "meshes={actor: [0], 'actor:rollout': [1, 2]}"]
THROUGHPUT_MODES = {
    "sync, colocated on 3 GPUs": ["placement=manual", "meshes={actor: [0, 1, 2]}"],
    "sync, split 1+2": SPLIT,
    "sync, split 1+2, streamed in 4 chunks": [*SPLIT, "stream_chunks=4"],
    "one_step_off, split 1+2": [*SPLIT, "pipeline=one_step_off"],
    "async k=1, split 1+2": [*SPLIT, "pipeline=async", "max_staleness=1"],
    "async k=2, split 1+2": [*SPLIT, "pipeline=async", "max_staleness=2"],
}
LEARNING_MODES = {
    "sync": ["pipeline=sync"],
    "one_step_off": ["pipeline=one_step_off"],
    "async k=1": ["pipeline=async", "max_staleness=1"],
    "async k=2": ["pipeline=async", "max_staleness=2"],
    "async k=2, TIS": ["pipeline=async", "max_staleness=2", "algorithm_options.rollout_correction=tis"],
}


def throughput(overrides: list[str], steps: int, new_tokens: int, out: Path) -> dict[str, float]:
    config = load_config(None, [
        "algorithm=grpo_no_ref", f"algorithm_options={{n: 8, max_new_tokens: {new_tokens}, temperature: 1.2}}",
        f"steps={steps}", "model.sft_steps=0", "data.batch_size=8", "actor.lr=1e-9", "executor=ray",
        "cluster=3xCPU", f"output_dir={out}", "progress=false", "tensorboard=false", "plot=false",
        "trackers=[jsonl]", *overrides])
    result = train(config)
    history = result.history[2:]
    tokens = sum(row["response_length/mean"] * 64 for row in history)
    seconds = sum(row["time/step"] for row in history)
    plan = json.loads((result.run_dir / "plan.json").read_text())
    return {"tokens_per_s": tokens / seconds, "step_s": statistics.mean(row["time/step"] for row in history),
            "predicted_s": plan["step_time_s"], "mean_len": statistics.mean(r["response_length/mean"] for r in history),
            "max_len": max(row["response_length/max"] for row in history),
            "staleness": max(row.get("pipeline/staleness_max", 0.0) for row in history),
            "rollout_idle": statistics.mean(row.get("pipeline/rollout_idle_fraction", float("nan")) for row in history)}


def learning(overrides: list[str], seed: int, out: Path) -> tuple[float, float]:
    config_file, base = LEARNING_RUNS["grpo"]
    configs = Path(__file__).parents[1] / "configs"
    config = load_config(configs / config_file, [
        *base, f"seed={seed}", "placement=manual", "cluster=2xCPU", "meshes={actor: [0], reference: [0], "
        "'actor:rollout': [1]}", f"output_dir={out}", "progress=false", "tensorboard=false", "plot=false",
        "trackers=[jsonl]", *overrides])
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
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.part == "throughput":
            rows = [(name, throughput(overrides, args.steps, args.new_tokens, Path(tmp) / str(i)))
                    for i, (name, overrides) in enumerate(THROUGHPUT_MODES.items())]
            base = rows[0][1]["tokens_per_s"]
            measured = _rank([row["step_s"] for _, row in rows])
            predicted = _rank([row["predicted_s"] for _, row in rows])
            print("| mode | tokens/s | x sync colocated | s per step | planner's s per step | rank measured | "
                  "rank predicted | response length mean / max | rollout idle | max staleness |")
            print("|---|---|---|---|---|---|---|---|---|---|")
            for (name, row), m, p in zip(rows, measured, predicted, strict=True):
                print(f"| {name} | {row['tokens_per_s']:.0f} | {row['tokens_per_s'] / base:.2f} | {row['step_s']:.2f} "
                      f"| {row['predicted_s']:.3g} | {m} | {p} | {row['mean_len']:.0f} / {row['max_len']:.0f} | "
                      f"{row['rollout_idle']:.2f} | {row['staleness']:.0f} |")
            return
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
