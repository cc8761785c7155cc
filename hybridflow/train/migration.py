"""Keys of the flat config (before the sections) and their homes now: accepted with a ``FutureWarning``.

``pipeline: async`` was a top-level key beside ``max_staleness``, ``checkpoint_every``, ``trackers``...; each
now lives in the section of the component that reads it (docs/configuration.md). A config written the old way
still loads: every old key is moved to its new home by :data:`MOVED`, once, with one warning naming both
spellings; docs/migrating.md says so. Nothing else in hybridflow reads an old spelling.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from hybridflow.runtime.protocols import OptimSpec

# old top-level key -> its dotted home (a key below an old section moves with it: liveness.x -> executor.liveness.x)
MOVED: dict[str, str] = {
    "ray_address": "executor.ray_address", "liveness": "executor.liveness",
    "num_gpus": "placement.num_gpus", "cluster": "placement.cluster",
    "meshes": "placement.meshes", "plan_file": "placement.plan_file", "separate_rollout": "placement.separate_rollout",
    "calibration": "placement.calibration", "host_cores": "placement.host_cores",
    "planner_settings": "placement.planner",
    "max_staleness": "pipeline.max_staleness",
    "partial_rollout": "pipeline.partial_rollout", "segment_tokens": "pipeline.segment_tokens",
    "stream_chunks": "pipeline.stream_chunks", "padding": "pipeline.padding",
    "skip_known_passes": "pipeline.skip_known_passes",
    "checkpoint_every": "checkpoint.every", "keep_checkpoints": "checkpoint.keep",
    "sigterm_grace_s": "checkpoint.sigterm_grace_s",
    "validation_every": "validation.every", "validation_samples": "validation.samples",
    "validate_before_train": "validation.before_train",
    "trackers": "logging.trackers", "progress": "logging.progress", "plot": "logging.plot",
    "console_metrics_every": "logging.console_every",
    "reward_cache_size": "data.reward_cache_size",
    "algorithm_options": "algorithm.options", "actor": "optim.actor", "critic": "optim.critic",
}
# Old sections whose name a dialect's section shares (verl's ``critic.optim.lr``): only our own fields below them
# (an :class:`~hybridflow.runtime.protocols.OptimSpec` field or ``micro_batch_size``) are old keys.
_SHARED = {"actor", "critic"}
_OPTIM_FIELDS = frozenset(f.name for f in dataclasses.fields(OptimSpec)) | {"micro_batch_size"}
RETIRED: dict[str, str] = {
    "tensorboard": "list it in 'logging.trackers' (default [tensorboard]), or set logging.trackers=[] for none",
}


def moved_key(dotted: str, value: Any) -> str | None:
    """The new spelling of an old key (``max_staleness`` -> ``pipeline.max_staleness``), else None."""
    head, _, rest = dotted.partition(".")
    if head not in MOVED or (head in _SHARED and rest.partition(".")[0] not in _OPTIM_FIELDS):
        return None
    return MOVED[head] + (f".{rest}" if rest else "")


def migrate(pairs: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``pairs`` with every old key moved to its home, warning once per key; a retired key is refused."""
    moved: list[tuple[str, Any]] = []
    for dotted, value in pairs:
        head = dotted.partition(".")[0]
        if head in RETIRED:
            raise ValueError(f"config key {head!r} is retired: {RETIRED[head]}")
        new = moved_key(dotted, value)
        if new is not None:
            warnings.warn(f"config key {dotted!r} is now {new!r} (docs/migrating.md); the old spelling will be "
                          "refused in a later release", FutureWarning, stacklevel=3)
            dotted = new
        moved.append((dotted, value))
    return moved
