"""``hybridflow train --config FILE [dotted.key=value ...] [--resume | --resume-from PATH | --overwrite]``: run RL
training."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.train.config import TrainConfig


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("train", help="train a policy with an RL graph (local or Ray executor)")
    parser.add_argument("--config", help="a YAML config (see configs/); keys map onto hybridflow.train.TrainConfig")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, values parsed as YAML")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    parser.add_argument("--resume-from", metavar="PATH",
                        help="start from this checkpoint (checkpoints/step_N, possibly of another run)")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume even though the config or graph differs from the checkpoint's (listed)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the previous run in a non-empty output_dir (its checkpoints and metrics)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hybridflow.train.loop import train

    # Scripts that build their own namespace (examples/train_ppo.py under torchrun) may lack the newer flags.
    config = _load(args.config, args.overrides)
    # SIGTERM: train() checkpoints the last finished step and raises Terminated (hybridflow/train/signals.py)
    result = train(config, resume=args.resume,
                   overwrite=getattr(args, "overwrite", False), resume_from=getattr(args, "resume_from", None),
                   allow_config_change=getattr(args, "allow_config_change", False))
    for line in summary(result, config):
        print(line)
    return 0


def summary(result: Any, config: TrainConfig) -> list[str]:
    """What a finished run wrote, one line each: only the outputs this config turned on (no TensorBoard path
    when TensorBoard is off)."""
    # A graph that scores nothing (DPO) reports its preference margin (TRL's rewards/margins) in the reward's place.
    key = "actor/rewards/margins" if result.history and "reward/mean" not in result.history[0] \
        and "actor/rewards/margins" in result.history[0] else "reward/mean"
    rewards = [row.get(key, float("nan")) for row in result.history]
    what = "reward" if key == "reward/mean" else "preference margin (actor/rewards/margins)"
    window = max(1, min(10, len(rewards)))
    lines = [f"trained steps {result.start_step}..{result.start_step + len(rewards) - 1}; mean {what} over the "
             f"first {window} steps {sum(rewards[:window]) / window:.3f}, over the last {window} "
             f"{sum(rewards[-window:]) / window:.3f}" if rewards else "trained no steps (the run was finished)",
             f"metrics:      {result.metrics_path}"]
    if "tensorboard" in config.logging.trackers:
        lines.append(f"tensorboard:  {result.run_dir / 'tensorboard'}")
    if result.curve_path is not None:
        lines.append(f"reward curve: {result.curve_path}")
    if result.report_path is not None:
        lines.append(f"report:       {result.report_path}")
    if result.export_path is not None:
        lines.append(f"final model:  {result.export_path} (Hugging Face format)")
    return lines


def _load(path: str | None, overrides: list[str]) -> Any:
    """The config, with a YAML syntax error named by file, line and column (yaml's own text spans lines)."""
    import yaml

    from hybridflow.train.config import load_config

    try:
        return load_config(path, overrides)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
        source = f"config file {path!r}" if path and mark is not None and "<unicode string>" in str(mark.name) \
            else "an override or the config file"
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{source} is not valid YAML: {where}: {problem}") from err
