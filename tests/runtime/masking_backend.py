"""The bigram backend of ``minimal_backend.py`` with a rollout that writes ``loss_mask`` and responses of varied length.

Every sampled token ``t`` with ``t % 4 == 3`` becomes :data:`STOP`, where the response stops (kept, as an EOS is);
``loss_mask`` is 0 on its even tokens, standing in for a multi-turn rollout's tool outputs. Both are functions of
the sampled tokens, so however a runtime cuts and joins generation (partial-rollout segments, streamed chunks) the
joined batch must satisfy :func:`expected_masks`.
"""

from __future__ import annotations

import torch
from minimal_backend import BigramBackend, BigramEngine, TrainableBigram

from hybridflow.planner import RoleLayout
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import RoleSpec, SamplingParams, WorkerContext

STOP, PAD = 3, 0


def expected_masks(responses: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``response_mask`` (up to and including the first STOP) and ``loss_mask`` the engine gives ``responses``."""
    stop = (responses == STOP).long()
    mask = ((stop.cumsum(dim=1) - stop) == 0).long() * (response_mask != 0).long()
    return mask, mask * (responses % 2 == 1).long()


def _masked(batch: Batch) -> Batch:
    responses = batch["responses"]
    responses = torch.where(responses % 4 == 3, STOP, responses)
    mask, loss_mask = expected_masks(responses, torch.ones_like(responses))
    width = max(int(mask.sum(dim=1).max()), 1)
    responses = responses.masked_fill(mask == 0, PAD)
    return Batch({"responses": responses[:, :width].contiguous(), "response_mask": mask[:, :width].contiguous(),
                  "loss_mask": loss_mask[:, :width].contiguous()})


class MaskingBigram(BigramEngine):
    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        return _masked(super().generate(batch, sampling))


class TrainableMaskingBigram(TrainableBigram):
    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        return _masked(super().generate(batch, sampling))


class MaskingBackend(BigramBackend):
    name = "masking-bigram"

    def build_role(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> BigramEngine:
        engine = super().build_role(spec, layout, context)
        cls = TrainableMaskingBigram if isinstance(engine, TrainableBigram) else MaskingBigram
        return cls(spec, layout, context)


BACKEND = MaskingBackend()
