"""Runtime overhead: a hybridflow GRPO step vs a bare single-process PyTorch loop doing the same maths.

    .venv/bin/python benchmarks/overhead.py [--steps 20] [--rounds 3] [--ray]

Both sides use the same tiny model files, prompts (batch x n samples), response length, micro
batch and loss; they alternate in rounds so machine noise hits both alike. The bare loop is what a
user would write by hand: HF ``generate``, two forward passes for old/reference log-probs, the
reward rule, GRPO advantages and one clipped-policy-gradient AdamW step. ``local`` uses the torch
backend's default lean sampling loop; ``local (HF generate)`` samples with HF ``generate`` like the
bare loop, so its ratio is the runtime's own overhead.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from hybridflow.algorithms import core

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, decode_responses, task_examples
from hybridflow.graph import load_graph
from hybridflow.models import build_tiny_causal_lm, save_model_dir
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, default_plan

BATCH, N, NEW_TOKENS, LR = 8, 4, 16, 1e-4


class BareLoop:
    """GRPO written directly against PyTorch/HF in one process."""

    def __init__(self, model_dir: Path, tokenizer: Any) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.actor = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.ref = AutoModelForCausalLM.from_pretrained(model_dir).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.actor.parameters(), lr=LR)
        self.tokenizer, self.reward = tokenizer, TASKS.get("reverse").reward
        self.gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0, top_k=0,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)

    def _logprobs(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logits = logits[:, prompt_len - 1:-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, prompt_len:, None]).squeeze(-1)

    def step(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, truth: list[str], seed: int) -> float:
        prompts, prompt_mask = prompts.repeat_interleave(N, 0), prompt_mask.repeat_interleave(N, 0)
        torch.manual_seed(seed)
        with torch.no_grad():
            out = self.actor.generate(input_ids=prompts, attention_mask=prompt_mask, generation_config=self.gen)
        responses = out[:, prompts.shape[1]:]
        eos = (responses == self.tokenizer.eos_token_id).long()
        rmask = (eos.cumsum(1) - eos == 0).long()
        ids, mask = torch.cat([prompts, responses], 1), torch.cat([prompt_mask, rmask], 1)
        with torch.no_grad():
            old = self._logprobs(self.actor, ids, mask, prompts.shape[1])
            ref = self._logprobs(self.ref, ids, mask, prompts.shape[1])
        texts = decode_responses(responses, rmask, self.tokenizer)
        scores = torch.tensor([self.reward(t, g) for t, g in zip(texts, [g for g in truth for _ in range(N)],
                                                                   strict=True)])
        advantages = core.grpo_advantages(scores, rmask.float(), N)
        self.actor.train()
        new = self._logprobs(self.actor, ids, mask, prompts.shape[1])
        loss, _ = core.ppo_policy_loss(new, old, advantages, rmask.float())
        loss = loss + 0.04 * core.kl_loss(new, ref, rmask.float())
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.actor.parameters(), 1.0)
        self.optimizer.step()
        self.actor.eval()
        return float(loss)


def make_controller(model_dir: Path, tokenizer: Any, executor: Any = None, rollout: str = "native") -> Controller:
    graph = load_graph("grpo", n=N, kl_coef=0.04, max_new_tokens=NEW_TOKENS, reward_kind="reward_function")
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model_dir),
                              optim=OptimSpec(lr=LR) if r.kind.trainable else None, rollout=rollout)
             for r in graph.roles if r.kind.needs_gpu}
    plan = default_plan(graph, micro_batch_sizes=dict.fromkeys(specs, BATCH * N))
    return Controller(graph, plan, specs=specs, executor=executor,
                      driver_roles={"reward": RuleScorer(TASKS.get("reverse").reward, tokenizer)})


def timed(fn: Any, steps: int) -> list[float]:
    times = []
    for step in range(steps):
        start = time.perf_counter()
        fn(step)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ray", action="store_true", help="also measure the Ray executor")
    args = parser.parse_args()
    tokenizer = char_tokenizer()
    model_dir = save_model_dir(build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer)), tokenizer,
                               Path(tempfile.mkdtemp()) / "model")
    loader = PromptLoader(records=task_examples("reverse", 512), tokenizer=tokenizer, batch_size=BATCH)
    bare = BareLoop(model_dir, tokenizer)
    # "local (HF generate)" samples exactly as the bare loop does, isolating the runtime's own overhead.
    sides: dict[str, Any] = {"local": make_controller(model_dir, tokenizer),
                             "local (HF generate)": make_controller(model_dir, tokenizer, rollout="hf_generate")}
    if args.ray:
        from hybridflow.runtime.ray_executor import RayExecutor

        sides["ray"] = make_controller(model_dir, tokenizer, RayExecutor())
    results: dict[str, list[float]] = {"bare": [], **{name: [] for name in sides}}
    for round_ in range(args.rounds + 1):  # round 0 warms up every side and is discarded
        def bare_step(step: int) -> None:
            batch = loader.batch(step)
            bare.step(batch["prompts"], batch["prompt_mask"], list(batch["ground_truth"]), seed=step)

        samples = {"bare": timed(bare_step, args.steps)}
        for name, controller in sides.items():
            samples[name] = timed(lambda s, c=controller: c.step(loader.batch(s), step=s), args.steps)
        if round_:
            for name, values in samples.items():
                results[name].extend(values)
    base = statistics.median(results["bare"])
    print(f"GRPO step, tiny-qwen2, {BATCH} prompts x {N} samples, {NEW_TOKENS} new tokens, "
          f"{args.rounds} rounds x {args.steps} steps (median step time)")
    print("| loop | median step ms | ratio vs bare |")
    print("|---|---|---|")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"| {name} | {median * 1000:.1f} | {median / base:.3f} |")
    for controller in sides.values():
        controller.shutdown()


if __name__ == "__main__":
    main()
