"""SIGTERM (a scheduler, Kubernetes, ``kill``) stops a run the way Ctrl-C does, on every executor.

:func:`sigterm_as_interrupt` raises :class:`Terminated`, a ``KeyboardInterrupt``, in the main thread, so
``train()``'s own clean-up (controller, workers, reward processes) runs as for Ctrl-C; ``hybridflow
train`` then prints one line and exits 143. Under torchrun every rank gets the signal: rank 0 stops the run
this way, and the serving ranks (:func:`sigterm_deferred`) keep answering until rank 0 tells them to leave,
so rank 0's clean-up is not cut short by a peer that vanished first.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, Kubernetes, ``kill``) seen as Ctrl-C: the run stops the way an interrupt does."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises :class:`Terminated` in the main thread. A handler someone else
    installed (an application's own) is left alone, as is every thread but the main one."""
    if not _can_install():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[list[int]]:
    """Within the block SIGTERM is only noted (the yielded list gets the signal number): a torchrun serving
    rank leaves when rank 0, which got the same signal, says so; torchrun kills what is left after its grace."""
    received: list[int] = []
    if not _can_install():
        yield received
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _can_install() -> bool:
    return threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
