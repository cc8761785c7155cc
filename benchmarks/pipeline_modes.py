"""Tokens/s of the execution modes side by side: sync colocated, sync with the rollout on its own logical GPU,
and one_step_off (the rollout generates step t+1 while the trainer trains on step t), on the Ray executor.

    .venv/bin/python benchmarks/pipeline_modes.py [--steps 16] [--new-tokens 96]

GRPO without a reference (actor + rollout only), tiny Qwen2 from random weights (so responses run long), 8 prompts x 8
samples per step, up to ``--new-tokens`` sampled tokens (temperature 1.2, so lengths spread out): generation
dominates. Tokens/s counts response tokens per second of wall time over the steps after the first two
(Ray start-up and the pipeline's first, unoverlapped step excluded). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from hybridflow.train.config import load_config
from hybridflow.train.loop import train

MODES = {
    "sync, colocated (1 GPU)": ["num_gpus=1"],
    "sync, rollout on its own GPU": ["placement=manual", "cluster=2xCPU", "meshes={actor: [0], 'actor:rollout': [1]}"],
    "one_step_off, rollout on its own GPU": ["placement=manual", "cluster=2xCPU",
                                             "meshes={actor: [0], 'actor:rollout': [1]}", "pipeline=one_step_off"],
}


def run(overrides: list[str], steps: int, new_tokens: int, out: Path) -> dict[str, float]:
    config = load_config(None, [
        "algorithm=grpo_no_ref", f"algorithm_options={{n: 8, max_new_tokens: {new_tokens}, temperature: 1.2}}",
        f"steps={steps}", "model.sft_steps=0", "data.batch_size=8", "actor.lr=1e-3", "executor=ray",
        f"output_dir={out}", "progress=false", "tensorboard=false", "plot=false", "trackers=[jsonl]", *overrides])
    history = train(config).history[2:]
    tokens = sum(row["response_length/mean"] * 64 for row in history)
    seconds = sum(row["time/step"] for row in history)
    return {"tokens_per_s": tokens / seconds, "step_s": statistics.mean(row["time/step"] for row in history),
            "reward_last": statistics.mean(row["reward/mean"] for row in history[-4:]),
            "staleness": max(row.get("pipeline/staleness_max", 0.0) for row in history)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, (name, overrides) in enumerate(MODES.items()):
            rows.append((name, run(overrides, args.steps, args.new_tokens, Path(tmp) / str(index))))
    base = rows[0][1]["tokens_per_s"]
    print("| mode | tokens/s | x sync colocated | s per step | max staleness | reward, last 4 steps |")
    print("|---|---|---|---|---|---|")
    for name, row in rows:
        print(f"| {name} | {row['tokens_per_s']:.0f} | {row['tokens_per_s'] / base:.2f} | {row['step_s']:.2f} | "
              f"{row['staleness']:.0f} | {row['reward_last']:.3f} |")


if __name__ == "__main__":
    main()
