"""On-policy distillation against GRPO on CPU: steps from the same weak start to 0.9 of a teacher's task reward.

    .venv/bin/python benchmarks/distill_learning.py [--seeds 3] [--steps 400] [--sft-steps 30] [--teacher-sft-steps 300]

A teacher (the tiny Qwen2 SFT-warmed for ``--teacher-sft-steps`` on the ``reverse`` task's answers, its own seed)
is saved as a local HF directory. For each seed, a student start (the same tiny model SFT-warmed for only
``--sft-steps``) is trained once with ``grpo`` and once with ``on_policy_distill`` (``roles.teacher.model``: the
teacher), from the same weights, with the same prompts per step, samples per prompt, learning rate and step budget,
through ``hybridflow train``'s loop on the local executor. One metric for all three: the run's own validation pass
(``val/reward/mean``: one temperature-1 sample per held-out prompt, ``data.val_fraction`` of the task's prompts,
scored by the task's rule), after every step for the students and before any step for the teacher and the start.
A run "reaches" the target at the first step whose trailing mean of ``--window`` validation rewards is at least
``--fraction`` of the teacher's. Prints a markdown table for docs/benchmarks.md and writes ``results.json`` (the
per-step curves) and ``curves.png`` (one panel per seed) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from hybridflow.data import task_examples
from hybridflow.models import build_tiny_causal_lm, save_model_dir
from hybridflow.models.tokenizer import char_tokenizer
from hybridflow.train.config import load_config
from hybridflow.train.loop import train
from hybridflow.train.sft import sft_warm_start

ROOT = Path(__file__).resolve().parents[1]
TEACHER_SEED = 1_000  # the teacher's init and SFT data: a seed no student run uses
VAL_REWARD = "val/reward/mean"


def build_teacher(directory: Path, sft_steps: int) -> Path:
    """The tiny model SFT-warmed for ``sft_steps`` on the task's answers, saved with its tokenizer."""
    tokenizer = char_tokenizer()
    model = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=TEACHER_SEED)
    sft_warm_start(model, tokenizer, task_examples("reverse", 2000, seed=TEACHER_SEED), steps=sft_steps, lr=3e-3,
                   seed=TEACHER_SEED)
    return save_model_dir(model, tokenizer, directory)


def run_config(algorithm: str, seed: int, out: Path, args: argparse.Namespace, extra: list[str]) -> Any:
    """The shared recipe: every run of a seed sees the same held-out prompts and the same training prompts."""
    options = f"{{n: {args.n}, max_new_tokens: 8, temperature: 1.0{', kl_coef: 0.0' if algorithm == 'grpo' else ''}}}"
    return load_config(ROOT / "configs" / "grpo_reverse.yaml", [
        f"algorithm={algorithm}", f"algorithm.options={options}", f"data.batch_size={args.batch_size}",
        f"optim.actor.lr={args.lr}", "optim.actor.mini_batches=2", f"model.sft_steps={args.sft_steps}",
        f"data.val_fraction={args.val_fraction}", f"seed={seed}", f"output_dir={out}", "checkpoint.every=0",
        "logging.progress=false", "logging.plot=false", "logging.trackers=[jsonl]", *extra])


def measure(model_dir: Path, seed: int, out: Path, args: argparse.Namespace) -> float:
    """The validation reward of ``model_dir`` before any update: a one-step run whose pass before training is the
    one logged (``validation.every=0``, so no pass after the step overwrites it)."""
    config = run_config("grpo", seed, out, args, [f"model.path={model_dir}", "steps=1", "validation.every=0",
                                                   "validation.before_train=true"])
    return train(config, overwrite=True).history[0][VAL_REWARD]


def reached(curve: list[float], target: float, window: int) -> int | None:
    """The first step count (updates done) whose trailing mean of ``window`` validation rewards is >= ``target``."""
    for end in range(window, len(curve) + 1):
        if sum(curve[end - window:end]) / window >= target:
            return end
    return None


def student_run(algorithm: str, seed: int, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    config = run_config(algorithm, seed, args.out / str(seed) / algorithm, args,
                        [f"steps={args.steps}", "validation.every=1", *extra])
    started = time.perf_counter()
    result = train(config, overwrite=True)
    history = result.history
    return {"val_reward": [row[VAL_REWARD] for row in history], "seconds": time.perf_counter() - started,
            "train_reward": [row["reward/mean"] for row in history if "reward/mean" in row],
            "teacher_kl": [row["teacher_kl"] for row in history if "teacher_kl" in row], "run_dir": result.run_dir}


def seed_row(seed: int, teacher: Path, args: argparse.Namespace) -> dict[str, Any]:
    grpo = student_run("grpo", seed, args, [])
    start_dir = grpo.pop("run_dir") / "init_model"  # the distillation run starts from the very same weights
    distill = student_run("on_policy_distill", seed, args,
                          [f"model.path={start_dir}", f"roles.teacher.model={teacher}"])
    distill.pop("run_dir")
    teacher_reward = measure(teacher, seed, args.out / str(seed) / "teacher_eval", args)
    start_reward = measure(start_dir, seed, args.out / str(seed) / "start_eval", args)
    target = args.fraction * teacher_reward
    return {"seed": seed, "teacher_reward": teacher_reward, "start_reward": start_reward, "target": target,
            "grpo": {**grpo, "steps_to_target": reached(grpo["val_reward"], target, args.window)},
            "distill": {**distill, "steps_to_target": reached(distill["val_reward"], target, args.window)}}


def tail(curve: list[float], window: int) -> float:
    return sum(curve[-window:]) / window


def plot_curves(rows: list[dict[str, Any]], window: int, path: Path) -> None:
    """One panel per seed: each run's trailing-mean validation reward, the teacher's and the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.2), sharey=True, squeeze=False)
    for axis, row in zip(axes[0], rows, strict=True):
        for name, label in (("grpo", "GRPO"), ("distill", "on_policy_distill")):
            curve = row[name]["val_reward"]
            smoothed = [sum(curve[end - window:end]) / window for end in range(window, len(curve) + 1)]
            axis.plot(range(window, len(curve) + 1), smoothed, label=label)
        axis.axhline(row["teacher_reward"], color="grey", linestyle="--", label="teacher")
        axis.axhline(row["target"], color="grey", linestyle=":", label="target")
        axis.set(title=f"seed {row['seed']}", xlabel="steps")
    axes[0][0].set_ylabel(f"validation reward (mean of {window})")
    axes[0][0].legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sft-steps", type=int, default=30, help="the student start's SFT warm start")
    parser.add_argument("--teacher-sft-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt, both algorithms")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--val-fraction", type=float, default=0.05, help="of the task's 2000 prompts, held out")
    parser.add_argument("--fraction", type=float, default=0.9, help="of the teacher's reward, the target")
    parser.add_argument("--window", type=int, default=3, help="validation passes in the trailing mean")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_distill")
    args = parser.parse_args()
    started = time.perf_counter()
    teacher = build_teacher(args.out / "teacher", args.teacher_sft_steps)
    print("| seed | teacher | start | target | GRPO steps to target | distill steps | GRPO last "
          f"{args.window} | distill last {args.window} | GRPO s | distill s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for seed in range(args.seeds):
        row = seed_row(seed, teacher, args)
        rows.append(row)
        grpo, distill = row["grpo"], row["distill"]
        print(f"| {seed} | {row['teacher_reward']:.3f} | {row['start_reward']:.3f} | {row['target']:.3f} | "
              f"{grpo['steps_to_target'] or f'> {args.steps}'} | {distill['steps_to_target'] or f'> {args.steps}'} | "
              f"{tail(grpo['val_reward'], args.window):.3f} | {tail(distill['val_reward'], args.window):.3f} | "
              f"{grpo['seconds']:.0f} | {distill['seconds']:.0f} |", flush=True)
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    (args.out / "results.json").write_text(json.dumps({"settings": settings, "seeds": rows,
                                                       "seconds": time.perf_counter() - started}, indent=1))
    plot_curves(rows, args.window, args.out / "curves.png")
    print(f"results: {args.out / 'results.json'}, curves.png ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
