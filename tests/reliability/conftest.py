"""A local Ray cluster per module, with token auth (the tiny random model: tests/conftest.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


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
