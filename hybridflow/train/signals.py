"""SIGTERM (a scheduler, Kubernetes, ``kill``) on every executor: a training run checkpoints, then stops.

:func:`stop_on_sigterm` is what ``train()`` runs under (so the CLI, the classic API, ``GRPOTrainer`` and a
script calling ``train()`` alike). Outside the step loop (loading, starting workers, the final export) SIGTERM
raises :class:`Terminated`, a ``KeyboardInterrupt``, in the main thread at once, so ``train()``'s clean-up
(controller, workers, reward processes) runs as for Ctrl-C. Inside the loop it only asks the run to stop: the
step in flight finishes, the loop checkpoints it and raises :class:`Terminated` naming the checkpoint
(:mod:`hybridflow.train.preemption`). A step still running ``sigterm_grace_s`` after the signal (or at a
second SIGTERM) is abandoned: :class:`Terminated` is raised inside it. ``hybridflow train`` prints one line
and exits 143.

Under torchrun every rank gets the signal: rank 0 stops the run this way, and the serving ranks
(:func:`sigterm_deferred`) keep answering, the checkpoint's calls included, until rank 0 tells them to leave.
A handler the application installed is left alone; Ray's (``ray.init`` installs one calling ``sys.exit``) is
replaced for the run and put back after it.
"""

from __future__ import annotations

import contextlib
import enum
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

Handler = Callable[[int, Any], Any] | int | None


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, Kubernetes, ``kill``) seen as Ctrl-C: the run stops the way an interrupt does. Its
    message, when a run wrote one, says which checkpoint ``--resume`` continues from."""


class _Mode(enum.Enum):
    IMMEDIATE = "immediate"  # setup and teardown: SIGTERM raises at once
    DEFERRED = "deferred"  # between steps, writing a checkpoint: SIGTERM only asks to stop
    ABANDONABLE = "abandonable"  # a step in flight: asks to stop; raises once the grace is over


class GracefulStop:
    """What SIGTERM has asked of a run: ``requested`` (stop after the step in flight), ``abandoned`` (a step
    was given up because ``grace_s`` ran out or a second SIGTERM came). Set by the handler that
    :func:`stop_on_sigterm` installs; a run whose handler is someone else's sees neither."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.requested = False
        self.abandoned = False
        self.grace_over = False
        self._mode = _Mode.IMMEDIATE
        self._closed = False
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Within the block (the step loop) a SIGTERM only asks to stop (``grace_s`` 0: it raises at once)."""
        with self._in(_Mode.DEFERRED):
            yield

    @contextlib.contextmanager
    def abandonable(self) -> Iterator[None]:
        """Within the block (a step, a validation pass) :class:`Terminated` is raised once the grace is over."""
        if self.grace_over:
            self.abandoned = True
            raise Terminated
        with self._in(_Mode.ABANDONABLE):
            yield

    @contextlib.contextmanager
    def _in(self, mode: _Mode) -> Iterator[None]:
        outer, self._mode = self._mode, mode
        try:
            yield
        finally:
            self._mode = outer

    def handle(self, signum: int, frame: Any) -> None:
        """The SIGTERM handler (main thread)."""
        if self._closed:
            return  # the timer's own signal, arriving as the run ends
        if self._mode is _Mode.IMMEDIATE or self.grace_s <= 0:
            raise Terminated
        if not self.requested:
            self.requested = True
            self._timer = threading.Timer(self.grace_s, self._grace_ran_out)
            self._timer.daemon = True
            self._timer.start()
        elif self._mode is _Mode.ABANDONABLE:  # a second SIGTERM, or the timer's
            self.abandoned = True
            raise Terminated

    def _grace_ran_out(self) -> None:
        with self._lock:
            self.grace_over = True
            if not self._closed and self._mode is _Mode.ABANDONABLE:
                # A real signal, not a flag: it wakes the main thread from a blocking wait on a future.
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()


@contextlib.contextmanager
def stop_on_sigterm(grace_s: float) -> Iterator[GracefulStop]:
    """Within the block SIGTERM goes to the yielded :class:`GracefulStop` (main thread only; a handler the
    application installed is kept, and then the stop never reports a request)."""
    stop = GracefulStop(grace_s)
    previous = signal.getsignal(signal.SIGTERM) if _on_main_thread() else None
    if not _replaceable(previous):
        yield stop
        return
    signal.signal(signal.SIGTERM, stop.handle)
    try:
        yield stop
    finally:
        stop.close()
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[list[int]]:
    """Within the block SIGTERM is only noted (the yielded list gets the signal number): a torchrun serving
    rank leaves when rank 0, which got the same signal, says so; torchrun kills what is left after its grace."""
    received: list[int] = []
    if not _on_main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield received
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _replaceable(handler: Handler) -> bool:
    """SIGTERM's default action, or the handler ``ray.init`` installs (``sys.exit``, which would end the driver
    with ``SystemExit`` wherever it is, skipping the run's checkpoint)."""
    return handler is signal.SIG_DFL or is_ray_handler(handler)


def is_ray_handler(handler: Handler) -> bool:
    """Whether ``handler`` is the SIGTERM handler Ray's ``init`` installs in a driver."""
    return callable(handler) and getattr(handler, "__module__", "").startswith("ray.") and \
        getattr(handler, "__name__", "") == "sigterm_handler"
