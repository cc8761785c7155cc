"""Reward functions by name: the built-in ones, a task's rule by the task's name, ``file.py:fn`` and ``module:fn``
specs, reward services by URL (:mod:`hybridflow.data.reward_service`), or callables, each wrapped as a checked
:class:`~hybridflow.data.reward_functions.RewardFunction`.

The scorer (:mod:`hybridflow.data.rewards`) and the reward pool's worker processes
(:mod:`hybridflow.data.reward_pool`, which rebuild a function from its spec) both load through here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from hybridflow.data.math_reward import math_reward, math_reward_flexible
from hybridflow.data.reward_functions import RewardFunction, RewardSignatureError, reward_function
from hybridflow.data.reward_service import RewardService, RewardServiceConfig, is_service_url
from hybridflow.data.tasks import TASKS
from hybridflow.fields import FieldError, UnknownName
from hybridflow.registry import Registry, RegistryError, load_object

RewardSpec = str | Callable[..., Any]

# Built-in reward functions by name; the built-in tasks' rules are found by task name too.
REWARDS: Registry[Callable[..., Any]] = Registry("reward function")
REWARDS.add("math", math_reward)
REWARDS.add("math_flexible", math_reward_flexible)


def load_reward_functions(specs: RewardSpec | Sequence[RewardSpec], *, weights: Sequence[float] | None = None,
                          service: RewardServiceConfig | None = None,
                          service_prefix: str = "") -> tuple[RewardFunction, ...]:
    """Reward functions from names (``math``, a task name), ``file.py:fn`` / ``module:fn`` specs, service URLs
    (``http://host:port/path``, called as ``service`` says; its errors spell its options under
    ``service_prefix``) or callables.

    Each signature is checked here, at load time. ``weights`` (default all 1.0) must match in length.
    """
    items: list[RewardSpec] = [specs] if isinstance(specs, str) or callable(specs) else list(specs)
    if not items:
        raise FieldError("reward", reason="is an empty list; name at least one reward function")
    if weights is not None and len(weights) != len(items):
        raise FieldError("reward_weights", list(weights), f"has {len(weights)} weights for {len(items)} reward "
                         f"functions ({[_label(s) for s in items]}); give one weight per function")
    chosen = list(weights) if weights is not None else [1.0] * len(items)
    loaded = []
    for spec, weight in zip(items, chosen, strict=True):
        if is_service_url(spec):
            assert isinstance(spec, str)
            loaded.append(service_function(RewardService(spec, service, option_prefix=service_prefix), weight))
            continue
        loaded.append(dataclasses.replace(reward_function(_resolve(spec), name=_label(spec), weight=weight),
                                          source=spec if isinstance(spec, str) else None))
    return tuple(loaded)


def service_function(service: RewardService, weight: float = 1.0) -> RewardFunction:
    """A reward service as a reward function named by its URL; it runs in the driver (its requests have their own
    deadline), never in the reward pool's processes."""
    if not (isinstance(weight, numbers.Real) and math.isfinite(weight)):
        raise ValueError(f"reward service {service.url!r}: weight {weight!r} must be a finite number")
    return RewardFunction(name=service.url, fn=service, style="service", keywords=frozenset(), any_keyword=False,
                          required=frozenset(), weight=float(weight))


def _resolve(spec: RewardSpec) -> Callable[..., Any]:
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise RewardSignatureError(f"reward entry {spec!r} is a {type(spec).__name__}, not a function or a "
                                   "'path/to/file.py:function' name")
    if ":" in spec:
        found: Callable[..., Any] = load_object(spec)
        return found
    if spec in TASKS:
        return TASKS.get(spec).reward
    try:
        return REWARDS.get(spec)
    except RegistryError as err:
        raise UnknownName("reward", spec, f"is neither a built-in reward function {REWARDS.names()}, a task "
                          f"{TASKS.names()}, nor a 'path/to/file.py:function' or 'module:function' spec") from err


def _label(spec: RewardSpec) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))
