"""A refused value, named by the field that holds it (:class:`FieldError`).

A layer below the config (runtime, planner, data, backends) knows its own fields, not how a user spells them:
``Liveness.heartbeat_timeout_s`` is ``executor.liveness.heartbeat_timeout_s`` in a run's YAML, and may be
something else in a plan file or the classic API. So a lower layer raises :class:`FieldError` with the field's
own name, and the layer that built the value from the user's keys re-spells it once with :meth:`FieldError.at`
(:func:`hybridflow.train.schema.from_mapping` does it for every config section). No module below ``train/``
quotes a config key (``tests/test_import_map.py`` checks it).
"""

from __future__ import annotations

import re
from typing import Any

_UNSET: Any = object()


class FieldError(ValueError):
    """``field``'s ``value`` is refused: the text reads ``field=value reason``. ``related`` are the sibling
    fields the reason names (``must be >= heartbeat_interval_s=2``), re-spelled with ``field`` by :meth:`at`."""

    def __init__(self, field: str, value: Any = _UNSET, reason: str = "", *, related: tuple[str, ...] = ()) -> None:
        self.field, self.value, self.reason, self.related = field, value, reason, related
        super().__init__(self.text(field))

    def __str__(self) -> str:
        return str(self.args[0])  # unquoted, for :class:`UnknownName` too (a ``KeyError`` quotes its text)

    def text(self, name: str, *, quote: bool = False) -> str:
        """The message with the field spelled ``name`` (quoted as a config key when ``quote``)."""
        shown = repr(name) if quote else name
        value = "" if self.value is _UNSET else "=" + (repr(self.value) if quote or isinstance(self.value, str)
                                                        else str(self.value))
        return f"{shown}{value} {self.reason}".rstrip()

    def at(self, prefix: str) -> FieldError:
        """This error with its field (and the related ones) under ``prefix`` (``'executor.liveness.'``)."""
        reason = self.reason
        for name in self.related:
            reason = re.sub(rf"(?<![\w.]){re.escape(name)}\b", prefix + name, reason)
        return type(self)(prefix + self.field, self.value, reason, related=())


class UnknownName(FieldError, KeyError):
    """A field naming something that does not exist (a reward function, a task): a ``KeyError`` as well, as a
    registry's lookup raises."""
