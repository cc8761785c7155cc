"""Rank function of the overlapped gradient reduce: the same gradients as one pass over the whole mini batch,
however many buckets; a non-finite loss on one rank stops both, none left waiting."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from harness import context, layout, rank_rows, role_spec
from norm_ranks import _gap, _update, ragged_batch

from hybridflow.registry import LOSSES
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.collective import ProcessGroupCollective


def overlap_results(rank: int, world_size: int) -> dict[str, Any]:
    from hybridflow.backends.torch import TorchRoleEngine
    from hybridflow.backends.torch import engine as torch_engine

    batch = ragged_batch()

    def engine(ranks: int) -> Any:
        ctx = context(rank if ranks > 1 else 0, ranks)
        if ranks > 1:
            ctx = dataclasses.replace(ctx, collective=ProcessGroupCollective(rank=rank, world_size=world_size))
        return TorchRoleEngine(role_spec(), layout(dp=ranks, micro_batch_size=1), ctx)

    _, reference = _update(engine(1), batch, "token-mean", lambda g: g)
    out: dict[str, Any] = {}
    for cap in (torch_engine.BUCKET_BYTES, 16 << 10):  # one bucket; then one per few tensors
        torch_engine.BUCKET_BYTES = cap
        overlapped = engine(2)
        assert overlapped.overlap is not None
        _, grads = _update(overlapped, rank_rows(batch, rank, world_size), "token-mean", lambda g: g)
        out[f"buckets{len(overlapped.overlap.views)}"] = _gap(grads, reference)
        out[f"overlapped{len(overlapped.overlap.views)}"] = overlapped.overlap.overlapped
    rows = rank_rows(batch, rank, world_size)
    if rank == 1:  # a NaN advantage in this rank's last micro batch: its loss is not finite, no backward runs
        last = torch.arange(len(rows))[:, None] == len(rows) - 1
        rows = Batch({**rows.tensors, "advantages": torch.where(last, float("nan"), rows["advantages"])})
    stopped = engine(2)
    try:
        stopped.train_step(rows, loss=LOSSES.get("ppo_policy"), options={"loss_agg": "token-mean"})
        out["non_finite"] = "stepped"
    except Exception as err:  # its type is what the test reads
        out["non_finite"] = type(err).__name__
    return out
