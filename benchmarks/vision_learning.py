"""GRPO must see: the ``largest_colour`` task on the tiny Qwen2-VL, with its images and with them blanked.

    nice -n 5 .venv/bin/python benchmarks/vision_learning.py [--seeds 0,1] [--steps 60] [--out runs/bench_vision]

The policy is first SFT-warmed on the task's answers with every image blanked (one grey canvas), so it learns the
answer format (a colour name, then EOS) but nothing that ties an answer to an image: it starts near chance (about
1 / 4 of the exact-match rule). Then two GRPO runs per seed from that start, through ``hybridflow train``'s own
loop (``configs/grpo_vision.yaml``): one on the real images, one (the control) on the same prompts and answers with
every image blanked. Prints per run the mean reward of the first and last ``--window`` steps and their rise; the
target is a rise of >= 0.2 with the images and none without (docs/benchmarks.md).

"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hybridflow.data import task_examples
from hybridflow.data.images import open_image
from hybridflow.data.records import render_prompt
from hybridflow.data.visual_tasks import BACKGROUND, CANVAS, PROMPT
from hybridflow.models.vision import build_tiny_vlm, load_processor, save_vlm_dir, tiny_vlm_processor
from hybridflow.train import loop
from hybridflow.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TASK = "largest_colour"


def blank_png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (CANVAS, CANVAS), BACKGROUND).save(buffer, "PNG")
    return buffer.getvalue()


def write_data(folder: Path, count: int, seed: int, *, blank: bool) -> Path:
    """The task's examples as a JSONL file beside its PNGs (``images`` paths, ``<image>`` prompts: verl's shape)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, record in enumerate(task_examples(TASK, count, seed=seed)):
        name = f"{index}.png"
        (folder / name).write_bytes(blank_png() if blank else record["images"][0].source)
        rows.append({"prompt": PROMPT, "images": [name], "ground_truth": record["ground_truth"]})
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def sft_blind(model: Any, processor: Any, *, steps: int, lr: float, batch_size: int, seed: int) -> float:
    """Teach the answer format with blank images: the prompt masked out, ``answer + EOS`` trained on. Returns the
    last step's loss."""
    records = task_examples(TASK, 2000, seed=seed + 10_000)
    blank = open_image(type(records[0]["images"][0])(blank_png(), "blank", "images", 0))
    tokenizer = processor.tokenizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        chosen = rng.sample(records, batch_size)
        prompts = [render_prompt(r["prompt"], tokenizer, "sft") for r in chosen]
        texts = [p + r["ground_truth"] + tokenizer.eos_token for p, r in zip(prompts, chosen, strict=True)]
        images = [blank] * batch_size
        full = processor(text=texts, images=images, padding=True, padding_side="right", return_tensors="pt")
        lengths = processor(text=prompts, images=images, padding=True, return_tensors="pt")["attention_mask"].sum(1)
        labels = full["input_ids"].masked_fill(full["attention_mask"] == 0, -100)
        for row, length in enumerate(lengths.tolist()):
            labels[row, :length] = -100
        loss = model(**full, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss.detach())


def warm_model(out: Path, *, seed: int, sft_steps: int) -> Path:
    target = out / f"warm_{seed}"
    if not (target / "config.json").is_file():
        processor = tiny_vlm_processor()
        model = build_tiny_vlm(processor.tokenizer, seed=seed)
        loss = sft_blind(model, processor, steps=sft_steps, lr=3e-3, batch_size=32, seed=seed)
        print(f"seed {seed}: SFT on blank images, last loss {loss:.3f}", flush=True)
        save_vlm_dir(model, load_processor(save_vlm_dir(model, processor, target)), target)
    return target


def run(model: Path, data: Path, run_dir: Path, *, seed: int, steps: int, window: int) -> dict[str, float]:
    config = load_config(ROOT / "configs" / "grpo_vision.yaml",
                         [f"seed={seed}", f"steps={steps}", f"model.path={model}", f"data.path={data}",
                          f"data.reward={TASK}", f"output_dir={run_dir}", "logging.progress=false",
                          "logging.plot=false", "checkpoint.every=0", "logging.trackers=[jsonl]"])
    began = time.perf_counter()
    history = loop.train(config, overwrite=True).history
    rewards = [step["reward/mean"] for step in history]
    first, last = statistics.fmean(rewards[:window]), statistics.fmean(rewards[-window:])
    return {"first": first, "last": last, "rise": last - first, "seconds": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_vision")
    args = parser.parse_args()
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        model = warm_model(args.out, seed=seed, sft_steps=args.sft_steps)
        for blank in (False, True):
            name = "blank" if blank else "images"
            data = write_data(args.out / f"data_{name}_{seed}", 512, seed, blank=blank)
            result = {"seed": seed, "images": name,
                      **run(model, data, args.out / f"run_{name}_{seed}", seed=seed, steps=args.steps,
                            window=args.window)}
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}), flush=True)
            results.append(result)
    for name in ("images", "blank"):
        rises = [r["rise"] for r in results if r["images"] == name]
        print(f"{name}: rise mean {statistics.fmean(rises):+.3f} over {len(rises)} seed(s): "
              f"{', '.join(f'{r:+.3f}' for r in rises)}")


if __name__ == "__main__":
    main()
