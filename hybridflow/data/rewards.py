"""Driver-side reward functions: decode samples, apply a rule, report the sample that broke it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.runtime.batch import Batch
from hybridflow.runtime.errors import RewardFunctionError

RewardRule = Callable[[str, str], float]


@dataclass(frozen=True)
class RuleScorer:
    """A :class:`~hybridflow.runtime.protocols.Scorer` applying ``rule(response_text, ground_truth)``."""

    rule: RewardRule
    tokenizer: Any

    def __call__(self, batch: Batch) -> Batch:
        texts = decode_responses(batch["responses"], batch["response_mask"], self.tokenizer)
        scores = []
        for i, (text, truth) in enumerate(zip(texts, batch["ground_truth"], strict=True)):
            try:
                scores.append(float(self.rule(text, truth)))
            except Exception as err:  # any user error: re-raise naming the sample
                prompt = self.tokenizer.decode(batch["prompts"][i], skip_special_tokens=True)
                raise RewardFunctionError(
                    f"reward function {getattr(self.rule, '__name__', self.rule)!r} raised "
                    f"{type(err).__name__}: {err} on sample {i} (prompt {prompt!r}, response {text!r}, "
                    f"ground truth {truth!r})", sample=i) from err
        return Batch({"scores": torch.tensor(scores, dtype=torch.float32)})


def decode_responses(responses: torch.Tensor, mask: torch.Tensor, tokenizer: Any) -> list[str]:
    """Text of each response's unmasked tokens (special tokens such as EOS dropped)."""
    return [tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=True) for row, m in zip(responses, mask,
                                                                                                strict=True)]
