"""Building a role's engine: its backend's engine, passed through the rollout factory its spec names."""

from __future__ import annotations

from hybridflow.graph import RoleKind
from hybridflow.planner import RoleLayout
from hybridflow.registry import BACKENDS, ROLLOUTS
from hybridflow.runtime.protocols import Engine, RoleSpec, RolloutFactory, WorkerContext


def rollout_factory(name: str, *, role: str) -> RolloutFactory:
    """The factory ``name`` (a role's ``rollout``) names; an unknown name lists the registered rollout engines."""
    factory = ROLLOUTS.get(name)
    if not isinstance(factory, RolloutFactory):
        raise TypeError(f"role {role!r}: rollout {name!r} is a {type(factory).__name__}, not a RolloutFactory "
                        "(a `standalone` flag and a `build(spec, layout, context, *, trainer)` method)")
    return factory


def build_engine(spec: RoleSpec, layout: RoleLayout, context: WorkerContext) -> Engine:
    """The engine role ``spec`` runs on this rank.

    A frozen policy whose rollout is standalone (a detached vLLM rollout) is the factory's engine alone;
    any other role is its backend's engine, which the factory returns or wraps. The rollout is resolved
    first, so an unknown name fails before a model loads.
    """
    factory = rollout_factory(spec.rollout, role=spec.name)
    if factory.standalone and spec.kind is RoleKind.FROZEN_POLICY:
        return factory.build(spec, layout, context, trainer=None)
    trainer = BACKENDS.get(spec.backend).build_role(spec, layout, context)
    return factory.build(spec, layout, context, trainer=trainer)
