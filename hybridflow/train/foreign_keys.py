"""What one TRL or verl key means here: renamed, translated, accepted or refused (:class:`ForeignKey`), the
dialect tables' row type, with the one set of row constructors every table is written in (:func:`renamed`,
:func:`translated`, :func:`accepted`, :func:`refused`). A row does not name its dialect: the
:class:`hybridflow.train.dialects.Dialect` holding it does, so a table is plain rows and a new key one line."""

from __future__ import annotations

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
KINDS = ("renamed", "translated", "accepted", "accepted when off", "accepted at values", "refused")
MEMORY_ONLY = "memory or speed only: the numbers trained are the same"
KL_LOSS = ("grpo", "dr_grpo", "gspo")  # kl_coef is a loss term (k3): TRL's beta, verl's use_kl_loss
KL_REWARD = ("ppo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline")  # kl_coef is a reward penalty
NO_KL = ("dapo", "grpo_no_ref")  # algorithms without a reference


@dataclass(frozen=True, kw_only=True)
class ForeignKey:
    """One TRL or verl key. ``target``: our key, the value kept; ``convert``: the value as our keys (it may
    raise :class:`Refused` for a value with no meaning here); ``harmless``: values that change nothing here
    (accepted and dropped; :data:`ANY` for all); otherwise refused. ``meaning`` is what it does there, ``why``
    the reason it is accepted or refused (with what to write instead)."""

    meaning: str
    source: str = ""  # the dialect's name, filled in by the Dialect that holds the row
    target: str | None = None
    convert: Convert | None = None
    harmless: Any = None
    why: str = ""
    first: bool = False  # decides the algorithm: translated before the keys whose value depends on it

    def __post_init__(self) -> None:
        if self.target is None and self.convert is None and self.harmless is not ANY and not self.why:
            raise ValueError(f"{self.source or 'foreign'} key ({self.meaning}): a refusal must say why")

    @property
    def kind(self) -> str:
        """Which of :data:`KINDS` the row is (what tests/train/test_dialects.py counts per dialect)."""
        if self.target is not None:
            return "renamed"
        if self.convert is not None:
            return "translated"
        if self.harmless is ANY:
            return "accepted"
        if self.harmless is OFF:
            return "accepted when off"
        return "accepted at values" if self.harmless else "refused"

    @property
    def status(self) -> str:
        """``renamed`` (the value kept), ``translated`` (by ``convert``, which may refuse some values),
        ``accepted``, ``accepted at ...`` (refused otherwise) or ``refused``: :attr:`kind`, spelled out."""
        if self.kind == "accepted when off":
            return "accepted when off (null, false, 0 or empty); else refused"
        if self.kind == "accepted at values":
            return "accepted at " + ", ".join(_show(v) for v in self.harmless) + "; else refused"
        return self.kind

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


def renamed(target: str, meaning: str, why: str = "") -> ForeignKey:
    """A key whose value is ours as it is, under the name ``target``."""
    return ForeignKey(meaning=meaning, target=target, why=why)


def translated(convert: Convert, meaning: str, why: str = "", *, first: bool = False) -> ForeignKey:
    """A key whose value becomes our keys through ``convert`` (which may refuse a value); ``first``: it decides
    the algorithm, so it is translated before the keys that depend on it."""
    return ForeignKey(meaning=meaning, convert=convert, why=why, first=first)


def accepted(meaning: str, why: str) -> ForeignKey:
    """A key that changes nothing here at any value: accepted and dropped; ``why`` says why it is harmless."""
    return ForeignKey(meaning=meaning, harmless=ANY, why=why)


def refused(meaning: str, why: str, unless: tuple[Any, ...] = OFF) -> ForeignKey:
    """A key with no meaning here, refused with ``why`` (what to write instead) unless its value is one of
    ``unless``, the values that leave the run as ours is: by default the feature switched off (null, false, 0,
    empty); ``()`` refuses every value."""
    return ForeignKey(meaning=meaning, harmless=unless, why=why)


def unless_null(target: str) -> Convert:
    """The conversion of a key renamed to ``target`` whose null means "not set" (so ours keeps its default)."""
    return lambda value, context: {} if value is None else {target: value}


def _among(value: Any, values: tuple[Any, ...]) -> bool:
    return any(type(value) is type(v) or (isinstance(value, int | float) and isinstance(v, int | float)
                                          and not isinstance(value, bool) and not isinstance(v, bool))
               for v in values if value == v) or (value is None and None in values)


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
