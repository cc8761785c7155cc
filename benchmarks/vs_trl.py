"""hybridflow GRPO vs TRL ``GRPOTrainer`` on the identical configuration, interleaved in one run.

    .venv/bin/pip install -r requirements-bench.txt   # trl, benchmarks only
    .venv/bin/python benchmarks/vs_trl.py [--steps 20] [--ray] [--dp 2]

Same random-init tiny Qwen2 (char tokenizer), same prompts, 8 prompts x 4 generations per step,
32 new tokens, temperature 1, beta (KL coefficient) 0.04, one optimizer step per batch, lr 1e-5,
CPU, one thread per process. After every TRL step each hybridflow variant runs one step, so all
sides see the same machine load (this box is shared). Reports steps/s and generated tokens/s
(completion tokens, EOS included) after two warm-up steps.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import load_graph
from hybridflow.models import build_tiny_causal_lm, save_model_dir
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, default_plan

PROMPTS, GENERATIONS, NEW_TOKENS, BETA, LR, WARMUP = 8, 4, 32, 0.04, 1e-5, 2


@dataclass
class Side:
    """One hybridflow variant and what it measured."""

    controller: Controller
    loader: PromptLoader
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def step(self) -> None:
        step = len(self.seconds)
        start = time.perf_counter()
        result = self.controller.step(self.loader.batch(step), step=step)
        self.seconds.append(time.perf_counter() - start)
        self.tokens.append(int(result.batch["response_mask"].sum()))


def hybridflow_side(model_dir: Path, tokenizer: Any, records: list[dict[str, str]], executor: Any = None,
                    num_gpus: int = 1) -> Side:
    graph = load_graph("grpo", n=GENERATIONS, kl_coef=BETA, max_new_tokens=NEW_TOKENS, reward_kind="reward_function")
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model_dir),
                              optim=OptimSpec(lr=LR) if r.kind.trainable else None)
             for r in graph.roles if r.kind.needs_gpu}
    plan = default_plan(graph, num_gpus=num_gpus, micro_batch_sizes=dict.fromkeys(specs, PROMPTS * GENERATIONS))
    controller = Controller(graph, plan, specs=specs, executor=executor,
                            driver_roles={"reward": RuleScorer(TASKS.get("reverse").reward, tokenizer)})
    return Side(controller, PromptLoader(records=records, tokenizer=tokenizer, batch_size=PROMPTS))


def run_trl_interleaved(model_dir: Path, tokenizer: Any, records: list[dict[str, str]], steps: int, out: Path,
                        sides: dict[str, Side]) -> tuple[list[float], list[float]]:
    """TRL's per-step seconds and completion tokens; every side steps once after each TRL step."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rule = TASKS.get("reverse").reward

    def reward(completions: list[str], ground_truth: list[str], **_: Any) -> list[float | None]:
        return [rule(c, g) for c, g in zip(completions, ground_truth, strict=True)]

    class Interleave(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.resumed = time.perf_counter()

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.resumed = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.seconds.append(time.perf_counter() - self.resumed)
            for side in sides.values():
                side.step()

    config = GRPOConfig(output_dir=str(out), use_cpu=True, per_device_train_batch_size=PROMPTS * GENERATIONS,
                        num_generations=GENERATIONS, steps_per_generation=1, gradient_accumulation_steps=1,
                        max_completion_length=NEW_TOKENS, beta=BETA, learning_rate=LR, temperature=1.0,
                        max_steps=WARMUP + steps, logging_steps=1, report_to="none", save_strategy="no",
                        seed=0, dataloader_num_workers=0, disable_tqdm=True)
    clock = Interleave()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list(records), processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    lengths = [row["completions/mean_length"] * PROMPTS * GENERATIONS for row in trainer.state.log_history
               if "completions/mean_length" in row]
    return clock.seconds, lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ray", action="store_true", help="also run the Ray executor")
    parser.add_argument("--dp", type=int, default=1,
                        help="also run with the roles data-parallel over this many logical GPUs (CPU processes "
                             "under Ray, threads locally); 1 = only the single-GPU comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = char_tokenizer()
    work = Path(tempfile.mkdtemp())
    model_dir = save_model_dir(build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer)), tokenizer,
                               work / "model")
    records = task_examples("reverse", 1024)
    sides = {"hybridflow (local)": hybridflow_side(model_dir, tokenizer, records)}
    if args.dp > 1:
        sides[f"hybridflow (local, dp={args.dp} threads)"] = hybridflow_side(model_dir, tokenizer, records,
                                                                           num_gpus=args.dp)
    if args.ray:
        from hybridflow.runtime.ray_executor import RayExecutor

        for dp in sorted({1, args.dp}):
            sides[f"hybridflow (ray, dp={dp})"] = hybridflow_side(model_dir, tokenizer, records, RayExecutor(),
                                                                num_gpus=dp)
    trl_seconds, trl_tokens = run_trl_interleaved(model_dir, tokenizer, records, args.steps, work / "trl", sides)
    rows = {"TRL GRPOTrainer": (trl_seconds[WARMUP:], trl_tokens[WARMUP:])}
    rows.update({name: (side.seconds[WARMUP:], [float(t) for t in side.tokens[WARMUP:]])
                 for name, side in sides.items()})
    base = sum(rows["TRL GRPOTrainer"][1]) / sum(rows["TRL GRPOTrainer"][0])
    print(f"GRPO, tiny-qwen2, {PROMPTS} prompts x {GENERATIONS} generations, {NEW_TOKENS} new tokens, beta {BETA}, "
          f"{args.steps} timed steps after {WARMUP} warm-up, interleaved")
    print("| trainer | steps/s | generated tokens/s | vs TRL (tokens/s) |")
    print("|---|---|---|---|")
    for name, (seconds, tokens) in rows.items():
        rate = sum(tokens) / sum(seconds)
        print(f"| {name} | {len(seconds) / sum(seconds):.2f} | {rate:.0f} | {rate / base:.2f}x |")
    for side in sides.values():
        side.controller.shutdown()


if __name__ == "__main__":
    main()
