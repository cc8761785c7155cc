"""hybridflow GRPO vs TRL ``GRPOTrainer`` on the identical configuration, side by side in one run.

    .venv/bin/pip install -r requirements-bench.txt   # trl, benchmarks only
    .venv/bin/python benchmarks/vs_trl.py [--steps 20]

Same random-init tiny Qwen2 (char tokenizer), same prompts, 8 prompts x 4 generations per step,
32 new tokens, temperature 1, beta (KL coefficient) 0.04, one optimizer step per batch, lr 1e-5,
CPU, one thread. Reports steps/s and generated tokens/s (completion tokens, EOS included) after
two warm-up steps, for the local executor (and ``--ray`` for the Ray executor).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import load_graph
from hybridflow.models import build_tiny_causal_lm, save_model_dir
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, default_plan

PROMPTS, GENERATIONS, NEW_TOKENS, BETA, LR, WARMUP = 8, 4, 32, 0.04, 1e-5, 2


def hybridflow_side(model_dir: Path, tokenizer: Any, records: list[dict[str, str]], steps: int,
                    executor: Any = None) -> tuple[float, float]:
    graph = load_graph("grpo", n=GENERATIONS, kl_coef=BETA, max_new_tokens=NEW_TOKENS, reward_kind="reward_function")
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model_dir), micro_batch_size=PROMPTS * GENERATIONS,
                              optim=OptimSpec(lr=LR) if r.kind.trainable else None)
             for r in graph.roles if r.kind.needs_gpu}
    loader = PromptLoader(records=records, tokenizer=tokenizer, batch_size=PROMPTS)
    with Controller(graph, default_plan(graph), specs=specs, executor=executor,
                    driver_roles={"reward": RuleScorer(TASKS.get("reverse").reward, tokenizer)}) as controller:
        tokens, start = 0, 0.0
        for step in range(WARMUP + steps):
            if step == WARMUP:
                tokens, start = 0, time.perf_counter()
            result = controller.step(loader.batch(step), step=step)
            tokens += int(result.batch["response_mask"].sum())
        seconds = time.perf_counter() - start
    return steps / seconds, tokens / seconds


def trl_side(model_dir: Path, tokenizer: Any, records: list[dict[str, str]], steps: int,
             out: Path) -> tuple[float, float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rule = TASKS.get("reverse").reward

    def reward(completions: list[str], ground_truth: list[str], **_: Any) -> list[float]:
        return [rule(c, g) for c, g in zip(completions, ground_truth, strict=True)]

    class Clock(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.stamps.append(time.perf_counter())

    config = GRPOConfig(output_dir=str(out), use_cpu=True, per_device_train_batch_size=PROMPTS * GENERATIONS,
                        num_generations=GENERATIONS, steps_per_generation=1, gradient_accumulation_steps=1,
                        max_completion_length=NEW_TOKENS, beta=BETA, learning_rate=LR, temperature=1.0,
                        max_steps=WARMUP + steps, logging_steps=1, report_to="none", save_strategy="no",
                        seed=0, dataloader_num_workers=0)
    clock = Clock()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list(records), processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    lengths = [row["completions/mean_length"] for row in trainer.state.log_history
               if "completions/mean_length" in row][WARMUP:]
    seconds = clock.stamps[-1] - clock.stamps[WARMUP - 1]
    return steps / seconds, sum(lengths) * PROMPTS * GENERATIONS / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ray", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = char_tokenizer()
    work = Path(tempfile.mkdtemp())
    model_dir = save_model_dir(build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer)), tokenizer,
                               work / "model")
    records = task_examples("reverse", 1024)
    rows = {"hybridflow (local)": hybridflow_side(model_dir, tokenizer, records, args.steps),
            "TRL GRPOTrainer": trl_side(model_dir, tokenizer, records, args.steps, work / "trl")}
    if args.ray:
        from hybridflow.runtime.ray_executor import RayExecutor

        rows["hybridflow (ray)"] = hybridflow_side(model_dir, tokenizer, records, args.steps, RayExecutor())
    trl_tokens = rows["TRL GRPOTrainer"][1]
    print(f"GRPO, tiny-qwen2, {PROMPTS} prompts x {GENERATIONS} generations, {NEW_TOKENS} new tokens, beta {BETA}, "
          f"{args.steps} timed steps after {WARMUP} warm-up")
    print("| trainer | steps/s | generated tokens/s | vs TRL (tokens/s) |")
    print("|---|---|---|---|")
    for name, (steps_s, tokens_s) in rows.items():
        print(f"| {name} | {steps_s:.2f} | {tokens_s:.0f} | {tokens_s / trl_tokens:.2f}x |")


if __name__ == "__main__":
    main()
