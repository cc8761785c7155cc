"""A tiny random model, built once per session (never downloaded), and a local Ray cluster per module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hybridflow.data import char_tokenizer
    from hybridflow.models import build_tiny_causal_lm, save_model_dir

    tokenizer = char_tokenizer()
    model = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=0)
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """Our own local cluster (token auth on); the process's Ray settings are restored afterwards."""
    ray = pytest.importorskip("ray")
    from hybridflow.runtime.ray_executor import ensure_ray, refresh_auth_settings

    saved = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    if ray.is_initialized():
        ray.shutdown()
    ensure_ray(address=None, num_gpus=2, num_cpus=2)
    yield
    ray.shutdown()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    refresh_auth_settings()  # later modules' hand-started clusters run without auth
