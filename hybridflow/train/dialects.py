"""The one engine that reads every dialect: a :class:`Dialect` is a name and a table of rows (source key ->
:class:`~hybridflow.train.foreign_keys.ForeignKey`), with how its keys are matched; :func:`translate` turns a
config's foreign keys into ours through any sequence of them. Nothing here knows TRL or verl: their tables
(:mod:`hybridflow.train.dialect_trl`, :mod:`hybridflow.train.dialect_verl`) are data, so a new key is one row
and a new dialect one :class:`Dialect` added to :data:`hybridflow.train.aliases.DIALECTS`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal

from hybridflow.train.foreign_keys import KINDS, ForeignKey, Refused

Match = Literal["exact", "pattern"]


@dataclass(frozen=True, eq=False)
class Dialect:
    """A foreign config's keys as rows. ``match``: ``"exact"`` finds a key only under its own name (TRL's
    top-level fields); ``"pattern"`` also by a dotted suffix naming one row (``rollout.n``) or under the most
    specific ``**`` row it falls in (``global_profiler.**``, ``**._target_``). ``title`` names the dialect in
    messages; ``undocumented`` rows are left out of docs/migrating.md's table. Each row is stamped with
    ``name`` as its source, so the rows themselves never repeat it."""

    name: str
    title: str
    rows: Mapping[str, ForeignKey]
    match: Match = "exact"
    undocumented: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.match not in ("exact", "pattern"):
            raise ValueError(f"dialect {self.name}: match is 'exact' or 'pattern', not {self.match!r}")
        if self.match == "exact" and any("**" in key for key in self.rows):
            raise ValueError(f"dialect {self.name}: '**' rows need match='pattern'")
        stamped = {key: replace(row, source=self.name) for key, row in self.rows.items()}
        object.__setattr__(self, "rows", MappingProxyType(stamped))

    def find(self, key: str) -> tuple[str, ForeignKey] | None:
        """``(the full source key, its row)`` for ``key``, or None when the dialect has no such key."""
        if key in self.rows and "**" not in key:
            return key, self.rows[key]
        if self.match == "exact":
            return None
        suffixed = [name for name in self.names() if name.endswith("." + key)]
        if len(suffixed) == 1:
            return suffixed[0], self.rows[suffixed[0]]
        patterns = [pattern for pattern in self.rows if "**" in pattern and _matches(pattern, key)]
        return (key, self.rows[max(patterns, key=len)]) if patterns else None

    def leaf(self, key: str) -> bool:
        """Whether ``key`` is one row of its own (not a ``**`` pattern): its value is read whole even when it is a
        mapping (TRL's ``model_init_kwargs``, verl's ``rollout.engine_kwargs.vllm``)."""
        found = self.find(key)
        return found is not None and found[0] in self.rows and "**" not in found[0]

    def names(self) -> list[str]:
        """The source keys spelled out (``**`` patterns left out), as typo suggestions can name them."""
        return [key for key in self.rows if "**" not in key]

    def sections(self) -> frozenset[str]:
        """The first parts of the dialect's dotted keys (verl's ``trainer``, ``actor_rollout_ref``...)."""
        return frozenset(key.split(".")[0] for key in self.names() if "." in key)

    def documented(self) -> list[tuple[str, ForeignKey]]:
        """The rows docs/migrating.md lists, in the table's order."""
        return [(key, row) for key, row in self.rows.items() if key not in self.undocumented]

    def counts(self) -> dict[str, int]:
        """How many rows are of each kind (renamed, translated, accepted, ... refused)."""
        counted = Counter(row.kind for row in self.rows.values())
        return {kind: counted[kind] for kind in KINDS}


def _matches(pattern: str, key: str) -> bool:
    if pattern.startswith("**."):
        return key.endswith(pattern[2:]) or key == pattern[3:]
    if pattern.endswith(".**"):
        return key.startswith(pattern[:-2])
    return pattern == key


def find(dialects: Sequence[Dialect], key: str) -> tuple[str, ForeignKey] | None:
    """The first of ``dialects`` that knows ``key``: ``(its full name there, the row)``."""
    for dialect in dialects:
        found = dialect.find(key)
        if found is not None:
            return found
    return None


def leaf(dialects: Sequence[Dialect], key: str) -> bool:
    """Whether ``key`` is a row of its own in the first of ``dialects`` that knows it (:meth:`Dialect.leaf`)."""
    owner = next((dialect for dialect in dialects if dialect.find(key) is not None), None)
    return owner is not None and owner.leaf(key)


def translate(pairs: list[tuple[str, Any]], dialects: Sequence[Dialect], native: Callable[[str], bool],
              problems: list[str], unknown: Callable[[str], str]) -> list[tuple[str, Any]]:
    """``pairs`` (dotted key, value; later ones win) with every foreign key translated to ours through
    ``dialects``. Each key that is neither ours (``native``) nor a row of a dialect, and each refusal or clash,
    appends a line to ``problems`` (``unknown(key)`` words an unknown key) instead of raising, so one pass names
    them all. Rows marked ``first`` (those that pick the algorithm) run before the rest, which read the
    algorithm from the context."""
    ours = [(k, v) for k, v in pairs if native(k)]
    given = dict(ours)
    foreign: list[tuple[str, str, ForeignKey, Any]] = []
    for key, value in pairs:
        if native(key):
            continue
        found = find(dialects, key)
        if found is None:
            problems.append(unknown(key))
        else:
            foreign.append((key, found[0], found[1], value))
    context: dict[str, Any] = {full: value for _, full, _, value in foreign}
    context.update(given)
    produced: dict[str, tuple[str, Any]] = {}
    for key, _full, row, value in sorted(foreign, key=lambda item: not item[2].first):
        context["algorithm"] = given.get("algorithm.name", produced.get("algorithm.name", ("", "grpo"))[1])
        try:
            result = row.resolve(key, value, context)
        except Refused as err:
            problems.append(f"{err} (docs/migrating.md)")
            continue
        for target, new in result.items():
            clash = _clash(key, row, target, new, given, produced)
            if clash:
                problems.append(clash)
            else:
                produced[target] = (key, new)
    return ours + [(target, value) for target, (_, value) in produced.items()]


_ABSENT = object()


def _given(given: Mapping[str, Any], target: str) -> Any:
    """``target``'s value among our keys: given itself, or inside a mapping given whole (``algorithm.options``)."""
    if target in given:
        return given[target]
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        node = given.get(".".join(parts[:cut]), _ABSENT)
        for part in parts[cut:]:
            node = node.get(part, _ABSENT) if isinstance(node, Mapping) else _ABSENT
        if node is not _ABSENT:
            return node
    return _ABSENT


def _clash(key: str, row: ForeignKey, target: str, value: Any, given: Mapping[str, Any],
           produced: Mapping[str, tuple[str, Any]]) -> str:
    ours = _given(given, target)
    if ours is not _ABSENT and ours != value:
        return (f"config keys {key!r} ({row.source}) and {target!r} are the same setting; keep {target!r} "
                f"(they say {value!r} and {ours!r})")
    if target in produced and produced[target][1] != value:
        other = produced[target][0]
        return f"config keys {other!r} and {key!r} both set {target!r} ({produced[target][1]!r} vs {value!r}): keep one"
    return ""
