"""The SFT-warmed tiny model of the runtime tests, built once per session (the random one: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.data import char_tokenizer, task_examples
from hybridflow.models import build_tiny_causal_lm, save_model_dir

SFT_STEPS = 60


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 SFT-warmed on string reversal until it is right about half the time."""
    from hybridflow.train.sft import sft_warm_start

    tokenizer = char_tokenizer()
    model = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=0)
    sft_warm_start(model, tokenizer, task_examples("reverse", 2000, seed=0), steps=SFT_STEPS, lr=3e-3, seed=0)
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("warm_model"))
