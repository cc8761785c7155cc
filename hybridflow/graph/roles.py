"""Roles (the models of an RL algorithm) and the operations a node may ask of them."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Op(enum.StrEnum):
    """What a node does. Every op but ``compute`` and ``filter`` runs on a role's worker group.

    ``filter`` keeps the rows a driver function marks (e.g. DAPO drops groups whose rewards are all equal);
    the nodes it depends on rerun on fresh prompts, a bounded number of rounds, until the batch is full.
    """

    GENERATE = "generate"
    LOGPROB = "logprob"
    REF_LOGPROB = "ref_logprob"
    VALUES = "values"
    SCORE = "score"
    COMPUTE = "compute"
    FILTER = "filter"
    UPDATE = "update"


class RoleKind(enum.StrEnum):
    """The type of a role, which fixes the ops it can perform."""

    POLICY = "policy"  # trainable policy (the actor)
    VALUE = "value"  # trainable value model (the critic)
    FROZEN_POLICY = "frozen_policy"  # e.g. the reference model
    REWARD_MODEL = "reward_model"  # a sequence-classification network
    REWARD_FUNCTION = "reward_function"  # a rule, runs on CPU beside the driver

    @property
    def allowed_ops(self) -> frozenset[Op]:
        return ALLOWED_OPS[self]

    @property
    def trainable(self) -> bool:
        return Op.UPDATE in ALLOWED_OPS[self]

    @property
    def needs_gpu(self) -> bool:
        """A reward function is plain Python: the planner does not place it on GPUs."""
        return self is not RoleKind.REWARD_FUNCTION


ALLOWED_OPS: dict[RoleKind, frozenset[Op]] = {
    RoleKind.POLICY: frozenset({Op.GENERATE, Op.LOGPROB, Op.UPDATE}),
    RoleKind.VALUE: frozenset({Op.VALUES, Op.UPDATE}),
    RoleKind.FROZEN_POLICY: frozenset({Op.GENERATE, Op.LOGPROB, Op.REF_LOGPROB}),
    RoleKind.REWARD_MODEL: frozenset({Op.SCORE}),
    RoleKind.REWARD_FUNCTION: frozenset({Op.SCORE}),
}


@dataclass(frozen=True, slots=True)
class Role:
    """A named model of the algorithm: ``actor``, ``critic``, ``reference``, ``reward`` or any user name."""

    name: str
    kind: RoleKind

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"role name {self.name!r} must be a non-empty identifier (letters, digits, _ or -)")
        object.__setattr__(self, "kind", RoleKind(self.kind))
