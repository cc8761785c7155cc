"""Ends a locally started Ray cluster's processes once the driver that started it is gone.

``ray.shutdown()`` stops the cluster when the driver exits normally; a driver killed with SIGKILL (or
an OOM kill) leaves GCS, raylet, dashboard and runtime-env agents and idle workers running for minutes.
:func:`start_reaper` launches a small watcher in its own session just before ``ray.init``. While Ray
starts, the watcher records the driver's Ray descendants (pid and start time) and reads the cluster's
session directory (``.../session_<date>_<driver pid>``) off their command lines; then it only polls the
driver, every ``POLL_S`` seconds. Once the driver is gone it terminates every process of the run and
kills those still alive ``GRACE_S`` seconds later. A process of the run is one recorded at start, or
one whose command line names the session directory or which holds a file open under it (every Ray
process writes its logs there, workers started later included), or one carrying the cluster's auth
token in its environment.

Why not the token alone: Ray retitles its agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``)
with ``setproctitle``, which overwrites the memory ``/proc/<pid>/environ`` and ``cmdline`` are read
from, so they no longer show the token nor their arguments; their open log files and their start-time
parentage are properties Ray cannot rename away. The cluster is gone within ``POLL_S + GRACE_S`` plus
one scan of the process table (``SCAN_S`` bounds it on a loaded 2-core machine) of the driver's death;
``tests/reliability/test_ray_shutdown.py`` checks it with an independent definition of the run's processes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Any

POLL_S = 0.5
GRACE_S = 1.0
SCAN_S = 1.0  # one scan of the process table (cmdlines, open files) at the driver's death, loaded machine
STARTUP_SCAN_S = 120.0  # the driver's descendants are recorded this long at most if no session shows up
# Ray names a session directory session_<%Y-%m-%d_%H-%M-%S_%f>_<pid of the process that started it>.
_SESSION = re.compile(r"(/[^\s=:]*/session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+)")


def start_reaper(token: str) -> None:
    """Watch this process; when it dies, end the Ray processes of the cluster it is about to start."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}  # the watcher must not match itself
    # Run as a file, not `-m hybridflow.runtime...`: the package's __init__ imports torch (seconds, ~300 MB);
    # -P keeps this file's folder, full of our module names, off sys.path.
    watcher = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), str(os.getpid())],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=env, start_new_session=True, text=True)
    assert watcher.stdin is not None
    watcher.stdin.write(token)  # on a pipe, not argv or env: other users can read those
    watcher.stdin.close()


def reap(driver: int, token: str) -> int:
    """Wait for ``driver`` to exit, then end the processes of its run; returns how many were ended."""
    import psutil

    try:
        born: float | None = started(psutil.Process(driver))
    except psutil.NoSuchProcess:
        born = None
    known: dict[int, float] = {}
    sessions: set[str] = set()
    watching_since = time.monotonic()
    while born is not None and _alive(driver, born):
        if not sessions and time.monotonic() - watching_since < STARTUP_SCAN_S:
            _record_ray_descendants(driver, known, sessions)
        time.sleep(POLL_S)
    victims = run_processes(known=known, sessions=sessions, token=token)
    for process in victims:
        try:
            process.terminate()
        except psutil.Error:
            continue
    for process in _still_running(victims, timeout_s=GRACE_S):
        try:
            process.kill()
        except psutil.Error:
            continue
    return len(victims)


def session_dirs(command_line: Iterable[str]) -> set[str]:
    """The Ray session directories a command line names (``--session-dir=``, ``--log_dir=.../logs``, ...)."""
    return {found.group(1) for part in command_line for found in _SESSION.finditer(part)}


def holds_session(process: Any, sessions: set[str]) -> bool:
    """Whether a ``psutil.Process`` names one of ``sessions`` on its command line or has a file open under one."""
    import psutil

    prefixes = tuple(session.rstrip("/") + "/" for session in sessions)
    try:
        if session_dirs(process.cmdline()) & sessions:
            return True
        return any(opened.path.startswith(prefixes) for opened in process.open_files())
    except psutil.Error:  # another user's process, or one that exited while we looked
        return False


def run_processes(*, known: dict[int, float], sessions: set[str], token: str) -> list[Any]:
    """The live processes of the run: recorded at start (same pid and start time), in a session, or with the token."""
    import psutil

    victims = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            ours = known.get(process.pid) == started(process) or \
                (bool(sessions) and holds_session(process, sessions)) or \
                process.environ().get("RAY_AUTH_TOKEN") == token
        except psutil.Error:
            continue
        if ours:
            victims.append(process)
    return victims


def _record_ray_descendants(driver: int, known: dict[int, float], sessions: set[str]) -> None:
    """Add the driver's Ray descendants to ``known`` and the session directories they name to ``sessions``."""
    import psutil

    try:
        children = psutil.Process(driver).children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            command = child.cmdline()
            named = session_dirs(command)
            if child.pid != os.getpid() and (named or _is_ray_process(child.name(), command)):
                known[child.pid] = started(child)
                sessions |= named
        except psutil.Error:
            continue


def _is_ray_process(name: str, command: list[str]) -> bool:
    """Ray's binaries and its retitled workers and agents (its Python services name the session directory)."""
    first = command[0] if command else ""
    return name.startswith("ray::") or first.startswith("ray::") or name in ("gcs_server", "raylet")


def _still_running(processes: list[Any], *, timeout_s: float) -> list[Any]:
    """Those of ``processes`` still running after up to ``timeout_s``; a zombie has ended (its new parent,
    not us, collects it, so ``psutil.wait_procs`` would wait the whole timeout on it)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        running = []
        for process in processes:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    running.append(process)
            except psutil.Error:
                continue
        if not running or time.monotonic() >= deadline:
            return running
        processes = running
        time.sleep(0.1)


def started(process: Any) -> float:
    """When ``process`` started, as a value that stays the same while it runs: on Linux its ``starttime`` in clock
    ticks since boot (``/proc/<pid>/stat``, field 22). psutil's ``create_time()`` adds the boot time, which Linux
    recomputes from the wall clock at every read, so a clock step or an NTP correction changes it for a live process
    (giampaolo/psutil#2526, #1724): a watcher comparing it would take its driver for dead and end the live run."""
    try:
        with open(f"/proc/{process.pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # the command name, in parentheses, may hold spaces
        return float(fields[19])
    except (OSError, IndexError, ValueError):  # not Linux, or gone: psutil's wall-clock value
        return float(process.create_time())


def _alive(pid: int, born: float) -> bool:
    import psutil

    try:
        process = psutil.Process(pid)
        return started(process) == born and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


if __name__ == "__main__":
    secret = sys.stdin.read().strip()
    if secret:
        reap(int(sys.argv[1]), secret)
