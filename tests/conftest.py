"""Shared test set-up: one OpenMP thread (small CPU matmuls are far slower with more) and a gpu marker."""

from __future__ import annotations

import os
import random
import sys
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shuffle", metavar="SEED", default=None,
                     help="run the test files in a seeded random order, and each file's tests in a seeded random "
                          "order (module fixtures stay shared): shows that no test depends on another's leftovers. "
                          "'random' picks a seed; the seed is printed, so a failing order can be replayed")


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = _shuffle_seed(config)
    return None if seed is None else f"shuffled: --shuffle={seed}"


def _shuffle_seed(config: pytest.Config) -> int | None:
    chosen = config.getoption("--shuffle")
    if chosen is None:
        return None
    if chosen == "random":
        config.option.shuffle = chosen = str(random.SystemRandom().randrange(10**6))
    try:
        return int(chosen)
    except ValueError as err:
        raise pytest.UsageError(f"--shuffle={chosen!r}: give an integer seed or 'random'") from err


def _shuffle(items: list[pytest.Item], seed: int) -> None:
    """Files in a seeded order, each file's tests in a seeded order, in place."""
    rng = random.Random(seed)
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(str(item.path), []).append(item)
    files = sorted(by_file)
    rng.shuffle(files)
    for name in files:
        rng.shuffle(by_file[name])
    items[:] = [item for name in files for item in by_file[name]]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seed = _shuffle_seed(config)
    if seed is not None:
        _shuffle(items, seed)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _no_ray_connection_outlives_its_file() -> Iterator[None]:
    """A file that connected this process to Ray disconnects it at its end: the next file (in any order) starts
    from no connection, as its own cluster fixtures and ``ensure_ray`` expect."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_two_nodes() -> Iterator[str]:
    """Two simulated Ray nodes of two logical GPUs each on this machine; yields the head address. A connection an
    earlier test of the same file left (a local cluster of ``RayExecutor()``) is closed first: the tests that take
    this cluster connect to it by its address, which ``ensure_ray`` refuses beside another connection."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
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
