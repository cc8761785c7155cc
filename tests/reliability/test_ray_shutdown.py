"""A SIGKILLed driver's local Ray cluster (GCS, raylet, agents, workers) is gone within seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

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
print(os.environ["RAY_AUTH_TOKEN"], ray.get(where.remote()), flush=True)
import time
time.sleep(600)
"""
BOUND_S = 10.0  # ray_reaper: POLL_S + GRACE_S, plus the scan, on a loaded 2-core machine


def _holding(token: str) -> list[int]:
    pids = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("RAY_AUTH_TOKEN") == token and process.status() != psutil.STATUS_ZOMBIE:
                pids.append(process.pid)
        except psutil.Error:
            continue
    return pids


def test_the_cluster_of_a_killed_driver_exits_within_the_bound() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, env=env)
    try:
        assert driver.stdout is not None
        token, worker = driver.stdout.readline().split()
        started = _holding(token)
        assert int(worker) in started and len(started) >= 3, started  # GCS, raylet, worker at least
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        killed = time.monotonic()
        while left := _holding(token):
            assert time.monotonic() - killed < BOUND_S, f"still running {BOUND_S}s after the driver died: {left}"
            time.sleep(0.2)
        print(f"{len(started)} Ray processes gone {time.monotonic() - killed:.1f}s after the driver's SIGKILL")
    finally:
        if driver.poll() is None:
            driver.kill()
