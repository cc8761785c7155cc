"""The schema engine: a frozen dataclass tree built from a nested mapping, every key and value type checked.

Errors name the dotted config key (``config key 'pipeline.max_staleness'=...``); a section's own
``__post_init__`` checks its ranges and raises :class:`~hybridflow.fields.FieldError` naming its own field, which
is spelled here, once, as the key it sits at; :mod:`hybridflow.train.config` composes the sections.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

from hybridflow.fields import FieldError
from hybridflow.train.foreign_keys import ConfigKeyError

T = typing.TypeVar("T")


def from_mapping(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, checking every key and value type against its fields."""
    if not isinstance(data, Mapping):
        raise TypeError(f"config key {prefix.rstrip('.') or '<root>'!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        home = getattr(cls, "STATED_BY_THE_RUN", {}).get(unknown[0])
        hint = f" (the run states it: {home})" if home else ""
        raise KeyError(f"unknown config key {prefix + unknown[0]!r}{hint}; valid keys here: {sorted(known)}")
    values = {name: _check(hints[name], _over_field_default(cls, name, hints[name], value), prefix + name)
              for name, value in data.items()}
    try:
        return cls(**values)
    except FieldError as err:  # the section's own field, spelled as the key it sits at
        raise ValueError(config_key_message(err.at(prefix))) from err


def config_key_message(err: FieldError) -> str:
    """A lower layer's refusal of a field as the config error a user reads: ``config key 'data.val_fraction'=1.5
    must be in [0, 1)``; ``err.field`` is already the dotted key (:meth:`FieldError.at`)."""
    return "config key " + err.text(err.field, quote=True)


@contextmanager
def keys_at(prefix: str) -> Iterator[None]:
    """Spell a lower layer's :class:`FieldError` raised in this block as the config key under ``prefix``
    (``data.``): the code that hands a section's values to the data layer names the user's keys, once."""
    try:
        yield
    except FieldError as err:
        message = config_key_message(err.at(prefix))
        raise (ConfigKeyError([message]) if isinstance(err, KeyError) else ValueError(message)) from err


def _over_field_default(cls: type, name: str, hint: Any, value: Any) -> Any:
    """A partial section over the field's own default: ``actor: {grad_clip: 1.0}`` keeps the actor's default
    lr (1e-3), not the section class's (``OptimSpec``: 1e-4). Only what the field's default changes is carried."""
    if not (dataclasses.is_dataclass(hint) and isinstance(hint, type) and isinstance(value, Mapping)):
        return value
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default_factory is dataclasses.MISSING:
        return value
    try:
        base, own = field.default_factory(), hint()
    except TypeError:  # a section without defaults for every field: nothing to carry
        return value
    changed = {f.name: getattr(base, f.name) for f in dataclasses.fields(hint)
               if f.init and getattr(base, f.name) != getattr(own, f.name)}
    return {**changed, **value}


def _check(hint: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        try:
            return from_mapping(hint, value, key + ".")
        except ValueError as err:  # a section's own check names its field, not where the section sits
            if f"'{key}" in str(err) or "config key" in str(err):
                raise
            raise ValueError(f"config key {key!r}: {err}") from err
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        for arm in arms[1:]:  # ``str | list[str]``: the value may match a later arm
            if typing.get_origin(arm) is list and isinstance(value, list):
                return _check(arm, value, key)
        if len(arms) == 1:
            return _check(arms[0], value, key)
        refusals = []
        for arm in arms:  # ``int | Literal["auto"]``: the first arm that takes the value
            try:
                return _check(arm, value, key)
            except (TypeError, ValueError) as err:
                refusals.append(str(err).removeprefix(f"config key {key!r}={value!r} "))
        raise TypeError(f"config key {key!r}={value!r}: " + "; or ".join(refusals))
    if origin is list:
        if not isinstance(value, list):
            raise TypeError(f"config key {key!r}={value!r} must be a list")
        return [_check(args[0], item, f"{key}[{i}]") for i, item in enumerate(value)] if args else value
    if origin is Literal:
        if value not in args:
            raise ValueError(f"config key {key!r}={value!r} must be one of {list(args)}")
        return value
    if origin is tuple and args and args[-1] is not Ellipsis:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise TypeError(f"config key {key!r}={value!r} must be a list of {len(args)} values")
        return tuple(_check(arg, item, f"{key}[{i}]") for i, (arg, item) in enumerate(zip(args, value, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"config key {key!r} must be a mapping, got {type(value).__name__}")
        item = args[1] if len(args) == 2 else Any
        if dataclasses.is_dataclass(item) and isinstance(item, type):
            return {name: from_mapping(item, entry, f"{key}.{name}.") for name, entry in value.items()}
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # PyYAML follows YAML 1.1, which reads ``1e-3`` (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise TypeError(f"config key {key!r}={value!r} must be a {hint.__name__}, got {type(value).__name__}")
    if hint in (int, float):
        _check_number(value, key)
    return value


INT64_MAX = 2**63 - 1  # torch and numpy hold seeds and counts as int64


def _check_number(value: int | float, key: str) -> None:
    """A numeric config value is finite and fits the int64 every count and seed becomes; ranges are checked
    beside their meaning (``__post_init__``, :mod:`hybridflow.train.preflight`)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"config key {key!r}={value!r} must be a finite number")
    if isinstance(value, int) and not -INT64_MAX <= value <= INT64_MAX:
        raise ValueError(f"config key {key!r}={value} does not fit a 64-bit integer (at most {INT64_MAX})")
