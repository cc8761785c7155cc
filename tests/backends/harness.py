"""Helpers of the backend tests: tiny batches, role specs, and world-size-2 gloo runs in spawned processes.

Spawned ranks import this module by name (pytest puts this folder on ``sys.path``, and spawn passes
``sys.path`` to the children), so rank functions must live in importable modules, not in test bodies.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridflow.graph import RoleKind
from hybridflow.planner import RoleLayout, Sharding
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import OptimSpec, RoleSpec, WorkerContext
from hybridflow.runtime.worker import SoloCollective

MODEL = "tiny-qwen2"
VOCAB = 51  # the default char tokenizer's size (hybridflow.data.char_tokenizer)


def rollout_batch(rows: int = 8, prompt_len: int = 6, response_len: int = 5, seed: int = 0) -> Batch:
    """Random prompt + response rows with the fields a PPO policy or value loss reads."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, VOCAB, (rows, prompt_len), generator=gen)
    responses = torch.randint(4, VOCAB, (rows, response_len), generator=gen)
    return Batch({
        "prompts": prompts, "prompt_mask": torch.ones_like(prompts),
        "responses": responses, "response_mask": torch.ones_like(responses),
        "old_logprobs": -3.0 + 0.1 * torch.randn(rows, response_len, generator=gen),
        "advantages": torch.randn(rows, response_len, generator=gen),
        "values": torch.randn(rows, response_len, generator=gen),
        "returns": torch.randn(rows, response_len, generator=gen),
    })


def role_spec(name: str = "actor", kind: RoleKind = RoleKind.POLICY, *, lr: float = 1e-3, grad_clip: float = 1e6,
              rollout: str = "native", rollout_options: dict[str, Any] | None = None, **options: Any) -> RoleSpec:
    optim = OptimSpec(lr=lr, grad_clip=grad_clip) if kind.trainable else None
    return RoleSpec(name=name, kind=kind, model=MODEL, optim=optim, seed=0, options=options,
                    rollout=rollout, rollout_options=rollout_options or {})


def layout(role: str = "actor", *, dp: int = 2, sharding: Sharding = Sharding.FULL_SHARD, dtype: str = "fp32",
           micro_batch_size: int = 2, **fields: Any) -> RoleLayout:
    return RoleLayout(role=role, dp=dp, sharding=sharding, dtype=dtype, micro_batch_size=micro_batch_size, **fields)


def context(rank: int = 0, world_size: int = 1) -> WorkerContext:
    return WorkerContext(group=0, rank=rank, world_size=world_size, device="cpu", collective=SoloCollective())


def rank_rows(batch: Batch, rank: int, world_size: int) -> Batch:
    return batch.chunk(world_size)[rank]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, init_file: str, out_dir: str, args: tuple[Any, ...]
           ) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as handle:
            pickle.dump(result, handle)
    finally:
        if dist.is_initialized():  # an in-process vLLM engine's shutdown already destroyed it
            dist.destroy_process_group()
    # The result is on disk: leave without interpreter teardown, where a native thread of a library (seen once
    # with DeepSpeed: "terminate called without an active exception") can abort a rank that already succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; returns each rank's result."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(Path(tmp) / "init")
        mp.start_processes(_entry, args=(fn, world_size, init_file, tmp, args), nprocs=world_size,
                           start_method="spawn", join=True)
        results = []
        for rank in range(world_size):
            with open(Path(tmp) / f"rank{rank}.pkl", "rb") as handle:
                results.append(pickle.load(handle))
    return results
