"""Plans the runtime can build without the planner (the trivial colocated plan), and the role specs a plan
adds (a policy's detached rollout)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hybridflow.graph import Graph, RoleKind
from hybridflow.planner import Plan, colocated_plan
from hybridflow.runtime.protocols import DEFAULT_ROLLOUT, RoleSpec

UNPLANNED_MICRO_BATCH = 64  # rows per pass and rank of a role in the one-group plan when the user fixed none


def default_plan(graph: Graph, *, num_gpus: int = 1, device: str = "cpu", dtype: str = "fp32",
                 micro_batch_sizes: Mapping[str, int] | None = None, token_budgets: Mapping[str, int] | None = None,
                 padding: bool = False) -> Plan:
    """Every GPU role of ``graph`` on one group of ``num_gpus``; reward functions on the driver.

    ``micro_batch_sizes``: rows per pass and rank per role (:data:`UNPLANNED_MICRO_BATCH` for the others);
    ``token_budgets``: per role, tokens per update and forward micro batch and GPU (the others cut by rows);
    ``padding``: every role's passes run padded rows instead of packed sequences.
    """
    gpu_roles = [role.name for role in graph.roles if role.kind.needs_gpu]
    driver_roles = [role.name for role in graph.roles if not role.kind.needs_gpu]
    plan = colocated_plan(graph.name, gpu_roles, driver_roles, num_gpus=num_gpus, device=device, dtype=dtype)
    sizes = {role: (micro_batch_sizes or {}).get(role, UNPLANNED_MICRO_BATCH) for role in gpu_roles}
    group = plan.groups[0]
    budgets = token_budgets or {}
    layouts = tuple(replace(layout, micro_batch_size=sizes[layout.role], padding=padding,
                            max_tokens_per_micro_batch=budgets.get(layout.role, 0),
                            forward_max_tokens_per_micro_batch=budgets.get(layout.role, 0))
                    for layout in group.layouts)
    return replace(plan, groups=(replace(group, layouts=layouts),))


def with_rollout_specs(plan: Plan, specs: Mapping[str, RoleSpec]) -> dict[str, RoleSpec]:
    """``specs`` plus one for each detached rollout in ``plan`` (``actor:rollout``) that has none.

    A rollout is a frozen copy of its policy (same model and seed) whose weights the controller replaces
    after every update. The policy's ``rollout`` and ``rollout_options`` move to the rollout's side (see
    :func:`rollout_spec`); the trainer itself then generates nothing, so it keeps the default rollout.
    """
    out = dict(specs)
    for policy, rollout in plan.detached_rollouts.items():
        if policy not in specs:
            raise KeyError(f"the plan gives policy {policy!r} a separate rollout ({rollout!r}) but no RoleSpec "
                           f"was given for {policy!r}; specs: {sorted(specs)}")
        out[policy] = replace(specs[policy], rollout=DEFAULT_ROLLOUT, rollout_options={})
        if rollout not in specs:
            out[rollout] = rollout_spec(specs[policy], rollout)
    return out


def rollout_spec(trainer: RoleSpec, name: str, **changes: Any) -> RoleSpec:
    """The frozen copy of ``trainer`` that serves as its detached rollout ``name``; ``changes`` override fields.

    It keeps the policy's backend, options, ``rollout`` and ``rollout_options``: a standalone rollout factory
    (vLLM) then builds the role's engine by itself, any other generates on a frozen copy that the policy's
    backend builds (:func:`hybridflow.runtime.engines.build_engine`). A LoRA policy's rollout serves its adapter
    (``serves_adapter``): the model is the adapter's base.
    """
    spec = RoleSpec(name=name, kind=RoleKind.FROZEN_POLICY, model=trainer.model, seed=trainer.seed,
                    backend=trainer.backend, options=trainer.options,
                    rollout=trainer.rollout, rollout_options=trainer.rollout_options,
                    serves_adapter=trainer.lora, policy_versions=trainer.policy_versions)
    return replace(spec, **changes)
