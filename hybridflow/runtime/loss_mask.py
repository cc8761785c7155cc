"""The one rule for a generate node's ``loss_mask``: the engine's own, checked against ``response_mask``, or a copy
of it. A single-turn generate (:mod:`hybridflow.runtime.worker`) and a multi-turn one
(:mod:`hybridflow.runtime.agent_rollout`) both fill the port through here."""

from __future__ import annotations

import torch

from hybridflow.graph import Node
from hybridflow.runtime.batch import Batch


def with_loss_mask(node: Node, result: Batch) -> Batch:
    """A generate call's outputs with the ``loss_mask`` port filled: the engine's own, checked, or else a copy of
    ``response_mask`` (the one place it defaults). ``rollout_logprobs`` become 0 where ``loss_mask`` is 0.

    An engine that masks tokens (loss_mask differs from response_mask) on a node without ``loss_mask=True`` is
    refused: dropping its mask would silently train on tokens the rollout meant to keep out of the loss.
    """
    mask = result["response_mask"]
    if "loss_mask" not in result:
        return result.union(Batch({"loss_mask": mask})) if "loss_mask" in node.port_outputs() else result
    loss_mask = result["loss_mask"]
    if loss_mask.shape != mask.shape:
        raise ValueError(f"generate node {node.name!r}: the engine's loss_mask has shape {tuple(loss_mask.shape)}; "
                         f"it must match response_mask {tuple(mask.shape)} (same right-padded layout)")
    if bool(((loss_mask != 0) & (mask == 0)).any()):
        raise ValueError(f"generate node {node.name!r}: the engine's loss_mask is 1 where response_mask is 0; "
                         "it must be a subset of response_mask (0 on padding)")
    if "loss_mask" not in node.port_outputs():
        if not torch.equal(loss_mask != 0, mask != 0):
            raise ValueError(f"generate node {node.name!r}: the engine masks tokens out of the loss (loss_mask "
                             "differs from response_mask) but the node drops loss_mask: add loss_mask=True to it "
                             "and 'loss_mask' to the inputs of the nodes that should honour it")
        return result
    if "rollout_logprobs" in result:
        logprobs = result["rollout_logprobs"]
        kept = torch.where(loss_mask != 0, logprobs, torch.zeros_like(logprobs))
        result = Batch({**result.tensors, "rollout_logprobs": kept}, result.non_tensors)
    return result
