"""What a backend can run of a :class:`RoleLayout`, declared by the backend and read by planner and runtime.

A backend exposes its :class:`LayoutSupport`; the planner's search only proposes layouts inside it (the
``support`` of :class:`~hybridflow.planner.PlannerOptions` and :func:`~hybridflow.planner.evaluate_mapping`),
and the controller refuses, before any model loads, a plan that asks a role's backend for more
(:meth:`LayoutSupport.problems`). Torch-free, like the rest of the planner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridflow.planner.plan import OFFLOAD_PARTS, RoleLayout, Sharding

DTYPES = frozenset({"bf16", "fp16", "fp32"})
FROZEN_SHARDINGS = (Sharding.FULL_SHARD, Sharding.ZERO3, Sharding.HYBRID_SHARD)  # what a frozen role can shard


@dataclass(frozen=True, kw_only=True)
class LayoutSupport:
    """The layouts a backend runs exactly as planned.

    ``shardings``: the strategies it executes as named (a backend that would run another one instead,
    e.g. replicas for ``SHARD_GRAD_OP``, must leave it out). ``max_tp`` / ``max_rollout_tp``: tensor
    parallelism of its training and forward passes, and of the engine it generates with (None: any).
    ``rollout_follows_tp``: its own engine generates (the ``native``/``hf_generate`` rollouts on the trained model),
    so with the training layout's tensor parallelism: ``rollout_tp`` must equal ``tp``.
    ``gradient_checkpointing``: it recomputes activations when the layout asks. ``rollout_batch_size``: it
    decodes at most the layout's ``rollout_batch_size`` sequences at a time. ``packing``: its forward and update
    passes pack sequences (no padding) unless the layout asks for ``padding``; a backend without it runs padded
    rows whatever the layout says (slower than costed, same numbers), so it is not refused. ``token_budgets``: it
    cuts micro batches by the layout's ``max_tokens_per_micro_batch`` / ``forward_max_tokens_per_micro_batch``
    (without it, a budget is refused: its memory bound would not hold). ``offload``: the parts
    (``params``, ``grads``, ``optimizer``) it can keep in host memory (``RoleLayout.offload_*``); ``offload_sets``:
    the combinations of them it runs, when it cannot offload each part alone (FSDP2's ``CPUOffloadPolicy`` moves all
    three; empty: any combination of ``offload``); ``offload_shardings``: per part, the shardings it offloads that
    part under on more than one rank (DeepSpeed offloads parameters at ZeRO-3 only; a part not listed: any).
    ``dtypes``: the layout dtypes it loads. ``served``: its rollout engines are inference servers behind a router
    (``rollout: server``), each engine of ``rollout_tp`` GPUs one replica, on GPUs of their own
    (:mod:`~hybridflow.planner.fleet`).
    """

    backend: str
    shardings: frozenset[Sharding] = frozenset({Sharding.NO_SHARD})
    max_tp: int | None = 1
    max_rollout_tp: int | None = 1
    rollout_follows_tp: bool = False
    gradient_checkpointing: bool = False
    rollout_batch_size: bool = False
    packing: bool = False
    token_budgets: bool = False
    offload: frozenset[str] = frozenset()
    offload_sets: tuple[frozenset[str], ...] = ()
    offload_shardings: tuple[tuple[str, frozenset[Sharding]], ...] = ()
    dtypes: frozenset[str] = DTYPES
    served: bool = False
    notes: Mapping[str, str] = field(default_factory=dict, compare=False)  # field -> how to get it elsewhere

    def __post_init__(self) -> None:
        object.__setattr__(self, "shardings", frozenset(Sharding(s) for s in self.shardings))
        if Sharding.NO_SHARD not in self.shardings:
            raise ValueError(f"LayoutSupport({self.backend}).shardings must include NO_SHARD (one rank, or replicas)")
        for name in ("max_tp", "max_rollout_tp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"LayoutSupport({self.backend}).{name}={value} must be >= 1 (or None: any)")
        named = set(self.offload) | {part for parts in self.offload_sets for part in parts}
        unknown = sorted((named | {part for part, _ in self.offload_shardings}) - set(OFFLOAD_PARTS))
        if unknown:
            raise ValueError(f"LayoutSupport({self.backend}).offload has {unknown}; parts: params, grads, optimizer")
        if not named <= set(self.offload):
            raise ValueError(f"LayoutSupport({self.backend}).offload_sets name parts outside "
                             f"offload={sorted(self.offload)}")

    def runs_sharding(self, sharding: Sharding) -> bool:
        return Sharding(sharding) in self.shardings

    def offload_problems(self, offloaded: frozenset[str], sharding: Sharding, dp: int) -> list[str]:
        """Why this backend would not keep ``offloaded`` in host memory under ``sharding`` on ``dp`` ranks (empty:
        it would, exactly)."""
        if not offloaded:
            return []
        asked = f"offload={sorted(offloaded)}"
        if not offloaded <= self.offload:
            return [f"{asked} (it keeps {sorted(self.offload) or 'nothing'} in host memory)"]
        if self.offload_sets and offloaded not in self.offload_sets:
            sets = " or ".join(str(sorted(parts)) for parts in self.offload_sets)
            return [f"{asked} (it offloads {sets} together)"]
        if dp > 1:
            for part, shardings in self.offload_shardings:
                if part in offloaded and Sharding(sharding) not in shardings:
                    return [f"{asked} with sharding={Sharding(sharding).value} (it offloads {part} under "
                            f"{_names(shardings)} only)"]
        return []

    def tps(self, candidates: list[int]) -> list[int]:
        return [tp for tp in candidates if self.max_tp is None or tp <= self.max_tp]

    def rollout_tps(self, candidates: list[int], tp: int = 1) -> list[int]:
        """The rollout tensor parallelism it runs among ``candidates``, for a training layout of ``tp``."""
        if self.rollout_follows_tp:
            return [tp]
        return [rtp for rtp in candidates if self.max_rollout_tp is None or rtp <= self.max_rollout_tp]

    def problems(self, layout: RoleLayout, *, generates: bool = True) -> list[str]:
        """Every field of ``layout`` this backend would not run as planned, each naming the fix.

        ``generates``: the role generates with this backend's engine (its rollout fields count).
        """
        found = []
        if not self.runs_sharding(layout.sharding) and layout.dp > 1:
            found.append(f"sharding={layout.sharding.value} (it runs {_names(self.shardings)})")
        if self.max_tp is not None and layout.tp > self.max_tp:
            found.append(f"tp={layout.tp} (it runs tp <= {self.max_tp})")
        if generates and self.max_rollout_tp is not None and layout.rollout_tp > self.max_rollout_tp:
            found.append(f"rollout_tp={layout.rollout_tp} (its rollout engine runs rollout_tp <= "
                         f"{self.max_rollout_tp})")
        if generates and self.rollout_follows_tp and layout.rollout_tp != layout.tp:
            found.append(f"rollout_tp={layout.rollout_tp} (it generates on the trained model, split as tp={layout.tp})")
        if generates and layout.rollout_batch_size and not self.rollout_batch_size:
            found.append(f"rollout_batch_size={layout.rollout_batch_size} (it decodes a rank's whole share at once)")
        if layout.gradient_checkpointing and not self.gradient_checkpointing:
            found.append("gradient_checkpointing=True (it does not recompute activations)")
        for name in ("max_tokens_per_micro_batch", "forward_max_tokens_per_micro_batch"):
            if getattr(layout, name) and not self.token_budgets:
                found.append(f"{name}={getattr(layout, name)} (it cuts micro batches by rows)")
        found.extend(self.offload_problems(layout.offloaded, layout.sharding, layout.dp))
        if layout.dtype not in self.dtypes:
            found.append(f"dtype={layout.dtype} (it loads {sorted(self.dtypes)})")
        for name in ("sp", "pp", "ep"):
            if getattr(layout, name) > 1:
                found.append(f"{name}={getattr(layout, name)} (no backend here splits ranks that way)")
        return [f"{item}; {self.notes[key]}" if (key := item.split("=")[0]) in self.notes else item
                for item in found]


def _names(shardings: frozenset[Sharding]) -> str:
    return ", ".join(sorted(s.value for s in shardings))


ANY_LAYOUT = LayoutSupport(backend="any", shardings=frozenset(Sharding), max_tp=None, max_rollout_tp=None,
                           gradient_checkpointing=True, rollout_batch_size=True, packing=True,
                           token_budgets=True, offload=frozenset({"params", "grads", "optimizer"}))
"""No constraint: what the planner searches when it is told nothing of the backends (a dry run)."""
