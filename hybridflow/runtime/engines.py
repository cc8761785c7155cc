"""Building a role's engine: its backend's engine, passed through the rollout factory its spec names."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from hybridflow.graph import RoleKind
from hybridflow.planner import RoleLayout
from hybridflow.registry import BACKENDS, ROLLOUTS
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import Engine, RoleSpec, RolloutFactory, WorkerContext

_log = logging.getLogger(__name__)


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


class SharedBaseReference:
    """A frozen role that is a LoRA policy's base model (``RoleSpec.shares_policy``), served by that policy's
    engine with its adapters disabled for each call: no model of its own is loaded."""

    def __init__(self, policy_engine: Any, *, role: str, policy: str) -> None:
        if not getattr(policy_engine, "has_adapters", False):
            raise TypeError(f"role {role!r} shares policy {policy!r}'s base model, but {policy!r}'s engine "
                            f"({type(policy_engine).__name__}) trains no LoRA adapters to disable")
        self.policy_engine, self.role, self.policy = policy_engine, role, policy

    def log_probs(self, batch: Batch, *, with_entropy: bool = False) -> Batch:
        result: Batch = self.policy_engine.log_probs(batch, with_entropy=with_entropy, adapters=False)
        return result

    def executed_layout(self) -> dict[str, Any]:
        """The policy's engine runs this role: its report, and which policy it is."""
        report = getattr(self.policy_engine, "executed_layout", None)
        return {**(report() if report is not None else {}), "shares_policy": self.policy}

    def close(self) -> None:
        """Nothing of its own: the policy's role closes the engine."""


def build_engines(specs: Mapping[str, RoleSpec], layouts: Mapping[str, RoleLayout], context: WorkerContext, *,
                  into: dict[str, Any]) -> None:
    """Every role's engine on this rank (:func:`build_engine`), added to ``into`` as each is built (so a failure
    leaves the built ones there to close). A reference that shares a LoRA policy's base model (``shares_policy``)
    on the same group runs on that policy's engine (:class:`SharedBaseReference`); one whose policy is elsewhere
    loads the base model itself (correct, at the cost of a copy the plan did not count)."""
    engines = into
    ordered = sorted(specs.values(), key=lambda spec: spec.shares_policy is not None)  # policies first
    for spec in ordered:
        if spec.shares_policy is not None and spec.shares_policy in engines:
            engines[spec.name] = SharedBaseReference(engines[spec.shares_policy], role=spec.name,
                                                     policy=spec.shares_policy)
        else:
            if spec.shares_policy is not None:
                _log.warning("role %r shares policy %r's base model but runs on another group: it loads a copy "
                             "(colocate them to save it)", spec.name, spec.shares_policy)
            engines[spec.name] = build_engine(spec, layouts[spec.name], context)
