"""Deadlines and heartbeats for every wait on a worker process (Ray, torchrun).

A worker that dies is seen at once (its connection closes). A worker that *hangs* (stopped, deadlocked,
swapping) is not: without a deadline the controller waits forever. Two bounds apply to each call:

- **heartbeat**: the worker answers a ``ping`` on a thread of its own every ``heartbeat_interval_s``; no
  answer for ``heartbeat_timeout_s`` means the process is not running (SIGSTOP, a frozen machine). A hung
  worker is therefore reported within ``heartbeat_timeout_s + heartbeat_interval_s``.
- **deadline**: a call that keeps its heartbeat but never returns (a collective waiting on a lost peer, a
  deadlock in the op) fails after ``call_timeout_s`` when set, else after
  ``max(min_timeout_s, timeout_factor x max(the plan's estimate, the slowest measured run of the node))``.
  Building engines and checkpoint I/O get ``setup_timeout_s`` (model loading is slow and not modelled).

This module is torch- and ray-free: the train config embeds :class:`Liveness`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.fields import FieldError


@dataclass(frozen=True, kw_only=True)
class Liveness:
    """How long the controller waits on a worker before it declares it failed (see the module docstring)."""

    call_timeout_s: float | None = None
    min_timeout_s: float = 300.0
    timeout_factor: float = 10.0
    setup_timeout_s: float = 1800.0
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("min_timeout_s", "timeout_factor", "setup_timeout_s", "heartbeat_interval_s",
                     "heartbeat_timeout_s"):
            if not getattr(self, name) > 0:
                raise FieldError(name, getattr(self, name), "must be > 0")
        if self.call_timeout_s is not None and not self.call_timeout_s > 0:
            raise FieldError("call_timeout_s", self.call_timeout_s,
                             "must be > 0 (or unset: derived from the plan and measured step times)")
        if self.heartbeat_timeout_s < self.heartbeat_interval_s:
            raise FieldError("heartbeat_timeout_s", self.heartbeat_timeout_s,
                             f"must be >= heartbeat_interval_s={self.heartbeat_interval_s}",
                             related=("heartbeat_interval_s",))

    def deadline_s(self, *, estimate_s: float = 0.0, measured_s: float = 0.0) -> float:
        """Seconds a node's call may take: the fixed ``call_timeout_s``, or the derived bound with its floor."""
        if self.call_timeout_s is not None:
            return self.call_timeout_s
        return max(self.min_timeout_s, self.timeout_factor * max(estimate_s, measured_s))

    @property
    def hang_bound_s(self) -> float:
        """The longest a hung (not running) worker goes unnoticed while the controller waits on it."""
        return self.heartbeat_timeout_s + self.heartbeat_interval_s
