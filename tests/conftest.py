"""Shared test set-up: one OpenMP thread (small CPU matmuls are far slower with more) and a gpu marker."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray waits ~20 s for a starting GCS; on a loaded 2-core machine that is not always enough.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "90")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ray_two_nodes() -> Iterator[str]:
    """Two simulated Ray nodes of two logical GPUs each on this machine; yields the head address."""
    import ray
    from ray.cluster_utils import Cluster

    sim = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2})
    sim.add_node(num_cpus=2, num_gpus=2)
    sim.wait_for_nodes()
    yield sim.address
    ray.shutdown()
    sim.shutdown()


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen2 with the character tokenizer."""
    from hybridflow.data import char_tokenizer
    from hybridflow.models import build_tiny_causal_lm, save_model_dir

    tokenizer = char_tokenizer()
    model = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=0)
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("random_model"))
