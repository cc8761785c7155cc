"""Packed sequences + token budgets vs padded rows on a long-tail GRPO workload (issue 22's first target).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/packing.py [--rows 64] [--cap 256] [--repeats 3]

A step's rows as a reasoning workload makes them: prompts of 8-32 tokens (left-padded to 32), response lengths
lognormal (sigma 1) with a mean of a fifth of the response cap, clipped to [1, cap], the step's responses
right-padded to its longest, as generation leaves them. The same random-init Qwen2 (hidden 256, 4 layers) runs
the two passes a GRPO step makes on them with the torch backend's engine:

- the log-prob pass (``log_probs``: the reference's, and the actor's old log-probs when not skipped);
- the update (``train_step`` with ``ppo_policy`` + the KL term: forward, backward, optimizer step);

once over padded rows (``padding: true``, micro batches of ``--micro-rows`` rows of P + T tokens each) and once
over packed sequences with token-budget micro batches (``max_tokens_per_micro_batch`` = ``--budget``),
interleaved ``--repeats`` times (the box is shared). Ideal speed-up = padded tokens / real tokens; target:
each phase's measured speed-up >= 0.8x of it. The end-to-end step adds generation, which padding does not
change (the sampling loop decodes every row until the longest ends): measured once with every row decoding to
the cap, the longest row's length in this workload, and summed with the phases (GRPO as ``hybridflow train``
runs it: generate, reference log-probs, update; and with the old-log-prob pass kept).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hybridflow.algorithms.functions import ppo_policy
from hybridflow.backends.torch import TorchRoleEngine

from hybridflow.data import char_tokenizer
from hybridflow.graph import RoleKind
from hybridflow.models import save_model_dir, tiny_config
from hybridflow.planner import RoleLayout
from hybridflow.runtime import Batch, OptimSpec, RoleSpec, SamplingParams
from hybridflow.runtime.protocols import WorkerContext
from hybridflow.runtime.worker import SoloCollective

PROMPT_CAP, SIGMA = 32, 1.0


def long_tail_rows(rows: int, cap: int, vocab: int, seed: int = 0) -> Batch:
    """A step's generated rows: left-padded prompts, lognormal response lengths (mean cap / 5), right-padded."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(8, PROMPT_CAP + 1, (rows,), generator=gen)
    mu = math.log(cap / 5) - SIGMA**2 / 2  # a lognormal's mean is exp(mu + sigma^2 / 2)
    lengths = torch.exp(mu + SIGMA * torch.randn(rows, generator=gen)).round().clamp(1, cap).long()
    width = int(lengths.max())
    prompt_mask = (torch.arange(PROMPT_CAP)[None] >= PROMPT_CAP - prompt_lens[:, None]).long()
    response_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    prompts = torch.randint(3, vocab, (rows, PROMPT_CAP), generator=gen) * prompt_mask
    responses = torch.randint(3, vocab, (rows, width), generator=gen) * response_mask
    return Batch({"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses,
                  "response_mask": response_mask, "loss_mask": response_mask,
                  "old_logprobs": torch.zeros(rows, width), "ref_logprobs": torch.zeros(rows, width),
                  "advantages": torch.randn(rows, generator=gen)[:, None].expand(rows, width).contiguous()})


def engine(model: Path, layout: RoleLayout) -> TorchRoleEngine:
    spec = RoleSpec(name="actor", kind=RoleKind.POLICY, model=str(model), optim=OptimSpec(lr=1e-6))
    return TorchRoleEngine(spec, layout, WorkerContext(group=0, rank=0, world_size=1, device="cpu",
                                                       collective=SoloCollective()))


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cap", type=int, default=256, help="the response cap (max_new_tokens)")
    parser.add_argument("--micro-rows", type=int, default=8, help="rows per padded micro batch")
    parser.add_argument("--budget", type=int, default=0,
                        help="tokens per packed micro batch (0: what --micro-rows padded rows of the prompt cap "
                             "plus the mean response hold, so both sides run passes of a similar size)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-generate", action="store_true", help="the two phases only, no end-to-end step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = char_tokenizer()
    config = tiny_config("tiny-qwen2", vocab_size=len(tokenizer))
    for key, value in {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
                       "max_position_embeddings": PROMPT_CAP + args.cap + 8}.items():
        setattr(config, key, value)
    config.layer_types = ["full_attention"] * config.num_hidden_layers  # derived at construction: follow the depth
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = save_model_dir(AutoModelForCausalLM.from_config(config), tokenizer, Path(tempfile.mkdtemp()) / "model")
    rows = long_tail_rows(args.rows, args.cap, len(tokenizer))
    real = int(rows["prompt_mask"].sum() + rows["response_mask"].sum())
    padded_tokens = len(rows) * (rows["prompts"].shape[1] + rows["responses"].shape[1])
    budget = args.budget or args.micro_rows * (PROMPT_CAP + args.cap // 5)
    padded = engine(model, RoleLayout(role="actor", dp=1, dtype="fp32", padding=True,
                                      micro_batch_size=args.micro_rows))
    packed = engine(model, RoleLayout(role="actor", dp=1, dtype="fp32", micro_batch_size=args.rows,
                                      max_tokens_per_micro_batch=budget, forward_max_tokens_per_micro_batch=budget))
    options = {"clip_ratio": 0.2, "kl_coef": 0.04, "kl_type": "low_var_kl"}
    phases: dict[str, dict[str, list[float]]] = {"logprob": {"padded": [], "packed": []},
                                                 "update": {"padded": [], "packed": []}}
    for _ in range(args.repeats + 1):  # the first round warms up (allocator, kernels) and is dropped
        for name, side in (("padded", padded), ("packed", packed)):
            phases["logprob"][name].append(timed(lambda side=side: side.log_probs(rows)))
        for name, side in (("padded", padded), ("packed", packed)):
            phases["update"][name].append(timed(lambda side=side: side.train_step(rows, loss=ppo_policy,
                                                                                   options=options)))
    ideal = padded_tokens / real
    print(f"{args.rows} rows, prompts 8-{PROMPT_CAP} tokens, responses lognormal mean {args.cap // 5} (cap "
          f"{args.cap}, longest {rows['responses'].shape[1]}), Qwen2 hidden 256 x 4 layers, one thread; padded "
          f"micro batches of {args.micro_rows} rows, packed budget {budget} tokens; median of {args.repeats} "
          "interleaved repeats")
    print(f"real tokens {real}, padded tokens {padded_tokens}: ideal speed-up {ideal:.2f}x")
    print("| phase | padded s | packed s | speed-up | of ideal |")
    print("|---|---|---|---|---|")
    medians = {phase: {name: statistics.median(times[1:]) for name, times in sides.items()}
               for phase, sides in phases.items()}
    for phase, sides in medians.items():
        speedup = sides["padded"] / sides["packed"]
        print(f"| {phase} | {sides['padded']:.2f} | {sides['packed']:.2f} | {speedup:.2f}x | {speedup / ideal:.2f} |")
    if args.no_generate:
        return
    prompts = rows.select(["prompts", "prompt_mask"])
    packed.model.config.eos_token_id = len(tokenizer) + 7  # never sampled: every row decodes to the cap
    generate = timed(lambda: packed.generate(prompts, SamplingParams(max_new_tokens=args.cap, seed=0)))
    for label, logprob_passes in (("GRPO step (generate, ref log-probs, update)", 1),
                                  ("GRPO step with the old-log-prob pass kept", 2)):
        steps = {name: generate + logprob_passes * medians["logprob"][name] + medians["update"][name]
                 for name in ("padded", "packed")}
        print(f"| {label} | {steps['padded']:.2f} | {steps['packed']:.2f} | "
              f"{steps['padded'] / steps['packed']:.2f}x | (generate {generate:.2f} s, the same on both) |")


if __name__ == "__main__":
    main()
