"""Token-level SFT demonstrations: observations in a multi-turn demonstration carry no loss."""

from __future__ import annotations

import pytest
import torch

from hybridflow.data import char_tokenizer
from hybridflow.models import build_tiny_causal_lm
from hybridflow.train.sft import Demonstration, demonstration_batch, sft_batch, sft_on_demonstrations


def test_labels_skip_the_prompt_the_observation_and_padding() -> None:
    long = Demonstration(prompt_ids=(5, 6), response_ids=(7, 2, 8, 9, 2), trained=(True, True, False, True, True))
    short = Demonstration(prompt_ids=(5,), response_ids=(9,), trained=(True,))
    batch = demonstration_batch([long, short], pad_token_id=0)
    assert batch["labels"].tolist() == [[-100, -100, 7, 2, -100, 9, 2], [-100, 9, -100, -100, -100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1] * 7, [1, 1, 0, 0, 0, 0, 0]]


def test_record_batches_are_unchanged() -> None:
    tokenizer = char_tokenizer()
    batch = sft_batch([{"prompt": "ab", "ground_truth": "ba"}], tokenizer)
    ids = [*tokenizer("abba", add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    assert batch["input_ids"].tolist() == [ids]
    assert batch["labels"].tolist() == [[-100, -100, *ids[2:]]]


def test_a_demonstration_must_train_on_something() -> None:
    with pytest.raises(ValueError, match="no response token"):
        Demonstration(prompt_ids=(1,), response_ids=(2,), trained=(False,))
    with pytest.raises(ValueError, match="trained flags"):
        Demonstration(prompt_ids=(1,), response_ids=(2, 3), trained=(True,))


def test_sft_on_demonstrations_fits_them() -> None:
    model = build_tiny_causal_lm("tiny-qwen2", vocab_size=16, seed=0)
    demo = Demonstration(prompt_ids=(5, 6), response_ids=(7, 2, 8, 9, 2), trained=(True, True, False, True, True))
    losses = sft_on_demonstrations(model, [demo], pad_token_id=0, steps=30, lr=3e-3)
    assert losses[-1] < 0.5 * losses[0]
    assert not model.training and torch.is_grad_enabled()
