"""Supervised warm start: teach a tiny policy the answer format so RL starts from occasional success."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.data.dataset import Record


def sft_batch(records: Sequence[Record], tokenizer: Any) -> dict[str, torch.Tensor]:
    """``prompt + answer + EOS`` rows, right-padded; labels are -100 on prompt and padding tokens."""
    rows, labels = [], []
    for record in records:
        prompt = tokenizer(record["prompt"], add_special_tokens=False).input_ids
        answer = [*tokenizer(record["ground_truth"], add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    return {"input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
            "labels": torch.tensor([r + [-100] * (width - len(r)) for r in labels])}


def sft_warm_start(model: Any, tokenizer: Any, records: Sequence[Record], *, steps: int, batch_size: int = 32,
                   lr: float = 3e-3, seed: int = 0, progress: bool = False) -> list[float]:
    """Train ``model`` in place for ``steps`` steps of next-token loss on the answers; returns the losses.

    ``progress``: a bar on stderr (the warm-up runs before the RL steps' bar exists).
    """
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="SFT warm-up", unit="step")
    for _ in range(steps):
        picked = rng.choice(len(records), size=min(batch_size, len(records)), replace=False)
        loss = model(**sft_batch([records[i] for i in picked], tokenizer)).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update(1)
    if bar is not None:
        bar.close()
    model.eval()
    return losses
