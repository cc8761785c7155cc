"""Ends a locally started Ray cluster's processes once the driver that started it is gone.

``ray.shutdown()`` stops the cluster when the driver exits normally; a driver killed with SIGKILL (or
an OOM kill) leaves GCS, raylet, dashboard and runtime-env agents and idle workers running for minutes.
:func:`start_reaper` launches a small watcher in its own session: it polls the driver every
``POLL_S`` seconds and, once the driver is gone, terminates every process carrying the cluster's auth
token (unique per driver, see :func:`~hybridflow.runtime.ray_executor.enable_token_auth`), killing
those still alive ``GRACE_S`` seconds later. So the cluster is gone within ``POLL_S + GRACE_S`` (+ the
scan) of the driver's death; ``tests/reliability/test_ray_shutdown.py`` measures it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 3.0


def start_reaper(token: str) -> None:
    """Watch this process; when it dies, end the processes started with ``token`` in their environment."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}  # the watcher must not match itself
    watcher = subprocess.Popen([sys.executable, "-m", "hybridflow.runtime.ray_reaper", str(os.getpid())],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=env, start_new_session=True, text=True)
    assert watcher.stdin is not None
    watcher.stdin.write(token)  # on a pipe, not argv or env: other users can read those
    watcher.stdin.close()


def reap(driver: int, token: str) -> int:
    """Wait for ``driver`` to exit, then end the processes holding ``token``; returns how many were ended."""
    import psutil

    try:
        born = psutil.Process(driver).create_time()
    except psutil.NoSuchProcess:
        born = None
    while born is not None and _alive(driver, born):
        time.sleep(POLL_S)
    victims = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and process.environ().get("RAY_AUTH_TOKEN") == token:
                victims.append(process)
        except psutil.Error:  # another user's process, or one that exited while we looked
            continue
    for process in victims:
        try:
            process.terminate()
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(victims, timeout=GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            continue
    return len(victims)


def _alive(pid: int, born: float) -> bool:
    import psutil

    try:
        process = psutil.Process(pid)
        return process.create_time() == born and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


if __name__ == "__main__":
    secret = sys.stdin.read().strip()
    if secret:
        reap(int(sys.argv[1]), secret)
