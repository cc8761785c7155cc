"""The data fields that flow along the graph's edges, and how big each is for a workload."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Extent(enum.StrEnum):
    """What one row of a field spans: one value per sequence, per prompt token or per response token."""

    SEQUENCE = "sequence"
    PROMPT_TOKENS = "prompt_tokens"
    RESPONSE_TOKENS = "response_tokens"


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """Shape class and element size of a field, used for edge byte counts."""

    name: str
    extent: Extent
    dtype_bytes: int


def _spec(name: str, extent: Extent, dtype_bytes: int) -> tuple[str, FieldSpec]:
    return name, FieldSpec(name, extent, dtype_bytes)


# The vocabulary of the built-in algorithms. A user field not listed here defaults to one
# float32 per response token, the common case for per-token statistics.
STANDARD_FIELDS: dict[str, FieldSpec] = dict(
    [
        _spec("prompts", Extent.PROMPT_TOKENS, 8),
        _spec("ground_truth", Extent.SEQUENCE, 64),
        _spec("uid", Extent.SEQUENCE, 8),
        _spec("responses", Extent.RESPONSE_TOKENS, 8),
        _spec("response_mask", Extent.RESPONSE_TOKENS, 1),
        _spec("loss_mask", Extent.RESPONSE_TOKENS, 1),
        _spec("rollout_logprobs", Extent.RESPONSE_TOKENS, 4),
        _spec("old_logprobs", Extent.RESPONSE_TOKENS, 4),
        _spec("ref_logprobs", Extent.RESPONSE_TOKENS, 4),
        _spec("values", Extent.RESPONSE_TOKENS, 4),
        _spec("scores", Extent.SEQUENCE, 4),
        _spec("token_rewards", Extent.RESPONSE_TOKENS, 4),
        _spec("advantages", Extent.RESPONSE_TOKENS, 4),
        _spec("returns", Extent.RESPONSE_TOKENS, 4),
        _spec("greedy_responses", Extent.RESPONSE_TOKENS, 8),
        _spec("greedy_response_mask", Extent.RESPONSE_TOKENS, 1),
        _spec("greedy_loss_mask", Extent.RESPONSE_TOKENS, 1),
        _spec("greedy_scores", Extent.SEQUENCE, 4),
        _spec("pair", Extent.SEQUENCE, 8),
        _spec("chosen", Extent.SEQUENCE, 8),
    ]
)


def field_spec(name: str) -> FieldSpec:
    """The spec of a field name; unknown names are one float32 per response token."""
    return STANDARD_FIELDS.get(name, FieldSpec(name, Extent.RESPONSE_TOKENS, 4))
