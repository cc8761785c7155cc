"""verl's and TRL's config names: each one is renamed to ours, accepted as a no-op, or refused saying why.

A config written with TRL 1.16's ``GRPOConfig`` fields (``num_generations``, ``beta``, ``loss_type``...) or verl
0.9's trainer keys (``algorithm.adv_estimator``, ``actor_rollout_ref.rollout.n``, ``trainer.save_freq``...) loads
here: a key whose meaning is ours is **renamed** (its value carried over, translated where the spelling of a
value differs), a key that changes nothing here is **accepted** (at every value, or only at the values that
leave the run as ours is: ``use_dynamic_bsz: false``), and any other is **refused** with what it means there
and what to write instead. The tables are :data:`hybridflow.train.dialect_trl.TRL` and
:data:`hybridflow.train.dialect_verl.VERL`; docs/migrating.md's table is generated from them
(``python -m hybridflow.train.aliases --write docs/migrating.md``) and a test keeps the two equal.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Context = Mapping[str, Any]  # every key the config gives (dotted, as written) and "algorithm" as it will run
Convert = Callable[[Any, Context], dict[str, Any]]


class Refused(ValueError):
    """A foreign key (or one of its values) with no meaning here; the message says why and what to write."""


class ConfigKeyError(KeyError):
    """Every bad key of a config at once, one line each (a ``KeyError`` whose text is not quoted)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems

    def __str__(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0]
        return f"{len(self.problems)} config keys need a fix:\n" + "\n".join(f"  - {p}" for p in self.problems)


ANY = object()  # ``harmless=ANY``: no value of the key changes anything here
OFF: tuple[Any, ...] = (None, False, 0, 0.0, "", (), [], {})  # a feature we lack, switched off: harmless


@dataclass(frozen=True, kw_only=True)
class ForeignKey:
    """One TRL or verl key. ``target``: our key, the value kept; ``convert``: the value as our keys (it may
    raise :class:`Refused` for a value with no meaning here); ``harmless``: values that change nothing here
    (accepted and dropped; :data:`ANY` for all); otherwise refused. ``meaning`` is what it does there, ``why``
    the reason it is accepted or refused (with what to write instead)."""

    source: str
    meaning: str
    target: str | None = None
    convert: Convert | None = None
    harmless: Any = None
    why: str = ""
    first: bool = False  # decides the algorithm: translated before the keys whose value depends on it

    def __post_init__(self) -> None:
        if self.target is None and self.convert is None and self.harmless is None and not self.why:
            raise ValueError(f"{self.source} key ({self.meaning}): a refusal must say why")

    @property
    def status(self) -> str:
        """``renamed`` (the value kept), ``translated`` (by ``convert``, which may refuse some values),
        ``accepted``, ``accepted at ...`` (refused otherwise) or ``refused``."""
        if self.target is not None:
            return "renamed"
        if self.convert is not None:
            return "translated"
        if self.harmless is ANY:
            return "accepted"
        if self.harmless is OFF:
            return "accepted when off (null, false, 0 or empty); else refused"
        if self.harmless is not None:
            return "accepted at " + ", ".join(_show(v) for v in self.harmless) + "; else refused"
        return "refused"

    def resolve(self, key: str, value: Any, context: Context) -> dict[str, Any]:
        """Our keys for ``key: value`` (empty when harmless); raises :class:`Refused` naming the key."""
        if self.harmless is ANY or (self.harmless is not None and _among(value, self.harmless)):
            return {}
        try:
            if self.convert is not None:
                return self.convert(value, context)
        except Refused as err:
            raise Refused(f"{self.label(key)}={value!r}: {err}") from None
        if self.target is not None:
            return {self.target: value}
        raise Refused(f"{self.label(key)}={value!r}: {self.why}")

    def label(self, key: str) -> str:
        return f"{key!r} ({self.source}: {self.meaning})"


def _among(value: Any, values: tuple[Any, ...]) -> bool:
    return any(type(value) is type(v) or (isinstance(value, int | float) and isinstance(v, int | float)
                                          and not isinstance(value, bool) and not isinstance(v, bool))
               for v in values if value == v) or (value is None and None in values)


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def lookup(key: str) -> tuple[str, ForeignKey] | None:
    """The TRL field (top level only) or verl key that ``key`` names, as ``(its full name, entry)``."""
    from hybridflow.train.dialect_trl import TRL
    from hybridflow.train.dialect_verl import verl_key

    if "." not in key and key in TRL:
        return key, TRL[key]
    return verl_key(key)


def foreign_leaf(key: str) -> bool:
    """Whether ``key`` is one TRL field or verl key whose value may itself be a mapping (TRL's
    ``model_init_kwargs``, verl's ``rollout.engine_kwargs.vllm``): such a value is read whole, not as sub-keys."""
    from hybridflow.train.dialect_trl import TRL
    from hybridflow.train.dialect_verl import table

    if "." not in key and key in TRL:
        return True
    found = lookup(key)
    return found is not None and found[0] in table() and "**" not in found[0]


def translate(pairs: list[tuple[str, Any]], native: Callable[[str], bool], problems: list[str],
              unknown: Callable[[str], str]) -> list[tuple[str, Any]]:
    """``pairs`` (dotted key, value; later ones win) with every foreign key translated to ours. Each key that
    is neither ours (``native``) nor a known foreign one, and each refusal or clash, appends a line to
    ``problems`` (``unknown(key)`` words an unknown key) instead of raising, so one pass names them all."""
    ours = [(k, v) for k, v in pairs if native(k)]
    given = dict(ours)
    foreign: list[tuple[str, str, ForeignKey, Any]] = []
    for key, value in pairs:
        if native(key):
            continue
        found = lookup(key)
        if found is None:
            problems.append(unknown(key))
        else:
            foreign.append((key, found[0], found[1], value))
    context: dict[str, Any] = {full: value for _, full, _, value in foreign}
    context.update(given)
    produced: dict[str, tuple[str, Any]] = {}
    for key, _full, entry, value in sorted(foreign, key=lambda item: not item[2].first):
        context["algorithm"] = given.get("algorithm", produced.get("algorithm", ("", "grpo"))[1])
        try:
            result = entry.resolve(key, value, context)
        except Refused as err:
            problems.append(f"{err} (docs/migrating.md)")
            continue
        for target, new in result.items():
            clash = _clash(key, entry, target, new, given, produced)
            if clash:
                problems.append(clash)
            else:
                produced[target] = (key, new)
    return ours + [(target, value) for target, (_, value) in produced.items()]


_ABSENT = object()


def _given(given: Mapping[str, Any], target: str) -> Any:
    """``target``'s value among our keys: given itself, or inside a mapping given whole (``algorithm_options``)."""
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


def _clash(key: str, entry: ForeignKey, target: str, value: Any, given: Mapping[str, Any],
           produced: Mapping[str, tuple[str, Any]]) -> str:
    ours = _given(given, target)
    if ours is not _ABSENT and ours != value:
        return (f"config keys {key!r} ({entry.source}) and {target!r} are the same setting; keep {target!r} "
                f"(they say {value!r} and {ours!r})")
    if target in produced and produced[target][1] != value:
        other = produced[target][0]
        return f"config keys {other!r} and {key!r} both set {target!r} ({produced[target][1]!r} vs {value!r}): keep one"
    return ""


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: insertions, deletions and substitutions turning ``a`` into ``b``."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def closest(key: str, candidates: list[str], limit: int = 3) -> list[str]:
    """The ``candidates`` within a typo's reach of ``key`` (edit distance at most a quarter of it, 1 to 3)."""
    reach = max(1, min(3, len(key) // 4))
    scored = sorted((edit_distance(key, c), c) for c in set(candidates) if abs(len(c) - len(key)) <= reach)
    return [c for d, c in scored if d <= reach][:limit]


def check_algorithm_options(factory: Any, options: Mapping[str, Any], algorithm: str) -> None:
    """Options the graph factory does not take are refused all at once, each named with its fix (a TRL/verl
    name's meaning here, or the option a typo was meant to be), instead of the factory's raw ``TypeError``."""
    if not callable(factory):
        return
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    valid = sorted(p for p in parameters if p != "reward_kind")
    problems = []
    for key in options:
        if key in parameters:
            continue
        found = lookup(key)
        hint = ""
        if found is not None:
            entry = found[1]
            hint = f" ({entry.source}: {entry.meaning}; {entry.why or 'here ' + repr(entry.target)})"
        elif closest(key, valid):
            hint = f"; did you mean {' or '.join(repr(c) for c in closest(key, valid))}?"
        problems.append(f"config key 'algorithm_options.{key}': {algorithm} takes no option {key!r}{hint}; "
                        f"its options are {valid}")
    if problems:
        raise ConfigKeyError(problems)


def table_markdown() -> str:
    """docs/migrating.md's key table, generated from the dialect tables (tested equal to the doc)."""
    from hybridflow.train.dialect_trl import TRL
    from hybridflow.train.dialect_verl import documented_verl_keys

    lines = ["| key | from | meaning there | here |", "|---|---|---|---|"]
    rows = [*((f"`{name}`", entry) for name, entry in TRL.items()), *documented_verl_keys()]
    for name, entry in rows:
        here = f"`{entry.target}`" if entry.target else entry.status
        if entry.why:
            here = f"{here}: {entry.why}"
        lines.append(f"| {name} | {entry.source} | {entry.meaning} | {_cell(here)} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


START, END = "<!-- alias table: generated by python -m hybridflow.train.aliases -->\n", "<!-- end alias table -->"


def write_table(path: str) -> None:
    """Replace the generated table between its markers in ``path`` (docs/migrating.md)."""
    from pathlib import Path

    text = Path(path).read_text()
    head, rest = text.split(START, 1)
    Path(path).write_text(head + START + table_markdown() + END + rest.split(END, 1)[1])


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--write"]:
        write_table(sys.argv[2])
    else:
        print(table_markdown(), end="")
