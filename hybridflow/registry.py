"""Named registries (algorithms, compute functions, losses, backends, rollout engines) that fail loudly.

A duplicate name raises; an unknown name lists the valid ones. A name containing ``:`` is an
import path (``package.module:function`` or ``path/to/file.py:function``) and is loaded instead.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """An unknown or duplicate registry name."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly.
        return str(self.args[0])


class Registry(Generic[T]):
    """A name -> object table; ``@registry.register("name")`` adds to it."""

    def __init__(self, kind: str, *, entry_point_group: str | None = None, also_from: tuple[str, ...] = ()) -> None:
        """``also_from``: further entry-point groups whose plugins register entries here as they import."""
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.groups = (*((entry_point_group,) if entry_point_group else ()), *also_from)
        self._items: dict[str, T] = {}
        self._plugins_loaded = not self.groups
        self._loading = False
        self._lock = threading.RLock()

    def _load_plugins(self) -> None:
        """Import every module advertised under the entry-point group; importing registers.

        Thread-safe: rank threads of a local worker group look names up at once, and none may see
        the table before every plugin has registered. A plugin may use the registry while it imports.
        """
        if self._plugins_loaded:
            return
        with self._lock:
            if self._plugins_loaded or self._loading:  # done meanwhile, or a re-entrant call mid-import
                return
            self._loading = True
            try:
                for group in self.groups:
                    for entry_point in importlib.metadata.entry_points(group=group):
                        _load_entry_point(entry_point, self.kind, group)
                self._plugins_loaded = True  # only now: a failure fails the same way on the next lookup
            finally:
                self._loading = False

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            self.add(name, obj)
            return obj

        return add

    def add(self, name: str, obj: T) -> None:
        if name in self._items:
            raise RegistryError(f"{self.kind} {name!r} is already registered; pick another name")
        self._items[name] = obj

    def get(self, name: str) -> T:
        """The object called ``name``, or, for ``module:attr`` / ``file.py:attr``, that import."""
        if name not in self._items:
            self._load_plugins()
        if name in self._items:
            return self._items[name]
        if ":" in name:
            found: T = load_object(name)
            return found
        raise RegistryError(f"unknown {self.kind} {name!r}; valid names: {sorted(self._items)}")

    def names(self) -> list[str]:
        self._load_plugins()
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        self._load_plugins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def _load_entry_point(entry_point: importlib.metadata.EntryPoint, kind: str, group: str | None) -> None:
    try:
        entry_point.load()
    except ImportError as err:
        raise ImportError(
            f"{kind} plugin {entry_point.name!r} ({entry_point.value}, entry-point group {group!r}) "
            f"failed to import: {err}"
        ) from err


def load_object(spec: str) -> Any:
    """Load ``path/to/file.py:name`` or ``package.module:name``, with errors naming the part at fault."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"{spec!r} is not of the form 'path/to/file.py:function' or 'module:function'")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise FileNotFoundError(f"{spec!r}: no file {path}")
        module = _import_file(path, spec)
    else:
        module = importlib.import_module(target)
    if not hasattr(module, attr):
        public = sorted(name for name in vars(module) if not name.startswith("_"))
        raise AttributeError(f"{spec!r}: {target} has no attribute {attr!r}; it defines {public}")
    return getattr(module, attr)


def _import_file(path: Path, spec: str) -> ModuleType:
    """Import a user file once per process: the CLI, planner and runtime may each resolve names in it,
    and re-running it would re-run its ``@register`` decorators (a duplicate-name error)."""
    module_name = f"hybridflow_user_{abs(hash(path.resolve()))}"
    # Rank threads of a local worker group resolve the same file at once: one imports, the others wait
    # (reentrant: a user file may name another one while it loads).
    with _FILE_IMPORT_LOCK:
        if module_name in sys.modules:
            return sys.modules[module_name]
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportError(f"{spec!r}: cannot import {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]  # a half-run module must not be reused by the next lookup
            raise
        return module


_FILE_IMPORT_LOCK = threading.RLock()


# The project's registries. Built-ins live in ``hybridflow.algorithms`` and are found through the
# entry points in pyproject.toml, so the core never imports the algorithms package by name.
ALGORITHMS: Registry[Callable[..., Any]] = Registry("algorithm", entry_point_group="hybridflow.algorithms")
COMPUTE_FNS: Registry[Callable[..., Any]] = Registry("compute function", entry_point_group="hybridflow.functions")
LOSSES: Registry[Callable[..., Any]] = Registry("loss", entry_point_group="hybridflow.functions")
# Role-engine factories (``hybridflow.runtime.protocols.Backend``); each backend module registers itself on import.
BACKENDS: Registry[Any] = Registry("backend", entry_point_group="hybridflow.backends")
# Rollout-engine factories (``hybridflow.runtime.protocols.RolloutFactory``), the ``RoleSpec.rollout`` names.
# A backend registers the rollouts it implements when it imports (every training backend ``native`` and
# ``hf_generate``, the vLLM backend ``vllm``), so the backends' group is read too; a rollout engine shipped
# without a backend registers under ``hybridflow.rollouts``.
ROLLOUTS: Registry[Any] = Registry("rollout engine", entry_point_group="hybridflow.rollouts",
                                   also_from=("hybridflow.backends",))
# Agents (``hybridflow.agents``): tools a model may call, the environments a multi-turn ``generate`` runs its
# rows in, and the formats tool calls take in the model's text. Built-ins register through the entry points in
# pyproject.toml, plugins under the same groups; ``path/file.py:name`` loads a user's own.
TOOLS: Registry[Any] = Registry("tool", entry_point_group="hybridflow.tools")
ENVIRONMENTS: Registry[Callable[..., Any]] = Registry("environment", entry_point_group="hybridflow.environments")
TOOL_FORMATS: Registry[Any] = Registry("tool-call format", entry_point_group="hybridflow.tools")
