"""``hybridflow train --config FILE [dotted.key=value ...] [--resume]``: run RL training."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("train", help="train a policy with an RL graph (local or Ray executor)")
    parser.add_argument("--config", help="a YAML config (see configs/); keys map onto hybridflow.train.TrainConfig")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, values parsed as YAML")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hybridflow.train.config import load_config
    from hybridflow.train.loop import train

    result = train(load_config(args.config, args.overrides), resume=args.resume)
    rewards = [row.get("reward/mean", float("nan")) for row in result.history]
    window = max(1, min(10, len(rewards)))
    print(f"trained steps {result.start_step}..{result.start_step + len(rewards) - 1}; mean reward over the first "
          f"{window} steps {sum(rewards[:window]) / window:.3f}, over the last {window} "
          f"{sum(rewards[-window:]) / window:.3f}")
    print(f"metrics:      {result.metrics_path}")
    print(f"tensorboard:  {result.run_dir / 'tensorboard'}")
    if result.curve_path is not None:
        print(f"reward curve: {result.curve_path}")
    return 0
