"""Learning curves: GRPO and PPO on a built-in task from an SFT-warmed tiny model, on CPU.

    .venv/bin/python benchmarks/learning.py [--steps-grpo 200] [--steps-ppo 200] [--executor local]
    .venv/bin/python benchmarks/learning.py --strong [--seeds 3]   # the >= 0.9 configs, GRPO and DAPO

Writes ``runs/bench_learning/<algorithm>/`` (metrics.jsonl, report.html) and prints a markdown
table for docs/benchmarks.md: mean reward over the first and last 10 steps, and wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hybridflow.train.config import load_config
from hybridflow.train.loop import train

ROOT = Path(__file__).resolve().parents[1]


def run(algorithm: str, steps: int, executor: str, out: Path) -> dict[str, float]:
    config = load_config(ROOT / "configs" / f"{algorithm}_reverse.yaml",
                         [f"steps={steps}", f"executor.name={executor}", f"output_dir={out / algorithm}",
                          "checkpoint.every=0", "logging.progress=false"])
    start = time.perf_counter()
    result = train(config)
    seconds = time.perf_counter() - start
    rewards = [row["reward/mean"] for row in result.history]
    window = min(10, len(rewards))
    return {"steps": steps, "seconds": round(seconds, 1), "first10": round(sum(rewards[:window]) / window, 3),
            "last10": round(sum(rewards[-window:]) / window, 3), "best10": round(max(
                sum(rewards[i:i + window]) / window for i in range(len(rewards) - window + 1)), 3)}


def strong(seeds: int, out: Path) -> list[str]:
    """The configs that break the plateau: reward of the first and last 10 steps, wall and CPU seconds."""
    lines = ["| config | seed | reward, first 10 steps | last 10 steps | wall s | CPU s (incl. SFT) |",
             "|---|---|---|---|---|---|"]
    for name in ("grpo_reverse_strong", "dapo_reverse"):
        for seed in range(seeds):
            overrides = [f"seed={seed}", f"output_dir={out / name / str(seed)}", "logging.progress=false",
                         "logging.trackers=[jsonl]"]
            config = load_config(ROOT / "configs" / f"{name}.yaml", overrides)
            wall, cpu = time.perf_counter(), time.process_time()
            rewards = [row["reward/mean"] for row in train(config).history]
            lines.append(f"| {name} | {seed} | {sum(rewards[:10]) / 10:.3f} | {sum(rewards[-10:]) / 10:.3f} | "
                         f"{time.perf_counter() - wall:.0f} | {time.process_time() - cpu:.0f} |")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-grpo", type=int, default=200)
    parser.add_argument("--steps-ppo", type=int, default=200)
    parser.add_argument("--executor", default="local", choices=["local", "ray"])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_learning")
    parser.add_argument("--strong", action="store_true", help="run the >= 0.9 configs instead")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    if args.strong:
        print("\n".join(strong(args.seeds, args.out)))
        return
    rows = {"grpo": run("grpo", args.steps_grpo, args.executor, args.out),
            "ppo": run("ppo", args.steps_ppo, args.executor, args.out)}
    (args.out / "learning.json").write_text(json.dumps(rows, indent=2))
    print("| algorithm | steps | wall s (incl. SFT warm start) | reward first 10 steps | last 10 steps | best 10 |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['steps']} | {row['seconds']} | {row['first10']} | {row['last10']} | {row['best10']} |")


if __name__ == "__main__":
    main()
