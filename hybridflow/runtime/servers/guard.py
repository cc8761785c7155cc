"""Ends the server processes a driver started once the driver is gone, even after a SIGKILL.

:func:`start_guard` launches this file as a small watcher in a session of its own and keeps the write end of
a pipe to it. The driver writes one line per process group it starts (``<pgid> <start time>``); the watcher
reads until the pipe closes, which happens when the driver closes the guard or dies in any way (the kernel
closes a dead process's files at once, so no polling is needed). It then ends every process of those groups
that started no earlier than the group's leader (``/proc/<pid>/stat``: group id and start time in clock
ticks), first with SIGTERM and, ``GRACE_S`` seconds later, with SIGKILL. The start-time check keeps it from
touching an unrelated process that reuses a group id after the group ended. It is the same promise as
``runtime/ray_reaper.py`` makes for Ray's processes; here the processes are our own children, each the leader
of its own group, so the pipe and the group ids are enough.

Stdlib only and run as a file (``python -P guard.py``): importing the ``hybridflow.runtime`` package would
import torch (seconds, ~300 MB) in a process that only waits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import IO

GRACE_S = 1.0  # a dead driver needs no graceful shutdown; vLLM takes seconds to honour SIGTERM


class ServerGuard:
    """The driver's end of a watcher: :meth:`watch` each process group as it starts; :meth:`close` when done."""

    def __init__(self) -> None:
        # Popen closes every other descriptor in its children (close_fds), so the servers never hold this pipe open.
        self._watcher = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True, text=True)
        self._pipe: IO[str] | None = self._watcher.stdin

    def watch(self, pgid: int) -> None:
        """End process group ``pgid`` (led by process ``pgid``, alive now) if this driver dies."""
        if self._pipe is None:
            raise RuntimeError("this server guard is closed; start a new one")
        self._pipe.write(f"{pgid} {start_time(pgid)}\n")
        self._pipe.flush()

    def close(self) -> None:
        """Let the watcher end whatever is left of the watched groups, then exit."""
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
            self._watcher.wait(timeout=GRACE_S + 10)


def start_time(pid: int) -> int:
    """Clock ticks since boot at which ``pid`` started (``/proc/<pid>/stat`` field 22); -1 if it is gone."""
    stat = _stat(pid)
    return stat[1] if stat else -1


def _stat(pid: int) -> tuple[int, int] | None:
    """(process group, start time) of ``pid``, or None when it is gone or a zombie (it has ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()  # the command name, in parentheses, may hold spaces
        return None if fields[0] == b"Z" else (int(fields[2]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def members(groups: list[tuple[int, int]]) -> list[int]:
    """Live processes of ``groups`` ((pgid, leader's start time)) that started no earlier than their leader."""
    found = []
    born = dict(groups)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        stat = _stat(int(entry))
        if stat is not None and stat[0] in born and born[stat[0]] >= 0 and stat[1] >= born[stat[0]]:
            found.append(int(entry))
    return found


def end_groups(groups: list[tuple[int, int]], *, grace_s: float = GRACE_S) -> None:
    """SIGTERM every member of ``groups``, then SIGKILL those still there after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in members(groups):
            try:
                os.kill(pid, sig)
            except OSError:  # exited meanwhile
                continue
        while sig == signal.SIGTERM and members(groups) and time.monotonic() < deadline:
            time.sleep(0.1)


class _Stop(Exception):
    """SIGTERM: whoever ends the run's processes (Ray's reaper ends those holding its token) reached this watcher
    first; it ends its groups before it goes."""


def _stop(signum: int, frame: object) -> None:
    raise _Stop


def _main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the driver must not stop the watcher
    signal.signal(signal.SIGTERM, _stop)
    groups = []
    try:
        for line in sys.stdin:  # until EOF: the driver closed the guard, or died
            pgid, born = line.split()
            groups.append((int(pgid), int(born)))
    except _Stop:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    end_groups(groups)


if __name__ == "__main__":
    _main()
