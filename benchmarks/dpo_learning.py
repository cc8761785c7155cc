"""DPO learning on CPU: rule-built `reverse` preference pairs lift the task's rule-measured reward of greedy samples.

    .venv/bin/python benchmarks/dpo_learning.py [--seeds 3] [--steps 150] [--sft-steps 30] [--beta 0.5] [--sft-coef 0]
        [--rejected corrupted|sampled]

Each seed trains a tiny policy (SFT-warmed for ``--sft-steps`` on the task's answers) with ``algorithm: dpo`` on
the task's rule-built pairs, through ``hybridflow train``'s loop on the local executor and the torch backend. The
chosen completion is the task's answer; the rejected one (``--rejected``) either a corrupted answer (``corrupted``:
a near miss, :func:`~hybridflow.data.preference.corrupt`) or the warmed policy's own sample that the rule scores
lowest of ``--samples`` (``sampled``: its own mistakes, written to a ``pairs.jsonl`` the run reads as
``data.path``; a prompt whose samples all score 1 keeps a corrupted answer). Before and after, on held-out
prompts: the mean reward of greedy samples under the task's rule, and the mean summed log-prob margin of chosen over
rejected on held-out pairs.
Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from hybridflow.backends.common.modeling import policy_outputs
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.data import TASKS, encode_prompts
from hybridflow.data.preference import encode_pairs, preference_task_examples
from hybridflow.train.config import TrainConfig, load_config
from hybridflow.train.loop import train
from hybridflow.train.setup import prepare_model
from hybridflow.train.sft import sft_warm_start

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT_SEED = 10_000  # held-out pairs and prompts: a generator seed no training run uses


def greedy_reward(model: Any, tokenizer: Any, records: list[dict[str, Any]], max_new_tokens: int = 8) -> float:
    """The task's rule on greedy samples, averaged over ``records`` (the ``reverse`` task's partial credit)."""
    rule = TASKS.get("reverse").reward
    batch = encode_prompts(records, tokenizer)
    with torch.no_grad():
        out = model.generate(input_ids=batch["prompts"], attention_mask=batch["prompt_mask"], do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, batch["prompts"].shape[1]:], skip_special_tokens=True)
    return sum(rule(text, record["ground_truth"]) for text, record in zip(texts, records, strict=True)) / len(records)


def pair_margin(model: Any, tokenizer: Any, records: list[dict[str, Any]]) -> float:
    """Mean of (summed log-prob of chosen) - (of rejected) over held-out pairs."""
    batch = encode_pairs(records, tokenizer)
    with torch.no_grad():
        logps = policy_outputs(model, batch, with_entropy=False, packed=False)["logprobs"]
    sums = (logps * batch["response_mask"]).sum(dim=-1)
    return float((sums[0::2] - sums[1::2]).mean())


def sampled_pairs(config: TrainConfig, out: Path, samples: int) -> list[str]:
    """Warm the run's starting policy once (as ``train`` would), sample ``samples`` responses per training prompt at
    temperature 1 and write pairs whose rejected completion is the lowest-scoring sample; returns the overrides that
    train from them (``data.path``, ``model.path``)."""
    pairs = preference_task_examples("reverse", config.data.num_examples, seed=config.seed)
    model_dir, tokenizer = prepare_model(config, out, pairs)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rule, worst = TASKS.get("reverse").reward, [(2.0, "")] * len(pairs)
    torch.manual_seed(config.seed)
    for _ in range(samples):
        for start in range(0, len(pairs), 256):
            chunk = pairs[start:start + 256]
            batch = encode_prompts(chunk, tokenizer)
            with torch.no_grad():
                ids = model.generate(input_ids=batch["prompts"], attention_mask=batch["prompt_mask"], do_sample=True,
                                     temperature=1.0, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(ids[:, batch["prompts"].shape[1]:], skip_special_tokens=True)
            for i, (text, pair) in enumerate(zip(texts, chunk, strict=True)):
                score = rule(text, pair["ground_truth"])
                worst[start + i] = min(worst[start + i], (score, text))
    path = out / "pairs.jsonl"
    with path.open("w") as f:
        for pair, (score, text) in zip(pairs, worst, strict=True):
            rejected = text if score < 1 else pair["rejected"]
            f.write(json.dumps({"prompt": pair["prompt"], "chosen": pair["chosen"], "rejected": rejected,
                                "ground_truth": pair["ground_truth"]}) + "\n")
    return [f"data.path={path}", f"model.path={model_dir}"]


def measure(directory: Path, held: list[dict[str, Any]]) -> tuple[float, float]:
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    return greedy_reward(model, tokenizer, held), pair_margin(model, tokenizer, held)


def sft_control(run_dir: Path, seed: int, args: argparse.Namespace, held: list[dict[str, Any]]) -> float:
    """The greedy reward after plain SFT on the chosen answers alone, from the same start, for as many steps of as
    many examples at the same rate: what the pairs add beyond their chosen halves."""
    start = run_dir / "init_model"
    start = start if start.is_dir() else args.out / f"pairs{seed}" / "init_model"
    tokenizer = AutoTokenizer.from_pretrained(start)
    model = AutoModelForCausalLM.from_pretrained(start)
    chosen = preference_task_examples("reverse", 2000, seed=seed)  # the run's pairs (data.num_examples, its seed)
    sft_warm_start(model, tokenizer, chosen, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=seed)
    return greedy_reward(model.eval(), tokenizer, held)


def run(seed: int, args: argparse.Namespace) -> dict[str, float]:
    overrides = [
        "algorithm=dpo",
        f"algorithm.options={{beta: {args.beta}, loss_type: {args.loss_type}, sft_coef: {args.sft_coef}}}",
        f"steps={args.steps}", f"data.batch_size={args.batch_size}", f"optim.actor.lr={args.lr}",
        "optim.actor.mini_batches=1", f"model.sft_steps={args.sft_steps}", f"seed={seed}",
        f"output_dir={args.out / str(seed)}", "checkpoint.every=0", "logging.progress=false", "logging.plot=false",
        "logging.trackers=[jsonl]"]
    config = load_config(ROOT / "configs" / "grpo_reverse.yaml", overrides)
    if args.rejected == "sampled":
        config = load_config(ROOT / "configs" / "grpo_reverse.yaml",
                             [*overrides, *sampled_pairs(config, args.out / f"pairs{seed}", args.samples)])
    started = time.perf_counter()
    result = train(config, overwrite=True)
    seconds = time.perf_counter() - started
    held = preference_task_examples("reverse", args.held_out, seed=HELD_OUT_SEED + seed)
    start = result.run_dir / "init_model"
    before = measure(start if start.is_dir() else args.out / f"pairs{seed}" / "init_model", held)
    after = measure(result.run_dir / "final", held)
    return {"seed": seed, "reward_before": before[0], "reward_after": after[0], "margin_before": before[1],
            "margin_after": after[1], "seconds": seconds, "sft_control": sft_control(result.run_dir, seed, args, held),
            "train_accuracy_last10": sum(r["actor/rewards/accuracies"] for r in result.history[-10:]) / 10}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--sft-steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16, help="pairs per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--loss-type", default="sigmoid")
    parser.add_argument("--sft-coef", type=float, default=0.0, help="RPO's NLL term on the chosen responses")
    parser.add_argument("--rejected", choices=("corrupted", "sampled"), default="corrupted",
                        help="the rejected completion: a corrupted answer, or the warmed policy's worst sample")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt for --rejected sampled")
    parser.add_argument("--held-out", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_dpo")
    args = parser.parse_args()
    print("| seed | greedy reward before | after | rise | SFT-only control | margin before (nats) | after | "
          "train acc, last 10 | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    rises = []
    for seed in range(args.seeds):
        row = run(seed, args)
        rises.append(row["reward_after"] - row["reward_before"])
        print(f"| {seed} | {row['reward_before']:.3f} | {row['reward_after']:.3f} | {rises[-1]:+.3f} | "
              f"{row['sft_control']:.3f} | "
              f"{row['margin_before']:.2f} | {row['margin_after']:.2f} | {row['train_accuracy_last10']:.2f} | "
              f"{row['seconds']:.0f} |", flush=True)
    print(f"mean rise {sum(rises) / len(rises):+.3f}, min {min(rises):+.3f}")


if __name__ == "__main__":
    main()
