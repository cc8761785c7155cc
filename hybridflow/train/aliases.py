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
from typing import Any

from hybridflow.train.dialect_trl import TRL
from hybridflow.train.dialect_verl import documented_verl_keys, table, verl_key
from hybridflow.train.foreign_keys import (  # noqa: F401 (ConfigKeyError, Refused: raised and caught through here)
    ANY,
    OFF,
    ConfigKeyError,
    Context,
    ForeignKey,
    Refused,
    _among,
    _show,
)


def lookup(key: str) -> tuple[str, ForeignKey] | None:
    """The TRL field (top level only) or verl key that ``key`` names, as ``(its full name, entry)``."""

    if "." not in key and key in TRL:
        return key, TRL[key]
    return verl_key(key)


def foreign_leaf(key: str) -> bool:
    """Whether ``key`` is one TRL field or verl key whose value may itself be a mapping (TRL's
    ``model_init_kwargs``, verl's ``rollout.engine_kwargs.vllm``): such a value is read whole, not as sub-keys."""

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
