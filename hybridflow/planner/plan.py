"""The planner's output: an immutable, JSON-serialisable placement of roles on GPU groups.

The runtime executes a :class:`Plan` as it is; nothing re-plans behind the user's back.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from hybridflow.graph import Graph, Op
from hybridflow.planner.execution import ExecutionMode

ROLLOUT_SUFFIX = ":rollout"
OFFLOAD_PARTS = ("params", "grads", "optimizer")  # what a role can keep in host memory (RoleLayout.offload_*)


def rollout_role(policy: str) -> str:
    """The plan role of ``policy``'s rollout engine when it runs on its own GPUs (``actor:rollout``).

    Graph role names cannot hold ``:``, so the name never clashes with a user's role.
    """
    return policy + ROLLOUT_SUFFIX


def detachable_policies(graph: Graph) -> tuple[str, ...]:
    """The roles whose rollout may run on GPUs of their own: trainable policies with a generate node."""
    return tuple(role.name for role in graph.roles if role.kind.trainable
                 and any(node.op is Op.GENERATE for node in graph.nodes_of(role.name)))


class Sharding(enum.StrEnum):
    """How a trainable role's parameters, gradients and optimizer states are split over DP ranks."""

    NO_SHARD = "NO_SHARD"  # replicate (DDP)
    SHARD_GRAD_OP = "SHARD_GRAD_OP"  # ZeRO-2-like: shard grads and optimizer states
    FULL_SHARD = "FULL_SHARD"  # ZeRO-3-like: shard parameters too
    HYBRID_SHARD = "HYBRID_SHARD"  # FULL_SHARD within a node, replicate across nodes
    ZERO1 = "ZERO1"
    ZERO2 = "ZERO2"
    ZERO3 = "ZERO3"


@dataclass(frozen=True, kw_only=True)
class RoleLayout:
    """How one role runs inside its group: ``dp * tp`` equals the group's GPU count."""

    role: str
    dp: int
    tp: int = 1
    sharding: Sharding = Sharding.NO_SHARD
    micro_batch_size: int = 1
    dtype: str = "bf16"  # "bf16", "fp16" or "fp32"
    gradient_checkpointing: bool = False
    rollout_tp: int = 1  # tensor parallel size of the rollout engine (generate nodes of a policy)
    forward_micro_batch_size: int = 0  # rows per forward-only micro batch (logprob, values, score); 0: same as training
    rollout_batch_size: int = 0  # sequences one rollout engine decodes together; 0: all of its share
    # Splits of the ``dp`` ranks (manual layouts of published runs; the search keeps them 1): Ulysses
    # sequence parallelism, pipeline stages, and expert parallelism of an MoE model's experts.
    sp: int = 1
    pp: int = 1
    ep: int = 1
    shard_size: int = 0  # HYBRID_SHARD: GPUs one copy is sharded over (verl ``fsdp_size``); 0: one machine
    # Forward and update passes over padded (B, P + T) rows instead of packed sequences (RunSettings.padding).
    padding: bool = False
    # Token budgets per GPU of update / forward micro batches (RunSettings.train_/forward_tokens_per_gpu): consecutive
    # rows up to that many tokens (each at least one row) instead of micro_batch_size rows; 0: row micro batches.
    max_tokens_per_micro_batch: int = 0
    forward_max_tokens_per_micro_batch: int = 0  # 0: forward_micro_batch_size rows
    # Trainer state kept in host memory, not on the GPU (RunSettings.offload of the role, verl's param_offload /
    # optimizer_offload): parameters, gradients, optimizer states. ``offloaded`` names the parts.
    offload_params: bool = False
    offload_grads: bool = False
    offload_optimizer: bool = False
    # The role runs on this role's engine and weights, holding none of its own: a reference that is a LoRA policy's
    # base runs ref_logprob with the policy's adapter disabled. Its other fields are the host's. "": its own.
    shares_weights_with: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding", Sharding(self.sharding))
        for name in ("forward_micro_batch_size", "rollout_batch_size", "max_tokens_per_micro_batch",
                     "forward_max_tokens_per_micro_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"RoleLayout({self.role}).{name}={getattr(self, name)} must be >= 0 (0: default)")
        for name in ("dp", "tp", "micro_batch_size", "rollout_tp", "sp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"RoleLayout({self.role}).{name}={getattr(self, name)} must be >= 1")
        if self.dp % (self.sp * self.pp):
            raise ValueError(f"RoleLayout({self.role}): sp={self.sp} x pp={self.pp} must divide dp={self.dp} "
                             "(dp counts every rank of a tensor-parallel slice; sp and pp split it)")
        if self.dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"RoleLayout({self.role}).dtype={self.dtype!r} must be bf16, fp16 or fp32")

    @property
    def offloaded(self) -> frozenset[str]:
        """The parts (``params``, ``grads``, ``optimizer``) this role keeps in host memory."""
        return frozenset(part for part in OFFLOAD_PARTS if getattr(self, f"offload_{part}"))


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """One colocation group: GPUs (global ids, with the machine each sits on) and the roles sharing them."""

    gpus: tuple[int, ...]
    hosts: tuple[int, ...]  # machine index of each GPU, parallel to ``gpus``
    device: str
    roles: tuple[str, ...]
    layouts: tuple[RoleLayout, ...]
    memory_per_gpu_bytes: int
    capacity_bytes: int

    def __post_init__(self) -> None:
        if len(self.gpus) != len(self.hosts):
            raise ValueError(f"GroupPlan: {len(self.gpus)} gpus but {len(self.hosts)} hosts")
        if {layout.role for layout in self.layouts} != set(self.roles):
            raise ValueError(f"GroupPlan: layouts {[lay.role for lay in self.layouts]} != roles {list(self.roles)}")

    @property
    def size(self) -> int:
        return len(self.gpus)

    def layout(self, role: str) -> RoleLayout:
        for layout in self.layouts:
            if layout.role == role:
                return layout
        raise KeyError(f"role {role!r} is not in this group (roles: {list(self.roles)})")


@dataclass(frozen=True, kw_only=True)
class NodeEstimate:
    """When a graph node runs in the modelled schedule: from ``start_s`` to ``end_s``, for ``seconds`` of its own
    (less than the span where a streamed node waits between its chunks). ``group`` is None for driver-side nodes."""

    node: str
    group: int | None
    seconds: float
    start_s: float
    end_s: float
    role: str | None = None  # the role the node runs on (None for driver-side compute)


@dataclass(frozen=True, kw_only=True)
class SearchStats:
    method: str
    candidates: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Roles placed on GPU groups, with the cost model's estimates for one step.

    ``driver_roles`` run beside the controller and hold no GPU (reward functions). ``mode`` is the
    execution mode the step time was costed for (:class:`~hybridflow.planner.execution.ExecutionMode`):
    ``sync``, ``one_step_off`` (a detached rollout generates the next step's batch while the trainer works
    on this one) or ``async`` (the detached rollout generates continuously, at most ``max_staleness``
    policy updates ahead of the trainer), and a sync step's ``stream_chunks``. The JSON form keeps the
    mode's fields at the top level (``pipeline``, ``max_staleness``...), as plans always wrote them.
    """

    algorithm: str
    groups: tuple[GroupPlan, ...]
    driver_roles: tuple[str, ...] = ()
    nodes: tuple[NodeEstimate, ...] = ()
    step_time_s: float = 0.0
    cross_group_bytes: int = 0
    weight_sync_bytes: int = 0
    weight_sync_seconds: float = 0.0  # modelled seconds of the weight refreshes/shipments of one step
    bottleneck: str = ""
    feasible: bool = True
    problems: tuple[str, ...] = ()
    search: SearchStats | None = None
    extra: tuple[tuple[str, Any], ...] = field(default=())
    mode: ExecutionMode = field(default_factory=ExecutionMode)

    def __post_init__(self) -> None:
        if not isinstance(self.mode, ExecutionMode):
            raise TypeError(f"Plan.mode must be an ExecutionMode, got {type(self.mode).__name__}")
        placed = [role for group in self.groups for role in group.roles] + list(self.driver_roles)
        if len(placed) != len(set(placed)):
            raise ValueError(f"Plan: a role is placed twice: {placed}")
        used = [gpu for group in self.groups for gpu in group.gpus]
        if len(used) != len(set(used)):
            raise ValueError(f"Plan: groups share GPUs: {[list(g.gpus) for g in self.groups]}")

    @property
    def pipeline(self) -> str:
        """The costed mode's pipeline (``mode.pipeline``)."""
        return self.mode.pipeline

    @property
    def max_staleness(self) -> int:
        """The costed mode's staleness bound (``mode.k``)."""
        return self.mode.k

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(role for group in self.groups for role in group.roles) + self.driver_roles

    def group_index(self, role: str) -> int | None:
        """Index of the group that holds ``role``; None for a driver role."""
        for index, group in enumerate(self.groups):
            if role in group.roles:
                return index
        if role in self.driver_roles:
            return None
        raise KeyError(f"role {role!r} is not in the plan; roles: {list(self.roles)}")

    @cached_property
    def detached_rollouts(self) -> dict[str, str]:
        """``{policy: its rollout role}`` for every policy whose generate nodes run on a separate group."""
        return {role.removesuffix(ROLLOUT_SUFFIX): role for role in self.roles if role.endswith(ROLLOUT_SUFFIX)}

    def runs_on(self, role: str, *, generates: bool = False) -> str:
        """The plan role that executes ``role``'s nodes: its detached rollout for generate nodes, else itself."""
        return self.detached_rollouts.get(role, role) if generates else role

    def layout(self, role: str) -> RoleLayout:
        index = self.group_index(role)
        if index is None:
            raise KeyError(f"role {role!r} runs on the driver and has no layout")
        return self.groups[index].layout(role)

    @property
    def num_gpus(self) -> int:
        return sum(group.size for group in self.groups)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["extra"] = dict(self.extra)
        del data["mode"]
        return {**data, **self.mode.to_dict()}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        groups = tuple(
            GroupPlan(
                gpus=tuple(g["gpus"]), hosts=tuple(g["hosts"]), device=g["device"], roles=tuple(g["roles"]),
                layouts=tuple(RoleLayout(**_without_backend(lay)) for lay in g["layouts"]),
                memory_per_gpu_bytes=g["memory_per_gpu_bytes"], capacity_bytes=g["capacity_bytes"],
            )
            for g in data["groups"]
        )
        search = SearchStats(**data["search"]) if data.get("search") else None
        return cls(
            algorithm=data["algorithm"], groups=groups, driver_roles=tuple(data.get("driver_roles", ())),
            nodes=tuple(NodeEstimate(**n) for n in data.get("nodes", ())),
            step_time_s=data.get("step_time_s", 0.0), cross_group_bytes=data.get("cross_group_bytes", 0),
            weight_sync_bytes=data.get("weight_sync_bytes", 0),
            weight_sync_seconds=data.get("weight_sync_seconds", 0.0), bottleneck=data.get("bottleneck", ""),
            feasible=data.get("feasible", True), problems=tuple(data.get("problems", ())), search=search,
            # Plans written before the mode held the chunks kept them in ``extra``.
            extra=tuple(sorted((k, v) for k, v in data.get("extra", {}).items() if k != "stream_chunks")),
            mode=ExecutionMode.from_dict(data),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


def _without_backend(layout: dict[str, Any]) -> dict[str, Any]:
    # Plans written before backends became part of a run's role specs named one per layout (``RoleSpec.backend``).
    return {key: value for key, value in layout.items() if key != "backend"}


def colocated_plan(algorithm: str, gpu_roles: Sequence[str], driver_roles: Sequence[str] = (), *,
                   num_gpus: int = 1, device: str = "cpu", dtype: str = "fp32") -> Plan:
    """The trivial plan: every GPU role on one group of ``num_gpus`` GPUs of one machine (verl's default)."""
    layouts = tuple(RoleLayout(role=role, dp=num_gpus, dtype=dtype) for role in gpu_roles)
    group = GroupPlan(gpus=tuple(range(num_gpus)), hosts=(0,) * num_gpus, device=device, roles=tuple(gpu_roles),
                      layouts=layouts, memory_per_gpu_bytes=0, capacity_bytes=0)
    return Plan(algorithm=algorithm, groups=(group,), driver_roles=tuple(driver_roles))
