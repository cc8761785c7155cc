"""How a SIGTERM ends a training run: the last finished step checkpointed, then :class:`Terminated` naming it.

The loop (:mod:`hybridflow.train.loop`) runs its steps inside :meth:`GracefulStop.deferred` and each step
inside :meth:`GracefulStop.abandonable` (:mod:`hybridflow.train.signals`). At each step boundary
:meth:`Preemption.check` ends a run a SIGTERM asked to stop; a step the grace gave up on ends it through
:meth:`Preemption.abandoned`, which checkpoints the steps before it only if the abandoned step had not begun
changing what a checkpoint holds (:meth:`~hybridflow.runtime.controller.Controller.abandon_step`).
Checkpoints go through the run's own atomic writer, so ``--resume`` continues exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybridflow.train.signals import GracefulStop, Terminated

RESUME = "resume with --resume"


@dataclass(kw_only=True)
class Preemption:
    """A run's answer to SIGTERM. ``write(done)`` checkpoints the run after ``done`` finished steps (the
    loop's atomic writer); ``written`` is the finished steps of the newest checkpoint this run loaded or
    wrote, ``latest`` that checkpoint."""

    stop: GracefulStop
    steps: int
    write: Callable[[int], Path]
    written: int | None = None
    latest: Path | None = None

    def saved(self, done: int, path: Path) -> None:
        """The loop wrote (or loaded) the checkpoint ``path`` of ``done`` finished steps."""
        self.written, self.latest = done, path

    def check(self, done: int) -> None:
        """At a step boundary, ``done`` steps finished: if a SIGTERM asked to stop, checkpoint them and raise
        :class:`Terminated` saying where ``--resume`` continues."""
        if self.stop.requested:
            raise Terminated(f"after {done} of {self.steps} steps: {self._checkpointed(done)}")

    def abandoned(self, done: int, *, intact: bool) -> Terminated:
        """The step after ``done`` finished ones was given up; ``intact``: what a checkpoint holds is still as
        those ``done`` steps left it. Returns the :class:`Terminated` to raise (after any checkpoint)."""
        reason = f"within sigterm_grace_s={self.stop.grace_s:g}" if self.stop.grace_over else "before a second SIGTERM"
        what = f"while step {done + 1}/{self.steps} ran: it did not finish {reason} and was abandoned"
        if intact:
            return Terminated(f"{what}; {self._checkpointed(done)}")
        if self.latest is None:
            return Terminated(f"{what} after its update had begun, so the {done} finished steps could not be "
                              "checkpointed; the run has no checkpoint to resume from")
        return Terminated(f"{what} after its update had begun, so the {done} finished steps could not be "
                          f"checkpointed; {RESUME} continues from {self.latest.name}")

    def _checkpointed(self, done: int) -> str:
        if done == self.written and self.latest is not None:
            return f"checkpoint {self.latest.name} holds them; {RESUME}"
        if done == 0:
            return "no step had finished, so there is nothing to checkpoint"
        path = self.write(done)
        self.saved(done, path)
        return f"checkpoint {path.name} written; {RESUME}"
