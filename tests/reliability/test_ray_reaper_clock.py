"""The Ray reaper tells a live driver from a dead one by a start time the wall clock cannot move.

psutil's ``create_time()`` on Linux is ``/proc/<pid>/stat``'s start ticks plus the boot time, which the kernel
recomputes from the wall clock at every read: after a clock step or an NTP correction a live process reports another
start time (giampaolo/psutil#2526). The reaper compared it with the one it read at start, so a clock change made it
end a live training run (its driver died of SIGTERM, then SIGKILL, in the middle of `benchmarks/planner_self.py`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.runtime import ray_reaper

psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")


def test_a_clock_step_does_not_make_a_live_driver_look_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    born = ray_reaper.started(psutil.Process(os.getpid()))
    stepped = psutil.Process.create_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: stepped(self) + 60.0)  # the clock jumps a minute
    assert ray_reaper._alive(os.getpid(), born)


def test_start_times_tell_processes_apart_and_a_recorded_one_is_found_again() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me, other = psutil.Process(os.getpid()), psutil.Process(child.pid)
        assert ray_reaper.started(me) == ray_reaper.started(psutil.Process(os.getpid()))
        assert ray_reaper.started(other) >= ray_reaper.started(me)
        victims = ray_reaper.run_processes(known={child.pid: ray_reaper.started(other)}, sessions=set(),
                                           token="not-this-run's")
        assert [process.pid for process in victims] == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert not ray_reaper._alive(child.pid, ray_reaper.started(me))
