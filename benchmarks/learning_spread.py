"""Seed-to-seed spread of the learning tests, and learning curves of every policy-gradient algorithm.

    .venv/bin/python benchmarks/learning_spread.py [--seeds 5] [--algorithms grpo,ppo] [--out runs/bench_spread]

Each run starts from the same SFT-warmed tiny model as ``tests/runtime/test_learning.py`` (60 SFT steps,
seed 0) and changes only the RL seed (sampling and data order). Prints, per algorithm, the reward rise of
every seed (mean of the last 6 steps minus the first 6, as the test measures it), their mean and standard
deviation, and the largest threshold the test may assert with a margin of 3 standard deviations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from hybridflow.data import char_tokenizer, task_examples
from hybridflow.models import build_tiny_causal_lm, save_model_dir
from hybridflow.train.config import load_config
from hybridflow.train.loop import train
from hybridflow.train.sft import sft_warm_start

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
from learning_configs import CURVE_RUNS, WINDOW, reward_rise  # noqa: E402


def warm_model(out: Path) -> Path:
    """The test fixture's warm model: a tiny Qwen2 SFT-warmed on reversal for 60 steps (seed 0)."""
    target = out / "warm_model"
    if not (target / "config.json").is_file():
        tokenizer = char_tokenizer()
        model = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=0)
        sft_warm_start(model, tokenizer, task_examples("reverse", 2000, seed=0), steps=60, lr=3e-3, seed=0)
        save_model_dir(model, tokenizer, target)
    return target


def run(algorithm: str, seed: int, model: Path, out: Path) -> dict[str, float]:
    config_file, overrides = CURVE_RUNS[algorithm]
    run_dir = out / f"{algorithm}_{seed}"
    config = load_config(ROOT / "configs" / config_file,
                         [*overrides, f"seed={seed}", f"model.path={model}", f"output_dir={run_dir}",
                          "logging.progress=false",
                          "logging.plot=false", "checkpoint.every=0", "logging.trackers=[jsonl]"])
    start = time.perf_counter()
    history = train(config).history
    first, last = reward_rise(history, WINDOW)
    return {"seed": seed, "first": first, "last": last, "rise": last - first, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--algorithms", default=",".join(CURVE_RUNS))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_spread")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = warm_model(args.out)
    table = ["| algorithm | rise per seed | mean | std | mean - 3 std | s per run |", "|---|---|---|---|---|---|"]
    results = {}
    for algorithm in args.algorithms.split(","):
        rows = [run(algorithm, seed, model, args.out) for seed in range(args.seeds)]
        rises = [row["rise"] for row in rows]
        mean = statistics.mean(rises)
        std = statistics.stdev(rises) if len(rises) > 1 else float("nan")
        results[algorithm] = rows
        table.append(f"| {algorithm} | {', '.join(f'{r:+.3f}' for r in rises)} | {mean:+.3f} | {std:.3f} | "
                     f"{mean - 3 * std:+.3f} | {statistics.mean(row['seconds'] for row in rows):.0f} |")
        print(table[-1], flush=True)
    (args.out / "spread.json").write_text(json.dumps(results, indent=2))
    print("\n".join(table))


if __name__ == "__main__":
    main()
