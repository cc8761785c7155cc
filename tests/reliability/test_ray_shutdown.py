"""A SIGKILLed driver's local Ray cluster (GCS, raylet, agents, workers) is gone within the reaper's bound.

The run's processes are found here independently of the reaper: the driver's descendants recorded before
the kill (pid and start time) and every process naming the session directory or holding a file open under
it, so the agents Ray retitles (their environment then reads empty) are counted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hybridflow.runtime import ray_reaper

psutil = pytest.importorskip("psutil")
pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

DRIVER = """
import os, ray
from hybridflow.runtime.ray_executor import ensure_ray
ensure_ray(address=None, num_gpus=1, num_cpus=1)
@ray.remote
def where():
    return os.getpid()
print(ray._private.worker._global_node.get_session_dir_path(), ray.get(where.remote()), flush=True)
import time
time.sleep(600)
"""
BOUND_S = ray_reaper.POLL_S + ray_reaper.SCAN_S + ray_reaper.GRACE_S  # what docs/runtime.md promises
AGENTS = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"}


def _descendants(driver: int) -> dict[int, tuple[str, float]]:
    """The driver's descendants once both agents are up: ``{pid: (name, start time)}``."""
    deadline = time.monotonic() + 60
    while True:
        found = {}
        for child in psutil.Process(driver).children(recursive=True):
            try:
                found[child.pid] = (child.name(), child.create_time())
            except psutil.Error:
                continue
        if {name for name, _ in found.values()} >= AGENTS or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _left(recorded: dict[int, tuple[str, float]], session: str) -> list[str]:
    left = []
    for process in psutil.process_iter():
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue  # ended; its new parent has yet to collect it
            mine = recorded.get(process.pid, ("", None))[1] == process.create_time()
            in_session = session in " ".join(process.cmdline()) or \
                any(f.path.startswith(session + "/") for f in process.open_files())
            if mine or in_session:
                left.append(f"{process.pid} {process.name()} {' '.join(process.cmdline())[:60]!r}")
        except psutil.Error:
            continue
    return left


def test_every_process_of_a_killed_drivers_cluster_exits_within_the_bound() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, env=env)
    try:
        assert driver.stdout is not None
        session, worker = driver.stdout.readline().split()
        recorded = _descendants(driver.pid)  # the reaper included: it must end too
        names = {name for name, _ in recorded.values()}
        assert AGENTS | {"gcs_server", "raylet"} <= names and int(worker) in recorded, names
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        killed = time.monotonic()
        while True:
            began = time.monotonic()
            left = _left(recorded, session)
            scan = time.monotonic() - began
            if not left:
                break
            assert time.monotonic() - killed < BOUND_S + scan, f"alive {BOUND_S}s after the driver died: {left}"
            time.sleep(0.1)
        print(f"{len(recorded)} Ray processes gone {time.monotonic() - killed:.1f}s after the driver's SIGKILL "
              f"(bound {BOUND_S}s; last scan {scan:.2f}s)")
    finally:
        if driver.poll() is None:
            driver.kill()
