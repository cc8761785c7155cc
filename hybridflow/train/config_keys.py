"""Which dotted keys a config may hold, checked all at once: ours by the dataclasses' fields, TRL's and verl's
through the dialects of :data:`hybridflow.train.aliases.DIALECTS` (one engine, :mod:`hybridflow.train.dialects`);
every bad key is named in one error with its fix.

A config is first flattened to ``(dotted key, value)`` pairs (a YAML file's nesting, then the ``a.b=value``
overrides, later ones winning), so that verl's nested sections (``algorithm.adv_estimator`` beside our
``algorithm: grpo``) are keys like any other; the pairs are translated, then nested again for
:func:`hybridflow.train.config.from_mapping` to check the values' types.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.train import dialects
from hybridflow.train.aliases import DIALECTS, ConfigKeyError, closest, foreign_leaf, lookup


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The fields' types (a ``ClassVar`` is the class's own, not a key)."""
    return {name: hint for name, hint in typing.get_type_hints(cls).items()
            if typing.get_origin(hint) is not typing.ClassVar}


def _section(hint: Any) -> type | None:
    """The dataclass a field's type holds (``X`` of ``X | None``), else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = arms[0] if len(arms) == 1 else None
    return hint if dataclasses.is_dataclass(hint) and isinstance(hint, type) else None


def _entries(hint: Any) -> type | None:
    """The dataclass of a ``dict[str, X]`` field's values (``roles``), else None."""
    if typing.get_origin(hint) is dict and len(typing.get_args(hint)) == 2:
        return _section(typing.get_args(hint)[1])
    return None


def _free_form(hint: Any) -> bool:
    """A mapping field whose keys are not ours to check (``algorithm.options``, ``roles.<name>.options``)."""
    return hint is Any or any(a is dict or typing.get_origin(a) is dict for a in (hint, *typing.get_args(hint)))


def walk(root: type, dotted: str) -> tuple[str, str, type | None]:
    """How ``dotted`` sits in ``root``'s schema: ``"field"`` (a field of ours), ``"free"`` (a free-form mapping
    field or a key inside one), ``"section"`` (one of our sections itself), else ``"unknown"``, with the deepest
    section of ours it enters (``prefix``, ending with a dot) and that section's class."""
    cls: type | None = root
    prefix = ""
    parts = dotted.split(".")
    index = 0
    while index < len(parts):
        assert cls is not None
        hints = _hints(cls)
        part = parts[index]
        if part not in hints:
            return "unknown", prefix, cls
        hint, prefix = hints[part], f"{prefix}{part}."
        index += 1
        inner, entries = _section(hint), _entries(hint)
        if entries is not None:
            if index == len(parts):
                return "section", prefix, entries
            prefix, index, inner = f"{prefix}{parts[index]}.", index + 1, entries
        if inner is None:
            if _free_form(hint):
                return "free", prefix, None
            if index == len(parts):
                return "field", prefix, None
            return "unknown", prefix[: -len(part) - 1], cls  # a scalar field given sub-keys
        if index == len(parts):
            return "section", prefix, inner
        cls = inner
    return "section", prefix, cls


def flatten(root: type, data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``data``'s leaves as dotted pairs; a mapping is a leaf where our schema has a free-form field there."""
    pairs: list[tuple[str, Any]] = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        kind = walk(root, dotted)[0] if isinstance(value, Mapping) and value else "free"
        if kind != "free" and not (kind == "unknown" and foreign_leaf(dotted)):
            pairs += flatten(root, value, dotted + ".")
        else:
            pairs.append((dotted, value))
    return pairs


def nest(pairs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """The nested mapping of dotted pairs (a later pair wins; a mapping value is copied, then merged into)."""
    data: dict[str, Any] = {}
    for dotted, value in pairs:
        keys = dotted.split(".")
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise TypeError(f"override {dotted}: {key!r} is not a section")
        node[keys[-1]] = _copy(value)
    return data


def _copy(value: Any) -> Any:
    return {k: _copy(v) for k, v in value.items()} if isinstance(value, Mapping) else value


def checked(root: type, pairs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """``pairs`` translated to our keys and nested; raises one :class:`ConfigKeyError` naming every key that is
    neither ours nor a TRL/verl key we translate, and every refused or clashing one."""
    problems: list[str] = []
    native = functools.partial(_is_native, root)
    unknown = functools.partial(_unknown, root)
    translated = dialects.translate(shorthand(root, pairs), DIALECTS, native, problems, unknown)
    if problems:
        raise ConfigKeyError(problems)
    return nest(translated)


def shorthand(root: type, pairs: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A plain value given for a section whose class names a ``SHORT`` field is that field's value
    (``algorithm: grpo`` is ``algorithm.name: grpo``, ``pipeline: async`` is ``pipeline.mode: async``)."""
    spelled: list[tuple[str, Any]] = []
    for dotted, value in pairs:
        kind, _, cls = walk(root, dotted)
        short = getattr(cls, "SHORT", None) if kind == "section" and not isinstance(value, Mapping) else None
        spelled.append((f"{dotted}.{short}", value) if short else (dotted, value))
    return spelled


def _is_native(root: type, dotted: str) -> bool:
    return walk(root, dotted)[0] != "unknown"


def _unknown(root: type, dotted: str) -> str:
    _, prefix, cls = walk(root, dotted)
    assert cls is not None
    valid = sorted(f.name for f in dataclasses.fields(cls))
    head = dotted.removeprefix(prefix).split(".")[0]
    if head in valid and head != dotted.removeprefix(prefix):
        return f"config key {dotted!r}: {prefix + head!r} is not a section (it takes a value)"
    home = getattr(cls, "STATED_BY_THE_RUN", {}).get(dotted.removeprefix(prefix))
    if home:
        return f"unknown config key {dotted!r} (the run states it: {home}); valid keys here: {valid}"
    suggestions = closest(dotted, [prefix + name for name in valid] + _foreign_names())
    last = dotted.rsplit(".", 1)[-1]
    suggestions += [key for key in all_keys(root) if key.rsplit(".", 1)[-1] == last and key not in suggestions]
    found = lookup(last) if "." in dotted else None
    if found is not None and found[1].target:
        suggestions.append(found[1].target)  # TRL's top-level name given inside a section
    hint = f"; did you mean {' or '.join(repr(s) for s in suggestions[:3])}?" if suggestions else ""
    owner = next((d for d in DIALECTS if dotted.split(".")[0] in d.sections()), None)
    if not prefix and "." in dotted and owner is not None:
        return f"unknown config key {dotted!r}{hint} (not a key of {owner.title} either)"
    if not prefix and suggestions:
        return f"unknown config key {dotted!r}{hint}"
    return f"unknown config key {dotted!r}{hint} (valid keys here: {valid})"


@functools.cache
def _foreign_names() -> list[str]:
    return [name for dialect in DIALECTS for name in dialect.names()]


def all_keys(root: type, prefix: str = "") -> list[str]:
    """Every dotted key of ours (``roles.<name>.*`` as ``roles.actor.*``)."""
    keys = []
    for name, hint in _hints(root).items():
        inner, entries = _section(hint), _entries(hint)
        if inner is not None:
            keys += all_keys(inner, f"{prefix}{name}.")
        elif entries is not None:
            keys += all_keys(entries, f"{prefix}{name}.actor.")
        else:
            keys.append(prefix + name)
    return keys
