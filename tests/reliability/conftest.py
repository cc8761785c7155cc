"""A tiny random model, built once per session (never downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hybridflow.data import char_tokenizer
    from hybridflow.models import build_tiny_causal_lm, save_model_dir

    tokenizer = char_tokenizer()
    model = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=0)
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("tiny_model"))
