"""Moving trainer weights into a running vLLM engine, and what it cost (time, bytes, peak extra copy)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from hybridflow.runtime.weights import CountedWeights, WeightSyncStats

BUCKET_BYTES = 256 << 20  # serialized path: one RPC per ~256 MiB keeps each message and copy bounded


def _reload_from_iterator(worker: Any, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    worker.model_runner.reload_weights(weights_iterator=iter(named))


def _reload_from_bytes(worker: Any, blob: bytes) -> None:
    from safetensors.torch import load

    worker.model_runner.reload_weights(weights_iterator=iter(load(blob).items()))


def load_in_process(llm: Any, named: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
    """Stream tensors straight into the engine's model (same process: no serialisation, no full copy)."""
    start = time.perf_counter()
    counter = CountedWeights(named)
    llm.collective_rpc(_reload_from_iterator, args=(counter,))
    return counter.stats(time.perf_counter() - start)


def _buckets(named: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[dict[str, torch.Tensor]]:
    """``named`` as CPU tensors in dicts of about ``limit`` bytes that safetensors can save."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    seen: set[int] = set()
    for name, tensor in named:
        tensor = tensor.detach().cpu().contiguous()
        if tensor.data_ptr() in seen:  # tied weights (embeddings = head): safetensors refuses shared storage
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        bucket[name] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= limit:
            yield bucket
            bucket, size, seen = {}, 0, set()
    if bucket:
        yield bucket


def load_serialized(llm: Any, named: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
    """Send safetensors buckets to vLLM's worker processes (tensor-parallel engines)."""
    from safetensors.torch import save

    start = time.perf_counter()
    counter = CountedWeights(named)
    for bucket in _buckets(counter, BUCKET_BYTES):
        llm.collective_rpc(_reload_from_bytes, args=(save(bucket),))
    return counter.stats(time.perf_counter() - start)


def write_snapshot(named: Iterable[tuple[str, torch.Tensor]], directory: Path) -> WeightSyncStats:
    """HF-named tensors as ``model-<k>.safetensors`` files of about ``BUCKET_BYTES`` in ``directory`` (emptied of
    earlier ones first): what a vLLM server's ``reload_weights(weights_path=directory)`` reads. At most one bucket
    is held at a time."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    for old in directory.glob("*.safetensors"):
        old.unlink()
    counter = CountedWeights(named)
    for k, bucket in enumerate(_buckets(counter, BUCKET_BYTES)):
        save_file(bucket, str(directory / f"model-{k:05d}.safetensors"), metadata={"format": "pt"})
    return counter.stats(time.perf_counter() - start)


def write_adapter(named: Iterable[tuple[str, torch.Tensor]], config: Mapping[str, Any],
                  directory: Path) -> WeightSyncStats:
    """A peft adapter (``adapter_model.safetensors`` and ``adapter_config.json``) in ``directory``, replacing the one
    there: what vLLM's ``LoRARequest`` and ``/v1/load_lora_adapter`` read. ``bytes``: the adapter's tensors."""
    import json

    from safetensors.torch import save_file

    start = time.perf_counter()
    counter = CountedWeights(named)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in counter}
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps(dict(config)))
    return counter.stats(time.perf_counter() - start)
