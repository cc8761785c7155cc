"""LoRA adapters into a running vLLM engine: the base loaded once, each update a new adapter version.

vLLM 0.32 loads a LoRA adapter from a directory (``LoRARequest.lora_path``; it has no tensor request, verl patches
the worker's loader for one): each sync writes the trainer's adapter in peft format (``adapter_model.safetensors``
and ``adapter_config.json``) into a per-version directory under one temporary root, loads it with
``LLMEngine.add_lora`` and generates under it. At most ``capacity`` versions stay loaded (k+1 for a staleness
bound k): the oldest is removed only when a newer one must take its place, so a trajectory that started under
the previous adapter finishes under it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hybridflow.runtime.weights import CountedWeights, WeightSyncStats

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"lora.rank={rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


class AdapterVersions:
    """The adapter versions loaded into ``llm`` (``vllm.LLM`` started with ``enable_lora``); ``current`` is
    the ``LoRARequest`` new generations run under (None: the base model, before the first sync)."""

    def __init__(self, llm: Any, *, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"lora adapter capacity={capacity} must be >= 1 (k+1 for a staleness bound k)")
        self.llm, self.capacity = llm, capacity
        self.root = Path(tempfile.mkdtemp(prefix="hybridflow-lora-"))
        self.loaded: deque[Any] = deque()  # LoRARequests, oldest first
        self.version = 0

    @property
    def current(self) -> Any:
        return self.loaded[-1] if self.loaded else None

    def load(self, named: Iterable[tuple[str, torch.Tensor]], config: Mapping[str, Any]) -> WeightSyncStats:
        """Write and load the next version of the adapter (peft names and tensors, peft's config); returns its
        cost (``bytes``: the adapter tensors' bytes, what left the trainer)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        counter = CountedWeights(named)
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in counter}
        self.version += 1
        directory = self.root / f"v{self.version}"
        directory.mkdir()
        save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
        (directory / "adapter_config.json").write_text(json.dumps(dict(config)))
        while len(self.loaded) >= self.capacity:
            self._remove(self.loaded.popleft())
        request = LoRARequest(f"v{self.version}", self.version, str(directory))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM refused LoRA adapter version {self.version} ({directory})")
        self.loaded.append(request)
        return counter.stats(time.perf_counter() - start)

    def loaded_ids(self) -> list[int]:
        """The adapter ids vLLM holds, sorted."""
        return sorted(self.llm.llm_engine.list_loras())

    def _remove(self, request: Any) -> None:
        self.llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
