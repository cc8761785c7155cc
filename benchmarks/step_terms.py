"""Measure the per-sample and per-byte costs behind the planner's step terms (``hybridflow.planner.step_terms``).

- **Detokenising a response**, per token: ``hybridflow.data.rewards.decode_responses`` (``tokenizer.decode`` of
  each row's unmasked ids, as verl's reward managers and hybridflow's scorers do before a rule scores the text),
  with a byte-level BPE tokenizer trained in memory (``--vocab`` tokens) on math-style text.
- **Scoring a sample with a rule**: ``hybridflow.data.math_reward.math_reward`` on a reasoning-length response
  ending in ``\\boxed{...}`` (what verl's ``math_dapo``/``gsm8k`` ``compute_score`` do: find the final answer,
  normalise it, compare), per sample, excluding the decode.
- **Rendering and tokenising an LLM judge's prompt** (``judge_prompts``, ``hybridflow.algorithms.judge_functions``):
  the pointwise template rendered around each decoded prompt and response (Jinja, per row), and the rendered text
  encoded in the judge's tokenizer, per token.
- **Writing a checkpoint**, per byte: ``torch.save`` of a state dict of fp32 tensors (``--checkpoint-mb``) to a
  temporary directory, flushed (``os.fsync``), the way FSDP/Megatron ranks write their shards.

Each is timed ``--repeats`` times, interleaved, and the median printed; the numbers go in
``hybridflow/planner/step_terms.py`` with this command and the machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_terms.py [--repeats 5] [--vocab 32000] [--checkpoint-mb 512]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

WORDS = ("the", "so", "we", "have", "then", "let", "compute", "therefore", "sum", "of", "is", "equal", "to", "and",
         "\\frac{1}{2}", "x^2", "+", "-", "=", "(", ")", "\\sqrt{3}", "step", "answer", "each", "gives", "wait")


def _text(rng: random.Random, words: int) -> str:
    body = " ".join(rng.choice(WORDS) if rng.random() > 0.2 else str(rng.randint(0, 999)) for _ in range(words))
    return f"{body}. The answer is \\boxed{{{rng.randint(0, 999)}}}."


def _tokenizer(vocab: int, rng: random.Random):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<eos>"], show_progress=False)
    tok.train_from_iterator((_text(rng, 400) for _ in range(4000)), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=256, help="responses per timing")
    parser.add_argument("--response-words", type=int, default=1200)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--checkpoint-mb", type=int, default=512)
    args = parser.parse_args(argv)
    import torch
    from hybridflow.algorithms.judge_templates import load_template

    from hybridflow.data.math_reward import math_reward
    from hybridflow.data.rewards import decode_responses

    rng = random.Random(0)
    tokenizer = _tokenizer(args.vocab, rng)
    texts = [_text(rng, args.response_words) for _ in range(args.samples)]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    width = max(len(row) for row in ids)
    responses = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, row in enumerate(ids):
        responses[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    tokens = int(mask.sum())
    state = {f"layer{i}": torch.randn(args.checkpoint_mb * 2**20 // 4 // 16) for i in range(16)}
    size = sum(t.numel() * 4 for t in state.values())
    template = load_template("pointwise")
    decode, score, write, render, encode = [], [], [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            start = time.perf_counter()
            decoded = decode_responses(responses, mask, tokenizer)
            decode.append((time.perf_counter() - start) / tokens)
            start = time.perf_counter()
            for text in decoded:
                math_reward(text, "42")
            score.append((time.perf_counter() - start) / len(decoded))
            start = time.perf_counter()
            judged = [template.render(prompt="Reverse the string.", response=text) for text in decoded]
            render.append((time.perf_counter() - start) / len(decoded))
            start = time.perf_counter()
            encoded = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in judged)
            encode.append((time.perf_counter() - start) / encoded)
            path = Path(folder) / f"shard{repeat}.pt"
            start = time.perf_counter()
            with path.open("wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            write.append(size / (time.perf_counter() - start))
            path.unlink()
    print(f"responses: {args.samples} x {tokens / args.samples:.0f} tokens (vocab {args.vocab}); "
          f"checkpoint {size / 2**20:.0f} MiB; {args.repeats} interleaved repeats, medians:")
    print(f"  detokenise: {statistics.median(decode) * 1e6:.3f} us/token  (runs {[round(x * 1e6, 3) for x in decode]})")
    print(f"  rule score: {statistics.median(score) * 1e6:.1f} us/sample (runs {[round(x * 1e6, 1) for x in score]})")
    print(f"  judge template render: {statistics.median(render) * 1e6:.1f} us/row "
          f"(runs {[round(x * 1e6, 1) for x in render]})")
    print(f"  tokenise: {statistics.median(encode) * 1e6:.3f} us/token  (runs {[round(x * 1e6, 3) for x in encode]})")
    print(f"  checkpoint write: {statistics.median(write) / 1e9:.2f} GB/s (runs {[round(x / 1e9, 2) for x in write]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
