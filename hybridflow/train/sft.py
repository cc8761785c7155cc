"""Supervised warm start: teach a tiny policy the answer format so RL starts from occasional success."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.data.dataset import Record


@dataclass(frozen=True, kw_only=True)
class Demonstration:
    """One SFT row as token ids: ``prompt_ids`` (never trained on), then ``response_ids``, trained on where
    ``trained`` is True. A multi-turn demonstration marks its observations (a tool's output) False, as the RL
    loss mask does, so the policy learns to call a tool, not to predict the tool's answer."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    trained: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.trained) != len(self.response_ids):
            raise ValueError(f"Demonstration: {len(self.trained)} trained flags for {len(self.response_ids)} "
                             "response tokens")
        if not any(self.trained):
            raise ValueError("Demonstration: no response token is trained on")


def record_demonstration(record: Record, tokenizer: Any) -> Demonstration:
    """``prompt`` then ``ground_truth + EOS``, all of the answer trained on."""
    prompt = tokenizer(record["prompt"], add_special_tokens=False).input_ids
    answer = [*tokenizer(record["ground_truth"], add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    return Demonstration(prompt_ids=tuple(prompt), response_ids=tuple(answer), trained=(True,) * len(answer))


def demonstration_batch(demonstrations: Sequence[Demonstration], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded rows; labels are -100 on the prompt, on untrained response tokens and on padding."""
    rows = [[*d.prompt_ids, *d.response_ids] for d in demonstrations]
    labels = [[-100] * len(d.prompt_ids) + [t if keep else -100 for t, keep in zip(d.response_ids, d.trained,
                                                                                   strict=True)]
              for d in demonstrations]
    width = max(len(r) for r in rows)
    return {"input_ids": torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
            "labels": torch.tensor([r + [-100] * (width - len(r)) for r in labels])}


def sft_batch(records: Sequence[Record], tokenizer: Any) -> dict[str, torch.Tensor]:
    """``prompt + answer + EOS`` rows, right-padded; labels are -100 on prompt and padding tokens."""
    return demonstration_batch([record_demonstration(r, tokenizer) for r in records], tokenizer.pad_token_id)


def sft_warm_start(model: Any, tokenizer: Any, records: Sequence[Record], *, steps: int, batch_size: int = 32,
                   lr: float = 3e-3, seed: int = 0, progress: bool = False) -> list[float]:
    """Train ``model`` in place for ``steps`` steps of next-token loss on the answers; returns the losses.

    ``progress``: a bar on stderr (the warm-up runs before the RL steps' bar exists).
    """
    demonstrations = [record_demonstration(r, tokenizer) for r in records]
    return sft_on_demonstrations(model, demonstrations, pad_token_id=tokenizer.pad_token_id, steps=steps,
                                 batch_size=batch_size, lr=lr, seed=seed, progress=progress)


def sft_on_demonstrations(model: Any, demonstrations: Sequence[Demonstration], *, pad_token_id: int, steps: int,
                          batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
                          progress: bool = False) -> list[float]:
    """:func:`sft_warm_start` on token-level demonstrations (e.g. tool-use trajectories as the runtime renders
    them); the model is left in eval mode."""
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
        picked = rng.choice(len(demonstrations), size=min(batch_size, len(demonstrations)), replace=False)
        loss = model(**demonstration_batch([demonstrations[i] for i in picked], pad_token_id)).loss
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
