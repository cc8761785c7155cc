"""From a data row to an environment: the :class:`EnvRecord` a rollout worker resets an environment from.

A rollout worker receives each row's ``ground_truth``: a plain ``str``, or a
:class:`hybridflow.data.records.GroundTruth` carrying the row's prompt and other columns. verl datasets keep
per-row tool and interaction settings in ``extra_info["tools_kwargs"]`` and ``extra_info["interaction_kwargs"]``
(``verl/utils/dataset/rl_dataset.py``); :func:`env_record` lifts them onto the record, and
:func:`environment_for` lets a row pick its environment by ``interaction_kwargs["name"]`` (verl) or an
``environment`` column (TRL's multi-environment routing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from hybridflow.agents.protocols import Environment, EnvRecord, Message
from hybridflow.registry import ENVIRONMENTS, RegistryError


@runtime_checkable
class RowContext(Protocol):
    """What a :class:`hybridflow.data.records.GroundTruth` carries besides its text. Matched by shape, because
    importing ``hybridflow.data`` imports torch and this package must not."""

    extra_info: dict[str, Any] | None
    columns: dict[str, Any]
    prompt: str | list[dict[str, str]] | None


TOOLS_KWARGS, INTERACTION_KWARGS = "tools_kwargs", "interaction_kwargs"
ENVIRONMENT_COLUMN = "environment"


def env_record(index: int, ground_truth: str, prompt: str | list[Message] | None = None) -> EnvRecord:
    """The record row ``index`` resets its environment from.

    From a :class:`GroundTruth`: its ``extra_info``, the verl extras found in ``extra_info`` (or, as verl's
    dataset also exposes them, in top-level columns) and, unless ``prompt`` is given, its prompt. The record's
    ``ground_truth`` stays that :class:`GroundTruth`, so adapters can still read the row's other columns.
    A plain ``str`` gives a record with empty extras.
    """
    if not isinstance(ground_truth, RowContext):
        return EnvRecord(index=index, prompt="" if prompt is None else prompt, ground_truth=str(ground_truth))
    extra_info = dict(ground_truth.extra_info or {})
    if prompt is None:
        prompt = list(ground_truth.prompt) if isinstance(ground_truth.prompt, list) else ground_truth.prompt or ""
    return EnvRecord(index=index, prompt=prompt, ground_truth=ground_truth, extra_info=extra_info,
                     tools_kwargs=_verl_extra(TOOLS_KWARGS, index, extra_info, ground_truth.columns),
                     interaction_kwargs=_verl_extra(INTERACTION_KWARGS, index, extra_info, ground_truth.columns))


def _verl_extra(key: str, index: int, extra_info: Mapping[str, Any], columns: Mapping[str, Any]) -> dict[str, Any]:
    # verl reads extra_info first and overwrites the top-level column with it; do the same.
    value = extra_info.get(key, columns.get(key))
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"row {index}: {key} is a {type(value).__name__} ({value!r}); verl-style {key} must be a "
                        f"mapping (extra_info[{key!r}] = {{...}})")
    return dict(value)


def row_columns(record: EnvRecord) -> dict[str, Any]:
    """The row's other columns (``data_source``, ``extra_info``, any column a reward function names), when the
    record came from a :class:`GroundTruth`; else just a non-empty ``extra_info``."""
    if isinstance(record.ground_truth, RowContext):
        return dict(record.ground_truth.columns)
    return {"extra_info": dict(record.extra_info)} if record.extra_info else {}


def environment_name(record: EnvRecord, default: str) -> str:
    """The environment row ``record`` asks for: ``interaction_kwargs["name"]`` (verl), else an ``environment``
    column (TRL), else ``default``. A row may only name a registered environment (never a file to import)."""
    name = record.interaction_kwargs.get("name", row_columns(record).get(ENVIRONMENT_COLUMN))
    if name is None or name == default:
        return default
    if not isinstance(name, str) or name not in ENVIRONMENTS:
        raise RegistryError(f"row {record.index} asks for environment {name!r} (interaction_kwargs['name'] or the "
                            f"{ENVIRONMENT_COLUMN!r} column); valid names: {ENVIRONMENTS.names()}")
    return name


def environment_for(record: EnvRecord, default: str, options: Mapping[str, Any] | None = None, *,
                    options_by_name: Mapping[str, Mapping[str, Any]] | None = None) -> Environment:
    """A fresh environment for ``record``: the one it names (see :func:`environment_name`), else ``default``.

    ``options`` configure ``default``; a row that names another environment gets
    ``options_by_name[name]`` (none if absent), since options meant for one environment rarely fit another.
    """
    name = environment_name(record, default)
    chosen = options if name == default else (options_by_name or {}).get(name)
    environment: Environment = ENVIRONMENTS.get(name)(**dict(chosen or {}))
    return environment
