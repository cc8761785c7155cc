"""``DataParallelConfig``: the verl-tutorial mapping style, validated field by field.

Users arriving from the well-known device-mapping tutorials write explicit device meshes per role.
This config keeps their parameter names and turns them into a manual mapping the planner checks
before anything launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from hybridflow.planner.plan import rollout_role

ROLES = ("actor", "critic", "reward", "reference")
ROLLOUT = rollout_role("actor")  # the plan role of the actor's rollout on GPUs of its own
STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
_MESH = "{}_model_device_mesh"
_MICRO = "{}_model_micro_batch_size"
_CONCURRENT = "{}_model_max_concurrent_requests"
# Without ``cluster`` the cluster is whole 8-GPU machines covering the highest GPU id; an id that would
# make it larger than this is a typo (10**9), not a cluster: such a size must be declared.
MAX_IMPLICIT_GPUS = 1024


class ConfigError(ValueError):
    """A bad ``DataParallelConfig`` value; ``field`` names the parameter at fault."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"DataParallelConfig.{field_name}: {message}")
        self.field = field_name


@dataclass
class DataParallelConfig:
    """Where each role runs and how it is parallelised.

    Roles given the same mesh are colocated (they share worker processes); meshes that partially
    overlap are an error. As with verl's FSDP workers, every role trains or infers data parallel
    over its whole mesh, sharded by ``fsdp_sharding_strategy``; ``data_parallel_size`` is the
    rollout engine's DP degree, the rest of the actor's mesh (``len(mesh) // data_parallel_size``)
    its tensor parallelism. ``None`` lets the planner choose the rollout's split.
    ``rollout_device_mesh`` gives the actor's rollout GPUs of its own (as OpenRLHF's separate vLLM
    engines); the actor's weights are shipped there after every update. Then ``data_parallel_size``
    splits that mesh instead of the actor's. ``cluster`` is a
    planner spec such as ``"8xA100-80G"``; by default whole 8-GPU A100
    machines covering the highest GPU id. Fields may be set after construction and are checked
    again when set.
    """

    actor_model_device_mesh: list[int] = field(default_factory=lambda: [0])
    critic_model_device_mesh: list[int] | None = None
    reward_model_device_mesh: list[int] | None = None
    reference_model_device_mesh: list[int] | None = None
    rollout_device_mesh: list[int] | None = None
    data_parallel_size: int | None = None
    fsdp_sharding_strategy: str = "FULL_SHARD"
    actor_model_micro_batch_size: int | None = None
    critic_model_micro_batch_size: int | None = None
    reward_model_micro_batch_size: int | None = None
    reference_model_micro_batch_size: int | None = None
    actor_model_max_concurrent_requests: int | None = None
    critic_model_max_concurrent_requests: int | None = None
    reward_model_max_concurrent_requests: int | None = None
    reference_model_max_concurrent_requests: int | None = None
    enable_reward_cache: bool = False
    reward_cache_size: int = 10000
    cluster: str | None = None

    def __post_init__(self) -> None:
        self._ready = True
        for item in fields(self):
            _check_field(item.name, getattr(self, item.name))
        self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        if name.endswith("_device_mesh") and isinstance(value, list | tuple):
            value = list(value)  # our own copy: a caller changing its list later must not change the mapping
        if getattr(self, "_ready", False):
            if name not in {item.name for item in fields(self)}:
                raise ConfigError(name, f"unknown parameter; valid ones: {[f.name for f in fields(self)]}")
            _check_field(name, value)
            previous = getattr(self, name)
            object.__setattr__(self, name, value)
            try:
                self.validate()
            except ConfigError:
                object.__setattr__(self, name, previous)
                raise
            return
        object.__setattr__(self, name, value)

    def mesh(self, role: str) -> list[int] | None:
        mesh: list[int] | None = getattr(self, _MESH.format(role))
        return list(mesh) if mesh is not None else None

    def micro_batch_size(self, role: str) -> int | None:
        value: int | None = getattr(self, _MICRO.format(role))
        return value

    def max_concurrent_requests(self, role: str) -> int | None:
        value: int | None = getattr(self, _CONCURRENT.format(role))
        return value

    @property
    def meshes(self) -> dict[str, list[int]]:
        """Role -> GPU ids, for the roles that have a mesh."""
        return {role: mesh for role in ROLES if (mesh := self.mesh(role)) is not None}

    @property
    def placed_meshes(self) -> dict[str, list[int]]:
        """:attr:`meshes` plus the rollout's own mesh (as ``actor:rollout``) when one is given."""
        rollout = {ROLLOUT: list(self.rollout_device_mesh)} if self.rollout_device_mesh is not None else {}
        return {**self.meshes, **rollout}

    @property
    def num_gpus(self) -> int:
        """GPUs in the cluster: from ``cluster`` or whole 8-GPU machines covering the highest id."""
        if self.cluster is not None:
            from hybridflow.planner.cluster import Cluster

            return int(Cluster.parse(self.cluster).num_gpus)
        highest = max(gpu for mesh in self.placed_meshes.values() for gpu in mesh)
        return (highest // 8 + 1) * 8

    @property
    def unused_gpus(self) -> list[int]:
        used = {gpu for mesh in self.placed_meshes.values() for gpu in mesh}
        return [gpu for gpu in range(self.num_gpus) if gpu not in used]

    def colocation_groups(self) -> list[tuple[list[int], list[str]]]:
        """Distinct meshes in order of first use, each with the roles that share it."""
        groups: dict[tuple[int, ...], list[str]] = {}
        for role, mesh in self.placed_meshes.items():
            groups.setdefault(tuple(sorted(mesh)), []).append(role)
        return [(list(mesh), roles) for mesh, roles in groups.items()]

    def validate(self) -> None:
        """Cross-field checks: meshes colocate or are disjoint, DP divides every mesh, ids exist."""
        groups = self.colocation_groups()
        for i, (mesh_a, roles_a) in enumerate(groups):
            for mesh_b, roles_b in groups[i + 1:]:
                shared = sorted(set(mesh_a) & set(mesh_b))
                if shared:
                    raise ConfigError(
                        _mesh_field(roles_b[0]),
                        f"{mesh_b} partially overlaps {_mesh_field(roles_a[0])}={mesh_a} on GPUs {shared}; "
                        "roles either share exactly the same mesh (colocated) or use disjoint GPUs",
                    )
        if self.data_parallel_size is not None:
            for role, mesh in self.placed_meshes.items():
                if len(mesh) % self.data_parallel_size:
                    raise ConfigError(
                        "data_parallel_size",
                        f"{self.data_parallel_size} does not divide {_mesh_field(role)} of {len(mesh)} GPUs; "
                        "pick a divisor of every mesh size (the rest of the rollout's mesh is its tensor "
                        "parallelism)",
                    )
        if self.cluster is None:
            highest = max(gpu for mesh in self.placed_meshes.values() for gpu in mesh)
            if highest >= MAX_IMPLICIT_GPUS:
                role = next(r for r, mesh in self.placed_meshes.items() if highest in mesh)
                raise ConfigError(_mesh_field(role), f"GPU id {highest} implies a cluster of more than "
                                  f"{MAX_IMPLICIT_GPUS} GPUs; declare the cluster (cluster='NxDEVICE', e.g. "
                                  "'16xA100-80G') or use ids within it")
        total = self.num_gpus
        for role, mesh in self.placed_meshes.items():
            beyond = [gpu for gpu in mesh if gpu >= total]
            if beyond:
                raise ConfigError(
                    _mesh_field(role), f"GPU ids {beyond} are out of range for a {total}-GPU cluster ({self.cluster})"
                )


def _mesh_field(role: str) -> str:
    return "rollout_device_mesh" if role == ROLLOUT else _MESH.format(role)


def _check_field(name: str, value: Any) -> None:
    if name.endswith("_device_mesh"):
        _check_mesh(name, value)
    elif name == "fsdp_sharding_strategy":
        if value not in STRATEGIES:
            raise ConfigError(name, f"unknown strategy {value!r}; use one of {list(STRATEGIES)}")
    elif name in ("enable_reward_cache",):
        if not isinstance(value, bool):
            raise ConfigError(name, f"must be True or False, got {value!r}")
    elif name == "cluster":
        if value is not None and not isinstance(value, str):
            raise ConfigError(name, f"must be a cluster spec such as '8xA100-80G', got {value!r}")
    elif (value is not None or name == "reward_cache_size") and not _positive_int(value):
        optional = "" if name == "reward_cache_size" else " or None"
        raise ConfigError(name, f"must be a positive integer{optional}, got {value!r}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_mesh(name: str, mesh: Sequence[int] | None) -> None:
    if mesh is None:
        if name == _MESH.format("actor"):
            raise ConfigError(name, "the actor needs a device mesh, e.g. [0, 1, 2, 3]")
        return
    if not isinstance(mesh, list | tuple) or not mesh:
        raise ConfigError(name, f"must be a non-empty list of GPU ids, got {mesh!r}")
    bad = [gpu for gpu in mesh if not isinstance(gpu, int) or isinstance(gpu, bool) or gpu < 0]
    if bad:
        raise ConfigError(name, f"GPU ids must be non-negative integers; bad: {bad}")
    if len(set(mesh)) != len(mesh):
        raise ConfigError(name, f"lists a GPU twice: {list(mesh)}")
