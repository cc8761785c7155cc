"""Per-step KL and entropy of TRL's ``GRPOTrainer`` and ``hybridflow.GRPOTrainer`` given the same ``GRPOConfig``
(issue 24: the ported script's KL ran 2-4x TRL's).

    .venv/bin/python benchmarks/trl_kl_parity.py [--steps 8] [--seeds 0 1 2] [--lr 3e-4]
        [--scheduler unset|constant|linear]

Same random-init tiny-qwen2 (benchmarks/vs_trl.py's model, char tokenizer), same ``reverse`` prompts and reward,
one ``trl.GRPOConfig`` handed to both trainers: 8 prompts x 4 generations, 32 new tokens, beta 0.04, one
optimizer step per generation, CPU, one thread. ``--scheduler unset`` leaves ``lr_scheduler_type`` at TRL's
default (``linear``), as a script that never names it does. Prints each trainer's per-step ``kl`` (k3 to the
reference, mean per completion token, logged from the step's loss, before its optimizer step) and ``entropy``,
and the mean over seeds of the last half of the steps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from hybridflow.data import TASKS, char_tokenizer, task_examples
from hybridflow.models import save_model_dir

PROMPTS, GENERATIONS, NEW_TOKENS, BETA = 8, 4, 32, 0.04


def reward(completions: list[str], ground_truth: list[str], **_: Any) -> list[float | None]:
    rule = TASKS.get("reverse").reward
    return [rule(c, g) for c, g in zip(completions, ground_truth, strict=True)]


def build_model_dir(work: Path, tokenizer: Any) -> Path:
    from transformers import AutoModelForCausalLM

    from hybridflow.models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("tiny-qwen2", vocab_size=len(tokenizer)))
    return save_model_dir(model, tokenizer, work / "model")


def grpo_config(out: Path, *, seed: int, steps: int, lr: float, scheduler: str) -> Any:
    from trl import GRPOConfig

    extra = {} if scheduler == "unset" else {"lr_scheduler_type": scheduler}
    return GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, per_device_train_batch_size=PROMPTS * GENERATIONS,
                      num_generations=GENERATIONS, max_completion_length=NEW_TOKENS, beta=BETA, learning_rate=lr,
                      max_steps=steps, logging_steps=1, report_to="none", save_strategy="no", seed=seed,
                      dataloader_num_workers=0, disable_tqdm=True, **extra)


def run_trl(model_dir: Path, tokenizer: Any, records: list[dict[str, str]], config: Any) -> dict[str, list[float]]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list(records), processing_class=tokenizer)
    trainer.train()
    rows = [row for row in trainer.state.log_history if "kl" in row]
    return {"kl": [row["kl"] for row in rows], "entropy": [row["entropy"] for row in rows],
            "lr": [row["learning_rate"] for row in rows]}


def _column(history: list[dict[str, float]], suffix: str) -> list[float]:
    names = sorted({key for row in history for key in row if key == suffix or key.endswith("/" + suffix)})
    if not names:
        raise KeyError(f"no metric named *{suffix} in hybridflow's history ({sorted(history[0])})")
    return [row[names[0]] for row in history]


def run_hybridflow(model_dir: Path, records: list[dict[str, str]], config: Any) -> dict[str, list[float]]:
    from hybridflow import GRPOTrainer

    result = GRPOTrainer(str(model_dir), reward_funcs=reward, args=config, train_dataset=records).train(overwrite=True)
    history = result.history
    lrs = [row[key] for row in history for key in row if key.endswith("lr")][:len(history)]
    return {"kl": _column(history, "kl"), "entropy": _column(history, "entropy"), "lr": lrs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--scheduler", choices=["unset", "constant", "linear", "cosine"], default="unset")
    parser.add_argument("--only", choices=["trl", "hybridflow"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = char_tokenizer()
    work = Path(tempfile.mkdtemp())
    model_dir = build_model_dir(work, tokenizer)
    records = task_examples("reverse", 256)
    results: dict[str, list[dict[str, list[float]]]] = {"TRL": [], "hybridflow": []}
    for seed in args.seeds:
        for name in results:
            if args.only and name.lower() != args.only.lower():
                continue
            config = grpo_config(work / f"{name}-{seed}", seed=seed, steps=args.steps, lr=args.lr,
                                 scheduler=args.scheduler)
            run = run_trl(model_dir, tokenizer, records, config) if name == "TRL" else run_hybridflow(
                model_dir, records, config)
            results[name].append(run)
            print(f"{name} seed {seed} kl      " + " ".join(f"{v:.4f}" for v in run["kl"]), flush=True)
            print(f"{name} seed {seed} entropy " + " ".join(f"{v:.3f}" for v in run["entropy"]), flush=True)
            if run["lr"]:
                print(f"{name} seed {seed} lr      " + " ".join(f"{v:.2e}" for v in run["lr"]), flush=True)
    half = args.steps // 2
    print(f"lr {args.lr}, lr_scheduler_type {args.scheduler}, {args.steps} steps, seeds {args.seeds}")
    for name, runs in results.items():
        if runs:
            late = [statistics.mean(run["kl"][half:]) for run in runs]
            print(f"{name}: mean kl over steps {half + 1}-{args.steps} per seed " + " ".join(f"{v:.4f}" for v in late)
                  + f"; mean entropy last step {statistics.mean(run['entropy'][-1] for run in runs):.3f}")


if __name__ == "__main__":
    main()
