"""What one TRL or verl key means here: renamed, translated, accepted or refused (:class:`ForeignKey`), the
tables' row type; :mod:`hybridflow.train.aliases` reads the tables built of them."""

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
